"""SIGKILL the collector in the middle of a real training run: nothing lost, nothing doubled.

The collector acknowledges a batch only after its transaction committed (SQLite WAL with
``synchronous=FULL``, or PostgreSQL), the trainer's transport spools what was not acknowledged
and replays it once the collector answers again, and ingest skips what it already stored (by
stream and sequence number). So a ``kill -9`` at any moment must leave, after the restart and
the replay, the complete step series with each step once, and anomalies opened before the kill
must still be open (not lost, not opened a second time by the replayed detectors).

The collector is killed twice: once before the injected NaN (step 100) and once after the
``nan_inf`` anomaly it causes was opened and stored.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from trainmon.monitor.store.storage import Storage, anomalies, steps, streams

pytestmark = pytest.mark.slow

STEPS = 150
NAN_STEP = 100
RUN = "crash-safety"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_collector(db: str, port: int, log: Path) -> subprocess.Popen:
    out = open(log, "a")  # noqa: SIM115 - handed to the child; closed with the test's tmp_path
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainmon.monitor.cli", "serve", "--db", db, "--port", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"collector did not become healthy:\n{log.read_text()}")


def _wait(what: str, cond: Callable[[], bool], trainer: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (trainer rc={trainer.poll()})")


def _stored_steps(store: Storage) -> int:
    with store.connect() as conn:
        return conn.execute(select(func.count()).select_from(steps).where(steps.c.run == RUN)).scalar_one()


def _nan_anomalies(store: Storage) -> list:
    with store.connect() as conn:
        return conn.execute(
            select(anomalies.c.status, anomalies.c.first_step).where(
                anomalies.c.run == RUN, anomalies.c.kind == "nan_inf"
            )
        ).all()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL


def _crash_twice_during_training(db: str, tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "collector.log"
    collector = _start_collector(db, port, log)
    store = Storage(db)
    out = tmp_path / "run"
    trainer_log = tmp_path / "trainer.log"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainmon.reference_trainer",
            "--run",
            RUN,
            "--steps",
            str(STEPS),
            "--out",
            str(out),
            "--collector",
            f"http://127.0.0.1:{port}",
            "--threads",
            "1",
            "--inject",
            f"nan@{NAN_STEP}",
            # ~100 ms per step, so the trainer is still running across both restarts.
            "--inject",
            "straggler@0:ms=100",
        ],
        stdout=open(trainer_log, "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"},
    )
    try:
        # Crash 1: mid-run, before the fault.
        _wait("~50 stored steps", lambda: _stored_steps(store) >= 50, trainer)
        _kill(collector)
        killed_at = _stored_steps(store)
        assert killed_at < NAN_STEP
        time.sleep(2.0)
        assert trainer.poll() is None, "the trainer finished while the collector was down; slow it down"
        collector = _start_collector(db, port, log)

        # Crash 2: after the NaN anomaly was opened and committed.
        _wait("the nan_inf anomaly", lambda: len(_nan_anomalies(store)) == 1, trainer)
        _kill(collector)
        assert [tuple(a) for a in _nan_anomalies(store)] == [("open", NAN_STEP)]
        time.sleep(2.0)
        assert trainer.poll() is None, "the trainer finished while the collector was down; slow it down"
        collector = _start_collector(db, port, log)

        assert trainer.wait(120) == 0, trainer_log.read_text()
        _wait("the replayed tail", lambda: _stored_steps(store) == STEPS, trainer, timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        collector.send_signal(signal.SIGTERM)
        collector.wait(30)

    assert "spooling" in trainer_log.read_text()  # the transport really had to hold events back
    assert not list((out / "spool").rglob("*.jsonl")), "spool not drained"
    with store.connect() as conn:
        rows = conn.execute(
            select(steps.c.attempt, steps.c.step, steps.c.time).where(steps.c.run == RUN).order_by(steps.c.step)
        ).all()
        stream_rows = conn.execute(
            select(streams.c.attempt, streams.c.last_seq, streams.c.missing, streams.c.end_status).where(
                streams.c.run == RUN
            )
        ).all()
        nan = conn.execute(
            select(anomalies.c.status, anomalies.c.first_step, anomalies.c.last_step).where(
                anomalies.c.run == RUN, anomalies.c.kind == "nan_inf"
            )
        ).all()
    store.close()
    assert [r.step for r in rows] == list(range(STEPS))  # complete, each step once
    assert {r.attempt for r in rows} == {0}  # a collector restart is not a trainer restart
    times = [r.time for r in rows]
    assert times == sorted(times)  # stored in the order the trainer took them
    assert len(stream_rows) == 1
    assert stream_rows[0].missing == 0 and stream_rows[0].end_status == "finished"
    assert len(nan) == 1, nan  # opened once, survived two crashes, not re-raised by the replay
    assert nan[0].status == "open" and nan[0].first_step == NAN_STEP and nan[0].last_step >= STEPS - 5


def test_sigkill_mid_run_loses_and_doubles_nothing_sqlite(tmp_path: Path) -> None:
    _crash_twice_during_training(str(tmp_path / "store.sqlite"), tmp_path)


def test_sigkill_mid_run_loses_and_doubles_nothing_postgresql(tmp_path: Path, postgres_url: str) -> None:  # noqa: F811
    _crash_twice_during_training(postgres_url, tmp_path)
