"""A full disk under the collector's database: said by /healthz, no finding lost (issue 15, item 8).

Before: ``/healthz`` said "ok" while every write failed (reads still worked), and anomalies found
while the database could not be written were dropped. The store here is SQLite on a small tmpfs that
the test fills up and empties again: a real ENOSPC, not a mock.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import start_collector
from tests.disks import fill, small_tmpfs
from tests.events import batch, event, step_events
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import Finding
from trainmon.monitor.store.storage import Storage


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "8m") as mount:
        yield mount


def test_healthz_says_when_writes_fail_and_recovers(small_disk: Path) -> None:
    lc = start_collector(small_disk / "db.sqlite")
    try:
        assert lc.post(batch([event("run_start", {"world_size": 1}, seq=0)]))[0] == 200
        filler = fill(small_disk)
        big = step_events(2000, start_seq=1)
        status, _ = lc.post(batch(big))
        assert status == 503  # not stored, not acknowledged: the producer spools and retries
        status, body = lc.get("/healthz")
        assert status == 503 and b"writes failing" in body, body
        filler.unlink()
        assert lc.post(batch(big))[0] == 200
        assert lc.get("/healthz")[0] == 200
    finally:
        lc.stop()


def test_findings_made_during_an_outage_are_stored_when_it_ends(small_disk: Path) -> None:
    storage = Storage(str(small_disk / "db.sqlite"))
    engine = Engine(storage, DetectorsConfig())
    try:
        filler = fill(small_disk)
        finding = Finding(
            "hang", "critical", 41, "no step from rank 0 for 300 s", "check the rank", {"pad": "x" * 9000}
        )
        with pytest.raises(Exception):  # noqa: B017 - whatever the database raises on a full disk
            engine._apply([("r1", 0, finding)])
        filler.unlink()
        changes = engine.tick()  # the next tick stores what could not be stored
        assert [(c.action, c.finding.kind, c.finding.step) for c in changes] == [("opened", "hang", 41)]
    finally:
        engine.close()
        storage.close()


def test_the_detection_child_holds_no_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMON_TOKEN", "tm-a-long-enough-secret-token")
    monkeypatch.setenv("TRAINMON_SLACK_URL", "https://hooks.slack.com/services/T/B/secret")
    lc = start_collector(tmp_path / "db.sqlite", token="tm-a-long-enough-secret-token")
    try:
        child = psutil.Process(lc.collector.ingestor.engine.detection.pid)
        env = child.environ()
        assert "TRAINMON_TOKEN" not in env and "TRAINMON_SLACK_URL" not in env
        assert "PATH" in env
    finally:
        lc.stop()


def test_a_newline_free_jsonl_is_not_held_in_memory(tmp_path: Path) -> None:
    big = tmp_path / "huge.jsonl"
    with open(big, "wb") as f:
        for _ in range(128):
            f.write(b"x" * (1 << 20))  # 128 MiB, no newline
    code = textwrap.dedent(
        f"""
        import resource, logging
        from pathlib import Path
        from trainmon.monitor.importers.jsonl import read_jsonl
        logging.disable(logging.WARNING)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        events = list(read_jsonl(Path({str(big)!r})))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(events), (after - before) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    n, grew_mib = map(int, out.stdout.split())
    assert n == 0
    assert grew_mib < 48, f"peak RSS grew by {grew_mib} MiB reading a 128 MiB line"
