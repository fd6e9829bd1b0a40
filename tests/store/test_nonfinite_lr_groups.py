"""Several param groups' learning rates with a non-finite one among them (a group whose scheduler produced NaN, an
infinite rate from a division by a zero warmup) are stored and read back as sent, on every store. JSON has no NaN or
infinity: PostgreSQL's JSON type refuses the text ``NaN`` that Python's ``json.dumps`` writes, and refused the whole
batch with it, acknowledged steps of every other field included."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.events import batch, event
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.export import export_lines
from trainmon.monitor.store.replay import recent_events
from trainmon.monitor.store.storage import Storage
from trainmon.wire import validate_batch

RUN = "nonfinite-groups"
SENT: list[list[Any]] = [
    [1e-4, "NaN"],
    ["Infinity", 2e-4],
    [3e-4, "-Infinity", 0.0],
    [1e-4, 2e-4],
    ["NaN", "NaN"],
]
_MARKERS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _decoded(values: list[Any]) -> list[float]:
    return [float(_MARKERS.get(x, x)) if isinstance(x, str) else float(x) for x in values]


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (x == y or (math.isnan(x) and math.isnan(y))) and math.copysign(1, x) == math.copysign(1, y)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_nonfinite_rates_among_groups_stored(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    url = str(tmp_path / "db.sqlite") if kind == "sqlite" else request.getfixturevalue("postgres_url")
    store = Storage(url)
    try:
        events = [event("run_start", {"world_size": 1}, run=RUN, seq=0, t=1000.0)]
        events += [
            event("step", {"step": i, "loss": 2.0, "lr": lr}, run=RUN, seq=i + 1, t=1001.0 + i)
            for i, lr in enumerate(SENT)
        ]
        result = Ingestor(store, Engine(store, DetectorsConfig(), detectors=()), None).ingest(
            validate_batch(batch(events))
        )
        assert result.accepted == len(events)
        with store.connect() as conn:
            exported = [json.loads(line) for line in export_lines(conn, RUN)]
            replayed = recent_events(conn, RUN, 0)
        by_export = {e["fields"]["step"]: e["fields"]["lr"] for e in exported if e["kind"] == "step"}
        by_replay = {e.fields["step"]: e.fields["lr"] for e, _ in replayed if e.kind == "step"}
        for step, lr in enumerate(SENT):
            assert _same(_decoded(by_export[step]), _decoded(lr)), step
            assert _same(by_replay[step], _decoded(lr)), step
    finally:
        store.close()


def test_postgres_json_cells_keep_nonfinite_floats_and_strings_apart() -> None:
    """What PostgreSQL's JSON cells are written as and read back: a non-finite float anywhere in a value (a layer's
    grad norm, an eval metric, a finding's evidence) comes back the float it was, and a string a run logged (the
    wire's own marker text included) comes back a string; a value without one is plain JSON."""
    from tests.bitwise import same
    from trainmon.monitor.store.storage import _json_text, _json_value

    value = {
        "lr": [1e-4, math.nan, -math.inf],
        "layers": {"wte": math.inf, "h.0": 0.5, "h.1": -0.0},
        "note": "NaN",
        "markers": ["Infinity", {"$float": "not a marker"}],
        "nested": [[math.nan], {"x": [math.inf, 2]}],
    }
    text = _json_text(value)
    assert "NaN" not in text.replace('"NaN"', "")  # no bare token PostgreSQL refuses
    assert same(_json_value(text), value)
    assert _json_text({"a": [1.0, 2]}) == json.dumps({"a": [1.0, 2]})
