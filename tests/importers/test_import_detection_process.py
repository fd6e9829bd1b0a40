"""A long log's detection runs in the detection child process (``import_log``'s ``_PROCESS_FROM``, in bytes of log),
and must store exactly the anomalies that detection in the importing thread stores: same rows, same ids, same order.

The threshold is lowered here so that real logs of every shape (resumes, several runs in one file, NaNs, spikes,
silences the log's clock shows) take the child's path, and the child is counted to prove they did.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.real_log_types import REAL_LOGS
from trainmon.monitor.collector.detection_process import DetectionProcess
from trainmon.monitor.importers import store as import_store
from trainmon.monitor.importers.store import import_log
from trainmon.monitor.store.storage import Storage, anomalies

LOGS = [
    "04_whisper-tiny-nb-100k.json",  # resumes
    "05_bashkir-asr.json",  # grad-norm spikes
    "09_star-draft-heads.json",  # a loss spike
    "51_megatron-ds-4runs-one-file.log",  # four runs in one file
    "55_nanochat-sft-nan.log",  # NaN losses
    "82_hf-resume-lr-rewarm-divergence.json",  # a resume, LR re-warm, divergence
    "97_megatron-ds-3d-static-scale-explode-rediverge.out",  # loss-scale collapse
    "102_nanochat-base-jitter-then-disk-full.log",  # throughput, a run cut off
]


def _anomalies(path: Path, process_from: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], int]:
    started: list[DetectionProcess] = []
    start = DetectionProcess._start

    def counted(self: DetectionProcess) -> None:
        started.append(self)
        start(self)

    monkeypatch.setattr(import_store, "_PROCESS_FROM", process_from)
    monkeypatch.setattr(DetectionProcess, "_start", counted)
    storage = Storage("sqlite://")
    import_log(path, storage)
    with storage.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(anomalies).order_by(anomalies.c.id))]
    for row in rows:  # wall times of the store, not findings
        for key in ("opened_at", "updated_at", "resolved_at"):
            row.pop(key, None)
    return rows, len(started)


@pytest.mark.skipif(not (REAL_LOGS / "manifest.json").exists(), reason=f"{REAL_LOGS} is not available")
@pytest.mark.parametrize("name", LOGS)
def test_a_log_detected_in_the_child_stores_what_this_thread_stores(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = REAL_LOGS / name
    here, none = _anomalies(path, 10**12, monkeypatch)
    child, started = _anomalies(path, 1, monkeypatch)
    assert none == 0 and started == 1, "the child's path was not taken"
    assert child == here


def test_a_short_log_starts_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "short.csv"
    log.write_text("step,loss\n" + "".join(f"{i},{3 - i / 1000}\n" for i in range(50)) + "50,nan\n")
    rows, started = _anomalies(log, log.stat().st_size + 1, monkeypatch)
    assert started == 0
    assert [r["kind"] for r in rows] == ["nan_inf"] and rows[0]["first_step"] == 50


def test_an_import_whose_detection_process_died_fails_instead_of_reporting_steps_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child killed once: the steps it held were never checked, and the import says so instead of passing
    their silence off as a clean run."""
    start = DetectionProcess._start
    killed: list[int] = []

    def start_then_die(self: DetectionProcess) -> None:
        start(self)
        if not killed:
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)

    monkeypatch.setattr(import_store, "_PROCESS_FROM", 1)
    monkeypatch.setattr(DetectionProcess, "_start", start_then_die)
    with pytest.raises(RuntimeError, match="detection process stopped during the import"):
        import_log(REAL_LOGS / "05_bashkir-asr.json", Storage("sqlite://"))
    assert killed


def test_a_long_log_starts_its_process_before_the_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is told by the log's size, so its start (a Python and its imports) overlaps the parse instead of
    following it; a log of that size or more takes the child's path."""
    log = tmp_path / "long.csv"
    log.write_text("step,loss\n" + "".join(f"{i},{3 - i / 1000}\n" for i in range(50)) + "50,nan\n")
    order: list[str] = []
    start, parse = DetectionProcess._start, import_store.read_events

    def started(self: DetectionProcess) -> None:
        order.append("child")
        start(self)

    def parsed(*args: Any, **kwargs: Any) -> Any:
        order.append("parse")
        return parse(*args, **kwargs)

    monkeypatch.setattr(DetectionProcess, "_start", started)
    monkeypatch.setattr(import_store, "read_events", parsed)
    monkeypatch.setattr(import_store, "_PROCESS_FROM", log.stat().st_size)
    storage = Storage("sqlite://")
    import_log(log, storage)
    assert order == ["child", "parse"]
    with storage.connect() as conn:
        assert [r.kind for r in conn.execute(select(anomalies))] == ["nan_inf"]
