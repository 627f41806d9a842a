"""The other ranks of a parallel engine: processes that hold part of the model and run forwards only.

Owns `Ranks` (rank 0's handle: starts ranks 1..k-1 with torch.multiprocessing's spawn, sends
them each step in one message, notices a rank that died or stopped answering, and stops them)
and `worker_main` (what a rank > 0 runs). Rank 0 (the engine's process) schedules, samples and
detokenises; the other ranks never see a request. A rank is a tensor-parallel shard
(`tensor_parallel_size`: every rank runs every layer on its heads) or a pipeline stage
(`pipeline_parallel_size`: rank s runs its contiguous layers on the activations stage s - 1
sends it, and the last stage sends its output back to rank 0); layers/parallel.py splits the
checkpoint either way.

Messages go down a pipe per rank (a rank waits on it for as long as the engine is idle, and a
pipe's end tells it that rank 0 is gone); tensors meet in the group's collectives and sends,
which fail after `timeout_s` when a rank stops answering, or at once when one died. A rank
runs what rank 0 runs, in the same order (rank 0 runs one step at a time), so every
collective is met by every rank:

    ("kv", num_pages, block_size)      an arena of num_pages pages of this rank's heads / layers
    ("step", copies, batch, twins)     page copies, then the forward of `batch` (and its twins)
    ("logits", hidden)                 tensor parallel: this rank's vocabulary slice, gathered
    ("stop",)
"""

from __future__ import annotations

import contextlib
import socket
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from treeserve.layers.parallel import TPGroup

READY_TIMEOUT_S = 600.0  # for a rank to load its part of the model


class RankFailed(RuntimeError):
    """A rank died or stopped answering: the engine cannot step any more."""


@dataclass
class WorkerArgs:
    model: str
    dtype: str
    device: str
    attention_backend: str
    rank: int
    tp_size: int
    pp_size: int
    port: int
    timeout_s: float
    threads: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Ranks 1..size-1 of one engine's model, seen from rank 0."""

    def __init__(self, model: str, dtype: str, device: torch.device, attention_backend: str, tp_size: int,
                 pp_size: int, timeout_s: float) -> None:  # fmt: skip
        size = tp_size * pp_size  # one of the two is 1 (config.check_parallel)
        self.tp_size, self.pp_size = tp_size, pp_size
        port = free_port()
        context = mp.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            args = WorkerArgs(model, dtype, str(device), attention_backend, rank, tp_size, pp_size, port, timeout_s,
                              torch.get_num_threads())  # fmt: skip
            process = context.Process(target=worker_main, args=(args, theirs), daemon=True,
                                      name=f"treeserve-rank{rank}")  # fmt: skip
            _start(process)
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self.send_s = 0.0  # seconds spent sending messages to the ranks (pickling the steps' inputs)
        self.parts: list[dict] = []  # per rank > 0, as it reported: its weights' bytes, its KV bytes a token
        self._finalizer = weakref.finalize(self, _stop, list(self.pipes), list(self.processes))
        try:
            self.group = TPGroup.connect(0, size, port, device, timeout_s)
        except Exception as e:  # a rank that never joined (it died starting, or hangs)
            states = ", ".join(f"rank {r}: {self._state(r)}" for r in range(1, size))
            self.close()
            raise RankFailed(f"the ranks did not meet within {timeout_s:g} s ({states}): {e}") from e

    def wait_ready(self) -> None:
        """Until every rank has loaded its part; its error (a ValueError) when one could not."""
        for rank, pipe in enumerate(self.pipes, start=1):
            if not wait([pipe, self.processes[rank - 1].sentinel], READY_TIMEOUT_S) or not pipe.poll():
                self.close()
                raise RankFailed(f"rank {rank} did not load its part of the model ({self._state(rank)})")
            try:
                status, detail = pipe.recv()
            except EOFError:  # it exited without a word
                status, detail = "error", f"it exited ({self._state(rank)})"
            if status != "ready":
                self.close()
                raise ValueError(f"rank {rank} could not load its part of the model: {detail}")
            self.parts.append(detail)

    def send(self, message: tuple) -> None:
        """`message` to every rank; RankFailed naming the rank that is gone."""
        self.check()
        start = time.perf_counter()
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(message)
            except (BrokenPipeError, ConnectionError, OSError):
                self.close()
                raise RankFailed(f"rank {rank} is gone ({self._state(rank)}); every rank is stopped") from None
        self.send_s += time.perf_counter() - start

    def check(self) -> None:
        if not self.pipes:
            raise RankFailed("the engine's ranks were stopped (a rank failed before): start a new engine")
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                state = self._state(rank)
                self.close()
                raise RankFailed(f"rank {rank} exited ({state}); every rank is stopped")

    def explain(self, error: BaseException) -> BaseException:
        """A step's error as the ranks' failure when a rank is gone or stopped answering (every
        rank is then stopped), else `error` itself."""
        if isinstance(error, RankFailed):
            return error
        if not isinstance(error, RuntimeError) or not self.pipes:
            return error
        wait([p.sentinel for p in self.processes], timeout=1.0)  # a killed rank's exit code arrives
        gone = [rank for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
        states = ", ".join(f"rank {rank}: {self._state(rank)}" for rank in range(1, len(self.processes) + 1))
        self.close()
        if gone:
            return RankFailed(f"rank {gone[0]} died during a step ({states}); every rank is stopped")
        return RankFailed(f"a rank did not answer within the timeout or failed ({states}): {error}; every rank "
                          "is stopped")  # fmt: skip

    def _state(self, rank: int) -> str:
        process = self.processes[rank - 1]
        code = process.exitcode
        return f"pid {process.pid}, " + ("still running" if code is None else f"exit code {code}")

    def close(self) -> None:
        """Stop every rank: ask, then kill what has not exited within a second."""
        self._finalizer()
        self.pipes = []


def _start(process: mp.Process) -> None:
    """Start `process`, also from a daemonic process (the server's engine core): multiprocessing
    refuses daemons children because it would not wait for them, and here nothing needs it to:
    a rank exits when its pipe closes (rank 0 is gone) and rank 0's finalizer stops its ranks."""
    config = mp.current_process()._config  # noqa: SLF001 - multiprocessing keeps the flag nowhere else
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        process.start()
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _stop(pipes: list[Connection], processes: list) -> None:
    for pipe in pipes:
        with contextlib.suppress(BrokenPipeError, ConnectionError, OSError):
            pipe.send(("stop",))
        pipe.close()
    for process in processes:
        process.join(timeout=1.0)
        if process.exitcode is None:
            process.kill()
            process.join(timeout=5.0)


def worker_main(args: WorkerArgs, pipe: Connection) -> None:
    """Rank `args.rank`: join the group, load its part, then run what rank 0 sends until it stops."""
    from treeserve.config import DTYPES
    from treeserve.engine.attention import BACKENDS
    from treeserve.engine.model_runner import ModelRunner
    from treeserve.kv.arena import KVArena, KVLayout, PageArena
    from treeserve.models.loader import load_model

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":  # rank r on the r-th GPU after rank 0's (unmeasured: one GPU is lent at a time)
        device = torch.device("cuda", (device.index or 0) + args.rank)
        torch.cuda.set_device(device)
    group = TPGroup.connect(args.rank, args.tp_size * args.pp_size, args.port, device, args.timeout_s)
    tp_rank, pp_rank = (args.rank, 0) if args.tp_size > 1 else (0, args.rank)
    try:
        loaded = load_model(args.model, dtype, device, tp_rank=tp_rank, tp_size=args.tp_size, pp_rank=pp_rank,
                            pp_size=args.pp_size)  # fmt: skip
        model, cfg = loaded.model, loaded.config
        if args.tp_size > 1:
            model.attach(group)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        kv_token_bytes = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype).token_bytes
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("ready", {"weights": weights, "kv_token_bytes": kv_token_bytes}))
    runner: ModelRunner | None = None
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # rank 0 is gone
            return
        kind = message[0]
        try:
            if kind == "kv":
                _, num_pages, block_size = message
                layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
                pages = PageArena(num_pages, layout.page_bytes(block_size), device)
                arena = KVArena(num_pages, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                                pages=pages)  # fmt: skip
                stage = (group, pp_rank, args.pp_size, dtype) if args.pp_size > 1 else None
                runner = ModelRunner(model, arena, device, cfg.attn_scale, BACKENDS[args.attention_backend](),
                                     stage=stage)  # fmt: skip
            elif kind == "step":
                runner.mirror_step(*message[1:])
            elif kind == "logits":
                with torch.inference_mode():
                    model.compute_logits(message[1].to(device))
            elif kind == "stop":
                return
        except Exception:  # noqa: BLE001 - a failed collective (rank 0 or a peer gone): stop
            traceback.print_exc()
            return
