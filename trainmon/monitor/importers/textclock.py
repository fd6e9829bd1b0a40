"""Clock helpers shared by the stdout importers that read real step durations.

Trainer stdout rarely prints a timestamp on its step lines, but often prints how long each step
took (Megatron's ``elapsed time per iteration (ms)``, nanochat's ``dt``, modded-nanogpt's
cumulative ``train_time``) and, somewhere before the first step, a wall-clock time (a logging
prefix, Megatron's ``datetime:`` lines, the ``nvidia-smi`` banner). Summing the durations from
that anchor gives real step times; without an anchor the durations are laid out to end at the
file's modification time, so the intervals are still real and only the absolute position is
assumed. Timestamps carry no time zone in these logs: they are read as UTC, and say so.
"""

from __future__ import annotations

import calendar
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.monitor.importers.common import EvalPoint, TrainPoint

__all__ = ["ISO_STAMP", "Segment", "iso_to_epoch", "lay_out"]

ISO_STAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
"""``2025-12-22 19:30:22`` with an optional ``,118`` / ``.123456`` fraction (logging, Megatron)."""


def iso_to_epoch(m: re.Match[str]) -> float | None:
    """Seconds since the epoch of an :data:`ISO_STAMP` match, read as UTC; None if not a date."""
    y, mo, d, h, mi, s, frac = m.groups()
    try:
        t = calendar.timegm(time.struct_time((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0)))
    except (ValueError, OverflowError):
        return None
    if not (1 <= int(mo) <= 12 and 1 <= int(d) <= 31 and int(h) < 24 and int(mi) < 60 and int(s) < 62):
        return None
    return t + (float(f"0.{frac}") if frac else 0.0)


@dataclass
class Segment:
    """The points of one launch of a trainer, timed relative to its start.

    ``anchor`` is the wall time of that start when the log printed one (None otherwise); each
    point's ``time`` is seconds since the start (None leaves the point for ``build_events`` to
    place after the previous one).
    """

    anchor: float | None
    points: list[TrainPoint | EvalPoint] = field(default_factory=list)


def lay_out(segments: list[Segment], path: Path, what: str) -> str:
    """Turn the segments' relative times into wall times, in place; the ``time_source`` text.

    A segment with an anchor starts there. One without starts where the previous one ended (or,
    before the first anchored one, ends where the next one starts); with no anchor at all the
    whole file is laid out to end at its modification time.
    """
    spans = [max((p.time for p in seg.points if p.time is not None), default=0.0) for seg in segments]
    starts: list[float | None] = [seg.anchor for seg in segments]
    anchored = any(a is not None for a in starts)
    if not anchored:
        try:
            end = os.stat(path).st_mtime
        except OSError:
            end = 0.0
        starts[0] = end - sum(spans)
    for k in range(1, len(segments)):  # forward: after the previous segment
        if starts[k] is None and starts[k - 1] is not None:
            starts[k] = starts[k - 1] + spans[k - 1]  # type: ignore[operator]
    for k in range(len(segments) - 2, -1, -1):  # backward: segments before the first anchor
        if starts[k] is None and starts[k + 1] is not None:
            starts[k] = starts[k + 1] - spans[k]  # type: ignore[operator]
    for seg, start in zip(segments, starts, strict=True):
        for p in seg.points:
            if p.time is not None:
                p.time = float(start) + p.time  # type: ignore[arg-type]
    if anchored:
        return f"{what}, from the wall-clock time the log prints before the first step (read as UTC)"
    return f"{what}, laid out to end at the file's modification time (the log prints no wall-clock time)"
