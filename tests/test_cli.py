"""The command line: the generate demo runs, and bad input gets a clear error (exit 2)."""

from __future__ import annotations

import json

import pytest

from treeserve.cli import main


def test_generate_runs(llama_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            llama_dir,
            "--raw",
            "hello",
            "--n",
            "2",
            "--max-tokens",
            "5",
            "--kv-cache-memory",
            str(8 << 20),
            "--dtype",
            "float32",
        ]
    )
    out = capsys.readouterr()
    assert code == 0
    assert "=== hello" in out.out and "completion 1" in out.out and "tok/s" in out.err


def test_bad_input_exits_2(llama_dir, capsys):
    assert main(["generate", "--model", "/does/not/exist"]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["generate", "--model", llama_dir, "--n", "0", "x", "--kv-cache-memory", str(8 << 20)]) == 2
    assert "n must be" in capsys.readouterr().err
    assert main(["generate", "--model", llama_dir, "--speculative-config", '{"method": "eagle"}', "x"]) == 2
    assert "method must be one of" in capsys.readouterr().err


def test_kv_cache_dtype_flag_reaches_the_engine(llama_dir, capsys, monkeypatch):
    """--kv-cache-dtype is the engine's kv_cache_dtype (an FP8 arena); an unknown value exits 2 naming the choices."""
    import torch

    import treeserve

    made = []

    class Recording(treeserve.LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(treeserve, "LLM", Recording)
    args = ["generate", "--model", llama_dir, "--raw", "hi", "--max-tokens", "3", "--kv-cache-memory", str(8 << 20)]
    assert main([*args, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert made[-1].engine.arena.buffer.dtype == torch.float8_e4m3fn
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--kv-cache-dtype", "fp8"])
    assert exit_.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.search.step_world import build_step_world

    return build_step_world(str(tmp_path_factory.mktemp("cli_world")))


def test_eval_plot_solve(world, tmp_path, capsys):
    generator, prm = world
    jsonl = tmp_path / "tiny.jsonl"
    jsonl.write_text(
        '{"problem": "Compute 1+2.", "answer": "3", "level": 1, "unique_id": "a"}\n'
        '{"problem": "Compute 2*2.", "answer": "4", "level": 2, "unique_id": "b"}\n'
    )
    common = [
        "--generator",
        generator,
        "--prm",
        prm,
        "--n",
        "4",
        "--beam-width",
        "2",
        "--num-iterations",
        "3",
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(64 << 20),
    ]
    out = tmp_path / "results.json"
    assert main(["eval", "--dataset", str(jsonl), "--output", str(out), *common]) == 0
    doc = json.loads(out.read_text())
    assert {"accuracy", "problems_per_s", "accuracy_by_level"} <= set(doc["summary"])
    assert [p["unique_id"] for p in doc["problems"]] == ["a", "b"]
    assert "problems/min" in capsys.readouterr().out
    png = tmp_path / "plot.png"
    assert main(["plot", str(out), "--output", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["solve", "Compute 1+2.", *common]) == 0
    assert "[step 1, PRM" in capsys.readouterr().out
    solved = tmp_path / "solve.json"
    assert main(["solve", "Compute 1+2.", *common, "--trace", "--output", str(solved)]) == 0
    assert f"treeserve view {solved}" in capsys.readouterr().out
    assert json.loads(solved.read_text())["problems"][0]["trace"]["nodes"]
    assert main(["view", str(solved), "--output", str(tmp_path / "solve.html")]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--strategy", "astar"], "unknown strategy"),
        (["--n", "6", "--beam-width", "4"], "divisible"),
        (["--generator", "/nope"], "generator model not found"),
        (["--dataset", "BADJSONL"], "bad.jsonl:2: not valid JSON"),
        (["--dataset", "arith:level=9"], "level"),
        (["--speculative-config", "{bad"], "not valid JSON"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "integer >= 1"),
        (["--speculative-config", '{"model": "/nope", "num_speculative_tokens": 2}'], "draft model directory"),
    ],
)
def test_eval_bad_input(world, tmp_path, capsys, extra, message):
    generator, prm = world
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{not json}\n')
    args = ["eval", "--generator", generator, "--prm", prm, "--output", str(tmp_path / "r.json")]
    args += [str(bad) if a == "BADJSONL" else a for a in extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


MODEL_SUBCOMMANDS = ("generate", "eval", "solve", "profile", "tune", "serve")


def _model_options(subcommand: str) -> set[str]:
    from treeserve.cli import build_parser
    from treeserve.model_flags import MODEL_FLAGS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[subcommand]
    mine = {name for flag in MODEL_FLAGS for model in ("generator", "prm") for name in flag.names(model)}
    return {
        o
        for action in sub._actions
        for o in action.option_strings
        if o.lstrip("-").removeprefix("no-") in {m.lstrip("-") for m in mine}
    }


def test_every_subcommand_has_the_same_per_model_flags():
    """One table makes them: the generator's in every subcommand, the PRM's in those that load one,
    under the names users have always typed."""
    with_prm = {sub: _model_options(sub) for sub in MODEL_SUBCOMMANDS if sub != "generate"}
    assert len({frozenset(options) for options in with_prm.values()}) == 1, with_prm
    options = with_prm["eval"]
    assert {
        "--generator",
        "--model",
        "--prm",
        "--prm-style",
        "--quantization",
        "--prm-quantization",
        "--dequantize",
        "--quant-activations",
        "--speculative-config",
        "--tensor-parallel-size",
        "--prm-tensor-parallel-size",
        "--pipeline-parallel-size",
        "--prm-pipeline-parallel-size",
        "--distributed-executor-backend",
        "--async-scheduling",
        "--no-async-scheduling",
        "--enforce-eager",
        "--max-model-len",
        "--prm-kv-fraction",
        "--prm-enforce-eager",
    } <= options
    assert _model_options("generate") == {o for o in options if not o.lstrip("-").removeprefix("no-").startswith("prm")}


def test_flags_become_each_models_settings():
    from treeserve.cli import build_parser
    from treeserve.model_flags import model_settings

    args = build_parser().parse_args(
        [
            "eval",
            "--model",
            "g",
            "--prm",
            "p",
            "--quantization",
            "int8",
            "--prm-tensor-parallel-size",
            "2",
            "--enforce-eager",
            "--prm-kv-fraction",
            "0.3",
            "--distributed-executor-backend",
            "ray",
            "--prm-style",
            "step_tag",
        ]
    )
    generator, prm = model_settings(args, "generator"), model_settings(args, "prm", {"max_num_seqs": 8})
    assert (generator.path, generator.load_config.quantization, generator.parallel_config.tensor_parallel_size) == (
        "g",
        "int8",
        1,
    )
    assert (prm.path, prm.load_config.quantization, prm.parallel_config.tensor_parallel_size, prm.kv_fraction) == (
        "p",
        None,
        2,
        0.3,
    )
    assert (
        generator.graph_config.enforce_eager and prm.graph_config.enforce_eager
    )  # a flag that always set both models still does
    assert prm.parallel_config.distributed_executor_backend == "ray"
    assert prm.style == "step_tag" and prm.scheduler_config.max_num_seqs == 8
    args = build_parser().parse_args(["serve", "--enforce-eager", "--no-prm-enforce-eager", "--prm", "p"])
    assert not model_settings(args, "prm").graph_config.enforce_eager  # the PRM's own flag wins
    assert model_settings(args, "generator") is None  # no path: serve picks its default


def test_a_search_has_the_same_defaults_from_the_cli_http_and_python():
    """`treeserve eval`'s flags and `/v1/search`'s fields take their defaults from `SearchConfig`:
    the same search whichever front end starts it (`--max-tokens` was 512 on the command line, 256
    over HTTP)."""
    from dataclasses import fields

    from treeserve.cli import build_parser
    from treeserve.search.config import SearchConfig
    from treeserve.server.protocol import SearchRequest

    config = SearchConfig()
    args = vars(build_parser().parse_args(["eval"]))
    shared = [f.name for f in fields(SearchConfig) if f.name in args and f.name != "stop"]
    assert len(shared) >= 20
    assert {k: args[k] for k in shared} == {k: getattr(config, k) for k in shared}
    request = SearchRequest(problem="q")
    over_http = [f.name for f in fields(SearchConfig) if f.name in SearchRequest.model_fields and f.name != "stop"]
    assert len(over_http) >= 20
    assert {k: getattr(request, k) for k in over_http} == {k: getattr(config, k) for k in over_http}


def test_the_command_loads_its_imports_without_collector_passes():
    """`treeserve` (treeserve/__main__.py) pauses the cyclic collector while the command's imports
    (torch and the rest) load and freezes them: no pass walks them (before, ~400 passes took
    ~0.13 s of the README job's ~7.5 s)."""
    import subprocess
    import sys

    probe = (
        "import gc, sys\n"
        "from treeserve.__main__ import main\n"
        "passes = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'stop' and passes.append(gc.get_freeze_count()))\n"
        "sys.argv = ['treeserve', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(passes.count(0), gc.get_freeze_count(), 'torch' in sys.modules, gc.isenabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    passes, frozen, torch_loaded, enabled = out.split()[-4:]  # passes: those before the freeze
    assert torch_loaded == "True" and enabled == "True"
    assert passes == "0" and int(frozen) > 100_000
