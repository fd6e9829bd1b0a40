"""Runs of quiet events, for :meth:`Detector.observe_batch` of detectors that read most steps of most logs only to
remember a little of them (the last step, the first step's time, the last losses).

A long imported log hands each detector a million steps, and most detectors look for a field most logs never
carry (step times, memory, a loss scale, checksums, evals): ``observe`` of such a step returns nothing and at
most overwrites a little state, or sets it once. A detector finds where a run of such *quiet* events ends, in one
tight scan, and :func:`observe_quiet` observes of the run only the events that leave a trace: the first (state set
once), the last (state overwritten), and the steps of the run's last ``window`` finite losses (a window of losses
kept); every other event goes to ``observe`` (:func:`.batch.observe_runs`). Every event observed is observed by the
detector's own ``observe``: nothing here knows a rule of a detector.

A detector's quiet scan reads the batch's :class:`.batch.Reading`, shared by the detectors of its group: where its
runs of steps end, which steps carry a field, a column, each read once a batch, so that a scan costs a bisection or a
pass in C rather than a test per event in each of a dozen detectors.
"""

from __future__ import annotations

from collections.abc import Callable

from trainmon.monitor.detectors.base import Finding, finite
from trainmon.monitor.detectors.batch import Reading, observe_runs, read
from trainmon.wire import Event

__all__ = ["observe_quiet", "steps_without"]


def observe_quiet(
    observe: Callable[[Event, int], list[Finding]],
    events: list[Event],
    attempts: list[int],
    out: list[list[Finding]],
    quiet_until: Callable[[Reading, int], int],
    window: int = 0,
) -> None:
    """``observe`` of each event in order, its outputs appended to ``out``, where ``quiet_until(batch, i)`` is the end
    of the run of quiet events from ``i`` (``i`` itself when ``events[i]`` is not quiet), read from the detector's state
    when asked and from ``batch``, the reading of ``events`` (:func:`.batch.read`): ``observe`` of a quiet event returns
    nothing, and the state it leaves after a run of them is the state it leaves after observing the run's first event,
    its last event, and the steps that carry the run's last ``window`` finite losses."""
    batch = read(events)

    def take(start: int) -> int:
        end = quiet_until(batch, start)
        if end > start:
            observe(events[start], attempts[start])  # outputs: nothing, as every quiet event's
            tail, need = end, window
            while tail > start + 1 and (tail == end or need > 0):  # the last event, and back to the last finite losses
                tail -= 1
                need -= finite(events[tail].fields.get("loss"))
            for i in range(tail, end):
                observe(events[i], attempts[i])
        return end

    observe_runs(observe, events, attempts, out, take)


def steps_without(*names: str) -> Callable[[Reading, int], int]:
    """The ``quiet_until`` of a detector whose quiet events are the steps that carry none of ``names``: where the run of
    them from an index ends."""
    keys = frozenset(names)

    def quiet_until(batch: Reading, i: int) -> int:
        return batch.quiet_end(i, keys)

    return quiet_until
