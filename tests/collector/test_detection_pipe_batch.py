"""What each side of the detection pipe hands its detectors (``detection_process._Batch``): the kinds, fields and
single (run, rank) it read while encoding or decoding the columns stand for what reading the events gives, and
detection through it finds what ``Detection.observe_keyed`` of the items finds, keys and order included.

The traces are the detection benchmark's (one per fault kind, and clean controls), cut into batches that go across
ranks, kinds and attempts; the hostile batch is the encoding test's (streams interleaved, 0.0 beside -0.0, NaN)."""

from __future__ import annotations

import pickle
import random

import pytest

from bench.synthetic import clean_controls, fault_traces
from tests.bitwise import same
from tests.collector.test_detection_encoding import _hostile, _step
from tests.collector.test_split_detection import _items
from trainmon.monitor.collector import detection_process as dp
from trainmon.monitor.collector.detection import Detection
from trainmon.monitor.config import DetectorsConfig
from trainmon.wire import Event

Items = list[tuple[Event, int]]

TRACES = {t.name: t for t in [*fault_traces(1, seed=5), *clean_controls(2, seed=5)]}


def _sides(items: Items) -> tuple[dp._Batch, dp._Batch]:
    """The parent's batch of ``items`` and the child's, decoded from the pickled columns."""
    columns, here = dp._encode(dp.parts(items))
    return here, dp._decode(pickle.loads(pickle.dumps(columns, dp._PROTOCOL)))


def _assert_reads_its_events(batch: dp._Batch, items: Items) -> None:
    events = batch.events
    assert len(events) == len(batch.attempts) == len(items)
    assert all(map(same, batch.attempts, [a for _, a in items]))
    for got, (sent, _) in zip(events, items, strict=True):
        assert type(got) is Event
        assert all(same(getattr(got, name), getattr(sent, name)) for name in Event.__slots__)
    assert batch.kinds == [e.kind for e in events]
    assert all(f is e.fields for f, e in zip(batch.fields, events, strict=True))
    keys = {(e.run, e.rank) for e in events}
    assert batch.key == (next(iter(keys)) if len(keys) == 1 else None)


def _batches(items: Items, rng: random.Random) -> list[Items]:
    out, i = [], 0
    while i < len(items):
        n = rng.choice([1, 2, rng.randint(3, 200)])
        out.append(items[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 5, 10])
def test_each_side_reads_of_a_hostile_batch_what_its_events_hold(n: int) -> None:
    items = _hostile()[:n]
    here, there = _sides(items)
    assert all(a is b for a, b in zip(here.events, [e for e, _ in items], strict=True))  # the caller's own events
    _assert_reads_its_events(here, items)
    _assert_reads_its_events(there, items)


def test_a_batch_of_one_rank_is_told_so_and_one_of_two_is_not() -> None:
    one = [(_step(i, stream=f"s{i % 2}", host=f"h{i % 3}"), i % 2) for i in range(6)]  # one (run, rank), two streams
    for batch in _sides(one):
        assert batch.key == ("r", 0)
    for odd in ({"rank": 1}, {"run": "q"}):
        two = [*one, (_step(6, **odd), 0), *one]
        for batch in _sides(two):
            assert batch.key is None
            _assert_reads_its_events(batch, two)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_detection_through_either_side_finds_what_the_items_show(name: str) -> None:
    items = _items(TRACES[name].events)
    config = DetectorsConfig()
    whole, parent, child = Detection(config), Detection(config), Detection(config)
    total = 0
    for batch in _batches(items, random.Random(name)):
        expected = whole.observe_keyed(batch)
        total += len(expected)
        here, there = _sides(batch)
        _assert_reads_its_events(there, batch)
        assert here.observe(parent) == expected
        assert there.observe(child) == expected
    if not TRACES[name].clean:
        assert total, "a fault trace whose detectors found nothing proves nothing"
