"""A step's learning rates read back as they were sent, though one group's rate is stored once (the ``lr`` column)
and the ``lrs`` column holds only what that column cannot say: several groups, a negative or -0.0 rate, a
non-finite one, an empty list. Read back the two ways a store gives steps back: the export (``trainmon export``,
``postmortem RUN --url``) and the replay a restarted collector rebuilds its detectors from."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from sqlalchemy import select

from tests.events import batch, event
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.export import export_lines
from trainmon.monitor.store.replay import recent_events
from trainmon.monitor.store.storage import Storage, steps
from trainmon.wire import validate_batch

RUN = "lr-groups"

# What each step sends as "lr" (None: no "lr" field), as JSON values on the wire.
SENT: list[Any] = [
    [3e-4],
    [1.0000000000000002e-05],  # a float whose shortest text is 17 digits
    [0.0],
    [-0.0],
    [-1e-4],
    ["NaN"],
    ["Infinity"],
    [1e-4, 2e-4],
    [5e-5, 5e-5, 0.0],
    [],
    None,
    [2.5e-4],
]


def _events(sent: list[Any]) -> list[dict[str, Any]]:
    out = [event("run_start", {"world_size": 1}, run=RUN, seq=0, t=1000.0)]
    for i, lr in enumerate(sent):
        fields: dict[str, Any] = {"step": i, "loss": 2.0}
        if lr is not None:
            fields["lr"] = lr
        out.append(event("step", fields, run=RUN, seq=i + 1, t=1001.0 + i))
    return out


def _ingest(store: Storage, events: list[dict[str, Any]]) -> None:
    Ingestor(store, Engine(store, DetectorsConfig(), detectors=()), None).ingest(validate_batch(batch(events)))


def _same(a: list[float] | None, b: list[float] | None) -> bool:
    """Equal lists of floats, NaN equal to NaN and the sign of a zero counted."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        type(x) is type(y)
        and (x == y or (math.isnan(x) and math.isnan(y)))
        and math.copysign(1, x) == math.copysign(1, y)
        for x, y in zip(a, b, strict=True)
    )


def _decoded(value: Any) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, value)


@pytest.mark.parametrize("order", ["mixed", "one_group_only"])
def test_rates_read_back_as_sent(store: Storage, order: str) -> None:
    sent = SENT if order == "mixed" else [[3e-4], [2e-4], [1e-4], [0.0], [5e-5]]
    _ingest(store, _events(sent))
    expected = {i: None if lr is None else [float(_decoded(x)) for x in lr] for i, lr in enumerate(sent)}
    with store.connect() as conn:
        exported = [json.loads(line) for line in export_lines(conn, RUN)]
        replayed = recent_events(conn, RUN, 0)
    by_export = {e["fields"]["step"]: e["fields"].get("lr") for e in exported if e["kind"] == "step"}
    by_replay = {e.fields["step"]: e.fields.get("lr") for e, _ in replayed if e.kind == "step"}
    for step, lr in expected.items():
        assert _same([_decoded(x) for x in by_export[step]] if by_export[step] is not None else None, lr), step
        assert _same(by_replay[step], lr), step


def test_one_group_is_stored_once(store: Storage) -> None:
    """A run of one param group leaves the ``lrs`` column empty (its JSON text cost a fifth of an import's store
    stage); several groups, an empty list and -0.0 (a REAL column gives 0.0 back) keep it."""
    _ingest(store, _events(SENT))
    with store.connect() as conn:
        stored = conn.execute(select(steps.c.step, steps.c.lrs)).all()
    assert len(stored) == len(SENT)
    kept = {step for step, lrs in stored if lrs is not None}  # SQL NULL or JSON null: none
    several = {i for i, lr in enumerate(SENT) if lr is not None and len(lr) != 1}
    negative_zero = {i for i, lr in enumerate(SENT) if lr == [-0.0] and math.copysign(1, lr[0]) < 0}
    assert set(kept) == several | negative_zero
