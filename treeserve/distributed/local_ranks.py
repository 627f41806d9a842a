"""Ranks on this host (`distributed_executor_backend="mp"`): spawned processes, messages down a
pipe; a closed pipe means rank 0 is gone."""

from __future__ import annotations

import contextlib
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from treeserve.distributed.protocol import RankGone, WorkerArgs, WorkerFactory


def local_device(device: torch.device, rank: int) -> str:
    """The rank-th GPU after rank 0's (untested on more than one), or the CPU."""
    return f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else "cpu"


class LocalRank:
    def __init__(self, args: WorkerArgs, worker: WorkerFactory) -> None:
        context = mp.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(
            target=serve, args=(worker, args, theirs), daemon=True, name=f"treeserve-rank{args.rank}"
        )
        _start(self.process)
        theirs.close()

    def ready(self, timeout_s: float) -> tuple[str, Any]:
        if not wait([self.pipe, self.process.sentinel], timeout_s) or not self.pipe.poll():
            return ("timeout", None) if self.process.exitcode is None else ("error", f"it exited ({self.state()})")
        try:
            return self.pipe.recv()
        except EOFError:
            return "error", f"it exited ({self.state()})"

    def send(self, message: tuple) -> None:
        try:
            self.pipe.send(message)
        except (BrokenPipeError, ConnectionError, OSError) as e:
            raise RankGone from e

    def exited(self, timeout_s: float = 0.0) -> bool:
        if timeout_s > 0:
            self.process.join(timeout_s)
        return self.process.exitcode is not None

    def state(self) -> str:
        code = self.process.exitcode
        return f"pid {self.process.pid}, " + ("still running" if code is None else f"exit code {code}")

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionError, OSError):
            self.pipe.send(("stop",))
        self.pipe.close()
        self.process.join(timeout=1.0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(timeout=5.0)


def _start(process: mp.Process) -> None:
    """Start `process`, also from a daemon (the server's engine core): multiprocessing refuses
    daemons children, but a rank exits when its pipe closes and rank 0's finalizer stops it."""
    config = mp.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        process.start()
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def serve(make_worker: WorkerFactory, args: WorkerArgs, pipe: Connection) -> None:
    worker = make_worker(args)
    if worker.load_error is not None:
        pipe.send(("error", worker.load_error))
        return
    pipe.send(("ready", worker.parts))
    while True:
        try:
            message = pipe.recv()
        except EOFError:
            return
        try:
            if not worker.handle(message):
                return
        except Exception:  # a failed collective: rank 0 or a peer is gone
            traceback.print_exc()
            return
