"""Run one engine on a generation workload and print one JSON line (run in a subprocess).

Usage: python bench/peers/run_generate.py ENGINE MODEL WORKLOAD_JSON
ENGINE is treeserve, vllm, transformers (MODEL: a checkpoint directory; treeserve also
takes a GGUF file, run quantised; treeserve-bf16 runs it dequantised to bf16; treeserve-tiles
runs it quantised with bf16 activations, `quant_activations="bf16"`) or llamacpp
(MODEL: a GGUF file; llama-cpp-python's low-level batch
API, every sequence in one llama_batch per step, llama.cpp's own samplers). The workload
JSON holds prompts (token ids), n, max_tokens, temperature, dtype. Model loading and a small
warm-up (on other prompts) are not timed; the whole workload is, from submission to the
last token.
"""

from __future__ import annotations

import json
import os
import sys
import time

# warm-up prompt (not timed): no workload prompt, so prefix caches start cold
WARM_UP = [(7 * i) % 500 + 3 for i in range(24)]
EXTRA: dict = {}  # engine-specific measurements that go into the RESULT line


def _timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_treeserve(
    model: str, w: dict, dequantize: bool = False, guided: bool = False, quant_activations: str = "int8"
) -> tuple[float, int]:
    from treeserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(
        model,
        dequantize=dequantize,
        quant_activations=quant_activations,
        dtype=w["dtype"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        kv_cache_memory=w["kv_bytes"],
        seed=0,
        device=w.get("device", "cpu"),
    )
    params = SamplingParams(n=w["n"], temperature=w["temperature"], max_tokens=w["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    if guided:  # the first guided request (1 token) pays the tokenizer setup and the schema's compile
        probe = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=w["typical_schema"]))
        EXTRA["first_guided_request_s"] = _timed(lambda: llm.generate([{"prompt_token_ids": WARM_UP}], probe))
        EXTRA["plain_request_s"] = _timed(
            lambda: llm.generate([{"prompt_token_ids": WARM_UP}], SamplingParams(max_tokens=1))
        )
        schema = StructuredOutputsParams(json=w["guided_json"])
        params = SamplingParams(
            n=w["n"], temperature=w["temperature"], max_tokens=w["max_tokens"], structured_outputs=schema
        )
    llm.generate([{"prompt_token_ids": WARM_UP}], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs)


def run_vllm(model: str, w: dict, guided: bool = False) -> tuple[float, int]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, w["kv_bytes"] >> 30)))
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=model,
        dtype=w["dtype"],
        seed=0,
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        max_model_len=1024,
        enable_prefix_caching=True,
    )
    params = SamplingParams(n=w["n"], temperature=w["temperature"], max_tokens=w["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    if guided:
        warm = [TokensPrompt(prompt_token_ids=WARM_UP)]
        probe = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=w["typical_schema"]))
        EXTRA["first_guided_request_s"] = _timed(lambda: llm.generate(warm, probe, use_tqdm=False))
        EXTRA["plain_request_s"] = _timed(lambda: llm.generate(warm, SamplingParams(max_tokens=1), use_tqdm=False))
        schema = StructuredOutputsParams(json=w["guided_json"])
        params = SamplingParams(
            n=w["n"], temperature=w["temperature"], max_tokens=w["max_tokens"], structured_outputs=schema
        )
    warm_up = SamplingParams(n=2, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=WARM_UP)], warm_up, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs)


def run_transformers(model: str, w: dict) -> tuple[float, int]:
    import torch
    import transformers

    dtype, device = getattr(torch, w["dtype"]), w.get("device", "cpu")  # on a GPU machine, the same GPU
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval().to(device)
    longest = max(len(p) for p in w["prompts"])
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in w["prompts"]], device=device)  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in w["prompts"]], device=device)
    kwargs = dict(
        do_sample=w["temperature"] > 0,
        temperature=w["temperature"] or None,
        top_p=None,
        top_k=None,
        num_return_sequences=w["n"],
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.inference_mode():
        hf.generate(torch.tensor([WARM_UP], device=device), max_new_tokens=8, min_new_tokens=8, **kwargs)
        start = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=w["max_tokens"], min_new_tokens=w["max_tokens"], **kwargs
        )
        out = out.cpu()
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - longest) * out.shape[0]


def run_llamacpp(model: str, w: dict) -> tuple[float, int]:
    import llama_cpp as lc

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    sequences = len(w["prompts"]) * w["n"]
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    lm = lc.llama_model_load_from_file(model.encode(), model_params)
    ctx_params = lc.llama_context_default_params()
    longest = max(len(p) for p in w["prompts"])
    ctx_params.n_ctx = max(2048, sequences * (longest + w["max_tokens"] + 8))
    ctx_params.n_batch = ctx_params.n_ubatch = max(512, w["max_num_batched_tokens"])
    ctx_params.n_seq_max = max(1, sequences)
    ctx_params.kv_unified = True  # sequences of one prompt share its KV, as the other engines' prefix caches do
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(lm, ctx_params)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if w["temperature"] > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(w["temperature"]))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(0))
    else:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
    batch = lc.llama_batch_init(max(ctx_params.n_batch, sequences), 0, max(1, w["n"]))

    def decode(entries: list[tuple[int, int, list[int], bool]]) -> None:
        """entries (at most n_batch): (token, position, sequence ids, wants logits)."""
        for i, (token, pos, seqs, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, len(seqs), logits
            for j, seq in enumerate(seqs):
                batch.seq_id[i][j] = seq
        batch.n_tokens = len(entries)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(prompts: list[list[int]], n: int, max_tokens: int) -> int:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        entries = []  # each prompt once, its tokens shared by its n sequences
        for p, prompt in enumerate(prompts):
            seqs = [p * n + i for i in range(n)]
            entries += [(t, pos, seqs, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
        pending: dict[int, tuple[int, int]] = {}  # sequence -> (next position, last token)
        for start in range(0, len(entries), ctx_params.n_batch):
            chunk = entries[start : start + ctx_params.n_batch]
            decode(chunk)
            for i, (_, pos, seqs, logits) in enumerate(chunk):
                for seq in seqs if logits else []:  # each sequence samples its own first token
                    pending[seq] = (pos + 1, lc.llama_sampler_sample(chain, ctx, i))
        order = sorted(pending)
        state = [pending[seq] for seq in order]
        generated = len(state)
        for _ in range(max_tokens - 1):
            decode([(token, pos, [seq], True) for seq, (pos, token) in zip(order, state, strict=True)])
            state = [(pos + 1, lc.llama_sampler_sample(chain, ctx, i)) for i, (pos, _) in enumerate(state)]
            generated += len(state)
        return generated

    generate([WARM_UP], 1, 4)
    start = time.perf_counter()
    tokens = generate(w["prompts"], w["n"], w["max_tokens"])
    elapsed = time.perf_counter() - start
    return elapsed, tokens


if __name__ == "__main__":
    engine, model, workload = sys.argv[1:4]
    with open(workload) as f:
        w = json.load(f)
    runner = {
        "treeserve": run_treeserve,
        "treeserve-bf16": lambda model, w: run_treeserve(model, w, dequantize=True),
        "treeserve-tiles": lambda model, w: run_treeserve(model, w, quant_activations="bf16"),
        "treeserve-guided": lambda model, w: run_treeserve(model, w, guided=True),
        "vllm": run_vllm,
        "vllm-guided": lambda model, w: run_vllm(model, w, guided=True),
        "transformers": run_transformers,
        "llamacpp": run_llamacpp,
    }[engine]
    seconds, tokens = runner(model, w)
    print("RESULT " + json.dumps({"engine": engine, "seconds": seconds, "tokens": tokens, **EXTRA}), flush=True)
