"""The memory planner and the shared arena under pressure: breakdown, page counts, bad budgets, no leaks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from treeserve import SamplingParams, ScoreParams
from treeserve.config import DeviceConfig
from treeserve.runtime.planner import weight_bytes
from treeserve.runtime.runtime import ModelSpec, Runtime


def specs(llama_dir, qwen2_dir, share=None, **engine_args):
    return [
        ModelSpec("gen", llama_dir, share, page_size=16, engine_args=engine_args),
        ModelSpec("prm", qwen2_dir, share, page_size=4, engine_args=engine_args),
    ]


def test_shared_plan_one_arena_of_equal_pages(llama_dir, qwen2_dir, tmp_path):
    rt = Runtime.load(specs(llama_dir, qwen2_dir), 4 << 20, device_config=DeviceConfig(dtype="float32"))
    plan = rt.memory_plan
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert plan.shared and plan.kv_bytes == 4 << 20
    assert plan.num_pages == (4 << 20) // plan.page_bytes
    assert gen.arena.pages is prm.arena.pages and gen.pages.pool is prm.pages.pool
    assert gen.page_size == prm.page_size == 4  # equal layouts: the smaller preferred page wins
    by_name = {m.name: m for m in plan.models}
    assert by_name["gen"].weights == weight_bytes(gen.model) > 0
    assert all(m.activation_peak > 0 for m in plan.models)
    assert plan.other == sum(m.other for m in plan.models) and all(m.other >= 0 for m in plan.models)
    for m in plan.models:  # what each load added, measured, beside its files' size
        # RSS added: > 0 in a fresh process; in a test process other tests' freed pages can leave during a load
        assert m.loaded >= 0 and m.other == max(0, m.loaded - m.weights)
        files = Path(rt.engines[m.name].config.model).glob("*.safetensors")
        assert m.checkpoint_bytes == sum(f.stat().st_size for f in files) > 0
    assert "its load added" in plan.table() and "loaded" in plan.sources
    assert gen.num_computed_tokens == 0  # the activation probe is not counted as work
    plan.write(str(tmp_path / "plan.json"))
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["num_pages"] == plan.num_pages and doc["weights"] == plan.weights
    assert "shared arena" in plan.table()
    rt.check_pages_idle()


def test_fp8_kv_plans_four_times_the_pages_of_fp32(llama_dir, qwen2_dir):
    """kv_cache_dtype="fp8_e4m3" on one model: the planner counts its 1-byte tokens, the shared page
    holds 4x its fp32 tokens, and the table says what its pages hold."""
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    prm = specs(llama_dir, qwen2_dir)[1]
    rt = Runtime.load(
        [ModelSpec("gen", llama_dir, page_size=4, engine_args=fp8), prm],
        4 << 20,
        device_config=DeviceConfig(dtype="float32"),
    )
    by_name = {m.name: m for m in rt.memory_plan.models}
    assert by_name["gen"].token_bytes * 4 == by_name["prm"].token_bytes == rt.engines["prm"].kv_layout.token_bytes
    assert rt.engines["gen"].page_size == 4 * rt.engines["prm"].page_size
    assert "KV in fp8_e4m3" in rt.memory_plan.table()
    rt.check_pages_idle()


def test_static_split_gives_each_model_its_share(llama_dir, qwen2_dir):
    rt = Runtime.load(specs(llama_dir, qwen2_dir, 0.5), 4 << 20, device_config=DeviceConfig(dtype="float32"))
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert gen.pages.pool is not prm.pages.pool
    assert (gen.page_size, prm.page_size) == (16, 4)
    for engine in (gen, prm):
        assert engine.arena.pages.nbytes <= 2 << 20 < engine.arena.pages.nbytes + engine.arena.pages.page_bytes


def test_budget_mode_subtracts_weights_activations_and_other(llama_dir, qwen2_dir):
    rt = Runtime.load(specs(llama_dir, qwen2_dir), memory_budget=600 << 20, device_config=DeviceConfig(dtype="float32"))
    plan = rt.memory_plan
    assert plan.budget == 600 << 20
    assert plan.kv_bytes == plan.budget - plan.weights - plan.activations - plan.other
    assert plan.num_pages == plan.kv_bytes // plan.page_bytes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"memory_budget": 1 << 20}, "leaves nothing for KV pages"),
        ({"kv_cache_memory": 1 << 20, "memory_fraction": 0.5}, "exactly one"),
        ({"kv_cache_memory": None, "memory_fraction": 1.5}, "memory_fraction"),
        ({"kv_cache_memory": -5}, "positive byte count"),
    ],
)
def test_bad_budgets_are_refused_clearly(llama_dir, qwen2_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Runtime.load(specs(llama_dir, qwen2_dir), device_config=DeviceConfig(dtype="float32"), **kwargs)


def test_mixed_split_specs_are_refused(llama_dir, qwen2_dir):
    with pytest.raises(ValueError, match="add up to 1"):
        Runtime.load(
            [ModelSpec("gen", llama_dir, 0.5), ModelSpec("prm", qwen2_dir)],
            4 << 20,
            device_config=DeviceConfig(dtype="float32"),
        )


def test_tight_shared_arena_serves_both_models_and_loses_no_page(llama_dir, qwen2_dir):
    """Far more work than pages: the generator preempts, the PRM waits for pages the generator
    releases, cached pages of one model are evicted for the other, and everything finishes."""
    rt = Runtime.load(
        specs(llama_dir, qwen2_dir, max_model_len=128), 96 * 4 * 512, device_config=DeviceConfig(dtype="float32")
    )
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert rt.memory_plan.num_pages == 96

    async def main():
        async def one(i):
            out = await rt.generate("gen", f"problem {i}", SamplingParams(n=4, max_tokens=40, seed=i, ignore_eos=True))
            for c in out.outputs:
                ids = out.prompt_token_ids + c.token_ids
                await rt.score("prm", ids, ScoreParams(positions=[len(ids) - 1], token_ids=[3]))
            return out

        outs = await asyncio.gather(*(one(i) for i in range(12)))
        await rt.close()
        return outs

    outs = asyncio.run(main())
    assert all(len(c.token_ids) == 40 for out in outs for c in out.outputs)
    assert gen.scheduler.num_preemptions > 0 or gen.pages.stats.evictions + prm.pages.stats.evictions > 0
    rows = gen.page_log.rows()
    assert rows and max(r["in_use"] for r in rows) <= 96
    assert {"step", "in_use", "cached", "free", "hits", "misses", "evictions", "thrash"} <= set(rows[0])
    rt.check_pages_idle()
    assert gen.pages.pool.num_available == 96


def test_an_aborted_starving_model_stops_blocking_the_other(llama_dir, qwen2_dir):
    """A model that waits for pages blocks the other's admissions; once its waiting requests are
    aborted, the other model admits again (no stale claim on the pool)."""
    rt = Runtime.load(
        specs(llama_dir, qwen2_dir, max_model_len=128), 96 * 4 * 512, device_config=DeviceConfig(dtype="float32")
    )
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    pool = gen.pages.pool
    gen.add_request("g", [1] * 20, SamplingParams(n=3, max_tokens=100, ignore_eos=True, seed=0))
    while gen.pages.num_used_pages < 70:
        gen.step()
    prm.add_request("p", [1] * 120, ScoreParams(positions=[119], token_ids=[3]))
    assert prm.step() == [] and prm.stalled  # 30 pages needed, fewer free, nothing of its own running
    assert not pool.may_admit(gen.pages.owner)
    prm.abort("p")
    assert pool.may_admit(gen.pages.owner) and not pool.starving
    gen.abort("g")
    rt.check_pages_idle()


def test_graphs_are_captured_once_on_the_final_arena(llama_dir, qwen2_dir, monkeypatch):
    """Graphs on a CPU (an eager stand-in for the CUDA graph): the planner's probe arena gets
    none, the shared arena one capture per engine, on that arena's pages."""
    from treeserve.engine import cuda_graphs

    captured: list = []

    class Recorded:
        def capture(self, fn, pool):  # noqa: ANN001, ANN201
            captured.append(fn)
            return fn()

    monkeypatch.setattr(cuda_graphs, "graphs_apply", lambda device, backend, eager, parallel: not eager)
    monkeypatch.setattr(cuda_graphs, "GRAPH_CLASS", Recorded)
    rt = Runtime.load(
        specs(llama_dir, qwen2_dir, max_num_seqs=4),
        memory_budget=600 << 20,
        device_config=DeviceConfig(dtype="float32"),
    )
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert len(captured) == len(gen.graph_stats["sizes"]) + len(prm.graph_stats["sizes"])  # not twice
    assert gen.runner.graphs.arena is gen.arena and prm.runner.graphs.arena is prm.arena
    assert rt.memory_plan.models[0].graphs is gen.graph_stats
    rt.check_pages_idle()
