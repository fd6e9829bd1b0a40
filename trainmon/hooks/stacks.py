"""Where the training thread is stuck: its Python stack, captured off the hot path.

When a rank stops finishing steps, the first question is where it waits: a collective the other
ranks never joined, a dataloader, a lock, a sleep. ``py-spy dump`` answers it, but only for
someone logged in on that node while it hangs. Here the sender thread (which runs every flush
interval anyway) notices that no step has ended for ``max(after, factor x median step interval)``
and reads the training thread's frame with ``sys._current_frames()``: no extra process, nothing
on the training thread, and it works while that thread waits inside a C call (a gloo or NCCL
wait releases the GIL). The capture is repeated each time the silence doubles, so a rank that
moved on to another wait is seen there. With ``TRAINMON_STACK_SIGNAL=1`` in the environment,
``SIGUSR1`` asks for one at once when the program has no handler of its own. It is opt-in: the
default action of SIGUSR1 ends the process, and schedulers rely on that (SLURM's ``--signal``);
Python runs the handler when the main thread next executes Python code, so a rank stuck inside
one C call is covered by the automatic capture, not the signal.

With torch's NCCL flight recorder on (``TORCH_NCCL_TRACE_BUFFER_SIZE > 0``) the last collectives
of each process group go along; without NCCL (CPU, gloo) that part is skipped quietly.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import sys
import threading
import traceback
from typing import Any

__all__ = ["StackWatch", "capture_frames"]

MAX_FRAMES = 32  # innermost frames kept: the wait is at the inner end, the loop at the outer
_NCCL_ENTRIES = 16  # flight-recorder entries kept (the newest)


def capture_frames(thread_id: int, limit: int = MAX_FRAMES) -> list[dict[str, Any]] | None:
    """The thread's stack, outermost first (as tracebacks print it); None if the thread is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    summary = traceback.extract_stack(frame, limit=limit)
    return [
        {"file": fs.filename[-512:], "line": fs.lineno or 0, "function": fs.name[:256], "code": (fs.line or "")[:256]}
        for fs in summary
    ]


def nccl_trace() -> dict[str, Any] | None:
    """The newest entries of torch's NCCL flight recorder, if it is on and this build has NCCL."""
    try:
        if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")) <= 0:
            return None
        import torch

        # The JSON form: no unpickling anywhere in the hooks (tests/web/test_security.py holds them to it).
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace_json", None)
        if dump is None:
            return None
        trace = json.loads(dump(includeCollectives=True, onlyActive=False))
    except Exception:  # no NCCL, no process group, an older torch: nothing to attach
        return None
    entries = []
    for e in (trace.get("entries") or [])[-_NCCL_ENTRIES:]:
        entries.append(
            {
                "pg_id": e.get("pg_id"),
                "seq": e.get("collective_seq_id"),
                "op": str(e.get("profiling_name", ""))[:128],
                "state": str(e.get("state", ""))[:32],
                "input_sizes": str(e.get("input_sizes", ""))[:256],
            }
        )
    return {"version": str(trace.get("version", "")), "entries": entries}


class StackWatch:
    """Decides when to capture the training thread's stack; called only from the sender thread
    (``step_done``, ``poll``) and once from the training thread (``attach``).

    Args:
        after: seconds without a step end before the first capture (the floor).
        factor: ...or this multiple of the median step interval, when that is longer.
    """

    def __init__(self, after: float, factor: float = 10.0) -> None:
        self.after = after
        self.factor = factor
        self._thread_id: int | None = None
        self._thread_name = ""
        self._last_end: float | None = None  # perf_counter of the latest step end (or of attach)
        self._last_step: int | None = None
        self._intervals: collections.deque[float] = collections.deque(maxlen=64)
        self._next_at: float | None = None  # silence (s) at which the next capture is due
        self._requested = False
        self._previous_usr1: Any = None

    def attach(self, now: float) -> None:
        """On the training thread: remember it, start the clock, take SIGUSR1 if asked to and nobody has it."""
        current = threading.current_thread()
        self._thread_id, self._thread_name = current.ident, current.name
        self._last_end = now
        self._next_at = None
        usr1 = getattr(signal, "SIGUSR1", None) if os.environ.get("TRAINMON_STACK_SIGNAL") == "1" else None
        if usr1 is not None and current is threading.main_thread() and signal.getsignal(usr1) == signal.SIG_DFL:
            self._previous_usr1 = signal.signal(usr1, self._on_signal)

    def detach(self) -> None:
        """Give SIGUSR1 back (the monitor is closing)."""
        if self._previous_usr1 is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._previous_usr1)
            self._previous_usr1 = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._requested = True  # captured by the sender thread at its next tick

    def step_done(self, step: int, end: float) -> None:
        """A step ended at ``end`` (perf_counter): learn the interval and start a new silence."""
        if self._last_end is not None and self._last_step is not None and end > self._last_end:
            self._intervals.append(end - self._last_end)
        if self._last_end is None or end >= self._last_end:
            self._last_end, self._last_step = end, step
            self._next_at = None

    def poll(self, now: float) -> dict[str, Any] | None:
        """The fields of a ``stack`` event when one is due at ``now`` (perf_counter), else None."""
        if self._thread_id is None or self._last_end is None:
            return None
        silent = now - self._last_end
        requested, self._requested = self._requested, False
        if not requested:
            if silent < self.after:
                return None
            if self._next_at is None:
                median = statistics.median(self._intervals) if self._intervals else 0.0
                self._next_at = max(self.after, self.factor * median)
            if silent < self._next_at:
                return None
            self._next_at *= 2  # the next capture when the silence has doubled
        frames = capture_frames(self._thread_id)
        if frames is None:
            return None
        fields: dict[str, Any] = {
            "reason": "signal" if requested else "no_step",
            "step": self._last_step,
            "seconds_since_step": round(silent, 3),
            "thread": self._thread_name[:128],
            "stack": {"frames": frames},
        }
        nccl = nccl_trace()
        if nccl is not None:
            fields["nccl"] = nccl
        return fields
