"""A results file's "config": each model's settings a section of its own. Files written before
(the generator's and PRM's settings as flat keys, the PRM's `prm_`-prefixed) still load, resume,
compare and view, read as today's form."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from treeserve.cli import main
from treeserve.eval.journal import Journal, journal_path
from treeserve.eval.report import read_results, upgrade_config
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings, run_config
from treeserve.runtime.model_settings import ModelSettings
from treeserve.search.config import SearchConfig

OLD = {  # as `treeserve eval` wrote it before models had settings of their own
    "search": {"strategy": "beam_search", "n": 4, "agg": "last"},
    "dataset": "arith:level=4,size=2,seed=0",
    "generator": "/models/gen",
    "prm": "/models/prm",
    "prm_style": "step_tag",
    "dtype": "float32",
    "device": "cpu",
    "attention_backend": "cpu",
    "kv_cache_memory": 1 << 26,
    "memory_budget": None,
    "memory_fraction": None,
    "prm_kv_fraction": 0.3,
    "engine_args": {"generator": {"max_num_seqs": 32}, "prm": {"max_num_batched_tokens": 512}},
    "quantization": "int8",
    "prm_quantization": None,
    "dequantize": False,
    "quant_activations": "bf16",
    "speculative_config": None,
    "async_scheduling": False,
    "enforce_eager": True,
    "tensor_parallel_size": 2,
    "prm_tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "prm_pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "memory_report": None,
    "page_logs": False,
    "reference": False,
    "limit": None,
    "shard": None,
    "selection": "weighted",
    "num_problems": 1,
}
COMPLETION = {"text": "1+2 = 3", "answer": "3", "step_scores": [0.9], "score": 0.9, "correct": True}
PROBLEM = {
    "unique_id": "a",
    "level": 1,
    "problem": "Compute 1+2.",
    "answer": "3",
    "pred": "3",
    "correct": True,
    "completions": [COMPLETION],
}


def test_an_old_config_reads_as_todays():
    config = upgrade_config(OLD)
    generator, prm = ModelSettings.from_dict(config["generator"]), ModelSettings.from_dict(config["prm"])
    assert generator == ModelSettings.from_flat(
        "/models/gen",
        quantization="int8",
        quant_activations="bf16",
        async_scheduling=False,
        enforce_eager=True,
        tensor_parallel_size=2,
        max_num_seqs=32,
    )
    assert prm == ModelSettings.from_flat(
        "/models/prm",
        style="step_tag",
        quant_activations="bf16",
        async_scheduling=False,
        enforce_eager=True,
        pipeline_parallel_size=2,
        kv_fraction=0.3,
        max_num_batched_tokens=512,
    )
    assert not {k for k in config if k.startswith("prm_")} and "engine_args" not in config
    assert config["device_config"] == {"device": "cpu", "attention_backend": "cpu", "dtype": "float32"}
    assert config["arena_config"]["kv_cache_memory"] == 1 << 26 and config["selection"] == "weighted"
    assert config["search"] == {**asdict(SearchConfig()), **OLD["search"]}  # settings added since: their defaults


def test_a_new_config_is_read_as_written():
    settings = EvalSettings(
        generator=ModelSettings.from_flat(DEFAULT_GENERATOR, max_num_seqs=8), prm=ModelSettings(DEFAULT_PRM)
    )
    config = json.loads(json.dumps(run_config(settings, SearchConfig(), [PROBLEM])))
    assert upgrade_config(config) == config
    assert config["generator"] == asdict(settings.generator) and config["prm"]["path"] == DEFAULT_PRM
    assert config["device_config"]["dtype"] == "bfloat16" and "runtime" not in config  # its sub-configs beside


def test_old_results_files_load_compare_and_view(tmp_path, capsys):
    old = tmp_path / "old.json"
    summary = {"accuracy": 1.0, "problems_per_s": 1.0, "wall_time_s": 1.0}
    old.write_text(json.dumps({"config": OLD, "summary": summary, "problems": [PROBLEM]}))
    assert read_results(old)["config"]["prm"]["parallel_config"]["tensor_parallel_size"] == 1
    assert main(["compare", str(old), str(old)]) == 0
    assert main(["view", str(old), "--output", str(tmp_path / "old.html")]) == 0
    assert (tmp_path / "old.html").stat().st_size > 0


def test_an_old_journal_resumes(tmp_path):
    """A run killed before this change resumes under it: the header's config, read as today's,
    equals the config the same command makes now."""
    path = journal_path(tmp_path / "results.json")
    path.write_text(json.dumps({"journal": 1, "config": OLD}) + "\n")
    journal = Journal.open(path, upgrade_config(OLD), resume=True)
    journal.close()


def test_a_journal_from_before_the_verifier_and_reasoning_resumes(tmp_path):
    """A run started before `verifier` and `search.reasoning` existed resumes: absent there, at
    their defaults here, they are the same run; a verifier given now is another run."""
    settings = EvalSettings(progress=False)
    config = json.loads(json.dumps(run_config(settings, SearchConfig(), [PROBLEM])))
    before = {k: v for k, v in config.items() if k != "verifier"}
    before["search"] = {k: v for k, v in config["search"].items() if k != "reasoning"}
    path = journal_path(tmp_path / "results.json")
    path.write_text(json.dumps({"journal": 1, "config": before}) + "\n")
    Journal.open(path, config, resume=True).close()
    settings.verifier = ModelSettings("/models/orm")
    with pytest.raises(ValueError, match="verifier"):
        Journal.open(path, run_config(settings, SearchConfig(), [PROBLEM]), resume=True)


def test_an_adaptive_journal_from_before_the_picked_budget_resumes_without_one(tmp_path):
    """An adaptive run without budget_tokens written before the run picked its own budget ran with
    none: it reads as budget_fraction None, so today's default (a picked budget) is another run and
    `--budget-fraction off` resumes it; runs the change did not touch read at the default."""
    settings = EvalSettings(progress=False)
    config = json.loads(json.dumps(run_config(settings, SearchConfig(adaptive=True), [PROBLEM])))
    before = config | {"search": {k: v for k, v in config["search"].items() if k != "budget_fraction"}}
    assert upgrade_config(before)["search"]["budget_fraction"] is None
    for unchanged in ({"adaptive": False}, {"budget_tokens": 1000}):  # fixed N; a budget given
        old = before | {"search": before["search"] | unchanged}
        assert upgrade_config(old)["search"]["budget_fraction"] == SearchConfig().budget_fraction
    path = journal_path(tmp_path / "results.json")
    path.write_text(json.dumps({"journal": 1, "config": before}) + "\n")
    with pytest.raises(ValueError, match="budget_fraction"):
        Journal.open(path, config, resume=True)
    off = run_config(settings, SearchConfig(adaptive=True, budget_fraction=None), [PROBLEM])
    Journal.open(path, json.loads(json.dumps(off)), resume=True).close()
    assert upgrade_config(config) == config  # written with it: read as written


@pytest.mark.parametrize("reference", [False, True])
def test_a_journal_with_the_prefix_cache_among_the_search_settings_resumes(tmp_path, reference):
    """`prefix_cache` was a search setting and is the runtime's now: a journal (or results file)
    written with `search.prefix_cache` reads with it beside the runtime's settings, and resumes."""
    settings = EvalSettings(progress=False, reference=reference)
    config = json.loads(json.dumps(run_config(settings, SearchConfig(), [PROBLEM])))
    assert "prefix_cache" not in config["search"] and config["arena_config"]["enable_prefix_caching"] is not reference
    before = {k: v for k, v in flat_as_this_morning(config).items() if k != "prefix_cache"}
    before["search"] = {**config["search"], "prefix_cache": not reference}
    assert upgrade_config(before) == config
    path = journal_path(tmp_path / "results.json")
    path.write_text(json.dumps({"journal": 1, "config": before}) + "\n")
    Journal.open(path, config, resume=True).close()


# ModelSettings' fields as results files held them until 2026-12-02 (None: the engine's default)
FLAT_MODEL_KEYS = (
    *("path", "style", "quantization", "dequantize", "quant_activations", "speculative_config"),
    *("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "async_scheduling"),
    *("enforce_eager", "max_model_len", "kv_cache_dtype", "kv_fraction", "max_num_seqs"),
    *("max_num_batched_tokens", "page_size"),
)
FLAT_DEFAULTS = {"quant_activations": "int8", "kv_cache_dtype": "auto", "max_num_seqs": 256}
FLAT_DEFAULTS |= {"max_num_batched_tokens": 2048}


def flat_as_this_morning(config: dict) -> dict:
    """`config` as `treeserve eval` wrote it until 2026-12-02: each model's section flat, the
    engine's defaults as None, the runtime's settings flat beside (the prefix cache `prefix_cache`)."""
    old = {k: v for k, v in config.items() if k not in ("device_config", "arena_config")}
    old |= config["device_config"] | {"kv_cache_memory": config["arena_config"]["kv_cache_memory"]}
    old["prefix_cache"] = config["arena_config"]["enable_prefix_caching"]
    for name in ("generator", "prm", "verifier"):
        if config.get(name) is not None:
            values = {k: v for group in config[name].values() if isinstance(group, dict) for k, v in group.items()}
            values |= {k: v for k, v in config[name].items() if not isinstance(v, dict)}
            flat = {k: values[k] for k in FLAT_MODEL_KEYS}
            old[name] = flat | {k: None for k, v in FLAT_DEFAULTS.items() if flat[k] == v}
    return old


def test_a_config_with_flat_model_sections_reads_as_todays(tmp_path, capsys):
    """A results file or journal written before the engine settings were sub-configs (each model's
    section flat, the runtime's settings flat) reads as today's form: it resumes the same run, and
    loads for compare and view."""
    settings = EvalSettings(
        generator=ModelSettings.from_flat(DEFAULT_GENERATOR, max_num_seqs=8, enforce_eager=True),
        prm=ModelSettings(DEFAULT_PRM, style="step_tag", kv_fraction=0.3),
        progress=False,
    )
    settings.check()
    config = json.loads(json.dumps(run_config(settings, SearchConfig(), [PROBLEM])))
    old = flat_as_this_morning(config)
    assert old["generator"]["max_num_seqs"] == 8 and old["prm"]["max_num_seqs"] is None and "dtype" in old
    assert upgrade_config(old) == config
    path = journal_path(tmp_path / "results.json")
    path.write_text(json.dumps({"journal": 1, "config": old}) + "\n")
    Journal.open(path, config, resume=True).close()
    results = tmp_path / "flat.json"
    summary = {"accuracy": 1.0, "problems_per_s": 1.0, "wall_time_s": 1.0}
    results.write_text(json.dumps({"config": old, "summary": summary, "problems": [PROBLEM]}))
    assert read_results(results)["config"] == config
    assert main(["compare", str(results), str(results)]) == 0
    assert main(["view", str(results), "--output", str(tmp_path / "flat.html")]) == 0
