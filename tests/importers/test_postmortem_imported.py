"""The post-mortem of imported logs (trainmon issue 14): what a foreign log cannot say is said to be unknown.

* A clock-less log gets a synthetic clock (one second per logged entry): every figure made of
  time (wall time, failure rate, MTBF, tokens/s, the Young/Daly interval) is null, with its reason
  under ``summary["unknown"]``, never a number.
* An HF ``checkpoint-N/trainer_state.json`` is a snapshot saved with a checkpoint: the log ends
  there because the file was written then. Not a failed attempt; the status says where it ends.
* HF's ``global_step`` counts from 1: its last logged step 5000 is 5000 steps done, not 5001.
* A log that starts mid-run (a resumed job's new log) is said to start at its first step.
* Runs with a real clock (trainmon's own JSONL) keep their numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.events import event, step_events
from tests.real_log_types import REAL_LOGS
from trainmon.monitor.analysis.postmortem import import_file, optimal_checkpoint_interval, summarize
from trainmon.monitor.store.storage import Storage

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
LOGS = REAL_LOGS

# Figures made of time: null on a synthetic clock, each with its reason in summary["unknown"].
CLOCK_FIGURES = (
    "duration_seconds",
    "checkpoint.failure_rate_per_hour",
    "checkpoint.mtbf_seconds",
    "checkpoint.optimal_interval_seconds",
    "checkpoint.optimal_interval_young_seconds",
    "checkpoint.optimal_interval_steps",
)


def _hf_state(
    path: Path,
    *,
    steps: range,
    max_steps: int,
    global_step: int,
    finished: bool = False,
    logging_steps: int | None = None,
    epoch_reset_after: int | None = None,
) -> Path:
    """A ``trainer_state.json`` shaped like the Trainer's: sorted keys, loss/grad_norm/lr/tokens per entry."""
    history: list[dict[str, Any]] = []
    for i, s in enumerate(steps):
        epoch = s / max_steps
        if epoch_reset_after is not None and s > epoch_reset_after:
            epoch -= epoch_reset_after / max_steps  # a resumed streaming run: the epoch starts over
        history.append(
            {
                "epoch": round(epoch, 6),
                "grad_norm": 1.0 + 0.01 * (i % 3),
                "learning_rate": 1e-4,
                "loss": round(2.0 - 0.002 * i, 6),
                "num_input_tokens_seen": 1000 * s,
                "step": s,
            }
        )
    if finished:
        history.append(
            {
                "epoch": 1.0,
                "step": global_step,
                "total_flos": 1.0e15,
                "train_loss": 1.9,
                "train_runtime": 321.5,
                "train_samples_per_second": 10.0,
                "train_steps_per_second": 1.0,
            }
        )
    state = {
        "best_metric": None,
        "best_model_checkpoint": None,
        "epoch": history[-1]["epoch"],
        "global_step": global_step,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": history,
        "logging_steps": logging_steps if logging_steps is not None else steps.step,
        "max_steps": max_steps,
        "num_train_epochs": 1,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2, sort_keys=True))
    return path


def _summary(path: Path) -> dict[str, Any]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    return summarize(storage, run)


def _cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*TRAINMON, "postmortem", str(path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _row(text: str, label: str) -> str:
    """The overview line that starts with ``label`` (rich prints it as ``label   value``)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(label)]
    assert lines, f"no {label!r} row in:\n{text}"
    return lines[0]


def _snapshot(tmp_path: Path) -> Path:
    """``checkpoint-80/trainer_state.json`` of a 200-step run, logged every 10 steps."""
    return _hf_state(
        tmp_path / "out" / "checkpoint-80" / "trainer_state.json",
        steps=range(10, 81, 10),
        max_steps=200,
        global_step=80,
    )


def _assert_clock_unknown(s: dict[str, Any]) -> None:
    unknown = s["unknown"]
    for key in CLOCK_FIGURES:
        section, _, name = key.rpartition(".")
        value = (s[section] if section else s)[name]
        assert value is None, (key, value)
        assert "synthetic" in unknown[key], (key, unknown.get(key))
    for a in s["attempts_detail"]:
        assert a["started_at"] is None and a["ended_at"] is None  # synthetic timestamps are not shown as times


# -- a checkpoint snapshot is not a failure ------------------------------------------------------


def test_checkpoint_snapshot_is_not_a_failed_attempt(tmp_path: Path) -> None:
    s = _summary(_snapshot(tmp_path))
    assert s["attempts"] == 1 and s["failures"] == 0 and s["checkpoint"]["failures"] == 0
    (attempt,) = s["attempts_detail"]
    assert attempt["failed"] is False and attempt["status"] == "unknown"  # not "interrupted", not "finished"
    assert s["status"] == "unknown"
    assert s["ends_at_checkpoint"] == 80
    detail = s["status_detail"]
    assert "checkpoint" in detail and "80" in detail and "200" in detail and "unknown" in detail, detail


def test_snapshot_in_the_terminal_and_json(tmp_path: Path) -> None:
    path = _snapshot(tmp_path)
    js = json.loads(_cli(path, "--json").stdout)
    assert js["failures"] == 0 and js["status"] == "unknown"
    _assert_clock_unknown(js)
    assert js["tokens_per_second"] is None and "tokens_per_second" in js["unknown"]
    human = _cli(path).stdout
    assert "(0 failed)" in _row(human, "attempts")
    status = _row(human, "status")
    assert "checkpoint" in status and "80" in status and "200" in status and "unknown" in status, status
    assert _row(human, "steps").split()[1:4] == ["80", "of", "200"]
    for label in ("wall time", "mean tokens/s", "failure rate", "optimal interval"):
        row = _row(human, label)
        assert "unknown" in row and "synthetic" in row, row
        assert not any(ch.isdigit() for ch in row.replace("(Daly)", "")), row  # no number on a made-up clock


# -- synthetic time ------------------------------------------------------------------------------


def test_synthetic_time_makes_every_time_figure_unknown(tmp_path: Path) -> None:
    path = _hf_state(tmp_path / "done" / "trainer_state.json", steps=range(10, 51, 10), max_steps=50, global_step=50)
    s = _summary(path)
    assert s["status"] == "finished"
    _assert_clock_unknown(s)
    # the log counts its tokens (num_input_tokens_seen) but not its time: tokens known, tokens/s not
    assert s["tokens"] and s["tokens_per_second"] is None and "synthetic" in s["unknown"]["tokens_per_second"]


def test_failures_on_a_synthetic_clock_have_no_rate(tmp_path: Path) -> None:
    """A resume (HF's epoch reset) ends an attempt without a clean end: a failure is counted, but
    one second per logged entry is no time base for a rate, an MTBF or Young/Daly."""
    path = _hf_state(
        tmp_path / "resumed" / "trainer_state.json",
        steps=range(10, 201, 10),
        max_steps=200,
        global_step=200,
        finished=True,
        epoch_reset_after=100,
    )
    s = _summary(path)
    assert s["attempts"] == 2 and s["failures"] == 1
    _assert_clock_unknown(s)
    assert "synthetic" in s["checkpoint"]["optimal_note"]


# -- HF step counting -----------------------------------------------------------------------------


def test_hf_steps_are_the_trainers_count(tmp_path: Path) -> None:
    """global_step counts from 1: logged step 50 of max_steps 50 is 50 steps done."""
    path = _hf_state(
        tmp_path / "done" / "trainer_state.json", steps=range(10, 51, 10), max_steps=50, global_step=50, finished=True
    )
    s = _summary(path)
    assert (s["steps"], s["planned_steps"], s["last_step"], s["step_base"]) == (50, 50, 50, 1)
    assert _row(_cli(path).stdout, "steps").split()[1:4] == ["50", "of", "50"]


def test_hf_steps_in_runs_and_status_are_the_trainers_count(tmp_path: Path) -> None:
    """``trainmon runs`` and ``trainmon status`` count like the post-mortem: 50 of 50, not 51/50."""
    path = _hf_state(
        tmp_path / "done" / "trainer_state.json", steps=range(10, 51, 10), max_steps=50, global_step=50, finished=True
    )
    db = tmp_path / "store.sqlite"
    env = {**os.environ, "COLUMNS": "200"}
    subprocess.run([*TRAINMON, "import", str(path), "--db", str(db)], check=True, capture_output=True, env=env)
    runs = subprocess.run([*TRAINMON, "runs", "--db", str(db)], check=True, capture_output=True, text=True, env=env)
    assert "50/50" in runs.stdout and "51/50" not in runs.stdout
    status = subprocess.run(
        [*TRAINMON, "status", "done", "--db", str(db)], check=True, capture_output=True, text=True, env=env
    )
    assert "step 50/50" in status.stdout, status.stdout


def test_tokens_of_a_log_written_every_n_steps_count_every_step(tmp_path: Path) -> None:
    """Logged every 10 steps at 1,000 tokens per step: 50,000 tokens over 50 steps, not the 4,000
    that summing the five entries' per-step figures gave (the first has no difference to take)."""
    path = _hf_state(
        tmp_path / "sparse" / "trainer_state.json", steps=range(10, 51, 10), max_steps=50, global_step=50, finished=True
    )
    assert _summary(path)["tokens"] == 50_000


def test_hf_steps_after_the_last_logged_one_count(tmp_path: Path) -> None:
    """Logged every 25 steps up to 16050, finished at global_step 16058 (file 24): 16058 steps done."""
    path = _hf_state(
        tmp_path / "medbot" / "trainer_state.json",
        steps=range(25, 16051, 25),
        max_steps=16058,
        global_step=16058,
        finished=True,
    )
    s = _summary(path)
    assert (s["steps"], s["last_step"], s["status"]) == (16058, 16050, "finished")


# -- a log that starts mid-run ----------------------------------------------------------------


def test_hf_log_starting_mid_run_says_where(tmp_path: Path) -> None:
    path = _hf_state(
        tmp_path / "late" / "trainer_state.json", steps=range(140750, 141001, 10), max_steps=200000, global_step=141000
    )
    s = _summary(path)
    assert s["first_step"] == 140750 and s["starts_mid_run"] is True
    assert any("starts at step 140750" in n for n in s["notes"]), s["notes"]
    assert "starts at step 140750" in _row(_cli(path).stdout, "steps")
    # issue 22: steps counts what the log covers (its 26 windows of 10 steps), run_steps the trainer's count
    assert (s["steps"], s["run_steps"]) == (260, 141000)


def test_a_log_that_starts_at_a_resume_counts_the_steps_it_covers(tmp_path: Path) -> None:
    """Issue 22: a torchtitan log beginning right after 'Loading the checkpoint at step 5000' reported twice the
    steps it covers (5,100 for steps 5001-5100)."""
    t = 1.7e9

    def line(at: float, msg: str) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(at))) + ",000"
        return f"[rank0]:[titan] {stamp} - root - INFO - {msg}\n"

    text = line(t, "Starting job: Llama 3 8B training") + line(t + 10, "Loading the checkpoint at step 5000.")
    text += line(t + 15, "Training starts at step 5001.")
    for step in range(5001, 5101):
        text += line(
            t + 15 + 1.5 * (step - 5000),
            f"step: {step}  loss: {3.0 - 0.001 * (step - 5000):7.4f}  grad_norm: {1.0:7.4f}  memory: 45.67GiB(57.71%)  "
            "tps: 5,461  tflops: 316.25  mfu: 31.98%",
        )
    path = tmp_path / "titan.log"
    path.write_text(text)
    s = _summary(path)
    assert (s["steps"], s["run_steps"], s["first_step"], s["last_step"]) == (100, 5100, 5001, 5100)
    assert any("starts at a resume from step 5000" in n for n in s["notes"]), s["notes"]


def test_lightning_csv_starting_mid_run_says_where(tmp_path: Path) -> None:
    """A resumed Lightning job writes a new ``version_N/metrics.csv`` from the step it resumed at."""
    rows = ["epoch,lr-AdamW,step,train_loss_epoch,train_loss_step,val_loss"]
    for k in range(40):
        s = 140749 + 50 * k
        rows += [f",0.0003,{s},,,", f"10,,{s},,{3.0 - 0.001 * k},"]
    path = tmp_path / "lightning_logs" / "version_3" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(rows) + "\n")
    s = _summary(path)
    assert s["first_step"] == 140749 and s["starts_mid_run"] is True
    assert any("starts at step 140749" in n for n in s["notes"]), s["notes"]


@pytest.mark.parametrize(
    ("first", "every", "step_base_file"),
    [(500, 500, "hf"), (10, 10, "hf"), (49, 50, "csv"), (1, 1, "hf")],
    ids=["hf-logging-500", "hf-logging-10", "lightning-0-based", "hf-every-step"],
)
def test_a_log_from_its_first_logging_window_is_not_mid_run(
    tmp_path: Path, first: int, every: int, step_base_file: str
) -> None:
    if step_base_file == "hf":
        path = _hf_state(
            tmp_path / "x" / "trainer_state.json",
            steps=range(first, first + 20 * every, every),
            max_steps=first + 19 * every,
            global_step=first + 19 * every,
        )
    else:
        rows = ["epoch,lr-AdamW,step,train_loss_epoch,train_loss_step,val_loss"]
        rows += [f"0,,{first + every * k},,{3.0 - 0.001 * k}," for k in range(20)]
        path = tmp_path / "version_0" / "metrics.csv"
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(rows) + "\n")
    s = _summary(path)
    assert s["first_step"] == first and s["starts_mid_run"] is False
    assert not any("mid-run" in n for n in s["notes"])


# -- real runs keep their numbers -----------------------------------------------------------


def _real_run() -> list[dict[str, Any]]:
    """trainmon JSONL with a real clock: attempt 0 crashes after step 29 (no run_end), attempt 1 resumes
    from the step-19 checkpoint and finishes at step 39; checkpoints take 0.5 s."""
    t0 = 1_700_000_000.0
    out: list[dict[str, Any]] = []
    a0 = [event("run_start", {"world_size": 1, "planned_steps": 40}, run="real", stream="a0", seq=0, t=t0)]
    for e in step_events(30, run="real", stream="a0"):
        e["time"] = t0 + 1 + e["fields"]["step"]
        a0.append(e)
    for k, s in enumerate((9, 19)):
        a0.append(
            event("checkpoint", {"step": s, "duration": 0.5}, run="real", stream="a0", seq=31 + k, t=t0 + s + 1.5)
        )
    t1 = t0 + 100
    a1 = [
        event("run_start", {"world_size": 1, "planned_steps": 40, "resumed": True}, run="real", stream="a1", t=t1),
        event("resume", {"step": 19, "duration": 1.0}, run="real", stream="a1", seq=1, t=t1 + 0.5),
    ]
    for i, e in enumerate(step_events(20, run="real", stream="a1", start_seq=2)):
        e["fields"]["step"] = 20 + i
        e["time"] = t1 + 1 + i
        a1.append(e)
    for k, s in enumerate((29, 39)):
        a1.append(
            event("checkpoint", {"step": s, "duration": 0.5}, run="real", stream="a1", seq=22 + k, t=t1 + s - 18.5)
        )
    a1.append(event("run_end", {"status": "finished", "step": 39}, run="real", stream="a1", seq=24, t=t1 + 22))
    out = a0 + a1
    out.sort(key=lambda e: e["time"])
    return out


def test_a_real_clock_keeps_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in _real_run()))
    s = json.loads(_cli(path, "--json").stdout)
    assert s["unknown"] == {}
    assert (s["steps"], s["first_step"], s["last_step"], s["step_base"]) == (40, 0, 39, 0)
    assert s["starts_mid_run"] is False and s["status"] == "finished"
    assert s["duration_seconds"] == pytest.approx(122.0)
    assert s["tokens_per_second"] == pytest.approx(512 / 0.05)
    ck = s["checkpoint"]
    assert s["failures"] == ck["failures"] == 1
    assert ck["failure_rate_per_hour"] == pytest.approx(3600 / 122.0)
    assert ck["mtbf_seconds"] == pytest.approx(122.0)
    expected = optimal_checkpoint_interval(0.5, 122.0)
    assert ck["optimal_interval_seconds"] == pytest.approx(expected["daly_seconds"])
    assert ck["optimal_interval_steps"] >= 1
    assert all(a["started_at"] is not None for a in s["attempts_detail"])
    human = _cli(path).stdout
    assert "unknown" not in _row(human, "wall time") and "2.0 min" in _row(human, "wall time")
    assert "/h (MTBF" in _row(human, "failure rate")


# -- the real logs (/work/shared/real-logs) ---------------------------------------------------


def _real(name: str) -> Path:
    path = LOGS / name
    if not path.exists():
        pytest.skip(f"{path} is not available (the shared real-log set is not mounted here)")
    return path


def test_real_partial_checkpoint_snapshot_60(tmp_path: Path) -> None:
    """checkpoint-5000 of max_steps 5260: a snapshot, not a failure; 5000 steps done, not 5001."""
    s = _summary(_real("60_cantillation-evalloss-up-acc-up.json"))
    assert (s["steps"], s["planned_steps"], s["failures"], s["status"]) == (5000, 5260, 0, "unknown")
    assert s["ends_at_checkpoint"] == 5000
    assert "5000" in s["status_detail"] and "5260" in s["status_detail"]
    _assert_clock_unknown(s)


def test_real_deepseek_checkpoint_6000_15() -> None:
    s = _summary(_real("15_deepseek-vl2-ck6000.json"))
    assert (s["steps"], s["planned_steps"], s["failures"], s["status"]) == (6000, 8000, 0, "unknown")
    assert s["ends_at_checkpoint"] == 6000 and s["starts_mid_run"] is False
    _assert_clock_unknown(s)


def test_real_finished_hf_run_counts_like_the_trainer_01() -> None:
    s = _summary(_real("01_whisper-large-v2-ja.json"))
    assert (s["steps"], s["planned_steps"], s["status"], s["failures"]) == (5000, 5000, "finished", 0)
    assert s["first_step"] == 25 and s["starts_mid_run"] is False


@pytest.mark.parametrize("name", ["59_whisper-braj-lr-too-high.json", "44_lightning-slm-v0.csv"])
def test_real_logs_from_their_first_window_are_not_mid_run(name: str) -> None:
    """59 logs every 500 steps (first entry 500); 44 is 0-based, logging every 50 (first entry 49)."""
    s = _summary(_real(name))
    assert s["starts_mid_run"] is False
