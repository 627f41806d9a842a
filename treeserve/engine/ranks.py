"""The other ranks of a parallel engine: processes that hold part of the model and run forwards only.

Owns `Ranks` (rank 0's handle: starts ranks 1..k-1, sends them each step in one message,
notices a rank that died or stopped answering, and stops them), `LocalRank` (a rank started with
torch.multiprocessing's spawn on this host, messages down a pipe) and `RankWorker` (what a rank
> 0 runs). Rank 0 (the engine's process) schedules, samples and detokenises; the other ranks
never see a request. Ranks are tensor_parallel_size x pipeline_parallel_size: a pipeline
stage's tensor shards are consecutive ranks (`layers/parallel.py::Placement`); a shard runs
every layer of its stage on its heads, a stage its contiguous layers on the activations the
stage before sends it (the last stage sends its output back to stage 0); layers/parallel.py
splits the checkpoint either way. Ray actors in a placement group (`engine/ray_ranks.py`) are
the other kind of rank, for ranks on other hosts.

A rank waits for messages for as long as the engine is idle (a pipe's end tells it that rank 0
is gone); tensors meet in the groups' collectives and sends, which fail after `timeout_s` when
a rank stops answering, or at once when one died. A rank runs what rank 0 runs, in the same
order (rank 0 runs one step at a time), so every collective is met by every rank:

    ("kv", num_pages, block_size)      an arena of num_pages pages of this rank's heads / layers
    ("step", copies, batch, twins)     page copies, then the forward of `batch` (and its twins)
    ("logits", hidden)                 tensor parallel: stage 0's vocabulary slices, gathered
    ("stop",)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.multiprocessing as mp

from treeserve.engine.executor import run_here
from treeserve.layers.parallel import Placement

if TYPE_CHECKING:
    from treeserve.config import EngineConfig

READY_TIMEOUT_S = 600.0  # for a rank to load its part of the model


class RankFailed(RuntimeError):
    """A rank died or stopped answering: the engine cannot step any more."""


class RankGone(Exception):
    """A message could not reach a rank (it exited)."""


@dataclass
class WorkerArgs:
    config: EngineConfig
    device: str  # this rank's
    rank: int
    host: str  # where rank 0's TCP store listens
    port: int
    threads: int


class RankHandle(Protocol):
    """Rank 0's view of one other rank, however it was started."""

    def ready(self, timeout_s: float) -> tuple[str, Any]: ...  # ("ready", parts) | ("error", why)
    def send(self, message: tuple) -> None: ...  # RankGone when it cannot be reached
    def exited(self, timeout_s: float = 0.0) -> bool: ...  # waits up to timeout_s for it to exit
    def state(self) -> str: ...
    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Ranks:
    """Ranks 1..size-1 of one engine's model, seen from rank 0."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if config.distributed_executor_backend == "ray":
            from treeserve.engine.ray_ranks import start_ray_ranks

            host, port, self.handles, release = start_ray_ranks(config, device)
        else:
            host, port, release = "127.0.0.1", free_port(), None
            self.handles = [LocalRank(WorkerArgs(config, _local_device(device, rank), rank, host, port,
                                                 torch.get_num_threads())) for rank in range(1, tp * pp)]  # fmt: skip
        self.send_s = 0.0  # seconds spent sending messages to the ranks (pickling the steps' inputs)
        self.parts: list[dict] = []  # per rank > 0, as it reported: its weights' bytes, its KV bytes a token
        self.stopped = False
        self._finalizer = weakref.finalize(self, _stop, list(self.handles), release)
        self.placement = self._meet(Placement(0, tp, pp), host, port, device, config.parallel_timeout_s)

    def _meet(self, placement: Placement, host: str, port: int, device: torch.device, timeout_s: float) -> Placement:
        """Rank 0's joins (they wait for every rank), watched from here: a rank that exits before
        it joined (it failed starting) is an error at once rather than after `timeout_s`."""
        joined: list[Future] = []
        join = lambda: joined.append(run_here(placement.connect, host, port, device, timeout_s))  # noqa: E731
        thread = threading.Thread(target=join, daemon=True, name="treeserve-rank0-join")
        thread.start()
        while True:
            thread.join(0.2)
            if joined:
                try:
                    return joined[0].result()
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
        """`message` to every rank; RankFailed naming the rank that is gone."""
        self.check()
        start = time.perf_counter()
        for rank, handle in enumerate(self.handles, start=1):
            try:
                handle.send(message)
            except RankGone:
                self.close()
                raise RankFailed(f"rank {rank} is gone ({handle.state()}); every rank is stopped") from None
        self.send_s += time.perf_counter() - start

    def check(self) -> None:
        if self.stopped:
            raise RankFailed("the engine's ranks were stopped (a rank failed before): start a new engine")
        for rank, handle in enumerate(self.handles, start=1):
            if handle.exited():
                state = handle.state()
                self.close()
                raise RankFailed(f"rank {rank} exited ({state}); every rank is stopped")

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


def _local_device(device: torch.device, rank: int) -> str:
    """Rank `rank`'s device on this host: the rank-th GPU after rank 0's (unmeasured: one GPU is
    lent at a time here), or the CPU."""
    return f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else "cpu"


def _stop(handles: list[RankHandle], release: Any) -> None:
    for handle in handles:
        handle.stop()
    if release is not None:
        release()


class LocalRank:
    """A rank on this host: a spawned process, its messages down a pipe."""

    def __init__(self, args: WorkerArgs) -> None:
        context = mp.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=worker_main, args=(args, theirs), daemon=True,
                                       name=f"treeserve-rank{args.rank}")  # fmt: skip
        _start(self.process)
        theirs.close()

    def ready(self, timeout_s: float) -> tuple[str, Any]:
        if not wait([self.pipe, self.process.sentinel], timeout_s) or not self.pipe.poll():
            return ("timeout", None) if self.process.exitcode is None else ("error", f"it exited ({self.state()})")
        try:
            return self.pipe.recv()
        except EOFError:  # it exited without a word
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


class RankWorker:
    """Rank `args.rank` > 0: its part of the model, and the messages rank 0 sends it."""

    def __init__(self, args: WorkerArgs) -> None:
        """Join the groups (a failure here is rank 0's "did not meet"), then load this rank's
        part (a failure there is `load_error`, reported to rank 0)."""
        from treeserve.models.loader import load_model

        config = args.config
        torch.set_num_threads(args.threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.config, self.device, self.runner = config, device, None
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.placement = Placement(args.rank, tp, pp).connect(args.host, args.port, device, config.parallel_timeout_s)
        self.load_error: str | None = None
        try:
            loaded = load_model(config.model, config.torch_dtype, device, config.quantization, config.quant_activations,
                                tp_rank=self.placement.tp_rank, tp_size=tp, pp_rank=self.placement.pp_rank,
                                pp_size=pp)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            self.load_error = f"{type(e).__name__}: {e}"
            return
        self.model, self.model_config = loaded.model, loaded.config
        if self.placement.tp is not None:
            self.model.attach(self.placement.tp)
        self.parts = {"weights": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
                      "kv_token_bytes": self._layout().token_bytes, "quantization": loaded.quantization}  # fmt: skip

    def _layout(self) -> Any:
        from treeserve.kv.arena import KVLayout

        cfg = self.model_config
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.torch_dtype)

    @torch.inference_mode()
    def handle(self, message: tuple) -> bool:
        """Run one message; False for "stop"."""
        from treeserve.engine.attention import BACKENDS
        from treeserve.engine.model_runner import ModelRunner
        from treeserve.kv.arena import KVArena, PageArena

        kind, cfg, placement = message[0], self.model_config, self.placement
        if kind == "kv":
            _, num_pages, block_size = message
            dtype = self.config.torch_dtype
            pages = PageArena(num_pages, self._layout().page_bytes(block_size), self.device)
            arena = KVArena(num_pages, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device,
                            pages=pages)  # fmt: skip
            stage = None if placement.pp is None else (placement.pp, placement.pp_rank, placement.pp_size, dtype)
            self.runner = ModelRunner(self.model, arena, self.device, cfg.attn_scale,
                                      BACKENDS[self.config.attention_backend](), stage=stage)  # fmt: skip
        elif kind == "step":
            self.runner.mirror_step(*message[1:])
        elif kind == "logits" and placement.pp_rank == 0:  # stage 0 holds the LM head's shards
            self.model.compute_logits(message[1].to(self.device))
        return kind != "stop"


def worker_main(args: WorkerArgs, pipe: Connection) -> None:
    """A local rank: join the group, load its part, then run what rank 0 sends until it stops."""
    worker = RankWorker(args)
    if worker.load_error is not None:
        pipe.send(("error", worker.load_error))
        return
    pipe.send(("ready", worker.parts))
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # rank 0 is gone
            return
        try:
            if not worker.handle(message):
                return
        except Exception:  # noqa: BLE001 - a failed collective (rank 0 or a peer gone): stop
            traceback.print_exc()
            return
