"""`torch.inference_mode` for the engine's step functions, entered only where it is not on yet.

A step runs under inference mode (no autograd records, no version counters). Entering it costs
a context manager and a C++ guard: ~1.6 us warm, ~15 us a step once a forward has swept the
caches (bench/host_overhead.py). The step's callers that loop (`LLM.generate`) enter it once
around their loop, and each step function checks the thread's mode (a few tens of nanoseconds)
instead of entering it again. A caller that does not (an asyncio driver, a worker thread) gets
it entered per call, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference_mode(fn: F) -> F:
    """`fn` under `torch.inference_mode()`, entered only when the calling thread is not in it."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> object:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
