"""Rebuild the arithmetic world's shipped checkpoints and their model cards, end to end.

    python -m tools.arith.build_all --seed 2

Trains the generator (its phases, the copy phase last); then, on the generator before its copy
phase (`common.PRM_BASE_DIR`), the PRM's curriculum (`tools.arith.facts`: the stages table, check
and route, each starting from the last), the PRM on judged solutions, starting from the
curriculum (`tools.arith.train_prm`), and the PRM's search rounds, each mining the solutions
beam search picks with it and fine-tuning on them (`tools.arith.mine_search`). Evaluates both
models on the test split and writes `treeserve/assets/arith-{generator,prm}/` (weights,
tokenizer, chat template, `prm_config.json`, `README.md` model cards, `eval.json`). The
generator trains on one thread and the PRM on two (`common.GENERATOR_THREADS`, `PRM_THREADS`: the weights depend on
the thread count); evaluation on `OMP_NUM_THREADS` (1 if unset). On this 2-core machine the
whole build takes about 2.5 hours, most of it the PRM's curriculum (the cards list the minutes).
"""

from __future__ import annotations

import argparse
import time

from tools.arith import evaluate, facts, mine_search, train_generator, train_prm
from tools.arith.common import (
    GENERATOR_DIR,
    PRM_BASE_DIR,
    PRM_DIR,
    SHIPPED_SEED,
    WORK_DIR,
    read_json,
    set_threads,
    write_json,
)
from tools.arith.model_card import minutes_text, write_cards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SHIPPED_SEED)
    reuse = "reuse the generator in assets (and the phase-2 one in WORK_DIR)"
    parser.add_argument("--skip-generator", action="store_true", help=reuse)
    parser.add_argument("--skip-prm", action="store_true", help="reuse the PRM already in assets")
    args = parser.parse_args()
    set_threads()
    start = time.time()
    if args.skip_generator:
        log = WORK_DIR / "generator_train.json"
        gen_train = read_json(log) if log.exists() else train_generator.recipe_summary(args.seed)
    else:
        gen_train = train_generator.train_recipe(args.seed, GENERATOR_DIR)
    if args.skip_prm:
        prm_train = read_json(WORK_DIR / "prm_train.json")
    else:
        if not PRM_BASE_DIR.exists():
            raise SystemExit(
                f"{PRM_BASE_DIR} (the generator before its copy phase) is missing: train the generator first"
            )
        init = PRM_BASE_DIR
        for stage in facts.STAGES:
            facts.build(stage, args.seed, init, facts.STAGE_DIRS[stage], **facts.DEFAULTS[stage])
            init = facts.STAGE_DIRS[stage]
        round0 = mine_search.ROUND0_DIR
        prm_train = train_prm.train(
            args.seed, **train_prm.DEFAULTS, generator_dir=PRM_BASE_DIR, out_dir=round0, init_dir=init
        )
        prm_train["search_rounds"] = mine_search.search_rounds(args.seed, PRM_BASE_DIR, round0, PRM_DIR)
        write_json(WORK_DIR / "prm_train.json", prm_train)
    results = evaluate.evaluate(GENERATOR_DIR, PRM_DIR, per_level_sampled=100, n=16, temperature=0.8, seed=args.seed)
    write_json(WORK_DIR / "eval.json", results)
    write_cards(GENERATOR_DIR, PRM_DIR, gen_train, prm_train, results)
    total = time.time() - start
    print(evaluate.format_table(results))
    stages = " + ".join(f"{name} {st['train_seconds'] / 60:.1f}" for name, st in prm_train["stages"].items())
    rounds = " + ".join(
        f"{(r['mine_seconds'] + r['train_seconds']) / 60:.1f}" for r in prm_train.get("search_rounds", [])
    )
    print(
        f"generator training {minutes_text(gen_train['train_seconds'])} min; PRM stages {stages} min, "
        f"sampling {prm_train['sample_seconds'] / 60:.1f} min + training {prm_train['train_seconds'] / 60:.1f} min, "
        f"search rounds {rounds or 'none'} min; build total {total / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
