"""Rank 0's handle on ranks 1..k-1 of a parallel model (`Ranks`): start them (local processes or
Ray actors), send each step in one message, notice one that died or stopped answering, stop them.
Ranks > 0 run the caller's `Worker` (the engine's `RankWorker`) and never see a request. They run
rank 0's messages in rank 0's order, so every collective is met by every rank; collectives fail
after `timeout_s` when a rank hangs, at once when one died. ("stop",) ends every rank.
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
from treeserve.distributed.protocol import ParallelEngine, RankGone, RankHandle, WorkerArgs, WorkerFactory, free_port

READY_TIMEOUT_S = 600.0  # to load a rank's part of the model


class RankFailed(RuntimeError):
    """A rank died or stopped answering: the engine cannot step again."""


class Ranks:
    def __init__(self, config: ParallelEngine, device: torch.device, worker: WorkerFactory) -> None:
        tp, pp = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
        if config.parallel_config.distributed_executor_backend == "ray":
            from treeserve.distributed.ray_ranks import start_ray_ranks

            host, port, self.handles, release = start_ray_ranks(config, device, worker)
        else:
            host, port, release = "127.0.0.1", free_port(), None
            threads = torch.get_num_threads()
            self.handles = [
                LocalRank(WorkerArgs(config, local_device(device, r), r, host, port, threads), worker)
                for r in range(1, tp * pp)
            ]
        self.send_s = 0.0  # sending (pickling) messages
        self.parts: list[dict] = []
        self.stopped = False
        self._finalizer = weakref.finalize(self, _stop, list(self.handles), release)
        self.placement = self._meet(Placement(0, tp, pp), host, port, device, config.parallel_config.parallel_timeout_s)

    def _meet(self, placement: Placement, host: str, port: int, device: torch.device, timeout_s: float) -> Placement:
        """Rank 0's joins, watched: a rank that exits before joining fails at once, not after `timeout_s`."""
        joined: Future = Future()

        def join() -> None:
            try:
                joined.set_result(placement.connect(host, port, device, timeout_s))
            except BaseException as e:  # re-raised on rank 0's thread
                joined.set_exception(e)

        thread = threading.Thread(target=join, daemon=True, name="treeserve-rank0-join")
        thread.start()
        while True:
            thread.join(0.2)
            if joined.done():
                try:
                    return joined.result()
                except Exception as e:  # a rank that hangs: the store timed out
                    error: Exception = e
                    break
            if any(h.exited() for h in self.handles):
                error = RuntimeError("a rank exited before it joined")
                break
        states = self._states()
        self.close()
        raise RankFailed(f"the ranks did not meet ({states}): {error}") from error

    def wait_ready(self) -> None:
        """Until every rank has loaded its part; ValueError when one could not."""
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
        return self.placement.wait_s

    def send(self, message: tuple) -> None:
        self.check()
        start = time.perf_counter()
        for rank, handle in enumerate(self.handles, start=1):
            try:
                handle.send(message)
            except RankGone:
                raise self._exited(rank, handle) from None
        self.send_s += time.perf_counter() - start

    def check(self) -> None:
        if self.stopped:
            raise RankFailed("the engine's ranks were stopped (a rank failed before): start a new engine")
        for rank, handle in enumerate(self.handles, start=1):
            if handle.exited():
                raise self._exited(rank, handle)

    def _exited(self, rank: int, handle: RankHandle) -> RankFailed:
        """Stop every rank; the error naming `rank`."""
        state = handle.state()
        self.close()
        return RankFailed(f"rank {rank} exited ({state}); every rank is stopped")

    def explain(self, error: BaseException) -> BaseException:
        """A step's error as RankFailed (every rank stopped) when a rank is gone or hangs, else itself."""
        if isinstance(error, RankFailed):
            return error
        if not isinstance(error, RuntimeError) or self.stopped:
            return error
        deadline = time.monotonic() + 1.0  # for a killed rank's exit to arrive
        gone = [rank for rank, h in enumerate(self.handles, start=1) if h.exited(max(deadline - time.monotonic(), 0.0))]
        states = self._states()
        self.close()
        if gone:
            return RankFailed(f"rank {gone[0]} died during a step ({states}); every rank is stopped")
        return RankFailed(
            f"a rank did not answer within the timeout or failed ({states}): {error}; every rank is stopped"
        )

    def _states(self) -> str:
        return ", ".join(f"rank {rank}: {h.state()}" for rank, h in enumerate(self.handles, start=1))

    def close(self) -> None:
        """Ask every rank to stop, then kill what has not exited within a second."""
        self._finalizer()
        self.stopped = True


def _stop(handles: list[RankHandle], release: Any) -> None:
    for handle in handles:
        handle.stop()
    if release is not None:
        release()
