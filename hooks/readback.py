"""Reads tensors and CUDA-event timings back to the host without stalling the device.

Calling ``.item()`` on a CUDA tensor waits for every kernel queued before it: one such call per
step serialises the CPU and the GPU and costs real throughput. Instead, a step's values are
flattened into one buffer, copied with ``non_blocking=True`` into pinned host memory, and a
CUDA event is recorded behind the copy. The record is released when ``event.query()`` says the
copy (and every phase-timing event of the step) is done, normally one step later; nothing waits
except :meth:`Readback.drain` at shutdown.

On CPU the values are already on the host and are read immediately.
"""

from __future__ import annotations

import collections
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
    done: Any  # torch.cuda.Event behind the copy, or None
    host: torch.Tensor | None
    layout: list[tuple[str, int, bool]]  # key, length, scalar?
    timings: list[Timing]


class Readback:
    """Queue of records whose device values are still in flight."""

    def __init__(self) -> None:
        self._pending: collections.deque[_Pending] = collections.deque()

    def submit(self, record: dict, tensors: dict[str, torch.Tensor], timings: list[Timing] | None = None) -> list[dict]:
        """Hand over ``record`` whose ``tensors`` still need reading; return the records now ready.

        Scalars become floats, other tensors lists of floats, under their key in ``record``.
        """
        on_device: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            if t.is_cuda:
                on_device[key] = t
            else:
                record[key] = _to_python(t)  # CPU tensor: a plain read, no device to wait for
        if not on_device and not timings:
            return [*self.ready(), record]
        host = done = None
        layout = []
        if on_device:
            flat = torch.cat([t.detach().reshape(-1).float() for t in on_device.values()])
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)  # device → host copy queued, not awaited
            done = torch.cuda.Event()
            done.record()
            layout = [(k, t.numel(), t.dim() == 0) for k, t in on_device.items()]
        self._pending.append(_Pending(record, done, host, layout, timings or []))
        return self.ready()

    def ready(self) -> list[dict]:
        """Records whose copies and timing events have completed, oldest first; never blocks."""
        out = []
        while self._pending and _complete(self._pending[0]):
            out.append(_fill(self._pending.popleft()))
        return out

    def drain(self) -> list[dict]:
        """Wait for everything in flight (shutdown only: this is a sync point)."""
        out = []
        while self._pending:
            p = self._pending.popleft()
            if p.done is not None:
                p.done.synchronize()  # SYNC: only at close()
            for t in p.timings:
                t.end.synchronize()  # SYNC: only at close()
            out.append(_fill(p))
        return out


def _to_python(t: torch.Tensor) -> float | list[float]:
    t = t.detach()
    return float(t) if t.dim() == 0 else t.float().reshape(-1).tolist()


def _complete(p: _Pending) -> bool:
    return (p.done is None or p.done.query()) and all(t.end.query() for t in p.timings)


def _fill(p: _Pending) -> dict:
    record = p.record
    if p.host is not None:
        values = p.host.tolist()
        i = 0
        for key, n, scalar in p.layout:
            record[key] = values[i] if scalar else values[i : i + n]
            i += n
    if p.timings:
        phases = record.setdefault("phases", {})
        for t in p.timings:
            phases[t.phase] = phases.get(t.phase, 0.0) + t.start.elapsed_time(t.end) / 1000.0
    return record
