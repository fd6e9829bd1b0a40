"""A batch of events read as columns: for :meth:`Detector.observe_batch` overrides that decide many steps at once from
a look at a few of their fields (numpy over a column), and observe the others one at a time."""

from __future__ import annotations

from typing import Any, NamedTuple

from trainmon.wire import Event

__all__ = ["Columns", "columns"]


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
