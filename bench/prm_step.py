"""The PRM's scoring step alone: new chunks over a cached prefix, in one engine step.

    python bench/prm_step.py --threads 1 [--checkout DIR]

A PRM scores a search's steps as chunks of a few to a few dozen tokens over a prefix it has
cached, so its steps are small prefill steps; this times `LLMEngine.step` for such steps of the
shipped `arith-prm` (bf16): each repetition caches a fresh 100-token prefix with `LLM.score`,
adds the chunks (each the prefix plus its new tokens) and times the steps that compute them.
Medians of `--repeats`. `--checkout DIR` runs the treeserve of another checkout (a `git
worktree` of an earlier commit), to compare in alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = ((1, 1), (1, 4), (2, 20), (4, 20), (8, 20), (16, 20))  # (chunks, new tokens each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=100, help="tokens cached before each step")
    ap.add_argument("--checkout", default=os.path.dirname(HERE), help="the treeserve checkout to run")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.checkout))
    import torch

    from treeserve import LLM, ScoreParams

    torch.set_num_threads(args.threads)
    llm = LLM(os.path.join(HERE, "..", "treeserve", "assets", "arith-prm"), dtype="bfloat16")
    engine, rng, times = llm.engine, random.Random(0), {}
    for chunks, new in SHAPES:
        taken = []
        for r in range(args.repeats):
            prefix = [rng.randrange(3, 1000) for _ in range(args.prefix)]
            llm.score([prefix], ScoreParams(positions=[args.prefix - 1], token_ids=[5, 6]))
            for i in range(chunks):
                ids = prefix + [rng.randrange(3, 1000) for _ in range(new)]
                params = ScoreParams(positions=[len(ids) - 1], token_ids=[5, 6])
                engine.add_request(f"{chunks}x{new}-{r}-{i}", {"prompt_token_ids": ids}, params)
            start, steps = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            taken.append((time.perf_counter() - start) / steps)
        taken.sort()
        times[f"{chunks}x{new}"] = round(taken[len(taken) // 2] * 1e3, 3)
    engine.check_pages_idle()
    print(json.dumps({"checkout": os.path.abspath(args.checkout), "threads": args.threads, "step_ms": times}))


if __name__ == "__main__":
    main()
