"""`torch.inference_mode` for the engine's step functions, entered only where it is not on yet.

Callers that loop (`LLM.generate`) enter it once around their loop; each step function checks
the thread's mode and enters it only when it is off.
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
