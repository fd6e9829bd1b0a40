"""LLaMA-Factory ``trainer_log.jsonl`` and ms-swift ``logging.jsonl``: small logs written here with
known values, then the real logs 46-49 and 57 of ``/work/shared/real-logs`` against their manifest.

The small logs pin what the importer reads (steps, losses, LR, grad norms, evals, planned steps,
status, the durations taken from the elapsed time) and the traps of these formats: eval and
closing lines repeat the step of a train line (not a resume), ms-swift's last line repeats the
whole history (not a second run), and a JSON-lines file of an unknown format fails in one line
instead of one warning per row.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.real_log_types import REAL_LOGS
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import FORMATS, ImportFormatError, detect_format, read_events
from trainmon.monitor.importers.jsonlog import _LINE_LIMIT, parse_duration
from trainmon.monitor.store.storage import Storage

LOGS = REAL_LOGS
MANIFEST = json.loads((LOGS / "manifest.json").read_text()) if (LOGS / "manifest.json").exists() else []
BY_FILE = {m["file"]: m for m in MANIFEST}
REAL = [
    "46_llamafactory-qwen25-medical.jsonl",
    "47_llamafactory-legal-nan-as-zero.jsonl",
    "48_llamafactory-rm-killed-early.jsonl",
    "49_llamafactory-finquant-nowarmup.jsonl",
    "57_ms-swift-gemma4-gn-spikes.jsonl",
]
needs_real_logs = pytest.mark.skipif(
    not all(name in BY_FILE and (LOGS / name).exists() for name in REAL),
    reason=f"{LOGS} (the real-log corpus with manifest.json and files 46-49, 57) is not available here",
)


def _write(path: Path, rows: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _hms(seconds: int) -> str:
    """``str(timedelta)`` as LLaMA-Factory prints it."""
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _swift_time(seconds: int) -> str:
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return " ".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v or u == "s")


def _steps(path: Path) -> list[dict[str, Any]]:
    return [e.fields for e in read_events(path) if e.kind == "step"]


def _evals(path: Path) -> list[dict[str, Any]]:
    return [e.fields for e in read_events(path) if e.kind == "eval"]


def _summary(path: Path) -> dict[str, Any]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    return summarize(storage, run)


# --- LLaMA-Factory -----------------------------------------------------------------------------


def _lf_rows(total: int = 60, upto: int = 60, *, closing: bool = True) -> list[dict[str, Any]]:
    """Train lines every 10 steps (20 s each), an eval at step 30 (taking 100 s), a closing line."""
    rows: list[dict[str, Any]] = []
    t = 0
    for step in range(10, upto + 1, 10):
        t += 20
        rows.append(
            {
                "current_steps": step,
                "total_steps": total,
                "loss": round(3.0 - step / 100, 4),
                "lr": step * 1e-6,
                "epoch": step / 30,
                "percentage": round(step / total * 100, 2),
                "elapsed_time": _hms(t),
                "remaining_time": "0:01:00",
            }
        )
        if step == 30:
            t += 100
            rows.append(
                {
                    "current_steps": 30,
                    "total_steps": total,
                    "eval_loss": 2.5,
                    "epoch": 1.0,
                    "percentage": 50.0,
                    "elapsed_time": _hms(t),
                    "remaining_time": "0:01:00",
                }
            )
    if closing:
        rows.append(
            {
                "current_steps": upto,
                "total_steps": total,
                "epoch": upto / 30,
                "percentage": 100.0,
                "elapsed_time": _hms(t + 1),
                "remaining_time": "0:00:00",
            }
        )
    return rows


def test_llamafactory_values(tmp_path: Path) -> None:
    path = _write(tmp_path / "trainer_log.jsonl", _lf_rows())
    assert detect_format(path) == "llamafactory_trainer_log"
    steps = _steps(path)
    assert [s["step"] for s in steps] == [10, 20, 30, 40, 50, 60]
    assert [s["loss"] for s in steps] == [2.9, 2.8, 2.7, 2.6, 2.5, 2.4]
    assert [s["lr"] for s in steps] == [[pytest.approx(k * 1e-5)] for k in range(1, 7)]
    assert all("grad_norm" not in s for s in steps)
    # 20 s per 10 steps; the window after the eval is timed from the eval line (eval time excluded).
    assert [s.get("step_time") for s in steps] == [None, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert _evals(path) == [{"step": 30, "loss": 2.5, "duration": 100.0}]
    s = _summary(path)
    assert s["attempts"] == 1 and s["resumes"] == []  # eval and closing lines repeat steps 30 and 60
    assert s["planned_steps"] == 60 and s["status"] == "finished"
    assert s["steps_logged"] == 6 and s["final_eval_loss"] == 2.5
    start = next(e for e in read_events(path) if e.kind == "run_start").fields
    assert start["framework"] == "llamafactory" and start["config"]["synthetic_time"] is True
    assert start["config"]["logging_steps"] == 10


def test_llamafactory_stopped_run_and_newer_keys(tmp_path: Path) -> None:
    rows = _lf_rows(total=600, upto=40, closing=False)
    for r in rows:
        if "loss" in r:
            r["learning_rate"] = r.pop("lr")  # older LLaMA-Factory spelling
            r["total_tokens"] = r["current_steps"] * 1000
            r["throughput"] = 500.0
            r["accuracy"] = 0.75
    path = _write(tmp_path / "trainer_log.jsonl", rows)
    steps = _steps(path)
    assert [s["lr"][0] for s in steps] == pytest.approx([1e-5, 2e-5, 3e-5, 4e-5])
    assert [s.get("tokens") for s in steps] == [None, 1000, 1000, 1000]
    s = _summary(path)
    assert s["status"] == "interrupted" and s["planned_steps"] == 600 and s["attempts"] == 1
    start = next(e for e in read_events(path) if e.kind == "run_start").fields
    assert start["config"]["ignored_keys"] == ["accuracy"]
    assert any("ends at step 40 of 600" in n for n in start["config"]["notes"])


def test_llamafactory_resume_is_an_attempt(tmp_path: Path) -> None:
    first = _lf_rows(upto=30, closing=False)
    # Relaunched from the checkpoint at 30: the step goes on, the elapsed time starts again.
    second = [
        {"current_steps": s, "total_steps": 60, "loss": 2.0, "lr": 1e-5, "epoch": s / 30, "elapsed_time": _hms(t)}
        for s, t in ((40, 25), (50, 45), (60, 65))
    ]
    path = _write(tmp_path / "trainer_log.jsonl", first + second)
    s = _summary(path)
    assert s["attempts"] == 2
    starts = [e.fields for e in read_events(path) if e.kind == "run_start"]
    assert starts[1]["resumed"] is True and "elapsed time went back" in starts[1]["config"]["attempt_inferred_from"]
    # The step going back (a restart without the checkpoint) is an attempt too, once.
    again = _write(tmp_path / "again.jsonl", first + _lf_rows(upto=60))
    assert _summary(again)["attempts"] == 2


# --- ms-swift ----------------------------------------------------------------------------------


def _swift_row(step: int, max_steps: int) -> dict[str, Any]:
    elapsed = 2.5 * step + (12.5 if step > 4 else 0.0)  # 2.5 s per step, a 12.5 s eval after step 4
    return {
        "loss": round(2.0 - step / 100, 8),
        "grad_norm": 1.0 + step / 10,
        "learning_rate": round(1e-5 * step / max_steps, 8),
        "token_acc": 0.6,
        "epoch": round(step / max_steps, 8),
        "global_step/max_steps": f"{step}/{max_steps}",
        "percentage": f"{step / max_steps * 100:.2f}%",
        "elapsed_time": _swift_time(round(elapsed)),
        "remaining_time": "1m 0s",
        "memory(GiB)": 20.5,
        "train_speed(s/it)": round(elapsed / step, 6),
    }


def _swift_log(path: Path, max_steps: int, upto: int, *, end: bool = True, history_pad: int = 0) -> Path:
    train = [_swift_row(s, max_steps) for s in range(1, upto + 1)]
    history = [{"loss": r["loss"], "grad_norm": r["grad_norm"], "step": s} for s, r in enumerate(train, 1)]
    history += [{"loss": 1.0, "step": upto, "pad": "x" * 100} for _ in range(history_pad)]
    rows = list(train)
    rows.insert(
        4,
        {
            "eval_loss": 1.5,
            "eval_token_acc": 0.7,
            "eval_runtime": 12.5,
            "eval_samples_per_second": 8.0,
            "epoch": 0.4,
            "global_step/max_steps": f"4/{max_steps}",
            "elapsed_time": "23s",  # 22.5 s, rounded; eval lines have no train_speed
        },
    )
    if end:
        rows.append(
            {
                "train_runtime": upto * 2.5 + 12.5,
                "train_loss": 1.9,
                "epoch": 1.0,
                "global_step/max_steps": f"{upto}/{max_steps}",
                "elapsed_time": _swift_time(round(upto * 2.5 + 12.5)),
            }
        )
    summary = {"model_parameter_info": "Tiny: 1.0M Params", "global_step": upto, "log_history": history, "memory": {}}
    return _write(path, rows, json.dumps(summary) + "\n")


def test_ms_swift_values(tmp_path: Path) -> None:
    path = _swift_log(tmp_path / "logging.jsonl", max_steps=10, upto=10)
    assert detect_format(path) == "ms_swift_logging"  # the short log's summary object is in the head: not HF
    steps = _steps(path)
    assert [s["step"] for s in steps] == list(range(1, 11))  # the summary's log_history is not imported again
    assert [s["loss"] for s in steps] == pytest.approx([2.0 - k / 100 for k in range(1, 11)])
    assert [s["grad_norm"] for s in steps] == pytest.approx([1.0 + k / 10 for k in range(1, 11)])
    assert [s["lr"][0] for s in steps] == pytest.approx([1e-6 * k for k in range(1, 11)])
    # train_speed(s/it) x steps gives the elapsed time to the millisecond: 2.5 s per step; the
    # window after the eval starts at the eval line's whole-second clock, too coarse: not timed.
    times = [s.get("step_time") for s in steps]
    assert [t is None for t in times] == [True, False, False, False, True, False, False, False, False, False]
    assert [t for t in times if t is not None] == pytest.approx([2.5] * 8, abs=1e-4)
    assert _evals(path) == [{"step": 4, "loss": 1.5, "metrics": {"token_acc": 0.7}, "duration": 12.5}]
    s = _summary(path)
    assert s["attempts"] == 1 and s["steps_logged"] == 10
    assert s["planned_steps"] == 10 and s["status"] == "finished"
    cfg = next(e for e in read_events(path) if e.kind == "run_start").fields["config"]
    assert cfg["model_parameter_info"] == "Tiny: 1.0M Params" and cfg["train_runtime_seconds"] == 37.5
    assert "token_acc" in cfg["ignored_keys"]


def test_ms_swift_huge_summary_line_is_skipped_not_loaded(tmp_path: Path) -> None:
    path = _swift_log(tmp_path / "logging.jsonl", max_steps=50, upto=8, end=False, history_pad=2000)
    assert len(path.read_text().splitlines()[-1]) > 3 * _LINE_LIMIT
    steps = _steps(path)
    assert [s["step"] for s in steps] == list(range(1, 9))
    s = _summary(path)
    # No end-of-train line, and the summary says global_step 8 of 50: stopped early.
    assert s["status"] == "interrupted" and s["planned_steps"] == 50 and s["attempts"] == 1


def test_durations() -> None:
    assert parse_duration("0:00:32") == 32
    assert parse_duration("6:48:06") == 6 * 3600 + 48 * 60 + 6
    assert parse_duration("3 days, 17:51:32") == 3 * 86400 + 17 * 3600 + 51 * 60 + 32
    assert parse_duration("1 day, 0:00:01") == 86401
    assert parse_duration("1h 13m 46s") == 3600 + 13 * 60 + 46
    assert parse_duration("6s") == 6 and parse_duration("0s") == 0 and parse_duration("31m 14s") == 1874
    assert parse_duration("1d 2h") == 93600
    for bad in ("", "soon", "12 parsecs", None, "1h 2x"):
        assert parse_duration(bad) is None


# --- unknown formats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "shown"),
    [
        ("other.jsonl", "".join(json.dumps({"it": i, "objective": 1.0}) + "\n" for i in range(3000)), '"it"'),
        ("notes.txt", "hello world\nthis is not a log\n" * 500, "'hello world'"),
        ("long.log", "x" * 500 + "\n", "x" * 120 + "..."),
    ],
)
def test_unknown_file_is_one_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, content: str, shown: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with caplog.at_level(logging.WARNING, "trainmon.import"), pytest.raises(ImportFormatError) as err:
        read_events(path)
    message = str(err.value)
    assert "\n" not in message and "unrecognised log format" in message
    for tried in ("trainmon JSONL", "trainer_state.json", "LLaMA-Factory", "ms-swift", "TensorBoard", "CSV", "llm.c"):
        assert tried in message
    assert shown in message and "x" * 121 not in message
    assert caplog.records == []  # said once, by the error; nothing per line


def test_damaged_spool_warns_a_few_times_not_per_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "spool.jsonl"
    path.write_text("garbage{\n" * 500)
    assert detect_format(path) == "jsonl"  # a damaged trainmon spool still goes to its reader
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        assert list(read_events(path)) == []
    assert 1 < len(caplog.records) <= 12 and "500 unreadable lines" in caplog.records[-1].getMessage()


def test_formats_are_registered() -> None:
    assert {"llamafactory_trainer_log", "ms_swift_logging"} <= set(FORMATS)


# --- the real logs -----------------------------------------------------------------------------


@needs_real_logs
@pytest.mark.parametrize("name", REAL)
def test_real_log_round_trip(name: str) -> None:
    m = BY_FILE[name]
    path = LOGS / name
    steps = [s["step"] for s in _steps(path)]
    assert len(steps) == m["entries"] == len(set(steps))
    assert steps[0] == m["first_step"] and steps[-1] == m["last_step"]
    s = _summary(path)
    assert s["steps_logged"] == m["entries"] and s["steps"] == m["last_step"]  # counted from 1, like the trainer
    assert s["attempts"] == 1 and s["resumes"] == []  # repeated steps of eval / closing lines are no resume
    assert s["attempts_detail"][0]["first_step"] == m["first_step"]
    meta = m["file_meta"]
    assert s["planned_steps"] == meta.get("total_steps", meta.get("max_steps"))
    stopped = m["run_status"].startswith("stopped")
    assert s["status"] == ("interrupted" if stopped else "finished")
    evals = _evals(path)
    assert [(e["step"], round(e["loss"], 4)) for e in evals] == [tuple(x) for x in meta.get("eval_loss", [])]


@needs_real_logs
def test_real_ms_swift_summary_line_is_not_a_second_run() -> None:
    path = LOGS / "57_ms-swift-gemma4-gn-spikes.jsonl"
    last = path.read_bytes().rsplit(b"\n", 2)[-2]
    assert len(last) > _LINE_LIMIT and b'"log_history"' in last  # the 380 KB line is still there
    steps = _steps(path)
    assert [s["step"] for s in steps] == list(range(1, 2354))
    assert steps[172]["grad_norm"] == 19584.0 and steps[172]["loss"] == pytest.approx(1.56, abs=0.01)
    kinds = {a["kind"]: a for a in _summary(path)["anomalies"] if a["first_step"] == 173}
    assert "grad_explosion" in kinds  # the 2200x spike the manifest lists
