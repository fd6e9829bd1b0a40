"""What the :meth:`Detector.observe_batch` overrides that decide runs of steps at once share: the batch read as columns
(a look at a few fields of thousands of steps, numpy over a column), and the walk that hands the runs they decide to
them and every other event to ``observe``."""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any, NamedTuple

from trainmon.monitor.detectors.base import NOTHING, Finding
from trainmon.wire import Event

__all__ = ["Columns", "columns", "observe_runs"]

_CHUNK = 8
"""Events observed one at a time after ``take`` decided none (doubling up to :data:`_MAX_CHUNK` while it decides none
again): a loud event, and the few after it, cost what ``observe`` costs."""
_MAX_CHUNK = 1024
"""... so that a stretch only ``observe`` can follow (an open episode, a run of loud steps) is observed in chunks, in C,
with ``take`` asked once a chunk, and the walk is back to deciding runs within a chunk of that stretch's end."""


class Columns(NamedTuple):
    fields: list[dict[str, Any]]
    """Each event's fields, in order."""
    others: list[int]
    """The positions of the events that are not steps, ascending (a few a batch: starts, evals, ends)."""
    values: list[list[Any]]
    """Each named field's value at each event, None where it is absent."""


def columns(events: list[Event], *names: str) -> Columns:
    """The batch's fields, where its other kinds are, and the columns of ``names``: each read in one comprehension
    (a long log's batch is thousands of steps), the other kinds found by ``list.index`` (in C) rather than a flag
    per event."""
    fields = [e.fields for e in events]
    kinds = [e.kind for e in events]
    others: list[int] = []
    if kinds.count("step") != len(kinds):
        for kind in set(kinds) - {"step"}:
            at = -1
            for _ in range(kinds.count(kind)):
                at = kinds.index(kind, at + 1)
                others.append(at)
        others.sort()
    return Columns(fields, others, [[f.get(name) for f in fields] for name in names])


def observe_runs(
    observe: Callable[[Event, int], list[Finding]],
    events: list[Event],
    attempts: list[int],
    out: list[list[Finding]],
    take: Callable[[int], int],
) -> None:
    """``observe`` of each event in order, its outputs appended to ``out``, but for the runs ``take`` decides.

    ``take(i)`` is the end ``j`` of a run of events from ``i`` that it has proven find nothing, after it left the
    detector in the state ``observe`` of ``events[i:j]`` would have (``i``: no run from there, or none worth its
    cost). Between runs, events go to ``observe`` in chunks that double while ``take`` decides none."""
    n = len(events)
    i, chunk = 0, _CHUNK
    while i < n:
        j = take(i)
        if j > i:
            out.extend(repeat(NOTHING, j - i))
            i, chunk = j, _CHUNK
            continue
        j = min(n, i + chunk)
        out.extend(map(observe, events[i:j], attempts[i:j]))
        i, chunk = j, min(2 * chunk, _MAX_CHUNK)
