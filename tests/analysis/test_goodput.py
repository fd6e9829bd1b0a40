"""Goodput: wall time split into productive training and badput by cause (issue 17 item 3).

The ledger is tested on synthetic traces with known clocks (one per cause, and a clean one); the
whole path on the reference trainer: a crash after step 25 with checkpoints every 10 steps, then a
resume, through a JSONL file into ``trainmon postmortem --json``, and through a live collector on
loopback into ``/metrics``; an imported log without a clock has no goodput fraction.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import LiveCollector
from tests.events import event
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.core.goodput import CAUSES, MARKS, Ledger, _columns, _seconds, headline
from trainmon.monitor.store.storage import Storage

NORMAL = {"data": 0.01, "forward": 0.5, "backward": 0.4}


def run_steps(
    ledger: Ledger,
    steps: range,
    t: float,
    *,
    attempt: int = 0,
    dt: Callable[[int], float] = lambda s: 1.0,
    phases: Callable[[int], dict[str, float]] = lambda s: NORMAL,
    hung: Callable[[int], bool] = lambda s: False,
    checkpoint_every: int = 0,
    save_seconds: float = 0.0,
) -> float:
    """Feed ``steps`` as the hooks send them, the first ending at ``t + dt(first)``; the time of the last.

    With ``checkpoint_every`` K, a checkpoint event follows every step s with (s + 1) % K == 0, and
    its save time lies in the next step's ``checkpoint`` phase, as in the reference trainer."""
    for s in steps:
        t += dt(s)
        ph = phases(s)
        ledger.step(attempt, s, t, dt(s), ph.get("data"), ph.get("checkpoint"), ph.get("eval"), hung(s))
        if checkpoint_every and (s + 1) % checkpoint_every == 0:
            ledger.checkpoint(attempt, s, save_seconds, t)
    return t


def shares(result: dict[str, Any]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in result["badput_seconds"].items() if v}


def test_clean_trace_is_productive_after_startup() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(100), 2.0)
    ledger.end(0, end, "finished")
    r = ledger.result()
    assert shares(r) == {"startup": 2.0}
    assert r["productive_seconds"] == pytest.approx(100.0)
    assert r["fraction"] == pytest.approx(100 / 102)
    assert r["recomputed_steps"] == 0 and r["failures"] == 0
    assert set(r["badput_seconds"]) == set(CAUSES)


def test_checkpoint_phase_and_the_final_save() -> None:
    """Saves after steps 9, 19, ...: 0.5 s in the next step's checkpoint phase; the last one (after
    step 99) is in no step: its event's duration counts, up to the end of the attempt."""
    ledger = Ledger()
    ledger.start(0, 0.0)
    saved = {s for s in range(10, 100, 10)}
    end = run_steps(
        ledger,
        range(100),
        0.0,
        dt=lambda s: 1.5 if s in saved else 1.0,
        phases=lambda s: {**NORMAL, "checkpoint": 0.5} if s in saved else NORMAL,
        checkpoint_every=10,
        save_seconds=0.5,
    )
    ledger.end(0, end + 2.5, "finished")
    ledger_result = ledger.result()
    # the last save's event says 0.5 s; the other 2 s after the last step are not explained
    assert shares(ledger_result) == {"checkpoint": 9 * 0.5 + 0.5, "other": 2.0}
    assert ledger_result["productive_seconds"] == pytest.approx(100.0)


def test_eval_phase() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(
        ledger,
        range(60),
        0.0,
        dt=lambda s: 4.0 if s in (20, 40) else 1.0,
        phases=lambda s: {**NORMAL, "eval": 3.0} if s in (20, 40) else NORMAL,
    )
    ledger.end(0, end, "finished")
    assert shares(ledger.result()) == {"eval": 6.0}


def test_data_stall_is_the_excess_the_data_phase_explains() -> None:
    """Steps 50-52 wait 3 s for data; step 53's data is 3 s late too, but the step is only 1 s long
    beyond the median: 1 s of data stall, not 3."""
    ledger = Ledger()
    ledger.start(0, 0.0)
    slow = {50: 4.0, 51: 4.0, 52: 4.0, 53: 2.0}
    end = run_steps(
        ledger,
        range(80),
        0.0,
        dt=lambda s: slow.get(s, 1.0),
        phases=lambda s: {**NORMAL, "data": 3.01} if s in slow else NORMAL,
    )
    ledger.end(0, end, "finished")
    r = ledger.result()
    assert shares(r) == {"data_stall": 3 * 3.0 + 1.0}
    assert r["productive_seconds"] == pytest.approx(80.0)


def test_slow_steps_beyond_the_runs_median() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(80), 0.0, dt=lambda s: 3.0 if s in (30, 31, 70) else 1.0)
    ledger.end(0, end, "finished")
    assert shares(ledger.result()) == {"slow_steps": 6.0}


def test_a_log_entry_covering_many_steps_is_compared_with_as_many_medians() -> None:
    """A log written every 10 steps: an entry 10 s after the previous one is on time."""
    ledger = Ledger()
    ledger.start(0, 10.0)
    t = 0.0
    for s in range(10, 510, 10):
        t += 25.0 if s == 300 else 10.0
        ledger.step(0, s, t, None)
    ledger.end(0, t, "unknown")
    assert shares(ledger.result()) == {"slow_steps": 15.0}


def test_hang_takes_the_excess_of_the_hung_step_and_a_hung_end() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(60), 0.0, dt=lambda s: 31.0 if s == 40 else 1.0, hung=lambda s: s == 40)
    ledger.end(0, end + 20.0, "failed", hung=True)  # stuck again after step 59, then killed
    r = ledger.result()
    assert shares(r) == {"hang": 30.0 + 20.0}
    assert r["failures"] == 1 and r["recomputed_steps"] == 0


def test_failure_recomputes_the_steps_after_the_checkpoint_and_pays_the_restart() -> None:
    """Checkpoints after steps 9 and 19, a crash 0.5 s after step 25, a restart 5 s later that
    resumes after step 19 and starts stepping 1 s after its run_start: steps 20-25 ran twice."""
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(26), 0.0, checkpoint_every=10)
    ledger.end(0, end + 0.5, "interrupted")
    restart = end + 0.5 + 5.0
    ledger.start(1, restart)
    end = run_steps(ledger, range(20, 40), restart + 1.0, attempt=1, checkpoint_every=10)
    ledger.end(1, end, "finished")
    r = ledger.result()
    assert r["recomputed_steps"] == 6
    assert shares(r) == {"recomputation": 6.0 + 0.5, "restart": 5.0, "startup": 1.0}
    assert r["productive_seconds"] == pytest.approx(40.0)  # 20 kept steps per attempt
    assert r["failures"] == 1
    assert r["wall_seconds"] == pytest.approx(end)


def test_lost_work_without_a_checkpoint_event_is_interpolated_by_step() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(26), 0.0)
    ledger.end(0, end, "failed")
    ledger.start(1, end + 1.0)
    run_steps(ledger, range(20, 30), end + 1.0, attempt=1)
    r = ledger.result()
    assert r["recomputed_steps"] == 6
    assert r["badput_seconds"]["recomputation"] == pytest.approx(6.0)


def test_resume_points_are_bounded_and_a_resume_from_the_newest_is_exact() -> None:
    """200 checkpoints: the ledger keeps the newest MARKS of them; the resume uses one of those."""
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(2000), 0.0, dt=lambda s: 2.0 if s >= 1990 else 1.0, checkpoint_every=10)
    ledger.end(0, end, "failed")
    assert len(ledger._attempts[0].marks) <= MARKS + 1
    ledger.start(1, end)
    run_steps(ledger, range(1990, 2000), end, attempt=1, dt=lambda s: 2.0)
    r = ledger.result()
    assert r["recomputed_steps"] == 10
    assert r["badput_seconds"]["recomputation"] == pytest.approx(20.0)  # the slow last 10 steps, exactly


def test_a_resume_from_step_zero_recomputes_everything() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(26), 0.0, checkpoint_every=10)
    ledger.start(1, end + 1.0)  # the first attempt ended silently: lost
    run_steps(ledger, range(0, 30), end + 1.0, attempt=1)
    r = ledger.result()
    assert r["recomputed_steps"] == 26 and r["failures"] == 1
    assert r["badput_seconds"]["recomputation"] == pytest.approx(26.0)
    assert r["badput_seconds"]["restart"] == pytest.approx(1.0)


def test_a_running_attempt_counts_to_its_last_step_unless_hung() -> None:
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(30), 0.0)
    assert ledger.result(now=end + 50.0)["wall_seconds"] == pytest.approx(30.0)
    hung = ledger.result(now=end + 50.0, hung=True)
    assert hung["badput_seconds"]["hang"] == pytest.approx(50.0)


def test_headline_names_the_losses_largest_first() -> None:
    summary = {
        "goodput": {
            "fraction": 0.81,
            "recomputed_steps": 31,
            "failures": 2,
            "wall_seconds": 100.0,
            "badput_seconds": {**dict.fromkeys(CAUSES, 0.0), "recomputation": 9.0, "checkpoint": 6.0, "startup": 4.0},
        }
    }
    assert headline(summary) == "81%: 9% recomputation after 2 failures (31 steps), 6% checkpointing, 4% startup"
    assert headline({"goodput": None}) is None


# -- the reference trainer -------------------------------------------------------------------------


def trainer(out: Path, collector: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "trainmon.reference_trainer", "--run", "R", "--steps", "40", "--out", str(out)]
    cmd += ["--checkpoint-every", "10", "--threads", "1", "--collector", collector, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def postmortem_json(target: str, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "trainmon.monitor.cli", "postmortem", target, *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_crash_and_resume_recompute_the_steps_after_the_last_checkpoint(tmp_path: Path) -> None:
    """``--stop-at 25`` with checkpoints after steps 9 and 19: the resume runs steps 20-25 again."""
    events = tmp_path / "events.jsonl"
    trainer(tmp_path / "out", f"file://{events}", "--stop-at", "25")
    trainer(tmp_path / "out", f"file://{events}", "--resume", str(tmp_path / "out"))
    s = postmortem_json(str(events))
    g = s["goodput"]
    assert g["recomputed_steps"] == 25 - 19
    assert g["failures"] == 1 and s["attempts"] == 2
    assert 0 < g["fraction"] < 1
    bad = g["badput_seconds"]
    assert bad["recomputation"] > 0 and bad["restart"] > 0 and bad["checkpoint"] > 0
    assert g["productive_seconds"] + sum(bad.values()) == pytest.approx(g["wall_seconds"])
    assert g["wall_seconds"] == pytest.approx(s["duration_seconds"], rel=1e-6)
    text = subprocess.run(
        [sys.executable, "-m", "trainmon.monitor.cli", "postmortem", str(events)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("goodput")]
    assert "recomputation after 1 failure (6 steps)" in line, line


@pytest.mark.slow
def test_a_clean_run_loses_nothing_to_failures(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    trainer(tmp_path / "out", f"file://{events}")
    g = postmortem_json(str(events))["goodput"]
    bad = g["badput_seconds"]
    assert g["recomputed_steps"] == 0 and g["failures"] == 0
    assert bad["recomputation"] == bad["restart"] == bad["hang"] == 0
    # the rest is timing on a shared CPU (slow steps under contention): only its bounds are asserted
    assert 0 < g["fraction"] <= 1


@pytest.mark.slow
def test_live_metrics_agree_with_the_postmortem(live_collector: LiveCollector, tmp_path: Path) -> None:
    trainer(tmp_path / "out", live_collector.url, "--stop-at", "25")
    trainer(tmp_path / "out", live_collector.url, "--resume", str(tmp_path / "out"))
    _, body = live_collector.get("/metrics")
    exposition = body.decode()
    assert 'trainmon_recomputed_steps{run="R"} 6.0' in exposition
    ratio = float(re.search(r'^trainmon_goodput_ratio\{run="R"\} (\S+)$', exposition, re.M)[1])
    causes = dict(re.findall(r'^trainmon_badput_seconds\{cause="(\w+)",run="R"\} (\S+)$', exposition, re.M))
    assert set(causes) == set(CAUSES)
    assert float(causes["recomputation"]) > 0 and float(causes["restart"]) > 0
    g = summarize(live_collector.collector.storage, "R")["goodput"]
    assert ratio == pytest.approx(g["fraction"], rel=1e-9)
    for cause, secs in causes.items():
        assert float(secs) == pytest.approx(g["badput_seconds"][cause], abs=1e-9), cause


def test_a_stall_the_hang_detector_names_is_hang_time_in_the_postmortem(tmp_path: Path) -> None:
    """Steps 1 s apart, then 901 s before step 50: the hang anomaly covers step 50, and its 900 s
    beyond the median step are hang time, not slow steps."""
    t0 = 1.7e9
    events = [event("run_start", {"world_size": 1, "planned_steps": 100}, seq=0, t=t0)]
    t = t0
    for s in range(100):
        dt = 901.0 if s == 50 else 1.0
        t += dt
        fields = {"step": s, "loss": 3.0, "step_time": dt, "phases": {"data": 0.01, "forward": 0.5}}
        events.append(event("step", fields, seq=s + 1, t=t))
    events.append(event("run_end", {"status": "finished", "step": 99}, seq=101, t=t))
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events))
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    s = summarize(storage, run)
    assert [(a["kind"], a["first_step"]) for a in s["anomalies"]] == [("hang", 50)]
    g = s["goodput"]
    assert shares(g) == {"hang": 900.0}
    assert g["fraction"] == pytest.approx(100 / 1000)


# -- imported logs ---------------------------------------------------------------------------------


def test_an_imported_log_without_a_clock_has_no_goodput_fraction(tmp_path: Path) -> None:
    """A ``trainer_state.json`` has steps but no times: the importer's clock is synthetic."""
    history = [{"step": s, "loss": 2.0 - 0.01 * s, "learning_rate": 1e-4, "epoch": s / 50} for s in range(5, 51, 5)]
    state = {"global_step": 50, "max_steps": 50, "logging_steps": 5, "log_history": history}
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(state))
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    s = summarize(storage, run)
    g = s["goodput"]
    assert g["fraction"] is None and g["badput_seconds"] is None and g["wall_seconds"] is None
    assert g["recomputed_steps"] == 0
    assert "synthetic" in s["unknown"]["goodput.fraction"]
    assert headline(s).startswith("unknown (the log has no clock")


def test_the_last_attempt_interrupted_is_how_the_run_ended_not_a_failure() -> None:
    """A Ctrl-C or a scheduler's time limit ends the run: no failure (a failure rate from it would be
    invented); the same interruption followed by another attempt is one (above: its work was lost)."""
    ledger = Ledger()
    ledger.start(0, 0.0)
    end = run_steps(ledger, range(30), 0.0, checkpoint_every=10)
    ledger.end(0, end + 0.5, "interrupted")
    r = ledger.result()
    assert r["failures"] == 0 and shares(r).get("recomputation", 0.0) == 0.0


_cell = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**53), 2**53),
    st.booleans(),
    st.sampled_from(["NaN", "nan", "-1.5", "abc", ""]),
)


@settings(max_examples=400)
@given(st.lists(st.tuples(st.integers(0, 2**53), st.floats(0, 2.0**32), _cell, _cell, _cell, _cell), min_size=1))
def test_a_table_read_at_once_equals_its_columns_read_one_by_one(rows: list[tuple[Any, ...]]) -> None:
    """The ledger's rows as one array (SQLite's rows: numbers, None, 'NaN') and, where a cell is not a number,
    column by column: the same steps, times and durations as the column-by-column conversion always gave."""
    cols = list(zip(*rows, strict=True))
    expected = (
        np.array(cols[0], dtype=np.int64),
        np.array(cols[1], dtype=float),
        *(_seconds(c) for c in cols[2:6]),
    )
    got = _columns(rows)
    assert got[0].dtype == np.int64
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
