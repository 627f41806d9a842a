"""Where an engine's device work runs, in what order: its `DeviceQueue`.

`run` runs a step on the calling thread (on CUDA, whose launches return at once, every step);
`submit` queues it, on a CPU to the device's one worker thread (shared by every engine on the
device, in submission order, as a GPU stream would run it). `fence` / `wait` order one queue's
next work after another's (the pages one engine hands to another while its step may still run).
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
        self.stream = stream
        self._last: Future | None = None  # CPU: the latest work this queue gave the worker
        self._after: list[Future] = []  # CPU: other queues' work this queue's next `run` waits for

    def run(self, fn: Callable, *args: object) -> Ran:
        if self._after:
            wait_for(self._after)  # their steps may still use pages this step writes
            self._after.clear()
        if self.stream is None:
            return run_here(fn, *args)
        with torch.cuda.stream(self.stream):
            return run_here(fn, *args)

    def submit(self, fn: Callable, *args: object) -> Future | Ran:
        if self.device.type != "cpu":
            return self.run(fn, *args)
        self._after.clear()  # the device's one worker runs what they wait for first
        self._last = run_on_worker(self.device, fn, *args)
        return self._last

    def fence(self) -> torch.cuda.Event | Future | None:
        """A marker after the work submitted so far, for another queue to `wait` on (None: none runs)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        last = self._last
        return last if last is not None and not last.done() else None

    def wait(self, fence: torch.cuda.Event | Future | None) -> None:
        if fence is None:
            return
        if isinstance(fence, Future):
            self._after.append(fence)
        else:
            (self.stream or torch.cuda.current_stream(self.device)).wait_event(fence)


@dataclass(slots=True)
class Ran:
    """A done `Future` of work run on the calling thread, without a Future's lock and condition."""

    value: object = None
    error: BaseException | None = None

    def result(self) -> object:
        if self.error is not None:
            raise self.error
        return self.value

    def done(self) -> bool:
        return True


def run_here(fn: Callable, *args: object) -> Ran:
    try:
        return Ran(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to whoever reads the step
        return Ran(error=e)


def run_on_worker(device: torch.device, fn: Callable, *args: object) -> Future:
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
