"""No single accepted event can break a shared view (issue 15, item 4).

Before: a health event with ``gpus:[{"temperature_c":"hot"}]`` was accepted, then ``/metrics`` answered
500 for every run; ``time = 1e300`` was accepted and ``trainmon runs`` crashed with OverflowError; a
config nested 1,000 levels passed validation, failed in storage with a 503 quoting SQL that was retried
forever, and the innocent batches grouped with it got 503 too; a 1,000-deep ``events`` item gave 500.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy.exc

from tests.conftest import LiveCollector
from tests.events import batch, event, step_events

TRAINMON = [sys.executable, "-m", "trainmon"]


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"x": value}
    return value


@pytest.mark.parametrize(
    ("fields_or_header", "path"),
    [
        ({"kind": "health", "fields": {"gpus": [{"temperature_c": "hot"}]}}, "events[0].fields.gpus[0].temperature_c"),
        ({"kind": "health", "fields": {"gpus": [{"index": 0, "fan": 3}]}}, "events[0].fields.gpus[0].fan"),
        ({"kind": "health", "fields": {"gpus": ["hot"]}}, "events[0].fields.gpus[0]"),
        ({"kind": "step", "time": 1e300, "fields": {"step": 1}}, "events[0].time"),
        ({"kind": "step", "time": -5.0, "fields": {"step": 1}}, "events[0].time"),
        ({"kind": "run_start", "fields": {"config": "DEEP"}}, "events[0].fields.config"),
        ({"kind": "run_start", "fields": {"config": {"k" * 300: 1}}}, "events[0].fields.config"),
        (
            {"kind": "eval", "fields": {"step": 1, "loss": 1.0, "metrics": {"wer": "bad"}}},
            "events[0].fields.metrics.wer",
        ),
        (
            {"kind": "step", "fields": {"step": 1, "layer_grad_norms": {"w": [1]}}},
            "events[0].fields.layer_grad_norms.w",
        ),
    ],
)
def test_bad_nested_values_are_refused_at_the_door_by_name(
    live_collector: LiveCollector, fields_or_header: dict, path: str
) -> None:
    ev = event(fields_or_header["kind"], fields_or_header["fields"], run="hostile", seq=1)
    if "time" in fields_or_header:
        ev["time"] = fields_or_header["time"]
    body_bytes = json.dumps(batch([ev])).replace('"DEEP"', '{"x":' * 1000 + "1" + "}" * 1000).encode()
    status, body = live_collector.post(body_bytes)  # (a 1,000-deep config cannot be built with json.dumps)
    assert status == 422, body
    assert body["field"].startswith(path), body
    assert live_collector.get("/metrics")[0] == 200


def test_a_deeply_nested_event_item_is_a_422_not_a_500(live_collector: LiveCollector) -> None:
    deep = "[" * 1000 + "]" * 1000
    status, body = live_collector.post(f'{{"version": 1, "events": [{deep}]}}'.encode())
    assert status in (400, 422), body  # refused by name (or as JSON too deep to parse), never a crash
    assert "error" in body


def test_views_survive_the_most_extreme_values_the_door_lets_in(live_collector: LiveCollector, tmp_path: Path) -> None:
    lc = live_collector
    gpu = {"index": 0, "temperature_c": 1e308, "mem_used_bytes": 2**53, "throttle_reasons": 2**53}
    start = event("run_start", {"world_size": 1, "config": _nested(14), "planned_steps": 2**53}, run="edge", seq=0)
    start["time"] = 2.0**32
    health = event("health", {"gpus": [gpu], "rss_bytes": 2**53, "cpu_percent": 1e308}, run="edge", seq=1)
    steps = step_events(3, run="edge", start_seq=2, loss=lambda i: [1e308, "NaN", "-Infinity"][i])
    for s in steps:
        s["time"] = 0.0
    assert lc.post(batch([start, health, *steps]))[0] == 200
    assert lc.get("/metrics")[0] == 200
    assert lc.get("/v1/runs")[0] == 200
    assert lc.get("/v1/runs/edge")[0] == 200
    db = str(lc.collector.config.db)
    for cmd in (["runs", "--db", db], ["status", "edge", "--db", db], ["postmortem", "edge", "--db", db, "--json"]):
        out = subprocess.run([*TRAINMON, *cmd], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
        assert "Traceback" not in out.stderr


def test_a_batch_that_cannot_be_stored_is_refused_alone_and_its_group_commits(
    live_collector: LiveCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage failure caused by one batch's data (here injected: the database refuses a host name)
    must not refuse the batches committed in the same transaction, nor be retried for ever."""
    lc = live_collector
    storage = lc.collector.storage
    real = storage.insert_ignore

    def picky(conn, table, columns):  # type: ignore[no-untyped-def]
        if "poison" in columns.get("run", ()):
            raise sqlalchemy.exc.DataError("INSERT ...", {}, ValueError("value refused by the database"))
        return real(conn, table, columns)

    monkeypatch.setattr(storage, "insert_ignore", picky)
    bodies = [batch(step_events(5, run=f"ok{i}", stream=f"s{i}")) for i in range(30)]
    bodies.insert(15, batch(step_events(5, run="poison", stream="sp")))
    replies: list[tuple[int, dict]] = [(-1, {})] * len(bodies)
    gate = threading.Barrier(len(bodies))

    def post(i: int) -> None:
        gate.wait()
        replies[i] = lc.post(bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    statuses = [s for s, _ in replies]
    assert statuses.pop(15) == 422
    assert "SQL" not in replies[15][1]["error"] and "INSERT" not in replies[15][1]["error"]
    assert statuses == [200] * 30
    runs = {r["run"] for r in lc.get_json("/v1/runs")}
    assert {f"ok{i}" for i in range(30)} <= runs and "poison" not in runs
