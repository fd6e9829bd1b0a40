"""Nothing is cut at 80 columns (issue 26).

Before: ``COLUMNS=80 trainmon runs`` showed ``ux-run-with-a-rather-long-name-00…   finish…   20/…
2.8…``: the name, the status, the step count and the loss all cut; the ranks tables of ``status``
and ``postmortem`` cut host names the same way. ``runs``, ``status`` and ``postmortem`` are rendered
at 80 and 120 columns with 60-character run names and 40-character host names: every name and
number is whole, and no line is wider than the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import LiveCollector
from tests.events import batch, event, step_events
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.core.fmt import fmt
from trainmon.monitor.web.server import Collector, ServerThread, create_app

TRAINMON = [sys.executable, "-m", "trainmon"]
BROKEN = "llama3-8b-sft-lr3e-5-bs256-20261126-nan-at-step-300-of-400xx"
CLEAN = "ux-run-with-a-rather-long-name-0001-and-a-clean-finish-000001"
PLANNED = 12_345_678


def _host(rank: int) -> str:
    return f"gpu-node-a100-{rank:03d}.cluster.example.internal"


def _events(run: str, nan_at: int | None, stream: str) -> list[dict[str, Any]]:
    t0 = time.time() - 30.0  # recent: the run is not silent (no hang) while the test reads it
    out = []
    for rank in (0, 1):
        fields = {"world_size": 2, "planned_steps": PLANNED, "vocab_size": 64}
        start = event("run_start", fields, run=run, rank=rank, stream=f"{stream}{rank}", seq=0, t=t0)
        steps = step_events(
            400,
            run=run,
            rank=rank,
            stream=f"{stream}{rank}",
            loss=lambda i: "NaN" if nan_at is not None and i >= nan_at else 4.1 - 0.001 * i,
        )
        for i, e in enumerate(steps):
            e["time"] = t0 + 1.0 + 0.05 * i
            e["fields"]["step_time"] = 0.05 if rank == 0 else 0.09  # rank 1 is slow: the ranks tables have rows
        for e in (start, *steps):
            e["host"] = _host(rank)
        out += [start, *steps]
    return out


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCollector]:
    coll = Collector.open(CollectorConfig(db=str(tmp_path_factory.mktemp("cols") / "store.sqlite")))
    app = create_app(coll)
    server = ServerThread(app, "127.0.0.1", 0)
    server.start()
    lc = LiveCollector(f"http://127.0.0.1:{server.port}", coll, server)
    for run, nan_at, stream in ((BROKEN, 300, "b"), (CLEAN, None, "c")):
        assert lc.post(batch(_events(run, nan_at, stream)))[0] == 200
    yield lc
    lc.stop()


def _cli(columns: int, *args: str) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run([*TRAINMON, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _whole(out: str, columns: int, texts: list[str]) -> None:
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    for text in texts:
        assert text in out, (text, out)


@pytest.mark.parametrize("columns", [80, 120])
def test_runs(collector: LiveCollector, columns: int) -> None:
    rows = json.loads(_cli(columns, "runs", "--url", collector.url, "--json"))
    texts = []
    for r in rows:
        texts += [r["run"], r["status"], f"{fmt(r['steps_done'])}/{fmt(r['planned_steps'])}", fmt(r["loss"])]
        texts.append(fmt(r["tokens_per_second"]))
    _whole(_cli(columns, "runs", "--url", collector.url), columns, texts)


@pytest.mark.parametrize("columns", [80, 120])
def test_status(collector: LiveCollector, columns: int) -> None:
    st = json.loads(_cli(columns, "status", BROKEN, "--url", collector.url, "--json"))
    texts = [BROKEN, f"{fmt(st['steps_done'])}/{fmt(PLANNED)}", fmt(float(st["loss"])), fmt(st["tokens_per_second"])]
    for r in st["ranks"]:
        texts += [r["host"], fmt(r["step_time"], 3), fmt(r["compute"], 3)]
    _whole(_cli(columns, "status", BROKEN, "--url", collector.url), columns, texts)


@pytest.mark.parametrize("columns", [80, 120])
def test_postmortem(collector: LiveCollector, columns: int) -> None:
    s = json.loads(_cli(columns, "postmortem", BROKEN, "--url", collector.url, "--json"))
    texts = [BROKEN, fmt(s["steps"]), fmt(PLANNED), fmt(s["tokens"]), fmt(s["tokens_per_second"])]
    for r in s["ranks"]:
        texts += [r["host"], f"{fmt(r['step_time'], 3)} s", f"{fmt(r['compute'], 3)} s"]
    out = _cli(columns, "postmortem", BROKEN, "--url", collector.url)
    _whole(out, columns, texts)
    assert out.count("steps trained on non-finite values") == 1  # the NaN on both ranks is one cost
