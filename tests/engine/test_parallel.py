"""Tensor and pipeline parallelism on a CPU (gloo, 2 processes): the same outputs as one rank,
the arithmetic pair's beam search unchanged, a killed rank a clear error with no process left
behind, and bad sizes refused before any weight loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams
from treeserve.config import EngineConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.sampling_params import ScoreParams
from treeserve.search.config import SearchConfig

PROMPTS = ["def f(x):", "hello world", "the quick brown fox"]
KINDS = ("tensor_parallel_size", "pipeline_parallel_size")
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {
        arch: build_checkpoint(
            str(tmp_path_factory.mktemp(arch)), arch, num_hidden_layers=3, tie_word_embeddings=arch == "qwen2"
        )
        for arch in ("llama", "qwen2", "gemma3_text", "qwen3_moe", "phi3")
    }
    # one KV head for two ranks (Gemma 3 270M's shape): each rank holds a copy of it
    out["llama-1kv"] = build_checkpoint(str(tmp_path_factory.mktemp("mqa")), "llama", num_key_value_heads=1)
    return out


def outputs(llm: LLM) -> tuple:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=16, seed=7, n=2))
    ids = llm.get_tokenizer().encode("def f(x): return x * x", add_special_tokens=False)
    [scored] = llm.score(
        [ids], ScoreParams(positions=list(range(len(ids))), token_ids=[3, 5, 7, 11], return_hidden_states=True)
    )
    return (
        [o.outputs[0].token_ids for o in greedy],
        [[c.token_ids for c in o.outputs] for o in sampled],
        torch.as_tensor(scored.logprobs),
        scored.hidden_states,
    )


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, tuple]:
    """Each checkpoint's outputs on one rank (computed once)."""
    out = {}
    for arch, path in checkpoints.items():
        llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20)
        out[arch] = outputs(llm)
        llm.engine.check_pages_idle()
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "llama-1kv", "qwen3_moe", "phi3"])
def test_two_ranks_give_one_ranks_outputs(checkpoints, one_rank, make_llm, arch, kind):
    one = one_rank[arch]
    llm = make_llm(checkpoints[arch], **{kind: 2})
    two = outputs(llm)
    assert two[0] == one[0]  # greedy tokens
    assert two[1] == one[1]  # seeded sampling: drawn on rank 0 from the gathered logits
    assert torch.allclose(two[2], one[2], atol=1e-5, rtol=0)  # fp32 log-probabilities
    assert torch.allclose(two[3], one[3], atol=1e-5, rtol=0)  # and final hidden states
    if kind == "pipeline_parallel_size":  # the same sums in the same order, split across processes
        assert torch.equal(two[2], one[2])
    assert len(llm.engine.ranks.handles) == 1
    llm.engine.close()
    assert all(h.exited() for h in llm.engine.ranks.handles)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_tensor_shards_of_pipeline_stages_give_one_ranks_outputs(checkpoints, one_rank, make_llm, monkeypatch, arch):
    """TP=2 x PP=2: four ranks, stage s's shards are ranks 2s and 2s + 1, each shard's stages a
    pipeline of their own. Four ranks on this 2-core machine need the core count substituted
    (the check asks for a core a rank; the ranks are slower, not wrong, when they share)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    one = one_rank[arch]
    llm = make_llm(checkpoints[arch], tensor_parallel_size=2, pipeline_parallel_size=2)
    two = outputs(llm)
    assert two[0] == one[0] and two[1] == one[1]
    assert torch.allclose(two[2], one[2], atol=1e-5, rtol=0)
    assert torch.allclose(two[3], one[3], atol=1e-5, rtol=0)
    parts = llm.engine.ranks.parts  # ranks 1..3: stage 0's other shard, then stage 1's two (2 of 3 layers)
    assert [p["kv_token_bytes"] for p in parts] == [parts[0]["kv_token_bytes"]] + [2 * parts[0]["kv_token_bytes"]] * 2
    llm.engine.close()
    assert all(h.exited() for h in llm.engine.ranks.handles)


def search(generator: dict | None = None, prm: dict | None = None) -> dict:
    settings = EvalSettings(
        dataset="arith:level=4,size=3,seed=1",
        progress=False,
        generator=ModelSettings.from_flat(DEFAULT_GENERATOR, **(generator or {})),
        prm=ModelSettings.from_flat(DEFAULT_PRM, **(prm or {})),
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    return run_eval(settings, SearchConfig(n=4, beam_width=2, num_iterations=5))  # checks the pages are idle


def beams(doc: dict) -> list:
    return [(p["pred"], [c["text"] for c in p["completions"]]) for p in doc["problems"]]


def scores(doc: dict) -> list[float]:
    return [s for p in doc["problems"] for c in p["completions"] for s in c["step_scores"]]


@pytest.fixture(scope="module")
def plain_search() -> dict:
    return search()


@pytest.mark.parametrize(
    "sizes",
    [
        {"generator": {"tensor_parallel_size": 2}, "prm": {"tensor_parallel_size": 2}},
        {"prm": {"tensor_parallel_size": 2}},  # a one-rank generator and a two-rank PRM on the shared arena
        {"generator": {"pipeline_parallel_size": 2}, "prm": {"pipeline_parallel_size": 2}},
    ],
)
def test_beam_search_keeps_its_beams(plain_search, sizes):
    parallel, plain = search(**sizes), plain_search
    assert beams(parallel) == beams(plain)
    assert scores(parallel) == pytest.approx(scores(plain), abs=1e-5)
    for model, given in sizes.items():  # the results record each model's sizes
        assert {k: parallel["config"][model]["parallel_config"][k] for k in given} == given
    prm = next(m for m in parallel["memory"]["models"] if m["name"] == "prm")
    [rank1] = prm["parallel"]["ranks"]  # the memory plan: what the other rank holds
    assert rank1["weights"] > 0 and rank1["kv_bytes"] > 0


def test_a_killed_rank_is_a_clear_error_and_no_rank_is_left(checkpoints):
    llm = LLM(
        checkpoints["llama"], dtype="float32", kv_cache_memory=8 << 20, tensor_parallel_size=2, parallel_timeout_s=10.0
    )
    engine, [rank1] = llm.engine, [h.process for h in llm.engine.ranks.handles]
    for i in range(8):
        engine.add_request(str(i), PROMPTS[i % 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    threading.Timer(0.3, os.kill, (rank1.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1") as failure:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10.0 + 5.0  # within the timeout (a dead peer is noticed at once)
    assert "rank 1 died during a step" in str(failure.value) and "exit code -9" in str(failure.value)
    rank1.join(timeout=5)
    assert rank1.exitcode is not None
    engine.add_request("again", PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(Exception, match="ranks were stopped"):  # the engine stays failed, and says so
        while engine.has_unfinished_requests():
            engine.step()
    engine.check_pages_idle()


def test_a_rank_that_fails_starting_is_an_error_at_once(checkpoints, monkeypatch):
    """Rank 1 exits before it joins (here: it is told to use 0 threads, which torch refuses):
    rank 0 says so at once instead of waiting out the timeout for it to join."""
    from treeserve.distributed.ranks import RankFailed

    monkeypatch.setattr(torch, "get_num_threads", lambda: 0)
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"a rank exited before it joined") as failure:
        LLM(
            checkpoints["llama"],
            dtype="float32",
            kv_cache_memory=8 << 20,
            tensor_parallel_size=2,
            parallel_timeout_s=60.0,
        )
    assert time.monotonic() - start < 30.0
    assert "exit code 1" in str(failure.value)


def test_ranks_exit_when_rank_0_is_killed(checkpoints):
    script = (
        "import sys, time, torch; torch.set_num_threads(1)\n"
        "from treeserve import LLM\n"
        f"llm = LLM({checkpoints['llama']!r}, dtype='float32', kv_cache_memory=8 << 20, pipeline_parallel_size=2)\n"
        "print(llm.engine.ranks.handles[0].process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        rank1 = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(rank1):
            time.sleep(0.1)
        assert not _alive(rank1), "rank 1 outlived rank 0"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("overrides", "kwargs", "message"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
            {"tensor_parallel_size": 2},
            "attention heads 6|KV heads 3",
        ),
        (
            {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
            {"tensor_parallel_size": 2},
            "attention heads 3, KV heads 3",
        ),
        (
            {"intermediate_size": 96},
            {"tensor_parallel_size": 2, "quantization": "int8"},
            "int8 at tensor_parallel_size=2 needs each rank's matrix widths to be multiples of 32",
        ),
        (
            {},
            {"tensor_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding runs on one rank",
        ),
        ({"num_hidden_layers": 1}, {"pipeline_parallel_size": 2}, "more than the model's 1 layers"),
        ({}, {"tensor_parallel_size": (os.cpu_count() or 1) + 1}, "more than the"),
        (
            {},
            {"tensor_parallel_size": 2, "pipeline_parallel_size": os.cpu_count() or 1},
            rf"tensor_parallel_size=2 x pipeline_parallel_size={os.cpu_count() or 1} needs {2 * (os.cpu_count() or 1)} "
            "ranks, more than the",
        ),
        (
            {},
            {"tensor_parallel_size": 2, "distributed_executor_backend": "threads"},
            "distributed_executor_backend must be one of",
        ),
        ({}, {"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
    ],
)
def test_bad_sizes_are_refused_before_any_weight_loads(tmp_path, overrides, kwargs, message):
    path = build_checkpoint(str(tmp_path), "llama", **overrides)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(model=path, dtype="float32", **kwargs)  # the config alone: no engine, no process


def test_int8_shards_quantise_the_same_blocks(tmp_path):
    """Each rank quantises its shard per output channel: column-parallel rows are one rank's rows
    exactly; a row-parallel rank's rows get a scale of their own over its half of the inputs (one
    int8 step at most from one rank's). Outputs are close, not equal: activations are rounded to
    8 bits too, which turns sums' last-bit differences into visible ones."""
    path = build_checkpoint(str(tmp_path), "llama", hidden_size=128, intermediate_size=256)
    one = LLM(path, dtype="float32", kv_cache_memory=8 << 20, quantization="int8")
    two = LLM(path, dtype="float32", kv_cache_memory=8 << 20, quantization="int8", tensor_parallel_size=2)
    assert one.engine.quantization == two.engine.quantization == "int8"
    assert two.engine.ranks.parts[0]["quantization"] == "int8"  # rank 1 quantises its shard too
    mlp1, mlp2 = one.engine.model.layers[1].mlp, two.engine.model.layers[1].mlp
    down1, down2 = mlp1.down_proj.weight.dequantize(), mlp2.down_proj.weight.dequantize()
    step = down1.abs().amax(dim=1, keepdim=True) / 127  # one rank's int8 step per row
    assert (down2 - down1[:, : down1.shape[1] // 2]).abs().le(step).all()  # row-parallel: the first half
    gate_up1, gate_up2 = mlp1.gate_up_proj.weight.dequantize(), mlp2.gate_up_proj.weight.dequantize()
    half = gate_up2.shape[0] // 2
    assert torch.equal(gate_up2, torch.cat([gate_up1[:half], gate_up1[2 * half : 3 * half]]))  # gate's, up's rows
    assert torch.allclose(outputs(two)[2], outputs(one)[2], atol=0.1, rtol=0)
    for llm in (one, two):
        llm.engine.check_pages_idle()
    two.engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL parity needs two GPUs")
@pytest.mark.parametrize("kind", KINDS)
def test_two_gpus_give_one_gpus_outputs(checkpoints, kind):
    """The same parity over NCCL, rank r on cuda:r (never run here: one GPU is lent at a time)."""
    one = outputs(LLM(checkpoints["llama"], dtype="float32", kv_cache_memory=8 << 20, device="cuda:0"))
    two = outputs(LLM(checkpoints["llama"], dtype="float32", kv_cache_memory=8 << 20, device="cuda:0", **{kind: 2}))
    assert two[0] == one[0] and two[1] == one[1]
    assert torch.allclose(two[2].cpu(), one[2].cpu(), atol=1e-5, rtol=0)
