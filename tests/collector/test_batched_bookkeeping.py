"""The ingest's bookkeeping a segment at a time keeps what it kept event by event: a run's pulse
(``Pulse.beats``) and a stream's stored seqs (``SeqSet.add_all``), on random and adversarial sequences."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from trainmon.monitor.collector.launches import Pulse
from trainmon.monitor.collector.seqs import MAX_RANGES, SeqSet

_SMOOTH = 0.2


class _OneByOne:
    """The pulse as it was kept, one call per event."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.interval: float | None = None
        self.ended = False

    def beat(self, t: float, kind: str, rank: int) -> None:
        if kind == "run_end":
            if rank == 0:
                self.ended = True
        elif kind == "run_start":
            self.ended = False
        if self.last is None:
            self.last = t
        elif t > self.last:
            gap = t - self.last
            self.interval = gap if self.interval is None else self.interval + _SMOOTH * (gap - self.interval)
            self.last = t


_TIMES = st.one_of(
    st.floats(0.0, 50.0, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, 1.0 + 1e-15, math.nan, math.inf, -math.inf, 5e-324]),
)
_EVENTS = st.lists(
    st.tuples(_TIMES, st.sampled_from(["step", "step", "eval", "run_start", "run_end"]), st.integers(1, 6)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(_EVENTS, st.integers(0, 1), st.booleans())
def test_a_pulse_fed_a_segment_at_a_time_is_the_pulse_fed_event_by_event(
    events: list[tuple[float, str, int]], rank: int, live: bool
) -> None:
    """Segments of the drawn lengths, each heard at its events' times, or (live) at one arrival for all."""
    batched, reference = Pulse(), _OneByOne()
    i = 0
    while i < len(events):
        segment = events[i : i + events[i][2]]
        i += len(segment)
        times, kinds = [t for t, _, _ in segment], [k for _, k, _ in segment]
        if live:
            times = [times[0]] * len(times)
        for t, kind in zip(times, kinds, strict=True):
            reference.beat(t, kind, rank)
        batched.beats(times[:1] if live else times, kinds, rank)
        assert repr((batched.last, batched.interval, batched.ended)) == repr(
            (reference.last, reference.interval, reference.ended)
        )


def test_a_steady_import_keeps_the_rhythm_to_the_last_bit() -> None:
    times = [1000.0 + 0.37 * i for i in range(5000)]
    batched, reference = Pulse(), _OneByOne()
    for t in times:
        reference.beat(t, "step", 0)
    for start in range(0, len(times), 700):
        batched.beats(times[start : start + 700], ["step"] * len(times[start : start + 700]), 0)
    assert (batched.last, batched.interval) == (reference.last, reference.interval)


def _seq_lists() -> st.SearchStrategy[list[list[int]]]:
    """Batches of seqs: runs that continue the highest one by one (as a stream sends), resent and shuffled ones."""
    run = st.tuples(st.integers(0, 3 * MAX_RANGES), st.integers(1, 30)).map(lambda a: list(range(a[0], a[0] + a[1])))
    scattered = st.lists(st.integers(0, 3 * MAX_RANGES), max_size=30)
    return st.lists(st.one_of(run, scattered), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_seq_lists())
def test_seqs_added_a_batch_at_a_time_are_the_seqs_added_one_by_one(batches: list[list[int]]) -> None:
    batched, reference = SeqSet(), SeqSet()
    for seqs in batches:
        assert batched.add_all(list(seqs)) == [reference.add(q) for q in seqs]
        assert (batched.ranges(), batched.closed, batched.last) == (
            reference.ranges(),
            reference.closed,
            reference.last,
        )


def test_a_batch_that_continues_the_highest_extends_its_range_and_stays_bounded() -> None:
    s = SeqSet()
    for start in range(0, 8 * MAX_RANGES, 4):  # two seqs of every four lost: a gap per batch
        assert s.add_all([start, start + 1]) == [True, True]
    assert len(s.ranges()) == MAX_RANGES and s.last == 8 * MAX_RANGES - 3
    assert s.closed == 2 * MAX_RANGES  # the oldest 256 gaps of two seqs each
    assert s.add_all([s.last + 1, s.last + 2]) == [True, True]
    assert s.ranges()[-1] == [8 * MAX_RANGES - 4, 8 * MAX_RANGES - 1]
    assert s.add_all([5, 6, 7, 8]) == [False, False, False, False]  # inside a closed gap: stored
    assert s.add_all([]) == []
