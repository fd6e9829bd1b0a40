"""Schemathesis against the collector's own OpenAPI description, on a live ``trainmon serve``.

Every operation in ``/openapi.json`` gets schema-driven examples, valid and invalid (the events
body schema is the wire format's JSON Schema, so schemathesis builds real batches of every
event kind as well as near-misses). The budget is fixed and the generation derandomised, so CI
runs the same examples every time and stays well under a minute.

Properties: no 5xx and no crash (the process is still healthy at the end), documented status
codes, and no partial write: every step stored afterwards was in a batch answered 2xx.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error, status_code_conformance
from sqlalchemy import select

from trainmon.monitor.store.storage import Storage, steps

EXAMPLES = 200

_accepted: list[dict] = []  # bodies of POST /v1/events answered 2xx
_answered: list[int] = []  # every status the events endpoint returned
_refused_valid: list[str] = []  # errors the events endpoint gave schema-valid batches
_deleted: set[str] = set()  # runs DELETE /v1/runs/{run} removed (fuzzed after the events operation)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, root: Path) -> None:
        self.db = root / "fuzz.sqlite"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "collector.log"
        # Generated batches mix dozens of runs: the memory limits (tested in test_collector_limits) are raised so
        # that the fuzzing reaches the write path instead of the 429 that protects it.
        config = root / "limits.toml"
        config.write_text("max_runs_per_batch = 100000\nmax_live_runs = 1000000\n")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainmon",
                "serve",
                "--db",
                str(self.db),
                "--port",
                str(self.port),
                "--config",
                str(config),
            ],
            stdout=open(self.log, "w"),  # noqa: SIM115 - closed when the child exits
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"},
        )
        deadline = time.monotonic() + 30
        while not self.healthy():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    srv = _Server(tmp_path_factory.mktemp("api-fuzz"))
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(30)


def _fuzz(operation, mode: schemathesis.GenerationMode, examples: int, server: _Server) -> None:
    session = requests.Session()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        derandomize=True,  # a fixed seed: CI replays the same examples
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.explicit, Phase.generate],  # a fixed budget: no shrinking after a failure
    )
    def run(case) -> None:
        if mode is schemathesis.GenerationMode.POSITIVE and case.path == "/v1/events":
            # Schema-valid batches reuse tiny stream ids ("0") across runs: most would be refused as
            # conflicts or skipped as duplicates. Fresh stream ids take them down the write path.
            for ev in case.body["events"]:
                ev["stream"] = f"fz{len(_answered)}-{ev['stream']}"[:64]
        # Sent with requests directly: Case.call's connection counting breaks on urllib3 >= 2.6.
        response = session.request(**case.as_transport_kwargs(base_url=server.url), timeout=10)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
        if case.method == "DELETE" and response.status_code == 200:
            _deleted.add(response.json()["deleted"])
        if case.method == "POST" and case.path == "/v1/events":
            _answered.append(response.status_code)
            if 200 <= response.status_code < 300:
                _accepted.append(case.body)
            elif mode is schemathesis.GenerationMode.POSITIVE and response.status_code != 409:
                _refused_valid.append(response.json().get("error", ""))  # 409: a stream id reused, by design

    run()


def test_api_conforms_and_never_fails(server: _Server) -> None:
    """Every operation the collector describes, valid and invalid inputs; the ingest endpoint gets
    most of the budget (``EXAMPLES``), the read endpoints a tenth each."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/events", "GET /healthz", "GET /metrics", "GET /v1/runs"} <= labels, labels
    for op in operations:
        examples = EXAMPLES // 2 if op.label == "POST /v1/events" else EXAMPLES // 20
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            try:
                _fuzz(op, mode, examples, server)
            except Unsatisfiable:
                # No invalid input exists when an operation takes nothing, or only free strings.
                assert mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET", op.label


def _as_float(value: object) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, value)  # type: ignore[arg-type]


def test_no_crash_and_no_partial_write(server: _Server) -> None:
    """Runs after the fuzzing above (file order): the daemon survived and stored only what it acknowledged."""
    assert server.proc.poll() is None, server.log.read_text()
    assert server.healthy()
    assert "Traceback" not in server.log.read_text()
    assert len(_answered) >= 50, "the events endpoint was hardly exercised"
    assert any(s < 300 for s in _answered) and any(s >= 400 for s in _answered), sorted(set(_answered))
    acknowledged = set()  # every step of a 2xx batch
    expected = set()  # the ones ingest must have stored: (stream, seq) not seen before
    seen: set[tuple[str, int]] = set()
    for body in _accepted:
        for ev in body["events"]:
            fresh = (ev["stream"], ev["seq"]) not in seen
            seen.add((ev["stream"], ev["seq"]))
            if ev["kind"] == "step":
                acknowledged.add((ev["run"], ev["rank"], ev["fields"]["step"], float(_as_float(ev["time"]))))
                if fresh:
                    expected.add((ev["run"], ev["rank"], ev["fields"]["step"]))
    store = Storage(str(server.db))
    with store.connect() as conn:
        stored = {(r.run, r.rank, r.step, r.time) for r in conn.execute(select(steps))}
    store.close()
    # A batch the published schema calls valid is never refused (but a 409 on a reused stream).
    assert _refused_valid == [], set(_refused_valid)
    assert expected, "no valid step was ever accepted: the fuzzing did not reach the write path"
    expected = {key for key in expected if key[0] not in _deleted}  # what a fuzzed DELETE removed is gone
    assert stored <= acknowledged, sorted(stored - acknowledged)[:5]  # nothing from a refused batch
    assert expected <= {key[:3] for key in stored}, sorted(expected - {key[:3] for key in stored})[:5]  # no loss
