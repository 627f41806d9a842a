"""PRM-guided beam search on several systems, side by side, on the same problems and settings.

    python bench/search.py \\
        --systems treeserve,treeserve-reference,sal-transformers,sal-vllm,thesis-vllm,vllm-prefix-prm \\
        --n 16 --problems 40 --repeats 3 --out bench/out/search_n16.json
    python bench/search.py --systems treeserve,sal-transformers --generator-shape qwen3-1.7b \\
        --prm-shape qwen3-1.7b --layers 2 --n 4 --problems 2 --repeats 1   # Qwen3 shapes, a CPU smoke run

Systems (each in its own subprocess and environment; peers' code in bench/peers/):
* `treeserve` (every optimisation on) and `treeserve-reference` (no caches, one problem at a
  time), through `treeserve eval`'s code path; `treeserve-int8`: `treeserve` with both models'
  weights in int8 (issue 33), `treeserve-int8-tiles` the same with bf16 activations
  (`--quant-activations bf16`: on an AMX CPU the int8 weights dequantised into bf16 tiles);
  `treeserve-tree`, `treeserve-ngram`: `treeserve` with the generator decoding speculatively
  (issue 35; k=4); `treeserve-overlap`: `treeserve` with overlapped steps (`--async-scheduling`,
  issue 52: a CPU leaves it off by default);
* `sal-transformers`, `sal-vllm`, `thesis-vllm`, `vllm-prefix-prm`: see bench/peers/sal_search.py;
* `treeserve-before`: `treeserve` from the checkout `--before DIR` (a `git worktree` of an earlier
  commit), to compare a change before and after in one invocation.

Workload: arithmetic problems of levels 4-5 (seed 0), the shipped generator and PRM (bf16),
beam search with n, beam width 4, up to 40 iterations, steps of at most 256 tokens ending at
"\\n\\n", T=0.8, `agg=last`, the last iteration sampled to EOS. Every system's completions
are graded here the same way, under the same answer rules: `weighted` (the answer whose
completions' last step scores sum highest, `treeserve eval`'s rule for beam search), with a 95%
Wilson interval over the problems, and `naive` (the best-scored completion: search-and-learn's
`pred`); the table names them. The order of systems rotates every repetition; medians are
reported (every system is seeded, so its repetitions give the same answers; they are not pooled).

`--model-size s|m|l` swaps the shipped models for their random-weight twins at ~24M, ~95M and
~310M parameters (bench/workloads.py `build_twin`, built once under bench/out/twins). Random
weights almost never write "\\n\\n", so the twin workload has a fixed shape on every system:
5 iterations of exactly 32-token steps (`fixed_steps`: no stop string, EOS ignored). Their
answers are noise, so accuracy is not graded.

`--generator-shape qwen3-1.7b|qwen3-30b-a3b` and `--prm-shape qwen3-1.7b` swap the generator
or the PRM (the other stays `--model-size`'s) for a random-weight model of that Qwen3 shape
(bench/workloads.py QWEN3_SHAPES: the Hugging Face config.json values), `--layers L` decoder
layers of it (default the shape's: 28 and 48). Its directory is `build_random_files`'s: bf16
safetensors that every system loads (vLLM too), a word-level tokenizer (it reads each word of
a problem as <unk>: short prompts) and, for the PRM, the step-tag prm_config.json;
written once under bench/out/shapes/SHAPE-Ll/ROLE (qwen3-1.7b 3.4 GB at full depth,
qwen3-30b-a3b 61 GB: on a CPU use a few layers, e.g. 2: 0.8 and 3.7 GB). The workload is the
twins' fixed shape, not graded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from workloads import QWEN3_SHAPES, TWIN_SIZES, build_random_files, build_twin  # noqa: E402

ASSETS = os.path.join(ROOT, "treeserve", "assets")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
SYSTEMS = {
    "treeserve": [sys.executable, os.path.join(HERE, "peers", "run_treeserve_search.py")],
    "treeserve-reference": [sys.executable, os.path.join(HERE, "peers", "run_treeserve_search.py")],
    "treeserve-int8": [sys.executable, os.path.join(HERE, "peers", "run_treeserve_search.py"), "--int8"],
    "treeserve-int8-tiles": [
        sys.executable,
        os.path.join(HERE, "peers", "run_treeserve_search.py"),
        "--int8",
        "--quant-activations=bf16",
    ],
    "treeserve-tree": [
        sys.executable,
        os.path.join(HERE, "peers", "run_treeserve_search.py"),
        "--speculative-config",
        '{"method": "tree", "num_speculative_tokens": 4}',
    ],
    "treeserve-overlap": [
        sys.executable,
        os.path.join(HERE, "peers", "run_treeserve_search.py"),
        "--async-scheduling",
    ],
    "treeserve-ngram": [
        sys.executable,
        os.path.join(HERE, "peers", "run_treeserve_search.py"),
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4}',
    ],
    "sal-transformers": [sys.executable, os.path.join(HERE, "peers", "sal_search.py"), "sal-transformers"],
    "sal-vllm": [VLLM_PYTHON, os.path.join(HERE, "peers", "sal_search.py"), "sal-vllm"],
    "thesis-vllm": [VLLM_PYTHON, os.path.join(HERE, "peers", "sal_search.py"), "thesis-vllm"],
    "vllm-prefix-prm": [VLLM_PYTHON, os.path.join(HERE, "peers", "sal_search.py"), "vllm-prefix-prm"],
}
DEFAULT_SYSTEMS = ["treeserve", "treeserve-reference", "sal-transformers", "sal-vllm", "thesis-vllm", "vllm-prefix-prm"]


def run_system(system: str, workload_path: str, threads: int, before: str | None = None) -> dict:
    """Run one system on the workload. `treeserve-before`: `treeserve` from the checkout `before`
    (a `git worktree` of an earlier commit: the same search before a change, in one invocation)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    root = ROOT
    if system == "treeserve-before":
        if before is None:
            raise SystemExit("treeserve-before needs --before DIR (a checkout of an earlier commit)")
        root = os.path.abspath(before)
        command = [
            sys.executable,
            os.path.join(root, "bench", "peers", "run_treeserve_search.py"),
            workload_path,
            out_path,
        ]
    else:
        command = [*SYSTEMS[system], workload_path, out_path]
    if system == "treeserve-reference":
        command.append("--reference")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{result.stderr[-3000:]}")
    with open(out_path) as f:
        out = json.load(f)
    os.unlink(out_path)
    return out


def shape_model(shape: str, role: str, layers: int | None) -> str:
    """A random-weight `role` ("generator" or "prm") of the QWEN3_SHAPES `shape` with `layers`
    decoder layers (None: the shape's), written once under bench/out/shapes."""
    config = QWEN3_SHAPES[shape]
    config = {**config, "num_hidden_layers": layers or config["num_hidden_layers"]}
    out_dir = os.path.join(HERE, "out", "shapes", f"{shape}-{config['num_hidden_layers']}l", role)
    return build_random_files(out_dir, config, seed=int(role == "prm"), step_tag_prm=role == "prm")


RULES = ("weighted", "naive")  # every system's accuracy under each; the first is the headline


def grade(records: list[dict], out: dict) -> dict[str, list[bool]]:
    """{rule: each problem solved?} for RULES, from the system's completions and step scores."""
    from treeserve.eval.grading import Grader
    from treeserve.eval.metrics import select
    from treeserve.eval.report import grade_problems

    by_id = {p["unique_id"]: p["completions"] for p in out["problems"]}
    completions = [[(c["text"], c["step_scores"]) for c in by_id[r["unique_id"]]] for r in records]
    with Grader() as grader:
        outcomes = grade_problems(records, completions, grader, agg="last")
    picks = {rule: [select(o.completions, rule, "last") for o in outcomes] for rule in RULES}
    return {
        rule: [i is not None and o.completions[i].correct for i, o in zip(chosen, outcomes, strict=True)]
        for rule, chosen in picks.items()
    }


def main() -> None:
    from treeserve.eval.arith import arith_dataset
    from treeserve.eval.metrics import wilson_interval

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--model-size",
        default="arith",
        choices=["arith", *TWIN_SIZES],
        help="the shipped models, or their random-weight twins of that size",
    )
    ap.add_argument(
        "--generator-shape",
        default=None,
        choices=list(QWEN3_SHAPES),
        help="a random-weight generator of this shape instead (module docstring)",
    )
    ap.add_argument("--prm-shape", default=None, choices=["qwen3-1.7b"], help="a random-weight PRM of this shape")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the --*-shape models")
    ap.add_argument("--generator", default=os.path.join(ASSETS, "arith-generator"), help="with --model-size arith")
    ap.add_argument("--prm", default=os.path.join(ASSETS, "arith-prm"), help="with --model-size arith")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "search.json"))
    ap.add_argument("--device", default="cpu", help="treeserve's device (cuda: see bench/gpu.py); peers use theirs")
    ap.add_argument("--before", default=None, help="the checkout system treeserve-before runs (a git worktree)")
    args = ap.parse_args()
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS and s != "treeserve-before"]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    if any("vllm" in s for s in systems) and not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"vllm python not found at {VLLM_PYTHON}: run bench/setup_vllm.sh first")
    records = arith_dataset(size=args.problems, seed=0, levels=(4, 5))
    models = {"generator": args.generator, "prm": args.prm}
    if args.model_size != "arith":
        twins = os.path.join(HERE, "out", "twins")
        models = {role: build_twin(args.model_size, role, twins) for role in ("generator", "prm")}
    shapes = {"generator": args.generator_shape, "prm": args.prm_shape}
    models.update({role: shape_model(shape, role, args.layers) for role, shape in shapes.items() if shape})
    random_weights = args.model_size != "arith" or any(shapes.values())  # a fixed shape, no grading
    shape = {"num_iterations": 40, "max_tokens": 256, "fixed_steps": False}
    if random_weights:
        shape = {"num_iterations": 5, "max_tokens": 32, "fixed_steps": True}
    workload = {
        "problems": records,
        **models,
        **shape,
        "n": args.n,
        "beam_width": args.beam_width,
        "temperature": 0.8,
        "top_p": 1.0,
        "agg": "last",
        "seed": 0,
        "dtype": "bfloat16",
        "kv_gib": 1,
        "device": args.device,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    workload_path = args.out + ".workload.json"
    with open(workload_path, "w") as f:
        json.dump(workload, f)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(args.repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for system in order:
            out = run_system(system, workload_path, args.threads, args.before)
            correct = None if random_weights else grade(records, out)
            row = {
                "problems_per_min": len(records) / out["wall_s"] * 60,
                "wall_s": out["wall_s"],
                "generated_tokens": out["generated_tokens"],
                "generated_tokens_per_s": out["generated_tokens"] / out["wall_s"],
                "prm_tokens_prefilled": out["prm_tokens_prefilled"],
                "prm_unique_tokens": out.get("prm_unique_tokens"),
                **({} if correct is None else {f"correct_{rule}": sum(hits) for rule, hits in correct.items()}),
            }
            runs[system].append(row)
            print(system, rep, json.dumps(row), flush=True)
    table = {}
    total = len(records)
    for system, rows in runs.items():
        table[system] = {
            "problems_per_min": statistics.median(r["problems_per_min"] for r in rows),
            "generated_tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in rows),
            "prm_tokens_prefilled": statistics.median(r["prm_tokens_prefilled"] for r in rows),
        }
        for rule in () if random_weights else RULES:  # seeded runs repeat their answers
            correct = int(statistics.median(r[f"correct_{rule}"] for r in rows))
            table[system][f"accuracy_{rule}"] = correct / total
            table[system][f"accuracy_{rule}_ci95"] = wilson_interval(correct, total)
    base = table.get("treeserve")
    for row in table.values():
        row["treeserve_speedup"] = base["problems_per_min"] / row["problems_per_min"] if base else None
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs, "table": table}, f, indent=1)
    models = f"{args.model_size} twins" if args.model_size != "arith" else "levels 4-5"
    models += "".join(f", {role} {shape}" for role, shape in shapes.items() if shape)
    models += f" at {args.layers} layers" if args.layers and any(shapes.values()) else ""
    print(f"\nn={args.n}, {len(records)} problems ({models}), {args.repeats} repetitions, medians:")
    print(
        "| system | problems/min | generated tok/s | PRM tokens prefilled | accuracy, weighted (95% CI) "
        "| accuracy, naive | treeserve speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for system, r in table.items():
        weighted, naive = "-", "-"
        if not random_weights:
            low, high = r["accuracy_weighted_ci95"]
            weighted, naive = f"{r['accuracy_weighted']:.1%} ({low:.1%}-{high:.1%})", f"{r['accuracy_naive']:.1%}"
        print(
            f"| {system} | {r['problems_per_min']:.1f} | {r['generated_tokens_per_s']:.0f} | "
            f"{r['prm_tokens_prefilled']:.0f} | {weighted} | {naive} | "
            f"{r['treeserve_speedup'] or float('nan'):.2f}x |"
        )


if __name__ == "__main__":
    main()
