"""The other ranks of a parallel model: processes that hold part of the model and run forwards only.

Owns `Ranks` (rank 0's handle: starts ranks 1..k-1, sends them each step in one message,
notices a rank that died or stopped answering, and stops them) and `RankFailed`. Ranks start as
processes on this host (`local_ranks.py`, `distributed_executor_backend="mp"`) or as Ray actors
in a placement group, for ranks on other hosts (`ray_ranks.py`, "ray"); what passes between
them and rank 0 is `protocol.py`'s. What a rank > 0 runs is a `Worker` that the caller passes in
as a factory (the engine's `engine/rank_worker.py::RankWorker`), so nothing here knows about
models, pages or steps. Rank 0 (the engine's process) schedules, samples and detokenises; the
other ranks never see a request. Ranks are tensor_parallel_size x pipeline_parallel_size: a
pipeline stage's tensor shards are consecutive ranks (`groups.py::Placement`); a shard runs
every layer of its stage on its heads, a stage its contiguous layers on the activations the
stage before sends it (the last stage sends its output back to stage 0); models/sharding.py
splits the checkpoint either way.

A rank waits for messages for as long as the engine is idle (a pipe's end tells it that rank 0
is gone); tensors meet in the groups' collectives and sends, which fail after `timeout_s` when
a rank stops answering, or at once when one died. A rank runs what rank 0 runs, in the same
order (rank 0 runs one step at a time), so every collective is met by every rank. The messages
are the worker's (the engine's: "kv", "step", "logits"); ("stop",) ends every rank.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import torch

from treeserve.distributed.groups import Placement
from treeserve.distributed.local_ranks import LocalRank, local_device
from treeserve.distributed.protocol import ParallelSettings, RankGone, RankHandle, WorkerArgs, WorkerFactory, free_port

READY_TIMEOUT_S = 600.0  # for a rank to load its part of the model


class RankFailed(RuntimeError):
    """A rank died or stopped answering: the engine cannot step any more."""


class Ranks:
    """Ranks 1..size-1 of one engine's model, seen from rank 0."""

    def __init__(self, config: ParallelSettings, device: torch.device, worker: WorkerFactory) -> None:
        """Start ranks 1..k-1, each running `worker(WorkerArgs(...))`, and meet them."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if config.distributed_executor_backend == "ray":
            from treeserve.distributed.ray_ranks import start_ray_ranks

            host, port, self.handles, release = start_ray_ranks(config, device, worker)
        else:
            host, port, release = "127.0.0.1", free_port(), None
            threads = torch.get_num_threads()
            self.handles = [LocalRank(WorkerArgs(config, local_device(device, r), r, host, port, threads), worker)
                            for r in range(1, tp * pp)]  # fmt: skip
        self.send_s = 0.0  # seconds spent sending messages to the ranks (pickling the steps' inputs)
        self.parts: list[dict] = []  # per rank > 0, as it reported: its weights' bytes, its KV bytes a token
        self.stopped = False
        self._finalizer = weakref.finalize(self, _stop, list(self.handles), release)
        self.placement = self._meet(Placement(0, tp, pp), host, port, device, config.parallel_timeout_s)

    def _meet(self, placement: Placement, host: str, port: int, device: torch.device, timeout_s: float) -> Placement:
        """Rank 0's joins (they wait for every rank), watched from here: a rank that exits before
        it joined (it failed starting) is an error at once rather than after `timeout_s`."""
        joined: Future = Future()

        def join() -> None:
            try:
                joined.set_result(placement.connect(host, port, device, timeout_s))
            except BaseException as e:  # noqa: BLE001 - read below, on rank 0's thread
                joined.set_exception(e)

        thread = threading.Thread(target=join, daemon=True, name="treeserve-rank0-join")
        thread.start()
        while True:
            thread.join(0.2)
            if joined.done():
                try:
                    return joined.result()
                except Exception as e:  # noqa: BLE001 - a rank that never joined (it hangs): the store timed out
                    error: Exception = e
                    break
            if any(h.exited() for h in self.handles):
                error = RuntimeError("a rank exited before it joined")
                break
        states = self._states()
        self.close()
        raise RankFailed(f"the ranks did not meet ({states}): {error}") from error

    def wait_ready(self) -> None:
        """Until every rank has loaded its part; its error (a ValueError) when one could not."""
        for rank, handle in enumerate(self.handles, start=1):
            status, detail = handle.ready(READY_TIMEOUT_S)
            if status == "timeout":
                self.close()
                raise RankFailed(f"rank {rank} did not load its part of the model ({handle.state()})")
            if status != "ready":
                self.close()
                raise ValueError(f"rank {rank} could not load its part of the model: {detail}")
            self.parts.append(detail)

    @property
    def wait_s(self) -> float:
        """Seconds rank 0 spent in collectives and receives (communication and waiting)."""
        return self.placement.wait_s

    def send(self, message: tuple) -> None:
        """`message` to every rank; RankFailed naming a rank that exited."""
        self.check()
        start = time.perf_counter()
        for rank, handle in enumerate(self.handles, start=1):
            try:
                handle.send(message)
            except RankGone:  # it exited since `check`
                raise self._exited(rank, handle) from None
        self.send_s += time.perf_counter() - start

    def check(self) -> None:
        if self.stopped:
            raise RankFailed("the engine's ranks were stopped (a rank failed before): start a new engine")
        for rank, handle in enumerate(self.handles, start=1):
            if handle.exited():
                raise self._exited(rank, handle)

    def _exited(self, rank: int, handle: RankHandle) -> RankFailed:
        """Every rank stopped; the error naming `rank`, found exited before a step's collectives
        (by `check`, or by a send that could not reach it: one message either way)."""
        state = handle.state()
        self.close()
        return RankFailed(f"rank {rank} exited ({state}); every rank is stopped")

    def explain(self, error: BaseException) -> BaseException:
        """A step's error as the ranks' failure when a rank is gone or stopped answering (every
        rank is then stopped), else `error` itself."""
        if isinstance(error, RankFailed):
            return error
        if not isinstance(error, RuntimeError) or self.stopped:
            return error
        deadline = time.monotonic() + 1.0  # a killed rank's exit arrives
        gone = [rank for rank, h in enumerate(self.handles, start=1)
                if h.exited(max(deadline - time.monotonic(), 0.0))]  # fmt: skip
        states = self._states()
        self.close()
        if gone:
            return RankFailed(f"rank {gone[0]} died during a step ({states}); every rank is stopped")
        return RankFailed(f"a rank did not answer within the timeout or failed ({states}): {error}; every rank "
                          "is stopped")  # fmt: skip

    def _states(self) -> str:
        return ", ".join(f"rank {rank}: {h.state()}" for rank, h in enumerate(self.handles, start=1))

    def close(self) -> None:
        """Stop every rank: ask, then kill what has not exited within a second."""
        self._finalizer()
        self.stopped = True


def _stop(handles: list[RankHandle], release: Any) -> None:
    for handle in handles:
        handle.stop()
    if release is not None:
        release()
