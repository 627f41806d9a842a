"""Search rounds for the PRM: mine the solutions beam search picks with it, judge them, fine-tune.

    python -m tools.arith.mine_search [--prm DIR] [--rounds N] [--out DIR]

Beam search selects hard on the PRM's score, so its final beams are where the PRM's blind spots
collect: a step the PRM wrongly likes (mostly a miscopied operand or rest) survives every
pruning, and an answer built on it is returned. Training on those beams shows the PRM exactly the
mistakes the search steers towards, which synthetic corruptions and plain samples did not
(`docs/prm-copy-check.md`). A round runs treeserve's own beam search (N=16, the eval's defaults
otherwise) with the current PRM on fresh training problems of levels 4-5 at the temperatures of
the evaluation, labels every step of every distinct final beam with the step judge, and
fine-tunes the PRM on its training data plus everything mined so far (`FINE_TUNE`). The mined
problems never include the evaluation problems (`excluded_texts`). `build_all` runs
`SEARCH_ROUNDS` rounds after `train_prm`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tools.arith.common import (
    PRM_BASE_DIR,
    PRM_DIR,
    SHIPPED_SEED,
    WORK_DIR,
    set_threads,
    write_json,
)
from tools.arith.data import held_out_texts, problem_stream
from tools.arith.prm_data import Example, cached_examples
from treeserve.eval.arith import arith_dataset, to_record
from treeserve.eval.arith_labels import split_steps, step_labels

ROUND0_DIR = WORK_DIR / "prm-round0"  # the PRM trained by `train_prm` alone, before any round
MINE_LEVELS = (4, 5)
MINE_TEMPERATURES = (0.4, 0.8)
# The largest level-4/5 evaluation set of BENCHMARKS.md and the README (the 200-problem
# set is part of it): mined problems never come from it.
EVAL_SPEC = {"size": 600, "seed": 0, "levels": MINE_LEVELS}
SEARCH_ROUNDS = 1
MINE_THREADS = 1  # beam search's choices depend on float rounding, and so on the thread count
MINE_PER_LEVEL = 600
# A round continues from the last PRM: every layer, one epoch, a third of the first lr.
FINE_TUNE = {"epochs": 1, "lr": 3e-4, "extra_layers": 0, "base_lr_scale": 1.0}


def excluded_texts() -> set[str]:
    return held_out_texts() | {r["problem"] for r in arith_dataset(**EVAL_SPEC)}


def mine(
    generator_dir: Path, prm_dir: Path, seed: int, per_level: int, temperature: float, round_: int = 1, n: int = 16
) -> list[Example]:
    """Beam search (N=`n`, beam width 4) on `per_level` fresh problems per level; every distinct
    final beam, split into steps and labelled. Each mining round draws its own problems."""
    from treeserve.eval.runner import EvalSettings, run_eval
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.search.config import SearchConfig

    set_threads(MINE_THREADS)
    exclude = excluded_texts()
    records = []
    for lv in MINE_LEVELS:
        key = f"prm-mined-{seed}-{lv}" if round_ == 1 else f"prm-mined-{seed}-round{round_}-{lv}"
        stream = problem_stream(random.Random(key), lv, exclude)
        records += [{**to_record(next(stream), f"mined/L{lv}/{i}"), "grader": "arith"} for i in range(per_level)]
    settings = EvalSettings(
        generator=ModelSettings(str(generator_dir)), prm=ModelSettings(str(prm_dir)), progress=False
    )
    config = SearchConfig(strategy="beam_search", n=n, temperature=temperature, seed=seed)
    results = run_eval(settings, config, inline=records)
    out: list[Example] = []
    for problem in results["problems"]:
        for text in dict.fromkeys(c["text"] for c in problem["completions"]):
            steps = split_steps(text)
            if steps:
                out.append((problem["problem"], steps, step_labels(problem["problem"], steps)))
    return out


def cached_mined(
    generator_dir: Path, prm_dir: Path, seed: int, per_level: int, round_: int = 1
) -> tuple[list[Example], float]:
    """`mine` at every temperature of `MINE_TEMPERATURES`, kept in the scratch directory."""

    def mine_all() -> list[Example]:
        out: list[Example] = []
        for temperature in MINE_TEMPERATURES:
            out += mine(generator_dir, prm_dir, seed, per_level, temperature, round_)
            print(f"mined round {round_} T={temperature}: {len(out)} solutions so far", flush=True)
        return out

    return cached_examples(WORK_DIR / f"prm_mined_seed{seed}_{per_level}_round{round_}.json", mine_all)


def search_rounds(
    seed: int,
    generator_dir: Path,
    prm_dir: Path,
    out_dir: Path,
    rounds: int = SEARCH_ROUNDS,
    per_level: int = MINE_PER_LEVEL,
) -> list[dict]:
    """`rounds` times: mine with the PRM so far, then fine-tune it (`FINE_TUNE`) on its training
    data plus every solution mined so far. Starts from the PRM in `prm_dir`; the last round's PRM
    goes to `out_dir`, earlier ones to the scratch directory. Returns each round's summary."""
    from tools.arith.train_prm import DEFAULTS, train

    recipe = {**DEFAULTS, **FINE_TUNE}
    mined: list[Example] = []
    summaries = []
    for round_ in range(1, rounds + 1):
        examples, seconds = cached_mined(generator_dir, prm_dir, seed, per_level, round_)
        mined += examples
        next_dir = out_dir if round_ == rounds else WORK_DIR / f"prm-round{round_}"
        summary = train(seed, **recipe, generator_dir=generator_dir, out_dir=next_dir, init_dir=prm_dir, mined=mined)
        bad = sum(not all(labels) for _, _, labels in examples)
        summaries.append(
            {
                **summary,
                "round": round_,
                "mined_this_round": len(examples),
                "mined_bad": bad,
                "mined_per_level": per_level,
                "mine_seconds": seconds,
            }
        )
        prm_dir = next_dir
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SHIPPED_SEED)
    parser.add_argument("--rounds", type=int, default=SEARCH_ROUNDS)
    parser.add_argument("--per-level", type=int, default=MINE_PER_LEVEL)
    parser.add_argument("--generator", type=Path, default=PRM_BASE_DIR)
    parser.add_argument("--prm", type=Path, default=ROUND0_DIR, help="the PRM to start from")
    parser.add_argument("--out", type=Path, default=PRM_DIR)
    args = parser.parse_args()
    summaries = search_rounds(args.seed, args.generator, args.prm, args.out, args.rounds, args.per_level)
    write_json(WORK_DIR / "prm_search_rounds.json", summaries)
    for s in summaries:
        print(
            f"round {s['round']}: mined {s['mined_this_round']} solutions ({s['mined_bad']} with a bad step) "
            f"in {s['mine_seconds'] / 60:.1f} min; fine-tuned on {s['steps_labelled']} steps in "
            f"{s['train_seconds'] / 60:.1f} min"
        )


if __name__ == "__main__":
    main()
