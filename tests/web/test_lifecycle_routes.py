"""``DELETE /v1/runs/{run}`` and ``GET /v1/runs/{run}/export`` on a live collector, on SQLite and on a
real PostgreSQL, and the collector's retention thread (issue 27, part 3)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event, step_events
from tests.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from trainmon.monitor.config import RetentionConfig
from trainmon.monitor.store.export import export_lines

TOKEN = "tm-lifecycle-Zq8x1vK0pL"


def _db(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "db.sqlite") if backend == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture(params=["sqlite", "postgresql"])
def collector(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveCollector]:
    lc = start_collector(_db(request.param, request, tmp_path), token=TOKEN, evict_idle_seconds=2.0)
    yield lc
    lc.stop()


def _call(url: str, method: str = "GET", body: dict | None = None, token: str | None = TOKEN) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _send_run(url: str, run: str, ended: bool) -> None:
    evs = [event("run_start", {"world_size": 1}, run=run, stream=f"{run}-0", seq=0)]
    evs += step_events(30, run=run, stream=f"{run}-0", loss=lambda i: "NaN" if i == 20 else 4.0 - 0.01 * i)
    if ended:
        evs.append(event("run_end", {"status": "finished", "step": 29}, run=run, stream=f"{run}-0", seq=31))
    status, body = _call(url + "/v1/events", "POST", batch(evs))
    assert status == 200, body


def test_delete_needs_the_token_and_names_unknown_and_live_runs(collector: LiveCollector) -> None:
    url = collector.url
    _send_run(url, "live", ended=False)
    assert _call(f"{url}/v1/runs/live", "DELETE", token=None)[0] == 401
    assert _call(f"{url}/v1/runs/live", "DELETE", token="tm-wrong-token-0000000")[0] == 401

    status, body = _call(f"{url}/v1/runs/nobody", "DELETE")
    assert (status, json.loads(body)) == (404, {"error": "no run 'nobody'"})

    status, body = _call(f"{url}/v1/runs/live", "DELETE")
    assert status == 409
    assert "still receiving events" in json.loads(body)["error"] and "idle" in json.loads(body)["error"]
    assert _call(f"{url}/v1/runs/live")[0] == 200  # nothing was deleted

    time.sleep(2.5)  # idle past evict_idle_seconds: its trainer is gone
    assert _call(f"{url}/v1/runs/live", "DELETE")[0] == 200


def test_deleting_an_ended_run_removes_it_from_the_store_and_from_memory(collector: LiveCollector) -> None:
    url = collector.url
    _send_run(url, "ended", ended=True)
    _send_run(url, "other", ended=False)
    metrics = _call(url + "/metrics")[1].decode()
    assert 'run="ended"' in metrics and 'run="other"' in metrics
    assert collector.collector.findings.since("ended", "info", 0)[0]  # its NaN is an open finding

    status, body = _call(f"{url}/v1/runs/ended", "DELETE")

    assert status == 200 and json.loads(body)["deleted"] == "ended" and json.loads(body)["rows"] > 30
    assert _call(f"{url}/v1/runs/ended")[0] == 404
    assert [r["run"] for r in json.loads(_call(url + "/v1/runs")[1])] == ["other"]
    metrics = _call(url + "/metrics")[1].decode()
    assert 'run="ended"' not in metrics and 'run="other"' in metrics  # exported series forget it
    assert "ended" not in collector.collector.live.runs
    assert collector.collector.findings.since("ended", "info", 0)[0] == []
    ingestor = collector.collector.ingestor  # nor does the stream cache keep it (a run sent again starts afresh)
    assert not [st for st in ingestor._streams.values() if st.run == "ended"]
    assert [st for st in ingestor._streams.values() if st.run == "other"]


def test_export_streams_the_stored_events(collector: LiveCollector) -> None:
    url = collector.url
    _send_run(url, "kept", ended=True)
    assert _call(f"{url}/v1/runs/kept/export", token=None)[0] == 401
    status, body = _call(f"{url}/v1/runs/nobody/export")
    assert (status, json.loads(body)) == (404, {"error": "no run 'nobody'"})

    status, body = _call(f"{url}/v1/runs/kept/export")

    assert status == 200
    with collector.collector.storage.connect() as conn:
        assert body == b"".join(export_lines(conn, "kept"))
    kinds = [json.loads(line)["kind"] for line in body.splitlines()]
    assert kinds == ["run_start", *["step"] * 30, "run_end"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_retention_thread_deletes_finished_runs_and_keeps_live_ones(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    retention = RetentionConfig(max_age_days=0, max_bytes=1, check_seconds=0.2)
    lc = start_collector(_db(backend, request, tmp_path), retention=retention)
    try:
        _send_run(lc.url, "done", ended=True)
        _send_run(lc.url, "going", ended=False)
        lc.collector.start_retention()
        deadline = time.monotonic() + 20
        while lc.collector.storage.run_ids() != ["going"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lc.collector.storage.run_ids() == ["going"]
        assert "done" not in lc.collector.live.runs
    finally:
        lc.stop()
