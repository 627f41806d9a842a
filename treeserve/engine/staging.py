"""Host-to-device staging of a step's small input tensors: one pinned buffer, one copy per call.

On CUDA each call packs its tensors of one dtype into a page-locked buffer and sends them with one
asynchronous copy; each dtype has a ring of RING buffers, and a buffer is refilled only after the
copy out of it (RING calls ago) has finished. On a CPU the tensors are used as they are.
"""

from __future__ import annotations

import torch

RING = 8  # buffers per dtype: a refill waits for a copy some steps old


class Staging:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._copied: dict[tuple[torch.dtype, int], torch.cuda.Event] = {}
        self._turn: dict[torch.dtype, int] = {}

    def to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The same tensors on the device (host tensors of one dtype; any shapes)."""
        if self.device.type == "cpu":
            return list(tensors)
        dtype = tensors[0].dtype
        assert all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)
        sizes = [t.numel() for t in tensors]
        key = (dtype, self._turn.get(dtype, 0))
        self._turn[dtype] = (key[1] + 1) % RING
        staged = self._buffer(key, sum(sizes))
        torch.cat([t.reshape(-1) for t in tensors], out=staged)
        on_device = staged.to(self.device, non_blocking=True)
        event = self._copied.setdefault(key, torch.cuda.Event())
        event.record()
        return [part.view(t.shape) for part, t in zip(on_device.split(sizes), tensors, strict=True)]

    def _buffer(self, key: tuple[torch.dtype, int], numel: int) -> torch.Tensor:
        event = self._copied.get(key)
        if event is not None:
            event.synchronize()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: refilled in and out of inference mode
                buffer = torch.empty(max(numel, 4096), dtype=key[0], pin_memory=True)
            self._buffers[key] = buffer
        return buffer[:numel]
