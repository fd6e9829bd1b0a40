"""A batch read once for the detectors of its group (trainmon.monitor.detectors.batch.Reading, opened by the engine):
each detector reads its own events' columns and quiet runs, whatever another detector did to what it was handed, and
nothing read of one batch answers for another batch or for another list."""

from __future__ import annotations

import random
from itertools import repeat
from typing import Any, ClassVar

from trainmon.monitor.collector.detection import _Group
from trainmon.monitor.detectors.base import NOTHING, Detector, Finding
from trainmon.monitor.detectors.batch import carries, columns, read
from trainmon.monitor.detectors.quiet import steps_without
from trainmon.wire import Event

_WITHOUT_PROBE = steps_without("probe")


def _naive_quiet_end(events: list[Event], i: int, names: frozenset[str]) -> int:
    """Where the run of steps from ``i`` that carry none of ``names`` ends, event by event."""
    for j in range(i, len(events)):
        if events[j].kind != "step" or not names.isdisjoint(events[j].fields):
            return j
    return len(events)


class _Reader(Detector):
    """Keeps what it read of each batch: the columns it was handed and where its quiet runs end. A vandal then
    overwrites every list it was handed, as a detector that changes its columns in place would."""

    kind = "reader"
    config_class = dict
    order = 0
    priority = None
    plots = ()
    localised = False

    def __init__(self, vandal: bool = False) -> None:
        self.vandal = vandal
        self.seen: list[tuple[Any, ...]] = []

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        fields, others, (losses,) = columns(events, "loss")
        ends = [_WITHOUT_PROBE(read(events), i) for i in range(len(events))]
        self.seen.append((list(fields), list(others), list(losses), ends, carries(events, "probe")))
        if self.vandal:
            fields[:] = [{}] * len(fields)
            others.append(len(events))
            losses[:] = ["vandal"] * len(losses)
        out.extend(repeat(NOTHING, len(events)))


class _StepReader(_Reader):
    """A reader handed only the steps (and starts): the engine gives it a list of its own."""

    consumes: ClassVar[frozenset[str] | None] = frozenset(("run_start", "step"))


def _expected(events: list[Event]) -> tuple[Any, ...]:
    fields = [e.fields for e in events]
    others = [i for i, e in enumerate(events) if e.kind != "step"]
    losses = [f.get("loss") for f in fields]
    ends = [_naive_quiet_end(events, i, frozenset(("probe",))) for i in range(len(events))]
    return fields, others, losses, ends, any("probe" in f for f in fields)


def _batch(rng: random.Random, n: int) -> list[Event]:
    kinds = ["step"] * 12 + ["health", "eval", "run_start"]
    events = []
    for i in range(n):
        fields: dict[str, Any] = {"step": i}
        if rng.random() < 0.8:
            fields["loss"] = rng.random()
        if rng.random() < 0.1:
            fields["probe"] = 1
        events.append(Event(rng.choice(kinds), "r", 0, "h", "s", i, float(i), fields))
    return events


def test_a_detector_changing_its_columns_changes_nobody_elses() -> None:
    rng = random.Random(1)
    vandal, witness, after = _Reader(vandal=True), _Reader(), _Reader(vandal=True)
    group = _Group([vandal, witness, after], [0, 1, 2])
    for n in (1, 16, 300):
        events = _batch(rng, n)
        group.feed(events, [0] * n)
        for det in (vandal, witness, after):
            assert det.seen[-1] == _expected(events)


def test_nothing_read_of_a_batch_answers_for_the_next_one_in_the_same_list() -> None:
    """A caller may refill one list between batches: each batch is read afresh, in the engine and out of it."""
    rng = random.Random(2)
    witness = _Reader()
    group = _Group([witness], [0])
    events = _batch(rng, 200)
    group.feed(events, [0] * 200)
    for n in (200, 50, 400):
        events[:] = _batch(rng, n)
        group.feed(events, [0] * n)
        assert witness.seen[-1] == _expected(events)
        witness.observe_batch(events, [0] * n, [])  # no reading open: read afresh
        assert witness.seen[-1] == _expected(events)
    with read(events) as batch:
        assert read(events) is batch
    assert read(events) is not batch


def test_each_detector_reads_its_own_list_not_the_groups() -> None:
    """The engine's reading is of the batch; a detector handed its kinds only, or asked about an equal list, reads
    that list."""
    rng = random.Random(3)
    every, steps = _Reader(), _StepReader()
    group = _Group([every, steps], [0, 1])
    for n in (16, 300):
        events = _batch(rng, n)
        events[n // 2] = Event("health", "r", 0, "h", "s", 0, 0.0, {"loss": 9.0})  # one that steps never see
        group.feed(events, [0] * n)
        assert every.seen[-1] == _expected(events)
        assert steps.seen[-1] == _expected([e for e in events if e.kind in ("run_start", "step")])
        with read(events):
            twin = [Event(e.kind, e.run, e.rank, e.host, e.stream, e.seq, e.time, dict(e.fields)) for e in events]
            twin[0] = Event("eval", "r", 0, "h", "s", 0, 0.0, {"loss": 7.0, "probe": 1})
            every.observe_batch(twin, [0] * n, [])
            assert every.seen[-1] == _expected(twin)


def test_quiet_end_is_where_the_steps_without_the_names_stop() -> None:
    rng = random.Random(4)
    for _ in range(200):
        events = _batch(rng, rng.randint(0, 80))
        names = frozenset(rng.sample(["probe", "loss", "absent", "step"], rng.randint(0, 2)))
        batch = read(events)
        for i in range(len(events)):
            assert batch.quiet_end(i, names) == _naive_quiet_end(events, i, names)
