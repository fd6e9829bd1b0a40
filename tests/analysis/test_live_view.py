"""`trainmon runs` and `trainmon status [--follow]` against a live collector and against its store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event
from trainmon.monitor.analysis.live_view import sparkline

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
RUN = "live"
PLANNED = 400


def _steps(run: str, rank: int, first: int, n: int, seq0: int, t0: float, slow: float = 1.0) -> list[dict]:
    """Steps of a 2-rank run: rank 1 computes `slow` times longer, rank 0 waits for it in comm."""
    out = []
    for i in range(first, first + n):
        compute = 0.04 * slow
        comm = 0.002 if slow > 1 else 0.04 * 0.5 + 0.002
        ev = event(
            "step",
            {
                "step": i,
                "loss": "NaN" if i == 30 and rank == 0 else 4.0 - 0.005 * i,
                "grad_norm": 1.0,
                "grad_norm_clipped": 1.0,
                "lr": [1e-3],
                "tokens": 1024,
                "step_time": 0.07,
                "phases": {"data": 0.005, "forward": compute * 0.4, "backward": compute * 0.6, "comm": comm},
            },
            run=run,
            rank=rank,
            stream=f"st{rank}",
            seq=seq0 + i - first,
            t=t0 + 0.07 * i,
        )
        out.append(ev)
    return out


def _start(lc: LiveCollector, n: int = 40) -> float:
    t0 = time.time() - 0.07 * n  # the newest step is now: no silence for the hang detector to see
    for rank in (0, 1):
        start = event(
            "run_start",
            {"world_size": 2, "planned_steps": PLANNED, "vocab_size": 64},
            run=RUN,
            rank=rank,
            stream=f"st{rank}",
            seq=0,
            t=t0,
        )
        status, body = lc.post(batch([start, *_steps(RUN, rank, 0, n, 1, t0, slow=1.5 if rank else 1.0)]))
        assert status == 200, body
    return t0


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TRAINMON, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, "COLUMNS": "160"}
    )


@pytest.fixture
def collector(tmp_path: Path):
    lc = start_collector(tmp_path / "store.sqlite")
    yield lc
    lc.stop()


@pytest.mark.parametrize("where", ["url", "db"])
def test_runs_and_status_over_http_and_from_the_store(collector: LiveCollector, tmp_path: Path, where: str) -> None:
    _start(collector)
    src = ["--url", collector.url] if where == "url" else ["--db", str(tmp_path / "store.sqlite")]
    runs = _cli("runs", *src, "--json")
    assert runs.returncode == 0, runs.stderr
    (row,) = json.loads(runs.stdout)
    assert (row["run"], row["status"], row["step"], row["planned_steps"]) == (RUN, "running", 39, PLANNED)
    assert row["tokens_per_second"] == pytest.approx(2 * 1024 / 0.07)
    # nan_inf at step 30; the hang detector may add a silence (the test posts nothing more)
    assert "nan_inf" in row["open_kinds"] and row["open_anomalies"] >= 1
    human = _cli("runs", *src)
    assert human.returncode == 0 and RUN in human.stdout and "40/400" in human.stdout and "nan_inf" in human.stdout

    st = json.loads(_cli("status", RUN, *src, "--json").stdout)
    assert (st["step"], st["planned_steps"], st["attempts"], st["world_size"]) == (39, PLANNED, 1, 2)
    assert st["progress"] == pytest.approx(40 / PLANNED)
    assert st["seconds_per_step"] == pytest.approx(0.07, rel=0.01)
    assert st["eta_seconds"] == pytest.approx((PLANNED - 40) * 0.07, rel=0.01)
    assert len(st["recent"]["loss"]) == 40 and st["recent"]["loss"][30] == "NaN"
    assert sum(st["phases"].values()) == pytest.approx(1.0)
    r0, r1 = st["ranks"]
    assert r1["compute"] / r0["compute"] == pytest.approx(1.5) and r1["comm"] < r0["comm"]
    nan = next(a for a in st["open_anomalies"] if a["kind"] == "nan_inf")
    assert all(a["hint"] for a in st["open_anomalies"])
    assert nan["kind"] == "nan_inf" and nan["first_step"] == 30 and nan["hint"]

    view = _cli("status", RUN, *src)
    assert view.returncode == 0, view.stderr
    for text in (f"run {RUN}", "step 40/400", "ETA", "loss", "tokens/s", "nan_inf", "comm wait", "phases"):
        assert text in view.stdout, text


def test_unknown_run_and_unreachable_collector_are_plain_errors(collector: LiveCollector, tmp_path: Path) -> None:
    missing = _cli("status", "ghost", "--url", collector.url)
    assert missing.returncode == 2 and "no run 'ghost'" in missing.stderr
    missing = _cli("status", "ghost", "--db", str(tmp_path / "store.sqlite"))
    assert missing.returncode == 2 and "no run 'ghost'" in missing.stderr
    down = _cli("runs", "--url", "http://127.0.0.1:9")
    assert down.returncode == 2 and "cannot reach the collector" in down.stderr


def test_read_endpoints(collector: LiveCollector) -> None:
    _start(collector, n=20)
    st = collector.get_json(f"/v1/runs/{RUN}?window=5")
    assert st["recent"]["steps"] == [15, 16, 17, 18, 19]
    rows = collector.get_json(f"/v1/runs/{RUN}/steps?since=16&rank=1")
    assert [r["step"] for r in rows] == [17, 18, 19] and rows[0]["phase_comm"] == pytest.approx(0.002)
    assert collector.get_json(f"/v1/runs/{RUN}/steps?since=19") == []
    assert collector.get(f"/v1/runs/{RUN}/steps?limit=0")[0] == 422
    assert collector.get("/v1/runs/ghost")[0] == 404
    assert collector.get("/v1/runs/ghost/steps")[0] == 404
    paths = collector.get_json("/openapi.json")["paths"]
    assert "/v1/runs/{run}" in paths and "/v1/runs/{run}/steps" in paths


@pytest.mark.parametrize("where", ["url", "db"])
def test_follow_refreshes_while_the_run_goes_on(collector: LiveCollector, tmp_path: Path, where: str) -> None:
    t0 = _start(collector, n=20)
    stop = threading.Event()

    def train() -> None:  # 10 more steps per rank every 0.2 s, then the end of the run
        step = 20
        while not stop.is_set() and step < 120:
            for rank in (0, 1):
                collector.post(batch(_steps(RUN, rank, step, 10, step + 1, t0)))
            step += 10
            time.sleep(0.2)
        for rank in (0, 1):
            end = event("run_end", {"status": "finished", "step": step - 1}, run=RUN, rank=rank, stream=f"st{rank}")
            end["seq"] = step + 1
            collector.post(batch([end]))

    src = ["--url", collector.url] if where == "url" else ["--db", str(tmp_path / "store.sqlite")]
    feeder = threading.Thread(target=train)
    started = time.monotonic()
    feeder.start()
    try:
        proc = _cli("status", RUN, *src, "--follow", "--interval", "0.25", "--max-refreshes", "40", timeout=60)
    finally:
        stop.set()
        feeder.join()
    assert proc.returncode == 0, proc.stderr
    frames = proc.stdout.count(f"run {RUN}")
    assert frames >= 3, proc.stdout[-3000:]
    shown = {int(line.split("step ")[1].split("/")[0]) for line in proc.stdout.splitlines() if f"run {RUN} " in line}
    assert len(shown) >= 3 and max(shown) > 20, shown  # the view moved with the run
    assert "finished" in proc.stdout  # and it stopped by itself when the run ended
    assert time.monotonic() - started < 30


def test_sparkline() -> None:
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([1.0, float("nan"), None, 1.0]) == "▁! ▁"
    assert len(sparkline(list(range(1000)), width=40)) == 40
    assert sparkline([]) == ""


def test_a_resampled_sparkline_keeps_what_stands_out() -> None:
    """Issue 26: a character standing for many steps shows the one furthest from the series' median
    (a chunk's mean drew a one-step spike of 50 among ~1 as a bump of about 3, below a sustained rise to
    5), in either direction (a one-step tokens/s collapse below a slowdown), and a non-finite step
    anywhere in its chunk as '!'."""
    loss = [1.0] * 1000
    loss[800:900] = [5.0] * 100
    loss[300] = 50.0
    line = sparkline(loss, width=50)  # 20 steps a character
    assert line[15] == "█" and set(line[40:45]) == {"▂"}  # the spike on top, the rise far below it
    tokens = [1000.0] * 1000
    tokens[100:200] = [800.0] * 100
    tokens[700] = 10.0
    line = sparkline(tokens, width=50)
    assert line.index("▁") == 35 and line.count("▁") == 1  # the collapse at the bottom, the slowdown above it
    with_nan = [1.0] * 1000
    with_nan[300] = float("nan")
    assert sparkline(with_nan, width=50)[15] == "!"


def test_status_gives_findings_the_whole_width_at_80_columns() -> None:
    """The open anomalies sat in a table column ~24 characters wide at 80 columns: two findings took
    40 lines. Each now reads across the panel, the critical one first."""
    from rich.console import Console

    from trainmon.monitor.analysis.live_view import render_status

    hint = "Check that scheduler.step() runs every step; " * 6
    found = [
        {"kind": "lr_schedule_drift", "severity": "warning", "rank": 0, "first_step": 262, "last_step": 399,
         "message": "LR of param group 0 is 0.00107 at step 399, the declared cosine schedule expects 0.0003",
         "hint": hint},
        {"kind": "nan_inf", "severity": "critical", "rank": 0, "first_step": 360, "last_step": 399,
         "message": "loss (nan) non-finite since step 360", "hint": "suspect the batch at step 360"},
    ]  # fmt: skip
    st = {"run": "demo-20261124-223756", "status": "finished", "step": 399, "planned_steps": 400, "attempts": 1,
          "world_size": 1, "open_anomalies": found}  # fmt: skip
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render_status(st, "sqlite:///x"))
    text = console.export_text()
    assert len(text.splitlines()) < 20, text
    assert text.index("nan_inf") < text.index("lr_schedule_drift")  # the critical one first
    assert "scheduler.step()" in text and "suspect the batch at step 360" in text


@pytest.mark.parametrize(
    ("said", "line"),
    [
        ({"attention": [], "unrecognised": ["blocks.0.mha", "blocks.1.mha"], "lm_head": True},
         "attention logits not measured on blocks.0.mha, blocks.1.mha"),
        ({"attention": ["blocks.0.attn"], "unrecognised": [], "lm_head": False}, "output logits not measured"),
        ({"attention": ["blocks.0.attn"], "unrecognised": [], "lm_head": True}, None),
        (None, None),  # a producer that did not say (an import, another client): nothing claimed
    ],
)  # fmt: skip
def test_status_names_what_the_precursors_do_not_measure(tmp_path: Path, said: dict | None, line: str | None) -> None:
    from rich.console import Console

    from trainmon.monitor.analysis.live_view import render_status, run_status

    lc = start_collector(tmp_path / "db.sqlite")
    try:
        fields = {"world_size": 1, "planned_steps": PLANNED, "vocab_size": 64}
        if said is not None:
            fields["precursors"] = said
        t0 = time.time() - 0.07 * 5
        start = event("run_start", fields, run=RUN, stream="st0", seq=0, t=t0)
        status, body = lc.post(batch([start, *_steps(RUN, 0, 0, 5, 1, t0)]))
        assert status == 200, body
        st = run_status(lc.collector.storage, RUN)
        console = Console(width=120, record=True)
        console.print(render_status(st))
        text = " ".join(console.export_text().replace("│", " ").split())  # the panel wraps long lines
        if line is None:
            assert "instability precursors" not in text
        else:
            assert "instability precursors" in text and line in text, text
    finally:
        lc.stop()
