"""A batch of events of which most are quiet: :meth:`Detector.observe_batch` for detectors that read most steps of
most logs only to remember a little of them (the last step, the first step's time, the last losses).

A long imported log hands each detector a million steps, and most detectors look for a field most logs never
carry (step times, memory, a loss scale, checksums, evals): ``observe`` of such a step returns nothing and at
most overwrites a little state, or sets it once. A detector names the events that are not so, its *loud* ones,
in one tight scan of the batch, and :func:`observe_quiet` observes those, and of each run of quiet events between
them only the ones that leave a trace: the first (state set once), the last (state overwritten), and the steps of
the run's last ``window`` finite losses (a window of losses kept); the others are :data:`NOTHING`. Every event
observed is observed by the detector's own ``observe``: nothing here knows a rule of a detector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import repeat

from trainmon.monitor.detectors.base import NOTHING, Finding, finite
from trainmon.wire import Event

__all__ = ["observe_quiet"]


def observe_quiet(
    observe: Callable[[Event, int], list[Finding]],
    events: list[Event],
    attempts: list[int],
    out: list[list[Finding]],
    loud: Iterator[int],
    window: int = 0,
) -> None:
    """``observe`` of each event in order, its outputs appended to ``out``, where every event but the ones ``loud``
    yields is quiet: ``observe`` of it returns nothing, and the state it leaves after a run of quiet events is the
    state it leaves after observing the run's first event, its last event, and the steps that carry the run's last
    ``window`` finite losses.

    ``loud`` yields the indices of the other events in ascending order and is read lazily: each index is observed
    before the next is asked for, so the scan may read the state the loud events change (a detector whose
    quietness depends on it, e.g. a warm-up that ends)."""
    start = 0
    for i in loud:
        if i > start:  # a live batch is often loud throughout: no call for the empty runs
            _quiet_run(observe, events, attempts, start, i, out, window)
        out.append(observe(events[i], attempts[i]))
        start = i + 1
    if start < len(events):
        _quiet_run(observe, events, attempts, start, len(events), out, window)


def _quiet_run(
    observe: Callable[[Event, int], list[Finding]],
    events: list[Event],
    attempts: list[int],
    start: int,
    end: int,
    out: list[list[Finding]],
    window: int,
) -> None:
    """The quiet events ``events[start:end]`` (at least one): their first and their tail observed, the others
    NOTHING."""
    out.append(observe(events[start], attempts[start]))
    tail, need = end, window
    while tail > start + 1 and (tail == end or need > 0):  # the last event, and back to the last finite losses
        tail -= 1
        need -= finite(events[tail].fields.get("loss"))
    out.extend(repeat(NOTHING, tail - start - 1))
    out.extend(map(observe, events[tail:end], attempts[tail:end]))
