"""`treeserve eval --workers N` on Ray: one `EvalWorker` actor (one runtime) per worker, problems handed
out as workers free up, a dead or hung worker's problems retried, counters merged. Seeds depend only on
(run seed, problem, beam lineage), so the results are the single-process run's plus `workers`,
`worker_failures` and `retried_problems`. Ray (the `treeserve[ray]` extra) is imported lazily."""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any

from tqdm import tqdm

from treeserve.eval.grading import Grader
from treeserve.eval.runner import (
    ASSETS,
    EvalSettings,
    Recorder,
    build_runtime,
    check_reasoning,
    finish,
    load_problems,
    open_journal,
    run_config,
    run_counters,
    search_context,
)
from treeserve.search.config import SearchConfig
from treeserve.search.run import search_problems

RAY_EXTRA = "pip install 'treeserve[ray]'"
HEARTBEAT_S = 2.0  # how often the driver pings each busy worker
MAX_ATTEMPTS = 3  # a problem in flight on this many dying workers fails the run rather than kill more


class RayMissing(ImportError):
    pass


class WorkerError(RuntimeError):
    """Workers could not start, or all of them died, or a problem kept killing them."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayMissing(f"--workers needs Ray, which is not installed ({e}); install it with: {RAY_EXTRA}") from None
    return ray


@dataclass
class RayOptions:
    workers: int
    address: str | None = None  # an existing cluster ("auto" or "HEAD_IP:6379"); None starts one here
    cpus_per_worker: int = 1  # Ray's num_cpus per actor and its torch threads
    heartbeat_timeout_s: float = 120.0  # a busy worker silent this long is hung: killed, as if it had died
    # tests only: worker index -> it exits (crash_after) or blocks its event loop (hang_after) at its k-th problem
    crash_after: dict[int, int] = field(default_factory=dict)
    hang_after: dict[int, int] = field(default_factory=dict)

    def check(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.cpus_per_worker < 1:
            raise ValueError(f"--cpus-per-worker must be >= 1, got {self.cpus_per_worker}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"--worker-timeout must be > 0 seconds, got {self.heartbeat_timeout_s}")


class EvalWorker:
    """One runtime (generator + PRM) in a Ray actor; searches one problem per call, many calls at once."""

    def __init__(
        self,
        settings: EvalSettings,
        config: SearchConfig,
        threads: int,
        driver_assets: str,
        crash_after: int | None,
        hang_after: int | None = None,
        run_problems: int = 0,
    ):
        import torch

        torch.set_num_threads(threads)
        settings = replace(
            settings,
            generator=replace(settings.generator, path=_local_path(settings.generator.path, driver_assets)),
            prm=settings.prm and replace(settings.prm, path=_local_path(settings.prm.path, driver_assets)),
            verifier=settings.verifier
            and replace(settings.verifier, path=_local_path(settings.verifier.path, driver_assets)),
        )
        self.runtime = build_runtime(settings, config)
        self.grader = Grader()  # adaptive search's answer keys (math kinds start worker processes when used)
        self.kinds: dict[str, str] = {}  # unique id -> grader kind, of the problems sent here
        self.ctx = search_context(settings, config, self.runtime, self.grader, self.kinds)
        self.ctx.budget.expect(run_problems)  # budget shares are the whole run's; only this worker's spend counts
        self.finished = 0
        self.crash_after, self.hang_after = crash_after, hang_after

    async def ready(self) -> str:
        return f"{socket.gethostname()} pid {os.getpid()}"

    async def ping(self) -> None:
        """The driver's heartbeat: answered whenever the event loop runs (a hung step blocks it)."""

    async def search(self, uid: str, question: str, kind: str = "math") -> dict:
        self.kinds[uid] = kind
        [result] = await search_problems(self.ctx, [(uid, question)])
        self.finished += 1
        if self.crash_after is not None and self.finished >= self.crash_after:
            os._exit(1)  # tests: die like a killed process, with other problems in flight
        if self.hang_after is not None and self.finished >= self.hang_after:
            time.sleep(3600)  # tests: hang like a stuck step, the event loop blocked
        return {
            "completions": [(b.text, list(b.scores)) for b in result.beams],
            "seconds": result.seconds,
            "trace": result.trace,
            "extra": {"spent": result.spent, "stop": result.stop},
            "counters": run_counters(self.runtime, self.ctx),
        }

    async def close(self) -> dict:
        """Stop the engines and check the page accounting (every page free or cached)."""
        await self.runtime.close()
        self.runtime.check_pages_idle()
        self.grader.close()
        return run_counters(self.runtime, self.ctx)


def _local_path(path: str, driver_assets: str) -> str:
    """A path into the driver's assets folder means this node's (the package may be installed elsewhere)."""
    if path and Path(path).is_relative_to(driver_assets):
        return str(ASSETS / Path(path).relative_to(driver_assets))
    return path


def run_eval_distributed(
    settings: EvalSettings,
    config: SearchConfig,
    options: RayOptions,
    inline: list[dict] | None = None,
    output: str | None = None,
    resume: bool = False,
    grace: float | None = None,
) -> dict:
    """`run_eval` on `options.workers` Ray actors; the driver keeps the journal and handles signals."""
    options.check()
    records = load_problems(settings, inline)
    check_reasoning(settings, config)
    if settings.reference:
        config = config.reference()
    # problems in flight per worker: enough for full batches, few enough that half are handed out as workers free up
    window = min(config.max_concurrent_problems, max(1, math.ceil(len(records) / (2 * options.workers))))
    distributed = {
        "workers": options.workers,
        "cpus_per_worker": options.cpus_per_worker,
        "ray_address": options.address,
        "problems_in_flight_per_worker": window,
    }
    journal, todo = open_journal(
        settings, run_config(settings, config, records, {"distributed": distributed}), records, output, resume
    )
    summary: dict = {}
    stopped = None
    if todo:
        ray = import_ray()
        started = _connect(ray, options)
        try:
            with Grader() as grader:
                if any(r.get("grader", "math") == "math" for r in todo):
                    grader.start()  # its workers start while the Ray workers load the models
                dispatch = ProblemDispatch(ray, settings, config, options, todo, window)
                recorder = Recorder(
                    journal,
                    grader,
                    settings.answer_rule(config.strategy),
                    config.agg,
                    dispatch.total_counters,
                    reasoning=config.reasoning,
                )
                summary = dispatch.run(recorder, grace)
                stopped = dispatch.stopped
        finally:
            if started:
                ray.shutdown()
    return finish(journal, records, config.agg, output, summary, stopped=stopped)


def _connect(ray: Any, options: RayOptions) -> bool:
    """Join, reuse or start a Ray cluster; True when this call started Ray (and so must shut it down)."""
    if ray.is_initialized():
        started = False
    elif options.address:
        ray.init(address=options.address, log_to_driver=True)
        started = True
    else:
        # "local": a new instance even where `ray start` left one (plain ray.init() would join it)
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True)
        started = True
    needed = options.workers * options.cpus_per_worker
    have = ray.cluster_resources().get("CPU", 0)
    if have < needed:
        message = (
            f"{options.workers} workers x {options.cpus_per_worker} CPUs need {needed} CPUs but the Ray "
            f"cluster has {have:g}"
        )
        if not options.address:
            if started:
                ray.shutdown()
            raise ValueError(message + "; use fewer --workers or --cpus-per-worker, or --ray-address for a cluster")
        _log(message + "; waiting for the cluster to grow")
    return started


@dataclass
class _Slot:
    """A worker position: its current actor (a new one after a death) and its calls in flight."""

    index: int
    actor: Any
    key: int  # which actor this is (counters are kept per actor, dead ones included)
    ready: Any  # the actor's ready() ref while it starts, else None
    name: str = ""
    in_flight: int = 0
    alive: bool = True
    ping: Any = None  # a heartbeat in flight, sent at `pinged`; the last one answered at `answered`
    pinged: float = 0.0
    answered: float = 0.0


class ProblemDispatch:
    """The driver's loop: problems go to workers with room, results and deaths come back."""

    def __init__(
        self,
        ray: Any,
        settings: EvalSettings,
        config: SearchConfig,
        options: RayOptions,
        records: list[dict],
        window: int,
    ):
        self.ray, self.settings, self.config, self.options, self.records = ray, settings, config, options, records
        self.window = window
        self.queue = deque(range(len(records)))
        self.attempts = [0] * len(records)
        self.answered: set[int] = set()
        self.recorder: Recorder | None = None
        self.stopped: int | None = None  # the signal that stopped admitting problems
        self.deadline = math.inf  # after a signal: when problems still in flight are given up
        self.calls: dict[Any, tuple[_Slot, int, float]] = {}  # ref -> (slot, problem index, submitted at)
        self.counters: dict[int, dict[str, int]] = {}  # actor key -> its latest counters
        self.retried: list[str] = []  # unique ids, in the order their first worker died
        self.failures = 0
        self.restarts_left = options.workers  # replacements for dead workers, in all
        self.actors = 0
        self.slots: list[_Slot] = []
        self.bar: tqdm | None = None

    def run(self, recorder: Recorder, grace: float | None = None) -> dict:
        """Search every problem, recording each as it returns; the summary's distributed fields.
        With `grace`, SIGINT/SIGTERM stop handing out problems and give those in flight `grace` s."""
        ray, options = self.ray, self.options
        self.recorder = recorder
        begin = time.perf_counter()
        handlers = {}
        if grace is not None:

            def on_signal(signum: int, frame: object) -> None:
                if self.stopped is None:
                    self.stopped, self.deadline = signum, time.perf_counter() + grace
                    _log(
                        f"{signal.Signals(signum).name}: handing out no more problems; those in flight get "
                        f"{grace:g} s to finish (signal again to stop now)"
                    )
                else:
                    self.deadline = 0.0

            handlers = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i in range(options.workers):
                self.slots.append(self._start(i, options.crash_after.get(i), options.hang_after.get(i)))
            for slot in self.slots:
                try:
                    slot.name = ray.get(slot.ready)
                except ray.exceptions.RayActorError as e:
                    raise WorkerError(f"worker {slot.index} failed to start: {_reason(e)}") from None
                slot.ready = None
            startup = time.perf_counter() - begin
            start = recorder.start = time.perf_counter()
            self.bar = tqdm(
                total=len(self.records), unit="problem", disable=not self.settings.progress, dynamic_ncols=True
            )
            try:
                seconds, overheads = self._dispatch()
            finally:
                self.bar.close()
            wall = time.perf_counter() - start
            # after a stop that left problems in flight, the actors are killed below as they are
            live = [(s, s.actor.close.remote()) for s in self.slots if s.alive and s.ready is None and not self.calls]
            for slot, ref in live:
                try:
                    self.counters[slot.key] = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # every answer is in: keep its last counters
                    _log(f"worker {slot.index} died while closing: {_reason(e)}")
        finally:
            for slot in self.slots:
                ray.kill(slot.actor, no_restart=True)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        return self._report(wall, startup, seconds, overheads)

    def total_counters(self) -> dict[str, int]:
        """Every actor's latest counters (dead ones' included), summed."""
        total: dict[str, int] = {}
        for counters in self.counters.values():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return total

    def _start(self, index: int, crash_after: int | None = None, hang_after: int | None = None) -> _Slot:
        worker = self.ray.remote(EvalWorker).options(num_cpus=self.options.cpus_per_worker, max_restarts=0)
        actor = worker.remote(
            self.settings,
            self.config,
            self.options.cpus_per_worker,
            str(ASSETS),
            crash_after,
            hang_after,
            len(self.records),
        )
        self.actors += 1
        return _Slot(index, actor, self.actors, actor.ready.remote())

    def _dispatch(self) -> tuple[list[float], list[float]]:
        """Run until every problem is answered; (search seconds, dispatch overhead seconds) per result."""
        ray = self.ray
        seconds: list[float] = []
        overheads: list[float] = []
        remaining = len(self.records)
        while remaining:
            if self.stopped is not None and (not self.calls or time.perf_counter() >= self.deadline):
                break
            self._fill()
            self._heartbeats()
            starting = {s.ready: s for s in self.slots if s.alive and s.ready is not None}
            if not self.calls and not starting:
                raise WorkerError(f"every worker died; {remaining} problems unanswered")
            ready, _ = ray.wait([*self.calls, *starting], num_returns=1, timeout=0.5)
            if not ready:
                continue
            [ref] = ready
            if ref in starting:
                self._started(starting[ref])
                continue
            slot, i, submitted = self.calls.pop(ref)
            slot.in_flight -= 1
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._lost(slot, i, e)
                continue
            seconds.append(out["seconds"])
            overheads.append(time.perf_counter() - submitted - out["seconds"])
            self.counters[slot.key] = out.pop("counters")
            if i in self.answered:
                raise AssertionError(f"problem {self.records[i]['unique_id']!r} answered twice")
            self.answered.add(i)
            self.recorder.add(self.records[i], out["completions"], out["trace"], out["extra"])
            remaining -= 1
            self.bar.update(1)
            alive = sum(s.alive for s in self.slots)
            retried = f", {len(self.retried)} retried" if self.retried else ""
            self.bar.set_postfix_str(f"{alive}/{len(self.slots)} workers{retried}")
        return seconds, overheads

    def _fill(self) -> None:
        if self.stopped is not None:
            return
        for slot in self.slots:
            while slot.alive and slot.ready is None and slot.in_flight < self.window and self.queue:
                i = self.queue.popleft()
                rec = self.records[i]
                ref = slot.actor.search.remote(str(rec["unique_id"]), rec["problem"], rec.get("grader", "math"))
                self.calls[ref] = (slot, i, time.perf_counter())
                slot.in_flight += 1

    def _heartbeats(self) -> None:
        """Ping busy workers; one silent for `heartbeat_timeout_s` is treated as dead."""
        now, timeout = time.perf_counter(), self.options.heartbeat_timeout_s
        for slot in self.slots:
            if not slot.alive or slot.ready is not None or not slot.in_flight:
                slot.ping = None
                continue
            if slot.ping is None:
                if now - slot.answered >= HEARTBEAT_S:
                    slot.ping, slot.pinged = slot.actor.ping.remote(), now
                continue
            done, _ = self.ray.wait([slot.ping], timeout=0)
            if done:
                slot.ping, slot.answered = None, now
            elif now - slot.pinged > timeout:
                slot.ping = None
                error = WorkerError(f"no answer to a heartbeat for {timeout:g} s (hung)")
                for ref in [ref for ref, (s, _, _) in self.calls.items() if s is slot]:
                    _, i, _ = self.calls.pop(ref)
                    slot.in_flight -= 1
                    self._lost(slot, i, error)

    def _started(self, slot: _Slot) -> None:
        try:
            slot.name = self.ray.get(slot.ready)
            slot.ready = None
            _log(f"worker {slot.index} restarted on {slot.name}")
        except self.ray.exceptions.RayActorError as e:
            slot.alive = False
            _log(f"worker {slot.index} could not be restarted ({_reason(e)}); going on without it")

    def _lost(self, slot: _Slot, i: int, error: Exception) -> None:
        """A call's worker died: requeue the problem at the front and replace the actor while restarts remain."""
        uid = str(self.records[i]["unique_id"])
        self.attempts[i] += 1
        if self.attempts[i] >= MAX_ATTEMPTS:
            raise WorkerError(f"problem {uid!r} was in flight on {MAX_ATTEMPTS} workers that died; giving up")
        self.queue.appendleft(i)
        if uid not in self.retried:
            self.retried.append(uid)
        if not slot.alive:
            return  # the death was handled at this worker's first failed call
        slot.alive = False
        self.failures += 1
        self.ray.kill(slot.actor, no_restart=True)
        lost = 1 + sum(1 for s, _, _ in self.calls.values() if s is slot)
        what = f"restarting it; its {lost} unanswered problems go to the live workers meanwhile"
        if not self.restarts_left:
            what = f"no restarts left; its {lost} unanswered problems go to the other workers"
        _log(f"worker {slot.index} ({slot.name}) died: {_reason(error)}; {what}")
        if self.restarts_left:
            self.restarts_left -= 1
            self.slots[slot.index] = self._start(slot.index)

    def _report(self, wall: float, startup: float, seconds: list[float], overheads: list[float]) -> dict:
        # prm_unique_tokens is per worker, summed: a prompt searched on two workers counts twice
        if self.retried:
            _log(
                f"{len(self.retried)} problems were retried after {self.failures} worker failures; "
                "each is answered once, by the worker that finished it"
            )
        return {
            "workers": self.options.workers,
            "worker_startup_s": startup,
            "worker_search_s": median(seconds) if seconds else 0.0,  # per problem, medians
            "dispatch_overhead_s": median(overheads) if overheads else 0.0,
            "worker_failures": self.failures,
            "retried_problems": [str(r["unique_id"]) for r in self.records if str(r["unique_id"]) in self.retried],
        }


def _reason(error: Exception) -> str:
    """One line on why an actor died: the exception its __init__ raised, or Ray's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    if getattr(error, "actor_init_failed", False):
        return lines[-1][:300]  # the traceback's last line: "ValueError: ..."
    return f"{type(error).__name__}: {lines[0][:200]}"


def _log(message: str) -> None:
    tqdm.write(f"treeserve: {message}", file=sys.stderr)
