"""Turns a step's tensors into numbers off the training thread, without stalling the device.

Calling ``.item()`` on a CUDA tensor waits for every kernel queued before it: one such call per
step serialises the CPU and the GPU. Instead, ``submit`` (training thread) only gathers: on GPU the
step's device scalars become one buffer of ours (``gather``: a stack and a cat, queued on the training
stream, so the values are the step's even where the loop later overwrites its tensors, as CUDA-graph
outputs are), behind which the caller records an event (``TrainMonitor.step_end``'s end of the optimizer
phase serves); on CPU nothing is gathered at all. The sender thread does the
rest (``ready``): it queues each buffer's ``non_blocking`` copy into pinned host memory on a copy
stream of its own that waits for that event on the device, and releases items in submission order once
their copy and phase-timing events have completed (``event.query()``, never a wait). The copy and the
pinned memory were the largest part of the training thread's time in trainmon on an H200
(``bench/gpu_check.sh``'s profile): the caching host allocator records an event of its own per copy.
Only ``drain`` (at close) waits.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import torch

from trainmon.hooks.device_events import EventPool

__all__ = ["Readback", "gather"]


Layout = list[tuple[str, int, bool]]
"""What a gathered buffer holds, in order: (key, number of values, a scalar?)."""


def gather(device: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Layout] | None:
    """``device``'s tensors (graph-free) in one buffer of ours, queued on the current stream: two ops however many
    values (the scalars in one stack, then one cat with the rest, its dtype the widest among them), where a
    reshape each made one more per tensor. None when there is nothing to gather."""
    if not device:
        return None
    scalars = [t for t in device.values() if t.dim() == 0]
    rest = [t if t.dim() == 1 else t.reshape(-1) for t in device.values() if t.dim() != 0]
    parts = [torch.stack(scalars), *rest] if scalars else rest
    # A buffer of ours, whatever the loop does with its tensors later: the stack is one already.
    flat = torch.cat(parts) if len(parts) > 1 else parts[0] if scalars else parts[0].clone()
    layout = [(k, 1, True) for k, t in device.items() if t.dim() == 0]
    layout += [(k, t.numel(), False) for k, t in device.items() if t.dim() != 0]
    return flat, layout


class _Gathered:
    """A step's device values in one buffer, on their way to the host."""

    __slots__ = ("copied", "flat", "layout", "pinned", "ready")

    def __init__(self, flat: torch.Tensor, layout: Layout, ready: Any) -> None:
        self.flat = flat  # the device buffer, kept alive until its copy has completed
        self.layout = layout  # (key, numel, scalar?) in the buffer's order
        self.ready = ready  # an event behind the gather on the training thread's stream (the caller's to release)
        self.pinned: torch.Tensor | None = None  # the host buffer, once the copy is queued (sender thread)
        self.copied: Any = None  # the event behind the copy, on the copy stream


class Readback:
    """Items in flight from the training thread to the sender thread, in submission order."""

    def __init__(self, capacity: int = 4096) -> None:
        # Public for the hot path: ``TrainMonitor.step_end`` queues a CPU step (nothing to copy, nothing to wait for)
        # as ``submit`` would, ``pending.append((item, None, ()))`` below ``capacity`` and ``dropped += 1`` above,
        # without the Python frame of a call (~3 us where the model's work has left the caches cold).
        self.pending: collections.deque[tuple[Any, _Gathered | None, Sequence[Any]]] = collections.deque()
        self.capacity = capacity
        self._lock = threading.Lock()  # between the sender thread and close(); never the training thread
        self._events: EventPool | None = None  # the events behind the copies, made on the first one
        self._streams: dict[torch.device, Any] = {}  # the copy stream of each device (sender thread)
        self._queued = 0  # pending items whose copy the sender has queued: the oldest ones
        # Pinned buffers whose copy has been read, by (length, dtype), for the next copies of that shape: the
        # caching host allocator checks every block in flight on each allocation (sender thread only).
        self._buffers: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.dropped = 0

    def submit(
        self,
        item: Any,
        values: tuple[torch.Tensor, Layout] | None = None,
        ready: Any = None,
        events: Sequence[Any] = (),
    ) -> bool:
        """Queue ``item``; ``values`` is what ``gather`` made of its CUDA tensors, ``ready`` a CUDA event the caller
        recorded after it (and releases), ``events`` CUDA events to wait for.

        Returns False (and counts) when too many items wait: never blocks.
        """
        if len(self.pending) >= self.capacity:
            self.dropped += 1
            return False
        gathered = None
        if values is not None:
            gathered = _Gathered(values[0], values[1], ready)
            if self._events is None:
                self._events = EventPool(enable_timing=False)
        self.pending.append((item, gathered, events))
        return True

    def ready(self) -> list[tuple[Any, dict[str, Any]]]:
        """Items whose device work has completed, oldest first, with their copied values; never blocks."""
        out = []
        with self._lock:
            self._queue_copies()
            while self._queued and _complete(self.pending[0]):  # only items counted in _queued: their copy is queued
                item, gathered, _ = self.pending.popleft()
                self._queued -= 1
                out.append((item, self._values(gathered)))
        return out

    def drain(self) -> list[tuple[Any, dict[str, Any]]]:
        """Everything in flight, waiting for the device if needed (close() only: a sync point)."""
        out = []
        with self._lock:
            while self.pending:
                if not self._queued:
                    self._queue_copies()
                item, gathered, events = self.pending.popleft()
                self._queued -= 1
                if gathered is not None:
                    gathered.copied.synchronize()  # SYNC: only at close()
                for ev in events:
                    ev.synchronize()  # SYNC: only at close()
                out.append((item, self._values(gathered)))
        return out

    def _queue_copies(self) -> None:
        """Queue the host copy of every gathered buffer that has none yet (sender thread): on a copy stream that
        waits, on the device, for the gather's event, so the training stream carries none of it."""
        pending = self.pending
        end = len(pending)  # before the check below: the copy events' pool is made before a gathered item is appended
        if self._events is None:  # nothing was ever gathered (a CPU run): nothing to copy
            self._queued = end
            return
        for i in range(self._queued, end):
            gathered = pending[i][1]
            if gathered is not None:
                flat = gathered.flat
                stream = self._streams.get(flat.device)
                if stream is None:
                    stream = self._streams[flat.device] = torch.cuda.Stream(flat.device)  # type: ignore[no-untyped-call]
                try:
                    pinned = self._buffers[(flat.numel(), flat.dtype)].pop()
                except (KeyError, IndexError):
                    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                stream.wait_event(gathered.ready)
                with torch.cuda.stream(stream):
                    pinned.copy_(flat, non_blocking=True)  # device → host copy queued, not awaited
                    gathered.copied = self._events.record()
                gathered.pinned = pinned
        self._queued = end  # items the training thread appended meanwhile wait for the next call

    def _values(self, gathered: _Gathered | None) -> dict[str, Any]:
        """The copied values by key; the copy's event goes back to the pool (it has completed)."""
        if gathered is None:
            return {}
        pinned = gathered.pinned
        assert pinned is not None and self._events is not None  # copied before it completed
        self._events.release((gathered.copied,))
        flat = pinned.tolist()
        free = self._buffers.setdefault((pinned.numel(), pinned.dtype), [])
        if len(free) < 64:  # enough for the copies in flight at once; a step's shape rarely changes
            free.append(pinned)
        values, i = {}, 0
        for key, n, scalar in gathered.layout:
            values[key] = flat[i] if scalar else flat[i : i + n]
            i += n
        return values


def _complete(pending: tuple[Any, _Gathered | None, Sequence[Any]]) -> bool:
    _, gathered, events = pending
    return (gathered is None or gathered.copied.query()) and all(ev.query() for ev in events)


def read(value: Any) -> Any:
    """A host value for a wire field: tensors (CPU, or already copied) become floats or lists."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach()
    return float(t) if t.dim() == 0 else t.float().reshape(-1).tolist()
