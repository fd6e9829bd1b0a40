"""Trainer stdout importers: Megatron-LM / Megatron-DeepSpeed, nanochat, modded-nanogpt, MiniMind.

Small inline logs with known values check what each line shape becomes (steps, losses, LR, grad
norm, evaluations, planned length, NaN kept, real step times); the real logs in
``/work/shared/real-logs`` (50, 51, 55, 56, 58) are imported end to end and checked against their
manifest entries (entries, first and last step).
"""

from __future__ import annotations

import calendar
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from tests.real_log_types import REAL_LOGS
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import ImportFormatError, detect_format, read_events
from trainmon.monitor.importers.textlog import parse_textlog
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.store.storage import runs as runs_table
from trainmon.wire import Event

LOGS = REAL_LOGS
_MANIFEST_FILE = LOGS / "manifest.json"
MANIFEST = {m["file"]: m for m in json.loads(_MANIFEST_FILE.read_text())} if _MANIFEST_FILE.is_file() else {}


def _events(path: Path, **kw: Any) -> list[Event]:
    return list(read_events(path, **kw))


def _steps(events: list[Event]) -> list[dict]:
    return [e.fields for e in events if e.kind == "step"]


def _evals(events: list[Event]) -> list[dict]:
    return [e.fields for e in events if e.kind == "eval"]


def _starts(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "run_start"]


def _utc(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")))


# -- Megatron --------------------------------------------------------------------------------------

_MEG_ARGS = """------------------------ arguments ------------------------
  fp16 ............................................ True
  bf16 ............................................ False
  global_batch_size ............................... 8
  log_interval .................................... 1
  lr .............................................. 0.0003
  lr_decay_iters .................................. None
  lr_decay_style .................................. cosine
  lr_warmup_iters ................................. 2
  min_lr .......................................... 3e-05
  seq_length ...................................... 1024
  train_iters ..................................... {iters}
-------------------- end of arguments ---------------------
"""


def _meg_line(
    it: int, total: int, ms: float, lr: float, loss: str | None, gn: float, skipped: int = 0, nan: int = 0
) -> str:
    loss_part = f" lm loss: {loss} |" if loss is not None else ""
    return (
        f" iteration {it:8d}/{total:8d} | consumed samples: {it * 8:12d} | consumed tokens: {it * 8 * 1024:12d} |"
        f" elapsed time per iteration (ms): {ms:.1f} | learning rate: {lr:.3E} | global batch size:     8 |"
        f"{loss_part} loss scale: {65536.0 if not skipped else 32768.0} | grad norm: {gn:.3f} | num zeros: 0.0 |"
        f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |\n"
    )


def _megatron_log(iters: int = 6, start: str = "2025-01-02 03:04:05") -> str:
    text = "using world size: 8, data-parallel-size: 8, tensor-model-parallel size: 1\n"
    text += _MEG_ARGS.format(iters=iters)
    text += f"[before the start of training step] datetime: {start} \n"
    text += "steps: 1 loss: 10.9000 iter time (s): 1.000 samples/sec: 8.000\n"  # DeepSpeed's own line: ignored
    text += _meg_line(1, iters, 1500.0, 1.5e-4, "1.090000E+01", 12.5)
    text += _meg_line(2, iters, 1000.0, 3.0e-4, "9.500000E+00", 8.25)
    text += _meg_line(3, iters, 1000.0, 2.9e-4, None, 99.0, skipped=1, nan=1)  # all-NaN interval: no loss printed
    text += _meg_line(4, iters, 1000.0, 2.5e-4, "8.700000E+00", 4.0)
    text += "-" * 60 + "\n validation loss at iteration 4 | lm loss value: 8.800000E+00 | lm loss PPL: 6.634E+03 | \n"
    text += _meg_line(5, iters, 3000.0, 1.0e-4, "8.100000E+00", 3.0)
    text += _meg_line(6, iters, 1000.0, 3.0e-5, "nan", 2.0)
    for which, value in (("val", "8.000000E+00"), ("test", "7.900000E+00")):
        text += f" validation loss at the end of training for {which} data |"
        text += f" lm loss value: {value} | lm loss PPL: 2.98E+03 |\n"
    text += "[after training is done] datetime: 2025-01-02 03:06:00 \n"
    return text


def test_megatron_values(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text(_megatron_log())
    assert detect_format(path) == "textlog"
    events = _events(path)
    (start,) = _starts(events)
    f = start.fields
    assert f["framework"] == "megatron" and f["planned_steps"] == 6 and f["resumed"] is False
    cfg = f["config"]
    assert cfg["format"] == "megatron_stdout" and cfg["synthetic_time"] is False
    assert cfg["lr_schedule_args"] == {
        "lr": 3e-4,
        "min_lr": 3e-5,
        "lr_decay_style": "cosine",
        "lr_warmup_iters": 2,
        "train_iters": 6,
    }
    assert cfg["megatron_args"]["seq_length"] == 1024 and cfg["precision"] == "fp16"
    assert cfg["skipped_iterations_total"] == 1 and cfg["nan_iterations_total"] == 1
    assert cfg["test_set_evaluations_not_imported"] == 1
    assert not {"loss", "grad_norm", "lr", "tokens", "step_time", "wall_time"} & set(cfg["missing_signals"])

    steps = _steps(events)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0] == {
        "step": 1,
        "loss": 10.9,
        "grad_norm": 12.5,
        "lr": [1.5e-4],
        "tokens": 8192,
        "step_time": 1.5,
        "loss_scale": 65536.0,
        "skipped": False,
    }
    assert math.isnan(steps[2]["loss"]) and steps[2]["skipped"] is True  # the NaN interval, kept as NaN
    assert math.isnan(steps[5]["loss"])  # "lm loss: nan" printed as such
    assert [s["lr"][0] for s in steps] == [1.5e-4, 3e-4, 2.9e-4, 2.5e-4, 1e-4, 3e-5]

    # real time: the datetime before training plus the summed iteration times
    t0 = _utc("2025-01-02 03:04:05")
    step_times = [e.time for e in events if e.kind == "step"]
    assert step_times == pytest.approx([t0 + 1.5, t0 + 2.5, t0 + 3.5, t0 + 4.5, t0 + 7.5, t0 + 8.5])

    assert _evals(events) == [
        {"step": 4, "loss": 8.8, "metrics": {"lm_loss_ppl": 6634.0}},
        {"step": 6, "loss": 8.0, "metrics": {"lm_loss_ppl": 2980.0}},
    ]
    assert events[-1].kind == "run_end" and events[-1].fields == {"status": "finished", "step": 6}


def test_megatron_lm_stamped_lines_and_log_interval(tmp_path: Path) -> None:
    """Newer Megatron-LM prints a timestamp on each line; one line per 10 iterations."""
    path = tmp_path / "megatron_lm.out"
    lines = [
        f" [2024-05-01 12:00:{10 * k:02d}] iteration {10 * k:8d}/{100:8d} | consumed samples: {10 * k * 4:12d} |"
        f" elapsed time per iteration (ms): 1000.0 | throughput per GPU (TFLOP/s/GPU): 100.0 |"
        f" learning rate: 1.000000E-04 | global batch size:     4 | lm loss: {5.0 - 0.1 * k:.6E} | loss scale: 1.0 |"
        f" grad norm: 0.500 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        for k in range(1, 5)
    ]
    path.write_text("\n".join(["  seq_length ...................................... 512", *lines]) + "\n")
    events = _events(path)
    steps = _steps(events)
    assert [s["step"] for s in steps] == [10, 20, 30, 40]
    assert steps[0]["loss"] == pytest.approx(4.9) and steps[0]["step_time"] == 1.0
    assert [e.time for e in events if e.kind == "step"] == [_utc(f"2024-05-01 12:00:{10 * k:02d}") for k in range(1, 5)]
    assert _starts(events)[0].fields["planned_steps"] == 100
    assert events[-1].fields["status"] == "interrupted"  # stopped at 40 of 100


def test_megatron_several_runs_in_one_file_are_separate_runs(tmp_path: Path) -> None:
    path = tmp_path / "sweep.log"
    runs = [(1000, "2025-01-02 03:04:05"), (1100, "2025-01-02 05:00:00")]
    path.write_text("".join(f"==== RUN {mhz} MHz ====\n" + _megatron_log(start=start) for mhz, start in runs))
    events = _events(path)
    starts = _starts(events)
    assert [s.run for s in starts] == ["sweep-run1-1000MHz", "sweep-run2-1100MHz"]
    assert all(s.fields["resumed"] is False for s in starts)
    assert starts[1].fields["config"]["banner"] == "RUN 1100 MHz"
    assert "starts over" in starts[1].fields["config"]["run_split_reason"]
    for run in ("sweep-run1-1000MHz", "sweep-run2-1100MHz"):
        assert [e.fields["step"] for e in events if e.kind == "step" and e.run == run] == [1, 2, 3, 4, 5, 6]
        assert [e.kind for e in events if e.run == run][-1] == "run_end"
    times = [e.time for e in events]
    assert times == sorted(times)
    storage = Storage("sqlite://")
    assert import_file(path, storage) == ["sweep-run1-1000MHz", "sweep-run2-1100MHz"]
    s = summarize(storage, "sweep-run2-1100MHz")
    assert s["attempts"] == 1 and s["steps_logged"] == 6 and s["status"] == "finished"


def test_megatron_resume_is_an_attempt_not_a_run(tmp_path: Path) -> None:
    """The counter going back to a later iteration is a restart from a checkpoint: same run."""
    text = _megatron_log(iters=8)
    text += "loading checkpoint from /ckpt at iteration 4\n"
    text += "[before the start of training step] datetime: 2025-01-02 04:00:00 \n"
    text += _meg_line(5, 8, 1000.0, 1e-4, "8.100000E+00", 3.0)
    text += _meg_line(6, 8, 1000.0, 5e-5, "8.000000E+00", 3.0)
    path = tmp_path / "resumed.log"
    path.write_text(text)
    events = _events(path)
    starts = _starts(events)
    assert len({e.run for e in events}) == 1
    assert [s.fields["resumed"] for s in starts] == [False, True]
    assert [e.time for e in events if e.kind == "step"][-2:] == [
        _utc("2025-01-02 04:00:00") + 1.0,
        _utc("2025-01-02 04:00:00") + 2.0,
    ]
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    assert summarize(storage, run)["attempts"] == 2


def test_megatron_detected_from_its_preamble(tmp_path: Path) -> None:
    """The first iteration is often past the first 64 KiB: the launch line or the argument dump is enough."""
    path = tmp_path / "long.log"
    noise = "".join(f"[rank{i % 16}] building the model, a long preamble line number {i}\n" for i in range(2000))
    launch = "+ torchrun --nproc_per_node 8 pretrain_gpt.py --train-iters 6 --lr 3e-4 --log-interval 1 --bf16\n"
    path.write_text(
        launch + noise + _meg_line(1, 6, 1000.0, 1e-4, "9.0", 1.0) + _meg_line(2, 6, 1000.0, 1e-4, "8.0", 1.0)
    )
    assert path.stat().st_size > 64 * 1024
    assert detect_format(path) == "textlog"
    events = _events(path)
    cfg = _starts(events)[0].fields["config"]
    assert cfg["megatron_args"]["train_iters"] == 6 and cfg["precision"] == "bf16"
    assert cfg["synthetic_time"] is False and "laid out" in cfg["time_source"]  # no wall-clock time printed
    assert "loss_scale" not in _steps(events)[0]  # bf16: no scaler to watch


# -- nanochat --------------------------------------------------------------------------------------

_NANOCHAT = """\
2026-03-16 22:57:30,775 - nanochat.common - \x1b[32m\x1b[1mINFO\x1b[0m - Distributed world size: 1
2026-03-16 22:57:31,000 - nanochat.checkpoint_manager - INFO - Loading model with step 10
Inherited matrix_lr=0.02 from pretrained checkpoint
Total batch size 1,024 => gradient accumulation steps: 1
Step 00000 | Validation bpb: 3.3084
step 00001/00004 (25.00%) | loss: 5.471677 | lrm: 1.00 | dt: 1142.98ms | tok/sec: 896 | mfu: 0.00 | epoch: 1
step 00002/00004 (50.00%) | loss: 7.252057 | lrm: 1.00 | dt: 5.71ms | tok/sec: 179,334 | mfu: 0.00 | epoch: 1
Step 00002 | CORE metric: 0.1234
Step 00002 | Validation bpb: 3.2000
step 00003/00004 (75.00%) | loss: nan | lrm: 0.50 | dt: 5.07ms | tok/sec: 201,972 | mfu: 0.00 | total time: 0.00m
Peak memory usage: 1.00MiB
Total training time: 0.02m
"""


def test_nanochat_values(tmp_path: Path) -> None:
    path = tmp_path / "sft.log"
    path.write_text(_NANOCHAT)
    events = _events(path)
    (start,) = _starts(events)
    cfg = start.fields["config"]
    assert start.fields["framework"] == "nanochat" and start.fields["planned_steps"] == 4
    assert cfg["format"] == "nanochat_stdout" and cfg["synthetic_time"] is False
    assert {"lr", "grad_norm"} <= set(cfg["missing_signals"])  # lrm is a multiplier, not an LR
    assert cfg["lrm_first"] == 1.0 and cfg["lrm_last"] == 0.5
    assert any("EMA" in n for n in cfg["notes"])
    steps = _steps(events)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0] == {"step": 1, "loss": 5.471677, "tokens": 1024, "step_time": pytest.approx(1.14298)}
    assert math.isnan(steps[2]["loss"])
    t0 = _utc("2026-03-16 22:57:31")
    assert [e.time for e in events if e.kind == "step"] == pytest.approx([t0 + 1.14298, t0 + 1.14869, t0 + 1.15376])
    assert _evals(events) == [
        {"step": 0, "loss": 3.3084, "metrics": {"val_bpb": 3.3084}},
        {"step": 2, "loss": 3.2, "metrics": {"val_bpb": 3.2, "core_metric": 0.1234}},
    ]
    assert events[-1].fields["status"] == "finished"


def test_nanochat_killed_run_is_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "sft.log"
    path.write_text("\n".join(_NANOCHAT.splitlines()[:7]).replace("/00004", "") + "\n")  # no end lines, no total
    events = _events(path)
    assert "planned_steps" not in _starts(events)[0].fields
    assert events[-1].fields["status"] == "interrupted"
    assert _steps(events)[-1]["tokens"] == 1024


# -- modded-nanogpt ----------------------------------------------------------------------------------

_MODDED_SCRIPT = '''import os
"""An example of what the log looks like (must not be read as a log line):
step:5/10 train_loss:1.0000 train_time:10ms step_avg:1.00ms
"""

@dataclass
class Hyperparameters:
    batch_size : int = 8*4 # batch size, in sequences, across all devices
    sequence_length : int = 64 # sequence length, in tokens
    num_iterations : int = 2*2 # number of iterations to run
    learning_rate : float = 0.0036 / 2
    warmup_iters : int = 1

for step in range(args.num_iterations + 1):
    print0(f"step:{step}/{args.num_iterations} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms")
    print0(f"step:{step+1}/{args.num_iterations} train_loss:{train_loss.item():.4f} train_time:{approx_time:.0f}ms")
'''


def _modded_log(last: int = 4) -> str:
    rows = [
        "step:0/4 val_loss:10.8250 train_time:200ms step_avg:nanms",
        "step:1/4 train_loss:10.8258 train_time:20200ms step_avg:nanms",
        "step:2/4 train_loss:9.5000 train_time:21200ms step_avg:nanms",
        "step:3/4 train_loss:nan train_time:1100ms step_avg:nanms",  # the timer is zeroed after the warm-up steps
        "step:4/4 train_loss:8.2500 train_time:2300ms step_avg:1150.00ms",
        "step:4/4 val_loss:8.3000 train_time:2310ms step_avg:1155.00ms",
    ]
    rows = [r for r in rows if int(r.split(":")[1].split("/")[0]) <= last]
    return (
        "=" * 100
        + "\n"
        + _MODDED_SCRIPT
        + "=" * 100
        + "\nRunning pytorch 2.4.1+cu121 compiled for CUDA 12.1\nnvidia-smi:\nWed Oct 16 02:54:21 2024       \n"
        + "+---------------------------------------------------------------+\n"
        + "=" * 100
        + "\n"
        + "\n".join(rows)
        + "\n"
    )


def test_modded_nanogpt_values(tmp_path: Path) -> None:
    path = tmp_path / "87bd51fd.txt"
    path.write_text(_modded_log())
    assert detect_format(path) == "textlog"
    events = _events(path)
    (start,) = _starts(events)
    cfg = start.fields["config"]
    assert start.fields["framework"] == "modded-nanogpt" and start.fields["planned_steps"] == 4
    assert cfg["format"] == "modded_nanogpt_log" and cfg["synthetic_time"] is False
    assert cfg["script_hyperparameters"] == {
        "batch_size": 32,
        "sequence_length": 64,
        "num_iterations": 4,
        "learning_rate": 0.0018,
        "warmup_iters": 1,
    }
    steps = _steps(events)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # nothing from the script's text
    assert steps[0] == {"step": 1, "loss": 10.8258, "tokens": 2048, "step_time": 20.0}
    assert math.isnan(steps[2]["loss"])
    # across the timer's restart the increment is not a step's duration (105: 729 ms among 1,180 ms steps)
    assert [s.get("step_time") for s in steps] == [20.0, 1.0, None, pytest.approx(1.2)]
    t0 = _utc("2024-10-16 02:54:21")
    assert [e.time for e in events if e.kind == "step"] == pytest.approx([t0 + 20.2, t0 + 21.2, t0 + 22.3, t0 + 23.5])
    assert _evals(events) == [{"step": 0, "loss": 10.825}, {"step": 4, "loss": 8.3}]
    assert events[-1].fields["status"] == "finished"
    assert any("restarted" in n for n in cfg["notes"])


def test_modded_nanogpt_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "cut.txt"
    path.write_text(_modded_log(last=2))
    events = _events(path)
    assert events[-1].fields == {"status": "interrupted", "step": 2}


# -- MiniMind --------------------------------------------------------------------------------------


def test_minimind_values(tmp_path: Path) -> None:
    progress = "\rGenerating train split: 0 examples [00:00, ?]\rGenerating train split: 85294 examples [00:00]"
    lines = [
        "Model Params: 30.03M",
        progress,
        "Epoch:[1/2](10/20), loss: 8.5371, logits_loss: 8.5371, aux_loss: 0.0000, lr: 0.00050000, epoch_time: 130.0min",
        "Epoch:[1/2](20/20), loss: 7.2000, logits_loss: 7.2000, aux_loss: 0.0000, lr: 0.00040000, epoch_time: 0.0min",
        "Epoch:[2/2](10/20), loss: nan, logits_loss: nan, aux_loss: 0.0000, lr: 0.00020000, epoch_time: 10.0min",
        "Epoch:[2/2](20/20), loss: 6.1000, logits_loss: 6.1000, aux_loss: 0.0000, lr: 0.00005000, epoch_time: 0.0min",
    ]
    path = tmp_path / "pretrain.log"
    path.write_text("\n".join(lines) + "\n")
    events = _events(path)
    (start,) = _starts(events)
    cfg = start.fields["config"]
    assert start.fields["framework"] == "minimind" and start.fields["planned_steps"] == 40
    assert cfg["format"] == "minimind_stdout" and cfg["synthetic_time"] is True  # epoch_time is an ETA
    steps = _steps(events)
    assert [s["step"] for s in steps] == [10, 20, 30, 40]  # global steps across epochs: no restart
    assert steps[0] == {"step": 10, "loss": 8.5371, "lr": [0.0005]}
    assert math.isnan(steps[2]["loss"])
    assert len(_starts(events)) == 1 and events[-1].fields["status"] == "finished"


def test_old_formats_still_read_by_the_generic_reader(tmp_path: Path) -> None:
    path = tmp_path / "main.log"
    path.write_text("s:0 trl:11.0 lr:3e-05 norm:2.0\ns:1 trl:10.5 lr:6e-05 norm:1.9\ns:1 tel:10.7\n")
    items, meta = parse_textlog(path)
    assert meta.format == "llmc_main_log" and len(items) == 3


def test_no_step_lines_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "args_only.log"
    path.write_text(_MEG_ARGS.format(iters=10))
    with pytest.raises(ImportFormatError, match="no Megatron iteration lines"):
        read_events(path)


# -- the real logs ---------------------------------------------------------------------------------

REAL = ["50_megatron-ds-qwen7b-500it.log", "51_megatron-ds-4runs-one-file.log", "55_nanochat-sft-nan.log"]
REAL += ["56_modded-nanogpt-1b.txt", "58_minimind-pretrain.log"]
N_RUNS = {"51_megatron-ds-4runs-one-file.log": 4}
needs_logs = pytest.mark.skipif(
    not all(name in MANIFEST for name in REAL), reason=f"{LOGS} (the real logs and their manifest) is not available"
)


@needs_logs
@pytest.mark.parametrize("name", REAL)
def test_real_log_round_trip(name: str) -> None:
    m = MANIFEST[name]
    events = _events(LOGS / name)
    runs = list(dict.fromkeys(e.run for e in events))
    assert len(runs) == N_RUNS.get(name, 1)
    steps = [e.fields["step"] for e in events if e.kind == "step"]
    assert len(steps) == m["entries"]
    assert min(steps) == m["first_step"] and max(steps) == m["last_step"]
    for run in runs:
        start = next(e for e in events if e.run == run and e.kind == "run_start")
        cfg = start.fields["config"]
        run_steps = [e.fields for e in events if e.run == run and e.kind == "step"]
        assert run_steps[0]["step"] == m["first_step"] and run_steps[-1]["step"] == m["last_step"]
        missing = set(cfg["missing_signals"])
        assert ("grad_norm" not in missing) == m["has_grad_norm"]
        assert ("lr" not in missing) == m["has_lr"]
        assert cfg["synthetic_time"] is (m["format"] == "minimind_stdout")  # the others print step times
        assert start.fields["resumed"] is False
    times = [e.time for e in events]
    assert times == sorted(times)


@needs_logs
@pytest.mark.parametrize("name", REAL)
def test_real_log_end_to_end(name: str) -> None:
    m = MANIFEST[name]
    storage = Storage("sqlite://")
    runs = import_file(LOGS / name, storage)
    assert len(runs) == N_RUNS.get(name, 1)
    total = 0
    for run in runs:
        s = summarize(storage, run)
        assert s["attempts"] == 1  # 51's restarts are separate runs, not resumes
        assert s["steps"] == m["last_step"]  # iterations counted from 1, like the trainer
        total += s["steps_logged"]
        with storage.connect() as conn:
            row = conn.execute(runs_table.select().where(runs_table.c.run == run)).first()
        assert row.config["imported_from"].endswith(name)
    assert total == m["entries"]


@needs_logs
def test_real_megatron_values() -> None:
    m = MANIFEST["50_megatron-ds-qwen7b-500it.log"]["file_meta"]
    events = _events(LOGS / "50_megatron-ds-qwen7b-500it.log")
    start = _starts(events)[0].fields
    assert start["planned_steps"] == m["train_iters"]
    sched = start["config"]["lr_schedule_args"]
    assert (sched["lr"], sched["min_lr"], sched["lr_warmup_iters"], sched["lr_decay_style"]) == (
        m["lr"],
        m["min_lr"],
        m["lr_warmup_iters"],
        m["lr_decay_style"],
    )
    assert [(e["step"], e["loss"]) for e in _evals(events)] == [tuple(v) for v in m["validation"]]
    steps = _steps(events)
    assert steps[0]["lr"] == [2e-7] and steps[49]["lr"] == [1e-5] and steps[-1]["lr"] == [1e-6]
    assert max(s["grad_norm"] for s in steps) == 44.296 and steps[17]["step"] == 18 and steps[17]["grad_norm"] == 44.296
    assert all(s["skipped"] is False for s in steps) and events[-1].fields["status"] == "finished"


@needs_logs
def test_real_nanochat_nan_is_kept_and_flagged() -> None:
    storage = Storage("sqlite://")
    (run,) = import_file(LOGS / "55_nanochat-sft-nan.log", storage)
    s = summarize(storage, run)
    assert math.isnan(s["final_loss"]) and s["status"] == "interrupted"
    nan = [a for a in s["anomalies"] if a["kind"] == "nan_inf"]
    assert nan and nan[0]["first_step"] == MANIFEST["55_nanochat-sft-nan.log"]["file_meta"]["first_nan_step"]


@needs_logs
def test_real_modded_nanogpt_reads_no_script_line() -> None:
    m = MANIFEST["56_modded-nanogpt-1b.txt"]
    events = _events(LOGS / "56_modded-nanogpt-1b.txt")
    evals = _evals(events)
    assert len(evals) == m["file_meta"]["n_val_entries"]
    assert (evals[0]["loss"], evals[-1]["loss"]) == tuple(m["file_meta"]["val_first_last"])
    assert _starts(events)[0].fields["planned_steps"] == m["file_meta"]["num_iterations"]
    assert events[-1].fields["status"] == "finished"


# -- the batch scheduler's end of a run ----------------------------------------------------------------

_PIPE_LOG = "".join(
    f"step {s:4d}/1000 | loss {10.5 - 0.01 * s:.4f} | lr 6.0000e-04 | norm 1.2000 | dt 250.00ms | tok/sec 2000.00\n"
    for s in range(1, 6)
)
_SLURM_TIME_LIMIT = (
    "slurmstepd: error: *** JOB 4242 ON gpu-node-17 CANCELLED AT 2024-05-01T12:00:00 DUE TO TIME LIMIT ***"
)


def test_slurm_time_limit_line_is_the_runs_end_status(tmp_path: Path) -> None:
    """The scheduler's line after the last step: the run was interrupted (cancelled at its time limit),
    not failed, and the line is neither a step nor an error."""
    path = tmp_path / "train.out"
    path.write_text(
        _PIPE_LOG
        + "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
        + _SLURM_TIME_LIMIT
        + "\n"
    )
    events = _events(path)
    assert [s["step"] for s in _steps(events)] == [1, 2, 3, 4, 5]
    assert events[-1].kind == "run_end" and events[-1].fields == {"status": "interrupted", "step": 5}
    cfg = _starts(events)[0].fields["config"]
    assert cfg["scheduler_end"] == {
        "scheduler": "slurm",
        "event": "cancelled",
        "at": "2024-05-01T12:00:00",
        "reason": "time limit",
        "job": "4242",
        "node": "gpu-node-17",
    }
    (note,) = [n for n in cfg["notes"] if "SLURM" in n]
    assert "cancelled by SLURM at its time limit at 2024-05-01T12:00:00" in note and "not by an error" in note
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    s = summarize(storage, run)
    assert s["status"] == "interrupted" and s["anomalies"] == []


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("CANCELLED AT 2024-05-01T12:00:00 DUE TO TIME LIMIT", "at its time limit"),
        ("*** STEP 4242.0 CANCELLED AT 2024-05-01T12:00:00 DUE TO PREEMPTION ***", "to preempt it"),
        ("slurmstepd: error: *** JOB 4242 ON n1 CANCELLED AT 2024-05-01T12:00:00 ***", "(scancel, by a user"),
        (  # the job's line and its step's line: one cancellation, the reason kept
            "slurmstepd: error: *** JOB 4242 ON n1 CANCELLED AT 2024-05-01T12:00:00 DUE TO TIME LIMIT ***\n"
            "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
            "slurmstepd: error: *** STEP 4242.0 ON n1 CANCELLED AT 2024-05-01T12:00:01 ***",
            "job 4242 on n1 was cancelled by SLURM at its time limit at 2024-05-01T12:00:01",
        ),
    ],
)
def test_slurm_cancel_forms(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "ckpt.log"
    path.write_text(
        "".join(f"iter {i}: loss {4.0 - 0.1 * i:.4f}, time 120.00ms, mfu 30.00%\n" for i in range(4)) + line + "\n"
    )
    events = _events(path)
    assert len(_steps(events)) == 4 and events[-1].fields["status"] == "interrupted"
    assert any(why in n for n in _starts(events)[0].fields["config"]["notes"])


def test_slurm_cancel_followed_by_more_steps_is_only_a_note(tmp_path: Path) -> None:
    """A requeued job appending to the same log: the cancellation is not how this log ends."""
    path = tmp_path / "train.out"
    path.write_text(_PIPE_LOG + _SLURM_TIME_LIMIT + "\n" + _PIPE_LOG.replace("step    5", "step    6"))
    events = _events(path)
    cfg = _starts(events)[0].fields["config"]
    assert events[-1].fields["status"] == "unknown" and "scheduler_end" not in cfg
    assert any("the log goes on after it" in n for n in cfg["notes"])


def test_a_finished_run_cancelled_afterwards_stays_finished(tmp_path: Path) -> None:
    path = tmp_path / "sft.log"
    path.write_text(_NANOCHAT + _SLURM_TIME_LIMIT + "\n")
    events = _events(path)
    assert events[-1].fields["status"] == "finished"
    (note,) = [n for n in _starts(events)[0].fields["config"]["notes"] if "SLURM" in n]
    assert "at its time limit" in note and "after its training steps had finished" in note
