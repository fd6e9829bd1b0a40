"""What the detection child's detectors read once a batch from its :class:`~trainmon.monitor.detectors.batch.Reading`
(issue 24): a column's float array (``floats``), whether a part of a column is of given types (``only``), where the
events with a clock offset are (``clocked``), the batch's rank where it is of one (set by ``Detection``), and a column
read without the field names; and loss_spike's noise over arrays (``_noises``). Each is checked against the
definition it replaces, and every detector that reads them for the same outputs and state, fed in batches under an
open reading that knows its rank (as the engine feeds them), as fed one event at a time."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from tests.detectors.batch_state import check_batches, state
from tests.detectors.test_lr_schedule_drift_batch import _state as lr_state
from trainmon.monitor.collector.detection import Detection
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS
from trainmon.monitor.detectors.bad_resume import BadResume
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import Reading, read
from trainmon.monitor.detectors.degenerate import Degenerate
from trainmon.monitor.detectors.divergence import Divergence
from trainmon.monitor.detectors.grad_explosion import GradExplosion
from trainmon.monitor.detectors.hang import Hang
from trainmon.monitor.detectors.loss_spike import LossSpike, _noise, _noises
from trainmon.monitor.detectors.lr_schedule_drift import LrScheduleDrift
from trainmon.monitor.detectors.nan_inf import NanInf
from trainmon.monitor.detectors.node_health import NodeHealth
from trainmon.monitor.detectors.straggler import Straggler
from trainmon.wire import Event

_VALUES: list[Any] = [1.5, -0.0, 0.0, 2, True, None, "x", [1.0], math.nan, math.inf]
_LISTS: list[Any] = [[], [2], [None], [-0.0, 1], None, 1.0]


def _event(kind: str, fields: dict[str, Any], t: float = 0.0, rank: int = 0, offset: float | None = None) -> Event:
    return Event(kind, "r", rank, "h", "s", 0, t, fields, offset)


def _mixed(rng: random.Random, n: int) -> list[Event]:
    """Steps whose fields ``a`` (every event), ``b`` (some) and ``c`` (none) take values of every type."""
    out = []
    for i in range(n):
        fields: dict[str, Any] = {"a": rng.choice(_VALUES[:3]) if rng.random() < 0.9 else rng.choice(_VALUES)}
        if rng.random() < 0.3:
            fields["b"] = rng.choice(_VALUES)
        if rng.random() < 0.99:  # an LR per param group, nearly always one float
            fields["l"] = [rng.random()] * rng.choice([1, 1, 2]) if rng.random() < 0.98 else rng.choice(_LISTS)
        kind = "step" if rng.random() < 0.95 else "eval"
        out.append(_event(kind, fields, float(i), offset=rng.choice([None, None, None, 0.5])))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_reading_answers_as_the_definitions(seed: int) -> None:
    rng = random.Random(seed)
    events = _mixed(rng, rng.choice([1, 5, 40, 300]))
    n = len(events)
    batch = Reading(events)
    if seed % 2:
        assert batch.keys  # the field names read first: column() then skips the look at each event for "c"
    for name in ("a", "b", "c", "l"):
        values = [e.fields.get(name) for e in events]
        assert batch.column(name) == values and list(map(type, batch.column(name))) == list(map(type, values))
        kinds: tuple[frozenset[type], ...] = (
            frozenset((float,)),
            frozenset((float, type(None))),
            frozenset((int,)),
            frozenset((list,)),
        )
        for types in kinds:
            for _ in range(20):
                lo = rng.randrange(n + 1)
                hi = rng.randrange(lo, n + 1)
                assert batch.only(name, types, lo, hi) == all(type(v) in types for v in values[lo:hi])
            assert batch.only(name, types) == all(type(v) in types for v in values)
        try:
            expected = np.array(values, dtype=float)
        except (TypeError, ValueError):
            with pytest.raises((TypeError, ValueError)):
                batch.floats(name)
            with pytest.raises((TypeError, ValueError)):  # each time it is asked
                batch.floats(name)
        else:
            got = batch.floats(name)
            assert repr(got.tolist()) == repr(expected.tolist()) and got.dtype == expected.dtype
            assert got is batch.floats(name) and not got.flags.writeable
    assert batch.clocked == [i for i, e in enumerate(events) if e.clock_offset is not None] + [n]
    lrs = [e.fields.get("l") for e in events]
    if all(type(v) is list and v and type(v[0]) is float for v in lrs):
        first = batch.firsts("l")
        assert first is not None and not first.flags.writeable
        assert repr(first.tolist()) == repr([v[0] for v in lrs])
    else:
        assert batch.firsts("l") is None


@pytest.mark.parametrize("seed", range(10))
def test_a_kept_reading_answers_of_its_own_events(seed: int) -> None:
    rng = random.Random(seed)
    events = _mixed(rng, 200)
    with Reading(events) as batch:
        batch.rank = 0
        part = batch.kept(frozenset(("eval",)))
        if part is None:
            return
        assert part.rank == 0
        assert part.column("a") == [e.fields.get("a") for e in part.events]
        assert part.column("c") == [None] * len(part.events)
        assert part.only("a", frozenset((float,))) == all(type(e.fields["a"]) is float for e in part.events)
        assert part.clocked == [i for i, e in enumerate(part.events) if e.clock_offset is not None] + [len(part.events)]


def test_detection_tells_the_reading_its_rank_only_when_the_batch_is_of_one() -> None:
    seen: list[int | None] = []

    class _Spy(Detector):
        kind = "nan_inf"  # a config the detectors' config has
        scope = "rank"
        consumes = None

        def __init__(self, config: Any) -> None:
            pass

        def observe(self, event: Event, attempt: int) -> list[Finding]:
            return []

        def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
            seen.append(read(events).rank)
            out.extend([] for _ in events)

    detection = Detection(DetectorsConfig(), (_Spy,))
    one = [_event("step", {"step": i}, float(i), rank=3) for i in range(5)]
    detection.observe_keyed([(e, 0) for e in one])
    mixed = [_event("step", {"step": i}, float(i), rank=i % 2) for i in range(6)]
    detection.observe_keyed([(e, 0) for e in mixed])
    assert seen == [3, None, None]  # the mixed batch: each rank's events are a list of their own


@pytest.mark.parametrize("seed", range(5))
def test_noises_are_noise_of_each(seed: int) -> None:
    rng = np.random.default_rng(seed)
    mids = np.concatenate(([0.0, 1e-300, 5e-324, 1e-7, 1e308, -math.inf], rng.exponential(rng.uniform(1e-9, 10), 300)))
    for n in (4, 7, 128, 1000):
        for levels in (0.0, rng.normal(0, rng.uniform(1e-6, 100), len(mids))):
            with np.errstate(over="ignore"):  # 1e308's sigma is inf, as Python's float
                got = _noises(mids, n, levels).tolist()
            each = np.broadcast_to(levels, mids.shape).tolist()
            assert repr(got) == repr([_noise(m, n, lv) for m, lv in zip(mids.tolist(), each, strict=True)])


def _stream(rng: random.Random, n: int, ranks: int = 1, odd: bool = True) -> list[Event]:
    """A long log as an import (or a live collector, with offsets) hands it over: steps with a loss, a grad norm
    and an LR, a spike now and then, with ``odd`` a few odd values (an int loss, an absent loss, a bool step, a skewed
    clock), a second rank's steps where ``ranks`` is 2, evals and a checkpoint between them."""
    out = [_event("run_start", {"vocab_size": 256, "world_size": ranks, "accum_steps": 1, "resumed": False})]
    loss, lr, t = 5.0, 1e-3, 0.0
    for i in range(n):
        loss = max(0.5, loss * 0.999) * math.exp(rng.gauss(0, 0.02))
        lr *= 0.9995
        t += 1.0 + rng.random() * 0.1
        fields: dict[str, Any] = {"step": i, "loss": loss * (6.0 if rng.random() < 0.002 else 1.0)}
        fields["grad_norm"] = abs(rng.gauss(1.0, 0.1))
        fields["lr"] = [lr]
        offset = None
        if odd and rng.random() < 0.003:
            fields["loss"] = rng.choice([2, None, math.nan])
            fields.pop("loss") if fields["loss"] is None else None
        if odd and rng.random() < 0.001:
            fields["step"] = True
        if odd and rng.random() < 0.01:
            offset = rng.choice([0.01, 0.5, 30.0])
        out.append(_event("step", fields, t, offset=offset))
        if ranks > 1:
            other = dict(fields, step_time_s=1.0, data_wait_s=0.1)
            out.append(_event("step", other, t + 0.01, rank=1))
        if rng.random() < 0.002:
            out.append(_event("eval", {"step": i, "loss": loss}, t))
        if rng.random() < 0.001:
            out.append(_event("checkpoint", {"step": i, "path": f"c{i}"}, t))
    out.append(_event("run_end", {"status": "finished", "step": n - 1}, t + 1.0))
    return out


_READERS = (LossSpike, Divergence, Hang, BadResume, NanInf, GradExplosion, Degenerate, NodeHealth, Straggler)


def _engine_batches(cls: type[Detector], events: list[Event], rng: random.Random) -> None:
    """As the engine feeds ``cls``: batches of one rank under an open reading that knows it, compared with ``observe``
    one event at a time, outputs and state, after every batch."""
    config = getattr(DetectorsConfig(), cls.kind)
    events = [e for e in events if cls.consumes is None or e.kind in cls.consumes]
    one, cut = cls(config), cls(config)
    i = 0
    while i < len(events):
        batch = events[i : i + rng.choice([rng.randint(1, 100), rng.randint(500, 4000)])]
        attempts = [0] * len(batch)
        expected = list(map(one.observe, batch, attempts))
        got: list[list[Finding]] = []
        with Reading(batch) as reading:
            if len({e.rank for e in batch}) == 1:
                reading.rank = batch[0].rank
            cut.observe_batch(batch, attempts, got)
        assert repr(got) == repr(expected), f"{cls.kind}: outputs differ in the batch from event {i}"
        assert _state(cut) == _state(one), f"{cls.kind}: state differs after the batch from event {i}"
        i += len(batch)


def _state(det: Detector) -> Any:
    """The detector's state, comparable (lr_schedule_drift keeps a plain object, which its own tests read)."""
    return lr_state(det) if isinstance(det, LrScheduleDrift) else state(det)


@pytest.mark.parametrize("cls", (*_READERS, LrScheduleDrift), ids=lambda c: c.kind)
@pytest.mark.parametrize("seed", range(4))
def test_batches_under_the_engines_reading_are_observe(cls: type[Detector], seed: int) -> None:
    rng = random.Random(seed)
    _engine_batches(cls, _stream(rng, 6000, odd=seed % 2 == 1), rng)


@pytest.mark.parametrize("cls", (Straggler, Hang, NodeHealth, BadResume, LrScheduleDrift), ids=lambda c: c.kind)
def test_two_ranks_and_no_reading_are_observe(cls: type[Detector]) -> None:
    """A batch of two ranks (a run's detectors see them all: no rank to read), and batches with no reading open (each
    detector reads its own)."""
    rng = random.Random(7)
    events = _stream(rng, 3000, ranks=2)
    _engine_batches(cls, events, rng)
    if cls is not LrScheduleDrift:
        check_batches(cls, getattr(DetectorsConfig(), cls.kind), events, rng)


def test_every_reader_is_a_detector_of_the_engine() -> None:
    assert {*_READERS, LrScheduleDrift} <= set(ALL_DETECTORS)


@pytest.mark.parametrize(
    ("lrs", "expected"),
    [
        ([[1e-3], [-0.0, 1.0], [math.nan]], [1e-3, -0.0, math.nan]),
        ([[1e-3], [2]], None),  # an int: lr_schedule_drift and bad_resume read it their own way
        ([[1e-3], []], None),
        ([[1e-3], None], None),
        ([[1e-3], (1.0,)], None),
        ([], None),
    ],
)
def test_firsts_are_the_first_floats_of_every_list(lrs: list[Any], expected: list[float] | None) -> None:
    batch = Reading([_event("step", {"lr": v}) for v in lrs])
    first = batch.firsts("lr")
    assert (None if first is None else repr(first.tolist())) == (None if expected is None else repr(expected))
    assert batch.firsts("lr") is first
