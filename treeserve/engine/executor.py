"""Where a step's device work runs: on the calling thread, or on the device's one worker thread.

`ModelRunner.execute` is the device work of a step. Without overlap, and on CUDA (whose kernel
launches return before the kernels run, so the host goes on at once), it runs where it is
submitted. On a CPU with overlapped steps it runs on a worker thread: PyTorch's operators and
the C kernels release the GIL while they compute, so the engine's Python for the next step
(scheduling, building inputs, detokenising) runs on another core meanwhile. Every engine on
one device shares that device's worker, whose queue runs steps in the order they were
submitted, as a GPU stream would: a step may read the samples of the step before it, and
the generator's and the PRM's steps queue behind each other instead of competing for cores.

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

import torch

SWITCH_INTERVAL_S = 5e-5

_workers: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_workers.clear)  # a forked child has none of the parent's threads


def run_here(fn: Callable, *args: object) -> Future:
    """Run `fn(*args)` now; its result (or exception) in a done future."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to whoever reads the step
        future.set_exception(e)
    return future


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
