"""Run one engine on a generation workload and print one JSON line (run in a subprocess).

Usage: python bench/peers/run_generate.py ENGINE MODEL_DIR WORKLOAD_JSON
ENGINE is treeserve, vllm or transformers. The workload JSON holds prompts (token ids),
n, max_tokens, dtype. Model loading and a small warm-up are not timed; the whole
workload is, from submission to the last token.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_treeserve(model: str, w: dict) -> tuple[float, int]:
    from treeserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=w["dtype"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        kv_cache_memory=w["kv_bytes"],
        seed=0,
    )
    params = SamplingParams(n=w["n"], temperature=w["temperature"], max_tokens=w["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    llm.generate(prompts[:4], SamplingParams(n=2, max_tokens=8, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs)


def run_vllm(model: str, w: dict) -> tuple[float, int]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, w["kv_bytes"] >> 30)))
    from vllm import LLM, SamplingParams, TokensPrompt

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
    llm.generate(prompts[:4], SamplingParams(n=2, max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs)


def run_transformers(model: str, w: dict) -> tuple[float, int]:
    import torch
    import transformers

    dtype = getattr(torch, w["dtype"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    longest = max(len(p) for p in w["prompts"])
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in w["prompts"]])  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in w["prompts"]])
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
        hf.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=8, min_new_tokens=8, **kwargs)
        start = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=w["max_tokens"], min_new_tokens=w["max_tokens"], **kwargs
        )
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - longest) * out.shape[0]


if __name__ == "__main__":
    engine, model, workload = sys.argv[1:4]
    with open(workload) as f:
        w = json.load(f)
    runner = {"treeserve": run_treeserve, "vllm": run_vllm, "transformers": run_transformers}[engine]
    seconds, tokens = runner(model, w)
    print("RESULT " + json.dumps({"engine": engine, "seconds": seconds, "tokens": tokens}), flush=True)
