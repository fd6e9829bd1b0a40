"""A batch's events of the kinds some detectors read alone (``batch.Reading.kept``: its steps without the evals, health
and heartbeats between them) are one list and one reading for all those detectors of both its groups, and their
outputs are mapped back to the batch's events by index: what they find, and where in the order, is what the detectors
fed one event at a time find; and nothing the batch kept stays open once it is done. A kept reading (its lists and
columns cut from its batch's) reads what a reading of those events alone reads.

The traces are the detection benchmark's (one per fault kind, and clean controls with evals, checkpoints and health),
with heartbeats between steps, cut into batches as the detection child gets them (through the pipe's columns)."""

from __future__ import annotations

import random

import pytest

from bench.synthetic import clean_controls, fault_traces
from tests.collector.test_split_detection import _items
from trainmon.monitor.collector import detection_process as dp
from trainmon.monitor.collector.detection import Detection, Found, Keyed
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import batch as batch_module
from trainmon.monitor.detectors.batch import Reading, read
from trainmon.wire import Event

Items = list[tuple[Event, int]]

TRACES = {t.name: t for t in [*fault_traces(1, seed=11), *clean_controls(5, seed=11)]}


def _with_heartbeats(items: Items) -> Items:
    """A heartbeat after every fifth step: a kind read by the detectors that read every kind alone."""
    out: Items = []
    for event, attempt in items:
        out.append((event, attempt))
        if event.kind == "step" and event.fields["step"] % 5 == 2:
            fields = {"step": event.fields["step"]}
            beat = Event("heartbeat", event.run, event.rank, event.host, event.stream, 0, event.time + 0.001, fields)
            out.append((beat, attempt))
    return out


def _one_at_a_time(items: Items) -> list[tuple[int, int, int, Found]]:
    """Each finding with its event's place in the items, its scope and its detector's place, and the finding."""
    detection = Detection(DetectorsConfig())
    return [_placed(at, keyed) for at, item in enumerate(items) for keyed in detection.observe_keyed([item])]


def _placed(offset: int, keyed: Keyed) -> tuple[int, int, int, Found]:
    (at, scope, pos, _), found = keyed
    return (offset + at, scope, pos, found)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_the_kinds_kept_for_some_detectors_find_what_each_event_alone_finds(name: str) -> None:
    items = _with_heartbeats(_items(TRACES[name].events))
    rng = random.Random(name)
    detection, found, i = Detection(DetectorsConfig()), [], 0  # found: as _one_at_a_time gives them
    while i < len(items):
        n = rng.choice([1, 2, rng.randint(3, 60), rng.randint(200, 900)])
        keyed = dp._decode(dp._encode(dp.parts(items[i : i + n]))[0]).observe(detection)
        assert batch_module._READINGS.open == []
        found += [_placed(i, k) for k in keyed]
        i += n
    assert found == _one_at_a_time(items)
    if not TRACES[name].clean:
        assert found, "a fault trace whose detectors found nothing proves nothing"


@pytest.mark.parametrize("seed", range(200))
def test_a_kept_reading_reads_what_a_reading_of_its_events_alone_reads(seed: int) -> None:
    rng = random.Random(seed)
    kinds = ["step", "eval", "run_start", "health", "checkpoint"]
    events = [
        Event(rng.choice(kinds) if rng.random() < 0.3 else "step", "r", 0, "h", "s", i, float(i), fields)
        for i, fields in enumerate(
            {name: i for name in rng.sample(["step", "loss", "lr", "acc"], rng.randint(0, 3))}
            for i in range(rng.randint(1, 40))
        )
    ]
    keep = frozenset(rng.sample(kinds, rng.randint(1, 4)))
    with Reading(events) as whole:
        assert whole.present == {e.kind for e in events}
        whole.column(rng.choice(["loss", "step"]))  # asked of the whole batch first, or not
        kept = whole.kept(keep)
        if kept is None:
            assert not any(e.kind in keep for e in events)
            return
        alone = Reading([e for e in events if e.kind in keep])
        assert read(kept.events) is kept
        assert kept.events == alone.events and kept.fields == alone.fields and kept.kinds == alone.kinds
        assert kept.ends == alone.ends and kept.keys == alone.keys
        assert kept.at == [i for i, e in enumerate(events) if e.kind in keep]
        assert kept.cut(list(range(len(events)))) == kept.at
        for name in ("step", "loss", "lr", "acc", "absent"):
            assert kept.column(name) == alone.column(name) == [e.fields.get(name) for e in alone.events]
            assert whole.column(name) == [e.fields.get(name) for e in events]
        assert whole.kept(keep) is kept
    assert batch_module._READINGS.open == []
