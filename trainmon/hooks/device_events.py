"""CUDA events for the hot path: recorded on the current stream, reused across steps.

A step on GPU records about six events (the phase boundaries, and the one behind the step's
read-back copy). Creating each one is a driver call, and ``Event.record()`` without a stream looks
the current stream up through several layers of Python: on an H200 that was the largest part of
the training thread's time in trainmon (``bench/gpu_check.sh``'s profile). Events go back to their
pool once the sender thread has read them, and stream objects are cached by their raw handle, so a
boundary costs one ``cudaEventRecord`` and a few dictionary lookups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["EventPool", "current_stream"]

_POOL_MAX = 512  # events kept for reuse; more in flight than this are simply created
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_streams: dict[tuple[int, int], Any] = {}  # (device, raw cudaStream_t) -> torch.cuda.Stream
# torch.cuda.Event.record's C half: the Python method only looks the current stream up when given none.
_record_on = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None)


def current_stream() -> Any:
    """This thread's current CUDA stream (the autograd device thread has its own), as ``torch.cuda.current_stream()``.

    The object is cached by its raw handle: recording an event only needs the handle, which is what
    the lookup is keyed on, so a cached object is always the stream the work is queued on.
    """
    if _get_device is None or _get_raw_stream is None:  # a torch without these internals: the public path
        return torch.cuda.current_stream()
    device = _get_device()
    key = (device, _get_raw_stream(device))
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.current_stream(device)
    return stream


class EventPool:
    """Events taken by the recording threads and given back by the sender thread once read.

    ``list.pop`` and ``list.extend`` are atomic under the GIL, so the pool needs no lock: the
    training thread (and the autograd thread, for the end of backward) pop, the sender thread extends.
    """

    def __init__(self, enable_timing: bool) -> None:
        self._timing = enable_timing
        self._free: list[Any] = []

    def record(self) -> Any:
        """An event recorded now on the current stream (queued work only: never waits)."""
        try:
            event = self._free.pop()
        except IndexError:
            # torch.cuda.Event.__new__ has no annotations in torch's sources, so mypy calls it untyped.
            event = torch.cuda.Event(enable_timing=self._timing)  # type: ignore[no-untyped-call]
        if _record_on is None:  # a torch without this internal: the public path
            event.record(current_stream())
        else:
            _record_on(event, current_stream())
        return event

    def release(self, events: Iterable[Any]) -> None:
        """Give back events whose completion has been seen (sender thread): they may be recorded again."""
        room = _POOL_MAX - len(self._free)
        if room > 0:
            self._free.extend(list(events)[:room])
