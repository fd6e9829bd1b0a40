"""Reading commands never create a store, and with no flags they ask the local collector first.

Before: ``trainmon status RUN --follow`` without --db/--url looked in ./trainmon.sqlite, said "no run",
and silently created an empty database file there (DESIGN.md, contracts: ``trainmon runs`` and
``trainmon status RUN`` with no --db/--url ask the collector on 127.0.0.1:9400).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LiveCollector
from tests.events import batch, event, step_events

TRAINMON = [sys.executable, "-m", "trainmon"]


def _run(cwd: Path, *args: str, collector: str = "http://127.0.0.1:9") -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINMON_COLLECTOR": collector}  # port 9: nothing listens there
    return subprocess.run([*TRAINMON, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args",
    [
        ("runs",),
        ("status", "r1"),
        ("runs", "--db", "missing.sqlite"),
        ("status", "r1", "--db", "missing.sqlite"),
        ("postmortem", "r1", "--db", "missing.sqlite"),
        ("compare", "a", "b", "--db", "missing.sqlite"),
    ],
)
def test_nothing_to_read_is_an_error_and_creates_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = _run(tmp_path, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # no trainmon.sqlite, no missing.sqlite
    if args[-1] != "missing.sqlite":
        assert "no collector answers" in out.stderr and "--db" in out.stderr


def test_no_flags_ask_the_local_collector(tmp_path: Path, live_collector: LiveCollector) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    start = event("run_start", {"world_size": 1}, run="here", seq=0)
    assert live_collector.post(batch([start, *step_events(5, run="here")]))[0] == 200
    out = _run(cwd, "runs", "--json", collector=live_collector.url)
    assert out.returncode == 0, out.stderr
    assert [r["run"] for r in json.loads(out.stdout)] == ["here"]
    out = _run(cwd, "status", "here", "--json", collector=live_collector.url)
    assert out.returncode == 0 and json.loads(out.stdout)["run"] == "here", out.stderr
    assert list(cwd.iterdir()) == []


def test_without_a_collector_the_local_store_is_read(tmp_path: Path, live_collector: LiveCollector) -> None:
    """The store a collector started in this folder wrote (its default ./trainmon.sqlite) is the fallback."""
    assert live_collector.post(batch(step_events(3, run="stored")))[0] == 200
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    (cwd / "trainmon.sqlite").symlink_to(Path(live_collector.collector.config.db).resolve())
    out = _run(cwd, "runs", "--json")
    assert out.returncode == 0, out.stderr
    assert "stored" in {r["run"] for r in json.loads(out.stdout)}
