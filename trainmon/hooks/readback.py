"""Turns a step's tensors into numbers off the training thread, without stalling the device.

Calling ``.item()`` on a CUDA tensor waits for every kernel queued before it: one such call per
step serialises the CPU and the GPU. Instead, ``submit`` (training thread) only queues work:
on GPU the step's device scalars are flattened into one buffer, copied with ``non_blocking=True``
into pinned host memory and a CUDA event is recorded behind the copy (stream order is why this
part runs on the training thread); on CPU nothing is copied or read at all. ``ready`` (the sender
thread) releases items in submission order once their copy and phase-timing events have
completed (``event.query()``, never a wait), so even CPU reads cost the training thread nothing.
Only ``drain`` (at close) waits.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import torch

from trainmon.hooks.device_events import EventPool

__all__ = ["Readback"]

# A pending item: (item, device copy or None, CUDA events to wait for). The copy is
# (pinned buffer, event behind the copy, [(key, numel, scalar?)]).
_Copy = tuple[torch.Tensor, Any, list[tuple[str, int, bool]]]


class Readback:
    """Items in flight from the training thread to the sender thread, in submission order."""

    def __init__(self, capacity: int = 4096) -> None:
        # Public for the hot path: ``TrainMonitor.step_end`` queues a CPU step (nothing to copy, nothing to wait for)
        # as ``submit`` would, ``pending.append((item, None, ()))`` below ``capacity`` and ``dropped += 1`` above,
        # without the Python frame of a call (~3 us where the model's work has left the caches cold).
        self.pending: collections.deque[tuple[Any, _Copy | None, Sequence[Any]]] = collections.deque()
        self.capacity = capacity
        self._lock = threading.Lock()  # between the sender thread and close(); never the training thread
        self._events: EventPool | None = None  # the events behind the copies, made on the first one
        # Pinned buffers read by the sender thread, by (length, dtype), for the next copies of that shape: the
        # caching host allocator checks every block in flight on each allocation. Popped and extended under
        # the GIL (atomic), as the event pool.
        self._buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.dropped = 0

    def submit(self, item: Any, device: dict[str, torch.Tensor] | None = None, events: Sequence[Any] = ()) -> bool:
        """Queue ``item``; ``device`` holds its CUDA tensors to copy (graph-free: ``.data`` or made under
        ``no_grad``), ``events`` CUDA events to wait for.

        Returns False (and counts) when too many items wait: never blocks.
        """
        if len(self.pending) >= self.capacity:
            self.dropped += 1
            return False
        copy = None
        if device:
            # One cat (its dtype the widest among them), one copy, one event: no per-tensor conversions.
            flat = torch.cat([t.reshape(-1) for t in device.values()])
            try:
                pinned = self._buffers[(flat.numel(), flat.dtype)].pop()
            except (KeyError, IndexError):
                pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)  # device → host copy queued, not awaited
            if self._events is None:
                self._events = EventPool(enable_timing=False)
            copy = (pinned, self._events.record(), [(k, t.numel(), t.dim() == 0) for k, t in device.items()])
        self.pending.append((item, copy, events))
        return True

    def ready(self) -> list[tuple[Any, dict[str, Any]]]:
        """Items whose device work has completed, oldest first, with their copied values; never blocks."""
        out = []
        with self._lock:
            while self.pending and _complete(self.pending[0]):
                item, copy, _ = self.pending.popleft()
                out.append((item, self._values(copy)))
        return out

    def drain(self) -> list[tuple[Any, dict[str, Any]]]:
        """Everything in flight, waiting for the device if needed (close() only: a sync point)."""
        out = []
        with self._lock:
            while self.pending:
                item, copy, events = self.pending.popleft()
                if copy is not None:
                    copy[1].synchronize()  # SYNC: only at close()
                for ev in events:
                    ev.synchronize()  # SYNC: only at close()
                out.append((item, self._values(copy)))
        return out

    def _values(self, copy: _Copy | None) -> dict[str, Any]:
        """The copied values by key; the copy's event goes back to the pool (it has completed)."""
        if copy is None:
            return {}
        pinned, done, layout = copy
        if self._events is not None:
            self._events.release((done,))
        flat = pinned.tolist()
        free = self._buffers.setdefault((pinned.numel(), pinned.dtype), [])
        if len(free) < 64:  # enough for the copies in flight at once; a step's shape rarely changes
            free.append(pinned)
        values, i = {}, 0
        for key, n, scalar in layout:
            values[key] = flat[i] if scalar else flat[i : i + n]
            i += n
        return values


def _complete(pending: tuple[Any, _Copy | None, Sequence[Any]]) -> bool:
    _, copy, events = pending
    return (copy is None or copy[1].query()) and all(ev.query() for ev in events)


def read(value: Any) -> Any:
    """A host value for a wire field: tensors (CPU, or already copied) become floats or lists."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach()
    return float(t) if t.dim() == 0 else t.float().reshape(-1).tolist()
