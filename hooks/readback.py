"""Turns a step's tensors into numbers off the training thread, without stalling the device.

Calling ``.item()`` on a CUDA tensor waits for every kernel queued before it: one such call per
step serialises the CPU and the GPU. Instead, ``submit`` (training thread) only queues work:
on GPU the step's scalars are flattened into one buffer, copied with ``non_blocking=True`` into
pinned host memory and a CUDA event is recorded behind the copy (stream order is why this part
runs on the training thread); on CPU nothing is read at all. ``ready`` (the sender thread)
releases records in order once their copy and phase-timing events have completed
(``event.query()``, never a wait) and reads the values there, so even CPU reads cost the
training thread nothing. Only ``drain`` (at close) waits.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Readback", "Timing"]


@dataclass(slots=True)
class Timing:
    """A device phase measured between two CUDA events; added to ``record['phases'][phase]``."""

    phase: str
    start: Any  # torch.cuda.Event
    end: Any


@dataclass(slots=True)
class _Pending:
    record: dict
    host_tensors: dict[str, torch.Tensor]  # CPU tensors, read when released
    done: Any  # torch.cuda.Event behind the device copy, or None
    pinned: torch.Tensor | None
    layout: list[tuple[str, int, bool]]  # key, length, scalar?
    timings: list[Timing]


class Readback:
    """Records in flight from the training thread to the sender thread, in submission order."""

    def __init__(self, capacity: int = 4096) -> None:
        self._pending: collections.deque[_Pending] = collections.deque()
        self._capacity = capacity
        self._lock = threading.Lock()  # between the sender thread and close(); never the training thread
        self.dropped = 0

    def submit(self, record: dict, tensors: dict[str, torch.Tensor], timings: list[Timing] | None = None) -> bool:
        """Queue ``record`` whose ``tensors`` still need reading.

        Returns False (and counts) when too many records wait: never blocks.
        """
        if len(self._pending) >= self._capacity:
            self.dropped += 1
            return False
        on_device = {k: t for k, t in tensors.items() if t.is_cuda}
        pinned = done = None
        layout: list[tuple[str, int, bool]] = []
        if on_device:
            flat = torch.cat([t.detach().reshape(-1).float() for t in on_device.values()])
            pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)  # device → host copy queued, not awaited
            done = torch.cuda.Event()
            done.record()
            layout = [(k, t.numel(), t.dim() == 0) for k, t in on_device.items()]
        host = {k: t for k, t in tensors.items() if k not in on_device}
        self._pending.append(_Pending(record, host, done, pinned, layout, timings or []))
        return True

    def ready(self) -> list[dict]:
        """Records whose device work has completed, oldest first, values filled in; never blocks."""
        out = []
        with self._lock:
            while self._pending and _complete(self._pending[0]):
                out.append(_fill(self._pending.popleft()))
        return out

    def drain(self) -> list[dict]:
        """Everything in flight, waiting for the device if needed (close() only: a sync point)."""
        out = []
        with self._lock:
            while self._pending:
                p = self._pending.popleft()
                if p.done is not None:
                    p.done.synchronize()  # SYNC: only at close()
                for t in p.timings:
                    t.end.synchronize()  # SYNC: only at close()
                out.append(_fill(p))
        return out


def _complete(p: _Pending) -> bool:
    return (p.done is None or p.done.query()) and all(t.end.query() for t in p.timings)


def _read(t: torch.Tensor) -> float | list[float]:
    t = t.detach()
    return float(t) if t.dim() == 0 else t.float().reshape(-1).tolist()


def _fill(p: _Pending) -> dict:
    record = p.record
    for key, value in p.host_tensors.items():
        record[key] = _read(value)
    if p.pinned is not None:
        values = p.pinned.tolist()
        i = 0
        for key, n, scalar in p.layout:
            record[key] = values[i] if scalar else values[i : i + n]
            i += n
    if p.timings:
        phases = record.setdefault("phases", {})
        for t in p.timings:
            phases[t.phase] = phases.get(t.phase, 0.0) + t.start.elapsed_time(t.end) / 1000.0
    return record
