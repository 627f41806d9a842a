"""Ranks 1..k-1 as Ray actors (`distributed_executor_backend="ray"`), one placement-group bundle
a rank (a GPU, or the thread count in CPUs; "PACK"). Actors meet rank 0's TCP store at its node
IP, so collectives run as with local ranks; messages are Ray calls, which Ray runs in order.
A failed call or dead actor is noticed at the next send; closing leaves Ray running.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treeserve.distributed.protocol import ParallelEngine, RankGone, WorkerArgs, WorkerFactory, free_port


@ray.remote
class RankActor:
    def start(self, make_worker: WorkerFactory, args: WorkerArgs) -> tuple[str, Any]:
        import os

        self.worker = make_worker(args)
        if self.worker.load_error is not None:
            return "error", self.worker.load_error
        self.pid = os.getpid()
        return "ready", self.worker.parts

    def handle(self, message: tuple) -> None:
        try:  # a step's numpy arrays arrive read-only (zero-copy)
            self.worker.handle(copy.deepcopy(message) if message[0] == "step" else message)
        except Exception:  # a failed collective: rank 0 or a peer is gone
            traceback.print_exc()
            ray.actor.exit_actor()

    def ping(self) -> int:
        return self.pid


def start_ray_ranks(
    config: ParallelEngine, device: torch.device, worker: WorkerFactory
) -> tuple[str, int, list[RayRank], Callable[[], None]]:
    """(TCP store host, port, handles, release of the placement group); ValueError when no room."""
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    size = config.parallel_config.tensor_parallel_size * config.parallel_config.pipeline_parallel_size
    threads = torch.get_num_threads()
    bundle = {"GPU": 1, "CPU": 1} if device.type == "cuda" else {"CPU": threads}
    group = placement_group([dict(bundle) for _ in range(size - 1)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.parallel_config.parallel_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        free = ray.available_resources()
        raise ValueError(
            f"the Ray cluster has no room for {size - 1} ranks of {bundle} within "
            f"{config.parallel_config.parallel_timeout_s:g} s (it has {free} free)"
        ) from None
    host, port = ray.util.get_node_ip_address(), free_port()
    handles = []
    for rank in range(1, size):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1)
        actor = RankActor.options(
            scheduling_strategy=strategy, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0)
        ).remote()
        rank_device = "cuda" if device.type == "cuda" else "cpu"  # an actor sees its one GPU as cuda:0
        args = WorkerArgs(config, rank_device, rank, host, port, threads)
        handles.append(RayRank(actor, actor.start.remote(worker, args)))
    return host, port, handles, lambda: remove_placement_group(group)


class RayRank:
    def __init__(self, actor: Any, started: Any) -> None:
        self.actor, self.started = actor, started
        self.pending: list[Any] = []
        self.pid: int | None = None
        self.failure: str | None = None

    def ready(self, timeout_s: float) -> tuple[str, Any]:
        try:
            status, detail = ray.get(self.started, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return "timeout", None
        except ray.exceptions.RayError as e:
            self.failure = type(e).__name__
            return "error", f"its actor failed ({e})"
        if status == "ready":
            self.pid = ray.get(self.actor.ping.remote())
        return status, detail

    def send(self, message: tuple) -> None:
        if self.exited():
            raise RankGone(self.failure)
        self.pending.append(self.actor.handle.remote(message))

    def exited(self, timeout_s: float = 0.0) -> bool:
        """Whether a finished call failed; with a timeout, also pings the actor."""
        if self.failure is None and self.pending:
            done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            self._check(done)
        if self.failure is None and timeout_s > 0:
            self._check([self.actor.ping.remote()], timeout_s)
        return self.failure is not None

    def _check(self, refs: list[Any], timeout_s: float = 0.0) -> None:
        try:
            ray.get(refs, timeout=timeout_s or None)
        except ray.exceptions.GetTimeoutError:
            pass
        except ray.exceptions.RayError as e:
            self.failure = type(e).__name__

    def state(self) -> str:
        where = f"Ray actor {self.actor._actor_id.hex()[:8]}, pid {self.pid}"  # Ray has no public getter
        return where + (", still running" if self.failure is None else f", gone ({self.failure})")

    def stop(self) -> None:
        ray.kill(self.actor)
