"""Reads scalar tensors back to the host without stalling the device.

Calling ``.item()`` on a CUDA tensor waits for every kernel queued before it: one such call per
step serialises the CPU and the GPU and costs real throughput. Instead, a step's scalars are
stacked, copied with ``non_blocking=True`` into pinned host memory, and a CUDA event is recorded
behind the copy. The record is released when ``event.query()`` says the copy is done, normally
one step later; nothing ever waits except :meth:`Readback.drain` at shutdown.

On CPU the values are already on the host and are read immediately.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["Readback"]


class Readback:
    """Queue of step records whose tensor values are still in flight from the device."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[Any, torch.Tensor, list[str], dict]] = collections.deque()

    def submit(self, record: dict, tensors: dict[str, torch.Tensor]) -> list[dict]:
        """Hand over ``record`` whose ``tensors`` still need reading; return records now ready."""
        on_device = {}
        for key, t in tensors.items():
            if t.is_cuda:
                on_device[key] = t
            else:
                record[key] = float(t)  # CPU tensor: a plain read, no device to wait for
        if not on_device:
            return [*self.ready(), record]
        keys = list(on_device)
        stacked = torch.stack([t.detach().reshape(()).float() for t in on_device.values()])
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)  # device → host copy queued, not awaited
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, keys, record))
        return self.ready()

    def ready(self) -> list[dict]:
        """Records whose copies have landed, oldest first; never blocks."""
        out = []
        while self._pending and self._pending[0][0].query():
            out.append(self._fill(*self._pending.popleft()))
        return out

    def drain(self) -> list[dict]:
        """Wait for every copy in flight (shutdown only: this is a sync point)."""
        out = []
        while self._pending:
            event, host, keys, record = self._pending.popleft()
            event.synchronize()  # SYNC: only at close()
            out.append(self._fill(event, host, keys, record))
        return out

    @staticmethod
    def _fill(event: Any, host: torch.Tensor, keys: list[str], record: dict) -> dict:
        for key, value in zip(keys, host.tolist(), strict=True):
            record[key] = value
        return record
