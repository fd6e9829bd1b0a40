"""The ingest's segments and the pipe's columns made from them, against what reading every event gives.

A batch's segments are told at C speed where the batch is one segment (``ingest._segments``), and the pipe's columns
are joined from the segments the ingest stored (``detection_process._columns``) rather than read from each event:
both must give what ``groupby`` over the events, and a transposition of each event's attributes, give."""

from __future__ import annotations

import itertools
import math
import operator
import pickle
import random

import pytest

from tests.bitwise import same
from trainmon.monitor.collector import detection_process as dp
from trainmon.monitor.collector.ingest import _exact_in_lr, _other_groups, _segment, _segments
from trainmon.wire import Event

Items = list[tuple[Event, int]]

_KEY = operator.attrgetter("stream", "run", "rank")


def _event(rng: random.Random, i: int, stream: str, run: str, rank: int) -> Event:
    offset = rng.choice([None, None, 0.0, -0.0, 0.25])
    return Event("step", run, rank, rng.choice(["h", "h", "g"]), stream, i, 1.7e9 + i, {"step": i}, offset)


def _batch(rng: random.Random, n: int) -> list[Event]:
    """Runs of events of a few streams, runs and ranks, often one run for the whole batch."""
    keys = [("s", "r", 0), ("t", "r", 0), ("s", "q", 0), ("s", "r", 1)]
    out: list[Event] = []
    while len(out) < n:
        key = rng.choice(keys[:1] if rng.random() < 0.5 else keys)
        out += [_event(rng, len(out) + j, *key) for j in range(rng.randint(1, 40))]
    return out[:n]


@pytest.mark.parametrize("seed", range(60))
def test_a_batchs_segments_are_groupbys(seed: int) -> None:
    rng = random.Random(seed)
    events = _batch(rng, rng.choice([0, 1, 15, 16, 17, rng.randint(2, 300)]))
    expected = [_segment(list(group)) for _, group in itertools.groupby(events, _KEY)]
    assert _segments(events) == expected
    for got, want in zip(_segments(events), expected, strict=True):
        assert all(a is b for a, b in zip(got.events, want.events, strict=True))


def _stored(rng: random.Random, events: list[Event]) -> list[dp.Part]:
    """The segments as the ingest hands them on: each with its attempt, some of them cut (a dedupe's survivors)."""
    out: list[dp.Part] = []
    for segment in _segments(events):
        if rng.random() < 0.3 and len(segment.events) > 1:
            keep = [rng.random() < 0.7 for _ in segment.events]
            segment = dp.Segment._make(list(itertools.compress(c, keep)) for c in segment)
        if segment.events:
            out.append((segment, rng.choice([0, 0, 1])))
    return out


def _transposed(items: Items) -> list[tuple[object, ...]]:
    """The columns as each event's attributes transposed give them, collapsed as the pipe collapses them."""
    rows = [(e.kind, e.run, e.rank, e.host, e.stream, e.clock_offset, a, e.seq, e.time, e.fields) for e, a in items]
    columns = list(zip(*rows, strict=True))
    return [dp._collapsed(c) for c in columns[:7]] + columns[7:]


@pytest.mark.parametrize("seed", range(80))
def test_the_columns_of_stored_segments_are_the_events_transposed(seed: int) -> None:
    rng = random.Random(seed)
    stored = _stored(rng, _batch(rng, rng.choice([1, 2, 8, rng.randint(3, 400)])))
    items = dp.pairs(stored)
    assert items == [(e, a) for segment, a in stored for e in segment.events]
    wire, batch = dp._encode(stored)
    assert same(wire, _transposed(items))
    assert wire == dp._encode(dp.parts(items))[0] == dp._events(items)
    assert all(a is b for a, b in zip(batch.events, [e for e, _ in items], strict=True))
    assert batch.attempts == [a for _, a in items]
    assert batch.kinds == [e.kind for e, _ in items]
    assert all(f is e.fields for f, (e, _) in zip(batch.fields, items, strict=True))
    back = dp._items(pickle.loads(pickle.dumps(wire, dp._PROTOCOL)))
    assert all(same(got, sent) for got, sent in zip(back, items, strict=True))


def test_an_imports_batch_goes_with_what_it_shares_once() -> None:
    events = [Event("step", "r", 0, "h", "s", i, 1.7e9 + i, {"step": i}) for i in range(1000)]
    wire, batch = dp._encode([(_segment(events), 2)])
    assert [len(c) for c in wire] == [1, 1, 1, 1, 1, 1, 1, 1000, 1000, 1000]
    assert batch.key == ("r", 0)
    assert batch.attempts == [2] * 1000


_RATES = [[1e-3], [2e-3], [0.0], [-0.0], [math.nan], [math.inf], [1e-3, 2e-3], [], None, (5e-4,), [1], ["x"], [[1e-3]]]


@pytest.mark.parametrize("seed", range(200))
def test_the_lrs_column_is_the_step_by_step_rules(seed: int) -> None:
    """``_other_groups``' answer for the whole column at once is what the step-by-step rule gives each step: NULL
    where the step has one rate that the ``lr`` column gives back as it is."""
    rng = random.Random(seed)
    common = rng.sample(_RATES, rng.choice([1, 1, 2, 3]))
    lrs = [rng.choice(common) for _ in range(rng.randint(1, 30))]
    lr = [x[0] if x else None for x in lrs]
    want = [None if x is not None and len(x) == 1 and _exact_in_lr(x[0]) else x for x in lrs]
    got = _other_groups(lrs, lr)
    assert list(got) == want
    assert all(a is b for a, b in zip(got, want, strict=True))
