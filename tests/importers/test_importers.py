"""Importers: every foreign format round-trips into wire events the detectors can use.

Fixtures live in ``tests/fixtures/importers``: the HF, TensorBoard and Lightning ones were written
by the real tools (``make_fixtures.py``), the others copy the exact shapes of real logs.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.cli import main
from trainmon.monitor.importers import ImportFormatError, detect_format, read_events
from trainmon.monitor.importers.store import import_log
from trainmon.monitor.importers.tensorboard import read_scalars
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "importers"
TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]


def _events(path: Path, **kw: object) -> list[Event]:
    return list(read_events(path, **kw))  # type: ignore[arg-type]


def _kinds(events: list[Event]) -> Counter:
    return Counter(e.kind for e in events)


def _start(events: list[Event]) -> dict:
    assert events[0].kind == "run_start"
    return events[0].fields


def _steps(events: list[Event]) -> list[dict]:
    return [e.fields for e in events if e.kind == "step"]


# (file, format, framework, steps, evals, synthetic_time, signals present, signals named missing)
CASES = [
    ("hf_trainer_state_grad_norm.json", "hf_trainer_state", "hf", 6, 2, True, {"loss", "grad_norm", "lr"}, set()),
    ("hf_trainer_state_no_grad_norm.json", "hf_trainer_state", "hf", 20, 2, True, {"loss", "lr"}, {"grad_norm"}),
    ("events.out.tfevents.fixture", "tensorboard", "tensorboard", 40, 4, False, {"loss", "grad_norm", "lr"}, set()),
    ("wandb_history.csv", "csv", "csv", 60, 3, False, {"loss", "grad_norm", "lr"}, set()),
    ("wandb_panel_export.csv", "csv", "csv", 40, 0, True, {"loss"}, {"grad_norm", "lr"}),
    ("lightning_metrics.csv", "lightning_csv", "lightning", 12, 3, True, {"loss", "lr"}, {"grad_norm"}),
    ("llmc_main.log", "llmc_main_log", "llm.c", 81, 5, True, {"loss", "grad_norm", "lr"}, set()),
    ("llmc_main_old.log", "llmc_main_log", "llm.c", 30, 3, True, {"loss"}, {"grad_norm", "lr"}),
    ("build_nanogpt_log.txt", "nanogpt_build_log", "nanogpt", 51, 3, True, {"loss"}, {"grad_norm", "lr"}),
    (
        "build_nanogpt_stdout.txt",
        "step_pipe_log",
        "nanogpt",
        30,
        0,
        True,
        {"loss", "grad_norm", "lr", "tokens", "step_time"},
        set(),
    ),
    ("nanogpt_train_stdout.txt", "nanogpt_stdout", "nanogpt", 50, 2, True, {"loss", "step_time"}, {"grad_norm"}),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(
    ("name", "fmt", "framework", "n_steps", "n_evals", "synthetic", "present", "absent"), CASES, ids=IDS
)
def test_round_trip(
    name: str,
    fmt: str,
    framework: str,
    n_steps: int,
    n_evals: int,
    synthetic: bool,
    present: set[str],
    absent: set[str],
) -> None:
    events = _events(FIX / name)
    kinds = _kinds(events)
    assert kinds == Counter({"run_start": 1, "step": n_steps, "eval": n_evals, "run_end": 1}) - Counter()
    start = _start(events)
    cfg = start["config"]
    assert cfg["format"] == fmt and start["framework"] == framework
    assert cfg["imported_from"].endswith(name)
    assert cfg["synthetic_time"] is synthetic
    missing = set(cfg["missing_signals"])
    assert absent <= missing and not (present & missing)
    assert {"phases", "memory"} <= missing  # never in a foreign log: said, not faked
    assert ("wall_time" in missing) is synthetic
    steps = _steps(events)
    for sig in present:
        assert any(sig in s for s in steps), sig
    for sig in absent:
        assert not any(sig in s for s in steps), sig
    assert all(isinstance(s["lr"], list) and len(s["lr"]) == 1 for s in steps if "lr" in s)
    times = [e.time for e in events]
    assert times == sorted(times), "events in time order"
    assert len({e.stream for e in events}) == 1 and [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == "run_end"


def test_hf_real_trainer_state_values() -> None:
    """Written by a real transformers.Trainer: values, step numbering and eval mapping kept exactly."""
    raw = json.loads((FIX / "hf_trainer_state_grad_norm.json").read_text())
    logged = [e for e in raw["log_history"] if "loss" in e]
    events = _events(FIX / "hf_trainer_state_grad_norm.json")
    steps = _steps(events)
    assert [s["step"] for s in steps] == [e["step"] for e in logged]
    assert [s["loss"] for s in steps] == [e["loss"] for e in logged]
    assert [s["grad_norm"] for s in steps] == [e["grad_norm"] for e in logged]
    assert [s["lr"] for s in steps] == [[e["learning_rate"]] for e in logged]
    start = _start(events)
    assert start["planned_steps"] == raw["max_steps"] == 6
    assert start["config"]["logging_steps"] == 1 and "notes" not in start["config"]
    # global_step counts from 1: the last logged step, 6, is 6 steps done (the trainer's own count)
    assert (start["config"]["step_base"], start["config"]["steps_done"]) == (1, 6)
    assert "ends_at_checkpoint" not in start["config"]  # the run finished
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [(e["step"], e["loss"]) for e in evals] == [
        (e["step"], e["eval_loss"]) for e in raw["log_history"] if "eval_loss" in e
    ]
    assert evals[0]["duration"] > 0
    assert events[-1].fields == {"status": "finished", "step": 6}


def test_hf_old_format_says_what_is_missing(tmp_path: Path) -> None:
    events = _events(FIX / "hf_trainer_state_no_grad_norm.json")
    cfg = _start(events)["config"]
    assert "grad_norm" in cfg["missing_signals"]
    assert any("mean over 10 optimizer steps" in n for n in cfg["notes"])  # logging_steps inferred from the steps
    assert cfg["train_runtime_seconds"] == 321.5
    assert [e.fields["metrics"]["accuracy"] for e in events if e.kind == "eval"] == [0.6, 0.7]


def test_hf_lr_key_partial_and_custom_keys(tmp_path: Path) -> None:
    """A custom trainer logging ``lr`` (file 09), extra keys, stopped before max_steps."""
    state = json.loads((FIX / "hf_trainer_state_no_grad_norm.json").read_text())
    hist = [e for e in state["log_history"] if "loss" in e][:8]
    for e in hist:
        e["lr"] = e.pop("learning_rate")
        e["grad_norm"] = 1.5
        e["train/acc_0"] = 0.3
    state["log_history"] = hist
    state["global_step"] = 80
    (tmp_path / "checkpoint-80").mkdir()
    path = tmp_path / "checkpoint-80" / "trainer_state.json"
    path.write_text(json.dumps(state))
    events = _events(path)
    assert events[0].run.endswith("checkpoint-80")  # a generic file name takes its folders' names
    assert all(s["lr"] and s["grad_norm"] == 1.5 for s in _steps(events))
    cfg = _start(events)["config"]
    assert cfg["ignored_keys"] == ["train/acc_0"]
    # checkpoint-80's snapshot: the log ends there because the file was saved then, not because the
    # run stopped; how it ended is unknown (not "interrupted": that would count a failed attempt)
    assert events[-1].fields["status"] == "unknown"
    assert cfg["ends_at_checkpoint"] == 80 and cfg["steps_done"] == 80 and cfg["step_base"] == 1
    assert any("ends at step 80 of max_steps 200" in n and "snapshot" in n for n in cfg["notes"])


def test_hf_resumes_become_attempts(tmp_path: Path) -> None:
    """Epoch reset (a resumed streaming run, file 04) and a step going back both start an attempt."""
    state = json.loads((FIX / "hf_trainer_state_no_grad_norm.json").read_text())
    hist = [e for e in state["log_history"] if "loss" in e]
    for e in hist[10:]:
        e["epoch"] = round(e["epoch"] - 1.1, 2)  # epoch goes back to ~0 after step 100
    replay = [dict(e) for e in hist[14:16]]  # then a restart from step 140 re-logs 150, 160
    state["log_history"] = hist + replay
    path = tmp_path / "resumed.json"
    path.write_text(json.dumps(state))
    events = _events(path)
    starts = [e for e in events if e.kind == "run_start"]
    assert len(starts) == 3 and len({e.stream for e in events}) == 3
    assert starts[1].fields["resumed"] is True
    assert starts[1].fields["config"]["resumed_after_step"] == 100
    assert "epoch went back" in starts[1].fields["config"]["attempt_inferred_from"]
    assert "step went back from 200 to 150" in starts[2].fields["config"]["attempt_inferred_from"]
    assert not any(e.kind == "resume" for e in events)  # which checkpoint was loaded is not in the log
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    summary = summarize(storage, run)
    assert summary["attempts"] == 3
    assert not [a for a in summary["anomalies"] if a["kind"] == "bad_resume"]


def test_hf_truncated_file_is_salvaged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = (FIX / "hf_trainer_state_no_grad_norm.json").read_text()
    cut = text[: text.index('"step": 120') + 5]
    path = tmp_path / "trainer_state_cut.json"
    path.write_text(cut)
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        events = _events(path)
    assert "damaged JSON" in caplog.text
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(10, 120, 10))
    cfg = _start(events)["config"]
    assert cfg["global_step"] == 200  # header fields before log_history survive
    assert any("truncated" in n for n in cfg["notes"])
    assert events[-1].fields["status"] == "unknown"
    assert "ends_at_checkpoint" not in cfg  # entries after the damage are lost: where it ends is not known


def test_tensorboard_reader_matches_tensorboard(tmp_path: Path) -> None:
    """Our dependency-free TFRecord/protobuf reader gives what TensorBoard's own reader gives."""
    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard not installed"
    )
    ours: dict[str, list[tuple[int, float]]] = {}
    for _, step, tag, value in read_scalars(FIX / "events.out.tfevents.fixture"):
        ours.setdefault(tag, []).append((step, value))
    acc = ea_mod.EventAccumulator(str(FIX / "events.out.tfevents.fixture"))
    acc.Reload()
    theirs = {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert ours == theirs
    assert set(ours) == {"train/loss", "train/grad_norm", "train/learning_rate", "train/epoch", "eval/loss"}


def test_tensorboard_written_now_real_time_and_spike_flagged(tmp_path: Path) -> None:
    """SummaryWriter output, with wall time kept; the 13x grad-norm spike at step 30 is flagged."""
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard not installed (SummaryWriter needs it)")
    w = tb.SummaryWriter(str(tmp_path / "run-a"))
    for step in range(1, 41):
        w.add_scalar("loss", 3.0 - step * 0.02 + 0.01 * (step % 3), step)
        w.add_scalar("grad_norm", 1.0 + 0.05 * (step % 4) + (12.0 if step == 30 else 0.0), step)
        w.add_scalar("lr", 1e-3, step)
        if step % 20 == 0:
            w.add_scalar("val/loss", 2.5, step)
    w.close()
    assert detect_format(tmp_path / "run-a") == "tensorboard"
    events = _events(tmp_path / "run-a")
    assert events[0].run == "run-a"
    assert _start(events)["config"]["tag_mapping"] == {
        "loss": "loss",
        "grad_norm": "grad_norm",
        "lr": "lr",
        "eval_loss": "val/loss",
    }
    scalars = list(read_scalars(next((tmp_path / "run-a").iterdir())))
    walls = {s: t for t, s, tag, _ in scalars if tag == "loss"}
    assert [e.time for e in events if e.kind == "step"] == [walls[s] for s in range(1, 41)]
    storage = Storage("sqlite://")
    (run,) = import_file(tmp_path / "run-a", storage)
    flagged = [a for a in summarize(storage, run)["anomalies"] if a["kind"] == "grad_explosion"]
    assert [a["first_step"] for a in flagged] == [30]


def test_tensorboard_damaged_and_restarted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = (FIX / "events.out.tfevents.fixture").read_bytes()
    cut = tmp_path / "events.out.tfevents.1.cut"
    cut.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        events = _events(cut)
    assert "truncated record" in caplog.text
    assert 5 < len(_steps(events)) < 40
    # a bit flip inside a record: that record is skipped, the rest is read
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF
    bad = tmp_path / "events.out.tfevents.2.flip"
    bad.write_bytes(bytes(flipped))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        n = len(_steps(_events(bad)))
    assert "checksum" in caplog.text and 30 <= n <= 40
    # a folder with two event files (the run restarted): one run, two attempts
    d = tmp_path / "logdir"
    d.mkdir()
    shutil.copy(FIX / "events.out.tfevents.fixture", d / "events.out.tfevents.100.host")
    shutil.copy(FIX / "events.out.tfevents.fixture", d / "events.out.tfevents.200.host")
    events = _events(d)
    assert len([e for e in events if e.kind == "run_start"]) == 2 and len(_steps(events)) == 80


def test_csv_wandb_history_keeps_timestamps() -> None:
    events = _events(FIX / "wandb_history.csv")
    steps = [e for e in events if e.kind == "step"]
    assert steps[0].time == 1700000000.0 and steps[-1].time == 1700000000.0 + 2 * 59
    cfg = _start(events)["config"]
    assert cfg["column_mapping"] == {
        "step": "_step",
        "loss": "train/loss",
        "grad_norm": "train/grad_norm",
        "lr": "train/learning_rate",
        "eval_loss": "eval/loss",
        "time": "_timestamp",
    }


def test_csv_wandb_panel_export_strips_run_prefix() -> None:
    events = _events(FIX / "wandb_panel_export.csv")
    assert _start(events)["config"]["column_mapping"] == {
        "step": "Step",
        "loss": "gpt2-small-3 - train/loss",
    }
    assert _steps(events)[0] == {"step": 0, "loss": 7.0}


def test_csv_lightning_sparse_rows_merge() -> None:
    """Lightning's LR-monitor row and loss row of a step become one step; epoch aggregates are not losses."""
    events = _events(FIX / "lightning_metrics.csv")
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(1, 24, 2))
    assert all(s["lr"] == [0.05] and "loss" in s for s in steps)
    assert steps[0]["loss"] == pytest.approx(6.41459321975708)
    assert [e.fields["step"] for e in events if e.kind == "eval"] == [7, 15, 23]
    assert _start(events)["config"]["column_mapping"]["loss"] == "train_loss_step"


def test_csv_mapping_override_and_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "export.csv"
    path.write_text("it,objective,val_objective\n0,5.0,\n1,4.0,\n2,oops,\n3,3.0,3.5\n4,2.5\n")
    with pytest.raises(ImportFormatError, match="no step column"):
        read_events(path)
    with pytest.raises(ImportFormatError, match="no training-loss column"):
        read_events(path, mapping="step=it")
    with pytest.raises(ValueError, match="unknown field 'los'"):
        read_events(path, mapping="los=objective")
    with pytest.raises(ImportFormatError, match="no such column"):
        read_events(path, mapping="step=it,loss=nope")
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        events = _events(path, mapping="step=it,loss=objective,eval_loss=val_objective")
    assert "line 6 has 2 fields" in caplog.text
    assert [s.get("loss") for s in _steps(events)] == [5.0, 4.0, 3.0]  # "oops" is not a loss
    assert [e.fields for e in events if e.kind == "eval"] == [{"step": 3, "loss": 3.5}]


def test_textlogs_values() -> None:
    llmc = _steps(_events(FIX / "llmc_main.log"))
    assert llmc[0] == {"step": 0, "loss": 11.0, "grad_norm": 2.0, "lr": [3e-05]}
    evals = [e.fields for e in _events(FIX / "llmc_main.log") if e.kind == "eval"]
    assert evals[1] == {"step": 20, "loss": 9.9, "metrics": {"hellaswag_acc": 0.242}}
    pipe = _steps(_events(FIX / "build_nanogpt_stdout.txt"))
    assert pipe[0]["step_time"] == pytest.approx(0.33) and pipe[0]["tokens"] == 524288
    nano = _events(FIX / "nanogpt_train_stdout.txt")
    assert [e.fields for e in nano if e.kind == "eval"][1] == {"step": 25, "loss": 8.95, "metrics": {"train_loss": 8.9}}
    build = [e.fields for e in _events(FIX / "build_nanogpt_log.txt") if e.kind == "eval"]
    assert build[0] == {"step": 0, "loss": 10.95, "metrics": {"hellaswag_acc": 0.2487}}


def test_llmc_console_format_gives_planned_steps(tmp_path: Path) -> None:
    path = tmp_path / "train.out"
    path.write_text(
        "step    1/19560 | train loss 11.010890 | norm 15.1742 | lr 8.57e-07 | 1286.05 ms | -100.0% bf16 MFU | "
        "407672 tok/s\n"
        "step    2/19560 | train loss 10.950000 | norm 14.9000 | lr 1.71e-06 | 1280.00 ms | 40.1% bf16 MFU | "
        "409600 tok/s\n"
    )
    events = _events(path)
    assert _start(events)["planned_steps"] == 19560
    assert _steps(events)[1] == {
        "step": 2,
        "loss": 10.95,
        "grad_norm": 14.9,
        "lr": [1.71e-06],
        "tokens": 524288,
        "step_time": 1.28,
    }


def test_textlog_damaged_lines_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = (FIX / "llmc_main.log").read_text().splitlines()
    text[5] = "s:4 trl:1.2.3 lr:x norm:y"
    text[9] = "\x00\x00garbage"
    text.append("s:81 trl:")  # truncated last line
    path = tmp_path / "main.log"
    path.write_text("\n".join(text))
    with caplog.at_level(logging.WARNING, "trainmon.import"):
        events = _events(path)
    assert "not a number" in caplog.text
    assert len(_steps(events)) == 79
    assert any("damaged" in n for n in _start(events)["config"]["notes"])


def test_nan_loss_survives_the_import(tmp_path: Path) -> None:
    path = tmp_path / "main.log"
    path.write_text("\n".join(f"s:{s} trl:{'nan' if s == 30 else 3.0} lr:0.0006 norm:0.3" for s in range(40)))
    steps = _steps(_events(path))
    assert math.isnan(steps[30]["loss"])
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    assert [a["first_step"] for a in summarize(storage, run)["anomalies"] if a["kind"] == "nan_inf"] == [30]


def test_detection_by_content_not_extension(tmp_path: Path) -> None:
    for name, fmt in [
        ("llmc_main.log", "textlog"),
        ("hf_trainer_state_grad_norm.json", "hf_trainer_state"),
        ("events.out.tfevents.fixture", "tensorboard"),
        ("wandb_history.csv", "csv"),
    ]:
        odd = tmp_path / f"{fmt}.dat"
        shutil.copy(FIX / name, odd)
        assert detect_format(odd) == fmt
    jsonl = tmp_path / "spool.txt"
    jsonl.write_text("\n".join(json.dumps(e.__dict__ if False else _raw(e)) for e in _events(FIX / "llmc_main.log")))
    assert detect_format(jsonl) == "jsonl"
    assert len(_events(jsonl)) == len(_events(FIX / "llmc_main.log"))


def _raw(e: Event) -> dict:
    from trainmon.wire import json_safe

    return json_safe(
        {
            "kind": e.kind,
            "run": e.run,
            "rank": e.rank,
            "host": e.host,
            "stream": e.stream,
            "seq": e.seq,
            "time": e.time,
            "fields": e.fields,
        }
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"hello world\nthis is not a log\n", "unrecognised log format"),
        (bytes(range(256)) * 4, "unrecognised log format"),
        (b'{"log_history": 3}', "not a trainer_state.json"),
        (b'{"log_history": [', "no training steps"),
        (b"step,loss\n", "no training steps"),
        (b"epoch,step,val_loss\n0,10,2.0\n", "no training-loss column"),
    ],
)
def test_bad_files_give_a_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.log"
    path.write_bytes(content)
    with pytest.raises(ImportFormatError, match=message):
        read_events(path)


def test_run_names(tmp_path: Path) -> None:
    assert _events(FIX / "llmc_main.log", run="gpt2-124m")[0].run == "gpt2-124m"
    with pytest.raises(ImportFormatError, match="not a valid run id"):
        read_events(FIX / "llmc_main.log", run="bad name/")
    events = _events(FIX / "llmc_main.log")
    again = _events(FIX / "llmc_main.log")
    assert [e.stream for e in events] == [e.stream for e in again]  # stable: a re-import is a duplicate


@pytest.mark.parametrize("name", IDS)
def test_postmortem_json_on_each_format(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["postmortem", str(FIX / name), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"run", "steps", "attempts", "final_loss", "anomalies"} <= out.keys()
    assert out["attempts"] == 1 and out["final_loss"] is not None
    assert [a for a in out["anomalies"] if a["kind"] == "hang"] == []


def test_import_command_stores_the_run(tmp_path: Path) -> None:
    db = tmp_path / "store.sqlite"
    proc = subprocess.run(
        [*TRAINMON, "import", str(FIX / "hf_trainer_state_grad_norm.json"), "--db", str(db), "--run", "tiny-hf"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "imported tiny-hf: 10 of 10 events stored" in proc.stdout
    again = subprocess.run(
        [*TRAINMON, "import", str(FIX / "hf_trainer_state_grad_norm.json"), "--db", str(db), "--run", "tiny-hf"],
        capture_output=True,
        text=True,
    )
    assert "0 of 10 events stored" in again.stdout and "already imported" in again.stdout
    pm = subprocess.run(
        [*TRAINMON, "postmortem", "tiny-hf", "--db", str(db), "--json"], capture_output=True, text=True, check=True
    )
    summary = json.loads(pm.stdout)
    assert summary["run"] == "tiny-hf" and summary["steps_logged"] == 6 and summary["planned_steps"] == 6
    assert summary["status"] == "finished" and summary["attempts"] == 1
    bad = subprocess.run(
        [*TRAINMON, "import", str(FIX / "make_fixtures.py"), "--db", str(db)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unrecognised log format" in bad.stderr and "Traceback" not in bad.stderr


def test_import_with_column_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.csv"
    path.write_text("it,objective\n" + "".join(f"{i},{5 - i * 0.1}\n" for i in range(20)))
    db = tmp_path / "s.sqlite"
    assert main(["import", str(path), "--db", str(db), "--map", "step=it,loss=objective"]) == 0
    assert "imported runs: 22 of 22 events" in capsys.readouterr().out
    assert main(["import", str(path), "--db", str(db), "--map", "loss"]) == 2
    assert "expected FIELD=COLUMN" in capsys.readouterr().err
    result = import_log(path, Storage(f"sqlite:///{db}"), run="named", mapping={"step": "it", "loss": "objective"})
    assert result.runs == ["named"] and result.stored == 22


def test_sparse_real_time_log_is_not_a_hang(tmp_path: Path) -> None:
    path = tmp_path / "sparse.csv"
    path.write_text(
        "_step,_timestamp,train/loss\n" + "".join(f"{i * 50},{1.7e9 + i * 50.0},{3 - 0.01 * i}\n" for i in range(40))
    )
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    assert [a for a in summarize(storage, run)["anomalies"] if a["kind"] == "hang"] == []


def test_tensorboard_eval_metrics_judge_the_fine_tune(tmp_path: Path) -> None:
    """``eval/wer`` beside ``eval/loss`` is read as a metric: a WER that doubles while the eval loss
    creeps up is the regression, named by the WER (real log 54 lost its eval/wer before)."""
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard not installed (SummaryWriter needs it)")
    w = tb.SummaryWriter(str(tmp_path / "asr"))
    wers = {100: 40.0, 200: 60.0, 300: 75.0, 400: 90.0}
    for step in range(10, 410, 10):
        w.add_scalar("train/loss", 2.0 * 0.99**step + 0.01, step)
        w.add_scalar("train/learning_rate", 1e-5, step)
        if step in wers:
            w.add_scalar("eval/loss", 0.18 + step * 1.3e-4, step)
            w.add_scalar("eval/wer", wers[step], step)
            w.add_scalar("eval/runtime", 31.0, step)
            w.add_scalar("eval/samples_per_second", 3.2, step)
    w.close()
    evals = [e for e in _events(tmp_path / "asr") if e.kind == "eval"]
    assert [(e.fields["step"], e.fields["metrics"]) for e in evals] == [(s, {"wer": v}) for s, v in wers.items()]
    storage = Storage("sqlite://")
    (run,) = import_file(tmp_path / "asr", storage)
    (found,) = [a for a in summarize(storage, run)["anomalies"] if a["kind"] == "eval_regression"]
    assert "wer" in found["message"] and found["severity"] in ("warning", "critical")
