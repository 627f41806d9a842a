"""Where an engine's device work runs, in what order, and what it records: its device queue.

`ModelRunner.execute` is the device work of a step. Each engine has one `DeviceQueue`:
* `run` runs a step on the calling thread (steps not overlapped; also every step on CUDA,
  whose kernel launches return before the kernels run, so the host goes on at once);
* `submit` queues it. On a CPU it goes to the device's one worker thread: PyTorch's operators
  and the C kernels release the GIL while they compute, so the engine's Python for the next
  step (scheduling, building inputs, detokenising) runs on another core meanwhile. Every engine
  on one device shares that thread, whose queue runs steps in the order they were submitted, as
  a GPU stream would: a step may read the samples of the step before it, and the generator's
  and the PRM's steps queue behind each other instead of competing for cores. On CUDA it runs
  on the queue's stream (`stream`; None: the current one).
* `fence` / `wait`: a marker after the work submitted so far, and a wait on another queue's
  marker before this queue's next work: the fence on pages one engine releases and another
  reuses while the first one's step may still be in flight (the page pool records such
  hand-overs; the engine fences on them before it launches). On CUDA the marker is an event
  recorded on the queue's stream, waited on by the other stream. On a CPU it is the future of
  the worker's latest step: work submitted to the worker runs after it anyway (one thread, in
  order), and work `run` here waits for it first (an overlapped generator beside a PRM whose
  steps are not overlapped).
This is the one place an engine's streams live: running the generator and the PRM on two CUDA
streams at once (the GPU issue) gives each engine's queue a stream of its own; the fences are
already in place (unmeasured on a GPU).

The GIL's switch interval decides how long the worker waits for the GIL after each operator
while the host runs Python (5 ms by default: a forward of ~100 operators would wait on every
one), so a process that starts a worker lowers it to SWITCH_INTERVAL_S.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import torch

SWITCH_INTERVAL_S = 5e-5

_workers: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_workers.clear)  # a forked child has none of the parent's threads


class DeviceQueue:
    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.device = device
        self.stream = stream  # CUDA: the stream this engine's steps run on (None: the current stream)
        self._last: Future | None = None  # CPU: the latest work this queue gave the worker
        self._after: list[Future] = []  # CPU: other queues' work this queue's next `run` waits for

    def run(self, fn: Callable, *args: object) -> Ran:
        """Run `fn(*args)` on the calling thread, on this queue's stream; its result, done."""
        if self._after:
            wait_for(self._after)  # their steps may still use pages this step writes
            self._after.clear()
        if self.stream is None:
            return run_here(fn, *args)
        with torch.cuda.stream(self.stream):
            return run_here(fn, *args)

    def submit(self, fn: Callable, *args: object) -> Future | Ran:
        """Queue `fn(*args)` behind the work submitted before it; its result when it has run."""
        if self.device.type != "cpu":
            return self.run(fn, *args)
        self._after.clear()  # the device's one worker runs what they wait for first
        self._last = run_on_worker(self.device, fn, *args)
        return self._last

    def fence(self) -> torch.cuda.Event | Future | None:
        """A marker after the work submitted so far, for another queue to `wait` on (None: nothing
        of this queue's can still be running)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        last = self._last
        return last if last is not None and not last.done() else None

    def wait(self, fence: torch.cuda.Event | Future | None) -> None:
        """This queue's next work starts after `fence` (another queue's `fence()`)."""
        if fence is None:
            return
        if isinstance(fence, Future):
            self._after.append(fence)
        else:
            (self.stream or torch.cuda.current_stream(self.device)).wait_event(fence)


@dataclass(slots=True)
class Ran:
    """What work run on the calling thread gave: a done `Future`'s `result()` and `done()`,
    without the lock and condition a `Future` makes (a few us a step after a forward)."""

    value: object = None
    error: BaseException | None = None

    def result(self) -> object:
        if self.error is not None:
            raise self.error
        return self.value

    def done(self) -> bool:
        return True


def run_here(fn: Callable, *args: object) -> Ran:
    """Run `fn(*args)` now; its result (or exception), done."""
    try:
        return Ran(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to whoever reads the step
        return Ran(error=e)


def run_on_worker(device: torch.device, fn: Callable, *args: object) -> Future:
    """Queue `fn(*args)` on `device`'s worker thread, with the caller's intra-op thread count."""
    threads = torch.get_num_threads()
    return _worker(device).submit(_with_threads, threads, fn, *args)


def _with_threads(threads: int, fn: Callable, *args: object) -> object:
    if torch.get_num_threads() != threads:  # per thread in PyTorch: the worker follows its callers
        torch.set_num_threads(threads)
    return fn(*args)


def _worker(device: torch.device) -> ThreadPoolExecutor:
    key = str(device)
    with _lock:
        worker = _workers.get(key)
        if worker is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            worker = _workers[key] = ThreadPoolExecutor(1, thread_name_prefix=f"treeserve-{key}")
        return worker
