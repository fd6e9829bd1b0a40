"""Detection in a child process: same findings as in-process, survives the child's death, never outlives us."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.conftest import start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.collector.detection import Detection
from trainmon.monitor.collector.detection_process import DetectionProcess, parts
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.exporter import DetectionCollector
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig, detectors_config
from trainmon.monitor.detectors import Detector
from trainmon.monitor.detectors.loss_spike import LossSpike
from trainmon.monitor.detectors.nan_inf import NanInf
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event, validate_batch


def _trace(run: str, nan_at: set[int], n: int = 60, rank: int = 0, start_seq: int = 1) -> list[dict]:
    """A run whose loss is NaN at ``nan_at`` and jumps tenfold at step 40 (a spike)."""

    def loss(i: int) -> float | str:
        if i in nan_at:
            return "NaN"
        return 30.0 if i == 40 else 3.0 - 0.005 * i

    start = event("run_start", {"world_size": 1}, run=run, rank=rank, seq=0)
    return [start, *step_events(n, run=run, rank=rank, start_seq=start_seq, loss=loss)]


def _anomalies(engine_process: bool, tmp_path: Path) -> list[tuple[str, int, int | None, str]]:
    storage = Storage(str(tmp_path / f"p{int(engine_process)}.sqlite"))
    engine = Engine(storage, DetectorsConfig(), process=engine_process)
    ingestor = Ingestor(storage, engine, LiveState())
    try:
        events = _trace("t", nan_at={12})
        for k in range(0, len(events), 7):  # several groups, as the collector would commit them
            ingestor.ingest(validate_batch(batch(events[k : k + 7])))
        with storage.connect() as conn:
            rows = conn.exec_driver_sql("SELECT kind, rank, first_step, status FROM anomalies ORDER BY id").all()
        return [tuple(r) for r in rows]
    finally:
        engine.close()
        storage.close()


def test_the_child_finds_what_the_thread_finds(tmp_path: Path) -> None:
    inline = _anomalies(False, tmp_path)
    child = _anomalies(True, tmp_path)
    assert ("nan_inf", 0, 12, "resolved") in inline  # the NaN crossed the pipe as a NaN, not a null
    assert any(kind == "loss_spike" and step == 40 for kind, _, step, _ in inline)
    assert child == inline


def test_detector_config_crosses_the_pipe_intact() -> None:
    config = DetectorsConfig(replay_window=77)
    config.loss_spike.z = 9.5
    assert detectors_config(dataclasses.asdict(config)) == config


def test_a_killed_detection_process_is_replaced_and_nothing_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lc = start_collector(tmp_path / "db.sqlite")
    try:
        events = _trace("k", nan_at={5, 80}, n=120)
        assert lc.post(batch(events[:30]))[0] == 200
        first = lc.collector.ingestor.engine.detection.pid
        assert psutil.Process(first).is_running()
        with caplog.at_level(logging.ERROR, logger="trainmon.collector"):
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while lc.collector.ingestor.engine.detection.pid == first and time.monotonic() < deadline:
                time.sleep(0.05)
        assert lc.collector.ingestor.engine.detection.pid != first
        assert any("detection process" in r.getMessage() and "died" in r.getMessage() for r in caplog.records)
        # Every batch is still stored and answered, and the new child (primed from storage) sees the NaN at 80.
        assert lc.post(batch(events[30:]))[0] == 200
        _, exposition = lc.get("/metrics")
        assert "trainmon_detection_restarts_total 1.0" in exposition.decode()  # what the alert reads
        steps = lc.get_json("/v1/runs/k/steps")
        assert len(steps) == 120
        found = lc.get_json("/v1/runs/k/anomalies")
        assert [a["first_step"] for a in found if a["kind"] == "nan_inf"] == [5, 80]
    finally:
        lc.stop()


def test_the_child_ignores_signals_and_exits_with_the_collector(tmp_path: Path) -> None:
    lc = start_collector(tmp_path / "db.sqlite")
    child = psutil.Process(lc.collector.ingestor.engine.detection.pid)
    try:
        trace = _trace("s", nan_at={3}, n=10)
        assert lc.post(batch(trace[:2]))[0] == 200  # one round trip: the child is up and serving
        child.send_signal(signal.SIGTERM)  # a signal to the process group must not take detection away mid-group
        child.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        assert lc.post(batch(trace[2:]))[0] == 200
        assert [a["first_step"] for a in lc.get_json("/v1/runs/s/anomalies")] == [3]
    finally:
        lc.stop()
    child.wait(10)  # gone once the collector closed


def test_a_child_that_stops_answering_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    """A detector stuck in a loop (here: a stopped process) must not stop the collector's acknowledgements."""
    detection = DetectionProcess(DetectorsConfig(), stuck_after=1.0)
    events = [(Event("step", "w", 0, "h", "s", i, 1e9 + i, {"step": i, "loss": 3.0}), 0) for i in range(5)]
    nan = [(Event("step", "w", 0, "h", "s", 5, 1e9 + 5, {"step": 5, "loss": math.nan}), 0)]
    try:
        first = detection.pid
        os.kill(first, signal.SIGSTOP)
        answers: list[list] = []
        with caplog.at_level(logging.ERROR, logger="trainmon.collector"):
            detection.observe(parts(events), answers.append)
            deadline = time.monotonic() + 15
            while not answers and time.monotonic() < deadline:
                time.sleep(0.05)
        assert answers == [[]]  # answered, with no findings: the events are stored, their detection is lost
        assert detection.pid != first and detection.generation == 1
        registry = CollectorRegistry()
        registry.register(DetectionCollector(detection))
        exposition = generate_latest(registry).decode()
        assert "trainmon_detection_restarts_total 1.0" in exposition
        assert "trainmon_detection_lost_calls_total 1.0" in exposition  # the group whose steps went unchecked
        assert any("answered nothing" in r.getMessage() for r in caplog.records)
        found: list[list] = []
        detection.observe(parts(events + nan), found.append)  # the new child works
        deadline = time.monotonic() + 15
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f.kind for _, (_, _, f) in found[0]] == ["nan_inf"]
    finally:
        detection.close()


def test_a_script_without_a_main_guard_can_open_a_collector(tmp_path: Path) -> None:
    """The child is not started by re-running the parent's __main__ (multiprocessing's spawn and
    forkserver would: this script would open a second collector from inside the first one's child),
    and a collector that was never closed does not keep its script from exiting."""
    script = tmp_path / "embed.py"
    script.write_text(
        "from trainmon.wire import validate_batch\n"
        "from trainmon.monitor.config import CollectorConfig\n"
        "from trainmon.monitor.web.server import Collector\n"
        "from tests.events import batch, event, step_events\n"
        f"c = Collector.open(CollectorConfig(db={str(tmp_path / 'e.sqlite')!r}))\n"
        "nan_at_3 = step_events(5, loss=lambda i: 'NaN' if i == 3 else 2.0)\n"
        "evs = [event('run_start', {'world_size': 1}, seq=0), *nan_at_3]\n"
        "c.ingestor.ingest(validate_batch(batch(evs)))\n"
        "with c.storage.connect() as conn:\n"
        "    print(conn.exec_driver_sql('SELECT kind, first_step FROM anomalies').all())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "[('nan_inf', 3)]" in out.stdout, out.stdout + out.stderr
    assert "Error" not in out.stderr, out.stderr


class _Boom(NanInf):
    """A detector with a bug: it raises on the third step it sees."""

    kind = "nan_inf"

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.seen = 0

    def observe(self, event: Event, attempt: int) -> list:
        self.seen += 1
        if self.seen == 3:
            raise ZeroDivisionError("a detector bug")
        return []

    observe_batch = Detector.observe_batch  # NanInf's reads its batch's columns: this bug is in observe


def test_a_failing_detector_does_not_blind_the_others(caplog: pytest.LogCaptureFixture) -> None:
    detection = Detection(DetectorsConfig(), (_Boom, LossSpike, NanInf))
    steps = [
        (Event("step", "b", 0, "h", "s", i, 1e9 + i, {"step": i, "loss": math.nan if i == 30 else 3.0}), 0)
        for i in range(40)
    ]
    with caplog.at_level(logging.ERROR, logger="trainmon.collector"):
        found = detection.observe(steps)
    assert [(f.kind, f.step) for _, _, f in found][:1] == [("nan_inf", 30)]  # the real NanInf still sees it
    assert sum("failed on a step event" in r.getMessage() for r in caplog.records) == 1  # logged once, then dropped
