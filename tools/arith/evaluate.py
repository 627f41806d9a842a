"""Measure the arithmetic-world checkpoints on the fixed test split (500 problems, seed 0).

    python -m tools.arith.evaluate [--per-level-sampled 100] [--n 16]

Greedy accuracy on all 500 problems; `--n` samples at T=0.8 for the first
`--per-level-sampled` problems of each level: sampled accuracy (mean over samples) and
pass@n; then the PRM's step-level ROC-AUC on those held-out samples, steps labelled by
`treeserve.eval.arith_labels.step_labels`. Writes `$TREESERVE_ARITH_WORK/eval.json` (default: a temp dir).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from tools.arith.common import GENERATOR_DIR, PRM_DIR, SHIPPED_SEED, WORK_DIR, load_model, set_threads, write_json
from tools.arith.copy_drills import copy_drill_auc, held_out_pairs
from tools.arith.data import problem_stream
from tools.arith.drills import fact_drill_auc
from tools.arith.prm_data import KINDS, corrupted_steps
from tools.arith.prm_io import roc_auc, score_steps
from tools.arith.sampling import generate, load_llm, max_new_tokens_for
from treeserve.eval.arith import arith_dataset, grade
from treeserve.eval.arith_labels import MISTAKES, split_steps, step_labels, step_verdicts

LEVELS = (1, 2, 3, 4, 5)


def by_level(records: list[dict]) -> dict[int, list[dict]]:
    return {lv: [r for r in records if r["level"] == lv] for lv in LEVELS}


def evaluate(
    generator_dir: Path, prm_dir: Path | None, per_level_sampled: int, n: int, temperature: float, seed: int
) -> dict:
    set_threads()
    records = by_level(arith_dataset(500, seed=0))
    llm = load_llm(generator_dir)
    results: dict = {"levels": {}, "n": n, "temperature": temperature, "per_level_sampled": per_level_sampled}
    held_out: list[tuple[int, str, list[str]]] = []
    start = time.time()
    for lv in LEVELS:
        recs = records[lv]
        greedy = generate(llm, [r["problem"] for r in recs], max_new_tokens=max_new_tokens_for(lv))
        greedy_acc = sum(grade(g[0], r["answer"]) for g, r in zip(greedy, recs, strict=True)) / len(recs)
        sub = recs[:per_level_sampled]
        samples = generate(
            llm,
            [r["problem"] for r in sub],
            max_new_tokens=max_new_tokens_for(lv),
            temperature=temperature,
            n=n,
            seed=seed + lv,
        )
        correct = [[grade(s, r["answer"]) for s in ss] for ss, r in zip(samples, sub, strict=True)]
        results["levels"][lv] = {
            "greedy_acc": greedy_acc,
            "sampled_acc": sum(map(sum, correct)) / (n * len(sub)),
            f"pass@{n}": sum(any(c) for c in correct) / len(sub),
            "problems_greedy": len(recs),
            "problems_sampled": len(sub),
        }
        held_out += [(lv, r["problem"], split_steps(s)) for ss, r in zip(samples, sub, strict=True) for s in ss]
        print(f"L{lv} {results['levels'][lv]} {time.time() - start:.0f}s", flush=True)
    results["generator_eval_seconds"] = time.time() - start
    del llm
    if prm_dir is not None:
        prm = load_model(prm_dir)
        results["prm"] = prm_auc(prm, held_out)
        results["prm"]["corruptions"] = corruption_check(prm)
        results["prm"]["fact_drill_auc"] = fact_drill_auc(prm)
        results["prm"]["copy_drill_auc"] = copy_drill_auc(prm, held_out_pairs())
        for lv in LEVELS:
            results["levels"][lv]["prm_auc"] = results["prm"]["by_level"][lv]["auc"]
    return results


def prm_auc(prm, held_out: list[tuple[int, str, list[str]]]) -> dict:
    """Step-level ROC-AUC of the PRM on held-out generator samples, by level and overall."""
    items = [(problem, steps) for _, problem, steps in held_out if steps]
    levels = [lv for lv, _, steps in held_out if steps]
    scores = score_steps(prm, items)
    verdicts = [step_verdicts(problem, steps) for problem, steps in items]
    labels = [[v == "good" for v in vs] for vs in verdicts]
    out: dict = {"by_level": {}, "first_mistakes": first_mistakes(scores, verdicts)}
    all_s: list[float] = []
    all_y: list[bool] = []
    for lv in LEVELS:
        s = [x for i, ss in enumerate(scores) if levels[i] == lv for x in ss]
        y = [x for i, ys in enumerate(labels) if levels[i] == lv for x in ys]
        out["by_level"][lv] = {"auc": roc_auc(s, y), "steps": len(y), "bad_steps": len(y) - sum(y)}
        all_s += s
        all_y += y
    out["auc"] = roc_auc(all_s, all_y)
    out["steps"], out["bad_steps"] = len(all_y), len(all_y) - sum(all_y)
    return out


def first_mistakes(scores: list[list[float]], verdicts: list[list[str]]) -> dict:
    """Does the PRM catch the generator's own mistakes? For each kind of first mistake in the
    held-out samples (`step_verdicts`): its share of the wrong solutions and the AUC of those
    first wrong steps against every good step."""
    good = [x for ss, vs in zip(scores, verdicts, strict=True) for x, v in zip(ss, vs, strict=True) if v == "good"]
    firsts = [
        next((x, v) for x, v in zip(ss, vs, strict=True) if v != "good")
        for ss, vs in zip(scores, verdicts, strict=True)
        if set(vs) - {"good"}
    ]
    out = {}
    for kind in MISTAKES:
        wrong = [x for x, v in firsts if v == kind]
        if wrong:
            auc = roc_auc(wrong + good, [False] * len(wrong) + [True] * len(good))
            out[kind] = {"share": len(wrong) / len(firsts), "solutions": len(wrong), "auc": auc}
    return out


def corruption_check(prm, per_kind: int = 45, seed: int = 5) -> dict:
    """Can the PRM tell a wrong step from a right one at the same depth? For each kind of
    synthetic mistake (`tools.arith.prm_data`), on training-stream problems of levels 3-5: the
    mean score of the first wrong step, of the right step just before it, and the step AUC.
    Step AUC on generator samples also rewards knowing that deep steps are more often wrong
    (one wrong step makes every later step wrong); this check does not."""
    rng = random.Random(seed)
    out: dict = {}
    for kind in KINDS:
        items, labels = [], []
        for lv in (3, 4, 5):
            stream = problem_stream(random.Random(f"check-{seed}-{lv}"), lv, set())
            for _ in range(per_kind // 3):
                problem = next(stream)
                steps = corrupted_steps(rng, problem, kind)
                items.append((problem.text, steps))
                labels.append(step_labels(problem.text, steps))
        scores = score_steps(prm, items)
        wrong, before = [], []
        for s, y in zip(scores, labels, strict=True):
            if False in y:
                i = y.index(False)
                wrong.append(s[i])
                if i:
                    before.append(s[i - 1])
        out[kind] = {
            "first_wrong": sum(wrong) / len(wrong),
            "right_before": sum(before) / len(before) if before else float("nan"),
            "auc": roc_auc([x for s in scores for x in s], [x for y in labels for x in y]),
        }
    return out


def format_table(results: dict) -> str:
    n = results["n"]
    lines = [
        f"| level | greedy acc | sampled acc (T={results['temperature']}) | pass@{n} | PRM step AUC |",
        "|---|---|---|---|---|",
    ]
    for lv, m in results["levels"].items():
        auc = m.get("prm_auc")
        auc_text = f"{auc:.3f}" if auc is not None else "-"
        lines.append(f"| {lv} | {m['greedy_acc']:.1%} | {m['sampled_acc']:.1%} | {m[f'pass@{n}']:.1%} | {auc_text} |")
    if "prm" in results:
        lines.append(f"| all | | | | {results['prm']['auc']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generator", type=Path, default=GENERATOR_DIR)
    parser.add_argument("--prm", type=Path, default=PRM_DIR)
    parser.add_argument("--no-prm", action="store_true")
    parser.add_argument("--per-level-sampled", type=int, default=100)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=SHIPPED_SEED, help="sampling seed (the cards used the recipe's)")
    parser.add_argument("--out", type=Path, default=WORK_DIR / "eval.json")
    args = parser.parse_args()
    results = evaluate(
        args.generator, None if args.no_prm else args.prm, args.per_level_sampled, args.n, args.temperature, args.seed
    )
    write_json(args.out, results)
    print(format_table(results))


if __name__ == "__main__":
    main()
