"""Ranks as Ray actors: a parallel engine's ranks 1..k-1 on the hosts of a Ray cluster.

Owns `start_ray_ranks` (`distributed_executor_backend="ray"`) and `RayRank`, the Ray kind of
`protocol.py::RankHandle`; each actor runs the `Worker` its caller's factory makes. The engine's
process joins the Ray cluster this host belongs to (`ray start` made it: other hosts too; else
Ray starts one here), reserves a placement group of one bundle a rank (a GPU each on CUDA, else
`torch.get_num_threads()` CPUs; "PACK": on as few hosts as fit), and starts an actor in each
bundle. The actors meet rank 0 at this host's address (its node IP) in the TCP store rank 0
hosts, so the collectives run as with local ranks (gloo, or NCCL on GPUs); only the messages
travel as Ray calls, in order (Ray runs one caller's calls to an actor in the order they were
made).

A rank's failure: a call that raised or an actor that died is noticed when rank 0 next sends; a
collective with a dead peer fails at once, as with local ranks. Closing the engine kills the
actors and removes the placement group; Ray itself keeps running (other engines may use it).
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

from treeserve.distributed.protocol import ParallelSettings, RankGone, WorkerArgs, WorkerFactory, free_port


@ray.remote
class RankActor:
    """A rank > 0 inside a Ray worker process."""

    def start(self, make_worker: WorkerFactory, args: WorkerArgs) -> tuple[str, Any]:
        import os

        self.worker = make_worker(args)
        if self.worker.load_error is not None:
            return "error", self.worker.load_error
        self.pid = os.getpid()
        return "ready", self.worker.parts

    def handle(self, message: tuple) -> None:
        try:  # a step's arrays arrive read-only (Ray hands numpy arrays over without a copy)
            self.worker.handle(copy.deepcopy(message) if message[0] == "step" else message)
        except Exception:  # a failed collective (rank 0 or a peer gone): this rank is done
            traceback.print_exc()
            ray.actor.exit_actor()

    def ping(self) -> int:
        return self.pid


def start_ray_ranks(config: ParallelSettings, device: torch.device,
                    worker: WorkerFactory) -> tuple[str, int, list[RayRank], Callable[[], None]]:  # fmt: skip
    """Ranks 1..k-1 as actors, each running `worker(args)`: (rank 0's host and port for the TCP
    store, their handles, what releases their placement group). ValueError when the cluster has
    no room for them."""
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)  # joins this host's cluster, else starts one
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    threads = torch.get_num_threads()
    bundle = {"GPU": 1, "CPU": 1} if device.type == "cuda" else {"CPU": threads}
    group = placement_group([dict(bundle) for _ in range(size - 1)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.parallel_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        free = ray.available_resources()
        raise ValueError(f"the Ray cluster has no room for {size - 1} ranks of {bundle} within "
                         f"{config.parallel_timeout_s:g} s (it has {free} free)") from None  # fmt: skip
    host, port = ray.util.get_node_ip_address(), free_port()
    handles = []
    for rank in range(1, size):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1)
        actor = RankActor.options(scheduling_strategy=strategy, num_cpus=bundle["CPU"],
                                  num_gpus=bundle.get("GPU", 0)).remote()  # fmt: skip
        rank_device = "cuda" if device.type == "cuda" else "cpu"  # an actor sees its one GPU as cuda:0
        args = WorkerArgs(config, rank_device, rank, host, port, threads)
        handles.append(RayRank(actor, actor.start.remote(worker, args)))
    return host, port, handles, lambda: remove_placement_group(group)


class RayRank:
    """Rank 0's handle on one actor: its calls in flight, and whether it is gone."""

    def __init__(self, actor: Any, started: Any) -> None:
        self.actor, self.started = actor, started
        self.pending: list[Any] = []  # handle() calls not yet seen to finish
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
        """Whether a call failed or the actor died (seen in the calls that finished; with a
        timeout, also asked of the actor)."""
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
            pass  # busy in a step: alive
        except ray.exceptions.RayError as e:
            self.failure = type(e).__name__

    def state(self) -> str:
        where = f"Ray actor {self.actor._actor_id.hex()[:8]}, pid {self.pid}"  # noqa: SLF001 - Ray names no getter
        return where + (", still running" if self.failure is None else f", gone ({self.failure})")

    def stop(self) -> None:
        ray.kill(self.actor)
