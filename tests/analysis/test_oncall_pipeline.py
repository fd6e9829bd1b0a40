"""``trainmon postmortem`` in a pipeline and from wherever the run lives (issue 26).

Before: the command always exited 0, so a CI job or a post-run hook could not act on it; and
``trainmon postmortem RUN --url URL`` was ``unrecognized arguments: --url``: a run held by a
remote collector (or by a PostgreSQL store whose URL the user does not have) could not be
explained at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveCollector
from tests.events import batch, event, step_events
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.web.server import Collector, ServerThread, create_app

TRAINMON = [sys.executable, "-m", "trainmon"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120", "TRAINMON_COLLECTOR": "http://127.0.0.1:9", **(env or {})}
    return subprocess.run([*TRAINMON, *args], capture_output=True, text=True, timeout=120, env=env)


def _run(name: str, *, vocab: int = 64, nan_at: int | None = None, n: int = 60) -> list[dict[str, Any]]:
    """A run of ``n`` steps whose loss starts near ln(vocab) (64: ln 64 = 4.16, a fresh model's
    start); ``vocab`` far above it makes the first loss a warning (init_loss), a NaN a critical."""
    start = event("run_start", {"world_size": 1, "vocab_size": vocab, "planned_steps": n}, seq=0, run=name, t=1000.0)
    steps = step_events(n, run=name, loss=lambda i: "NaN" if i == nan_at else 4.1 - 0.01 * i)
    for i, e in enumerate(steps):
        e["time"] = 1001.0 + 0.05 * i
    end = event("run_end", {"status": "finished", "step": n - 1}, seq=n + 1, run=name, t=1001.0 + 0.05 * n)
    return [start, *steps, end]


def _file(tmp_path: Path, events: list[dict[str, Any]]) -> str:
    path = tmp_path / f"{events[0]['run']}.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def _severities(proc: subprocess.CompletedProcess) -> set[str]:
    return {a["severity"] for a in json.loads(proc.stdout)["anomalies"]}


def test_fail_on_exit_status(tmp_path: Path) -> None:
    clean = _file(tmp_path, _run("clean"))
    warned = _file(tmp_path, _run("warned", vocab=50_000))  # first loss 4.1 far below ln 50,000 = 10.8
    broken = _file(tmp_path, _run("broken", nan_at=40))
    assert not _severities(_cli("postmortem", clean, "--json")) & {"warning", "critical"}
    assert _severities(_cli("postmortem", warned, "--json")) & {"warning", "critical"} == {"warning"}
    assert "critical" in _severities(_cli("postmortem", broken, "--json"))
    expected = {  # (file, --fail-on) -> exit status
        (clean, "warning"): 0,
        (clean, "critical"): 0,
        (warned, "warning"): 1,
        (warned, "critical"): 0,
        (broken, "warning"): 1,
        (broken, "critical"): 1,
    }
    for (path, level), code in expected.items():
        proc = _cli("postmortem", path, "--json", "--fail-on", level)
        assert proc.returncode == code, (path, level, proc.stderr)
        json.loads(proc.stdout)  # the report is still printed
    text = _cli("postmortem", broken, "--fail-on", "critical")
    assert text.returncode == 1 and "nan_inf" in text.stdout
    assert _cli("postmortem", broken).returncode == 0  # without --fail-on, a report is a success


def test_fail_on_says_2_when_the_input_cannot_be_judged(tmp_path: Path) -> None:
    no_steps = _file(tmp_path, _run("empty")[:1])  # a run_start and nothing else
    proc = _cli("postmortem", no_steps, "--json", "--fail-on", "warning")
    assert proc.returncode == 2, proc.stderr
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    proc = _cli("postmortem", str(garbage), "--fail-on", "warning")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = _cli("postmortem", "ghost", "--fail-on", "critical")
    assert proc.returncode == 2 and "is not a file or folder" in proc.stderr


def test_fail_on_is_documented_in_help() -> None:
    out = _cli("postmortem", "--help").stdout
    assert "--fail-on" in out and "{warning,critical}" in out
    flat = " ".join(out.split())
    assert "exit 1 when a finding at or above" in flat and "2 when the input could not be judged" in flat


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[LiveCollector]:
    """A collector on loopback serving the reading routes of :mod:`read_api`."""
    coll = Collector.open(CollectorConfig(db=str(tmp_path / "store.sqlite")))
    app = create_app(coll)
    server = ServerThread(app, "127.0.0.1", 0)
    server.start()
    lc = LiveCollector(f"http://127.0.0.1:{server.port}", coll, server)
    yield lc
    lc.stop()


def test_postmortem_from_a_collector_is_the_store_s_report(collector: LiveCollector, tmp_path: Path) -> None:
    assert collector.post(batch(_run("remote", nan_at=40)))[0] == 200
    db = str(tmp_path / "store.sqlite")
    local = _cli("postmortem", "remote", "--db", db, "--json")
    remote = _cli("postmortem", "remote", "--url", collector.url, "--json")
    assert local.returncode == remote.returncode == 0, local.stderr + remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    assert any(a["kind"] == "nan_inf" for a in json.loads(remote.stdout)["anomalies"])

    # $TRAINMON_COLLECTOR is where a bare RUN is looked for; the text report renders the same JSON
    text = _cli("postmortem", "remote", "--fail-on", "critical", env={"TRAINMON_COLLECTOR": collector.url})
    assert text.returncode == 1, text.stderr
    assert "post-mortem of run remote" in text.stdout and "nan_inf" in text.stdout
    assert text.stdout == _cli("postmortem", "remote", "--db", db).stdout

    out = tmp_path / "report"
    page = _cli("postmortem", "remote", "--url", collector.url, "--out", str(out))
    assert page.returncode == 0, page.stderr
    html = (out / "report.html").read_text()
    assert "remote" in html and "nan_inf" in html and "data:image/png;base64," in html
    assert "all runs" not in html and "http-equiv" not in html  # a file: no link back to the web view, no reload

    ghost = _cli("postmortem", "ghost", "--url", collector.url, "--fail-on", "warning")
    assert ghost.returncode == 2 and "no run 'ghost'" in ghost.stderr and str(tmp_path) not in ghost.stderr
    down = _cli("postmortem", "remote", "--url", "http://127.0.0.1:9")
    assert down.returncode == 2 and "cannot reach the collector" in down.stderr
