"""Imported logs in shapes the real-log corpus lacks: each test pins what a probe found wrong.

The fixtures are written here, in the shapes the tools write (SummaryWriter for TensorBoard, a W&B
CSV export of a run logged by HF's WandbCallback), small enough to read in a second.
"""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.monitor.importers import read_events
from trainmon.monitor.store.storage import Storage

TOTAL = 3000


def _cosine(step: int, peak: float = 3e-4, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (TOTAL - warmup)))


def _loss(step: int, rng: random.Random) -> float:
    return 1.8 + 2.7 * math.exp(-5 * step / TOTAL) + rng.gauss(0, 0.03)


def _postmortem(path: Path) -> dict[str, Any]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    return summarize(storage, run)


def _tb_resumed_from_an_older_checkpoint(folder: Path, resumed_lr) -> None:
    """Crashed after logging step 640, resumed from checkpoint-500: a second event file re-logs 500-640."""
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard not installed (SummaryWriter needs it)")
    rng = random.Random(0)
    w = tb.SummaryWriter(str(folder), filename_suffix=".0")
    for s in range(0, 641, 10):
        w.add_scalar("train/loss", _loss(s, rng), s, walltime=1e9 + s)
        w.add_scalar("train/lr", _cosine(s), s, walltime=1e9 + s)
    w.close()
    w = tb.SummaryWriter(str(folder), filename_suffix=".1")  # a later file: read after the first
    for s in range(500, TOTAL, 10):
        w.add_scalar("train/loss", _loss(s, rng), s, walltime=1e9 + 1000 + s)
        w.add_scalar("train/lr", resumed_lr(s), s, walltime=1e9 + 1000 + s)
    w.close()


def test_resume_from_an_older_checkpoint_with_the_scheduler_restored_is_not_a_restart(tmp_path: Path) -> None:
    """The replayed steps carry the LRs they had the first time, above the floor reached at step 640:
    the inferred schedule said 'the schedule restarted ... the scheduler state was not restored'."""
    _tb_resumed_from_an_older_checkpoint(tmp_path / "run", _cosine)
    summary = _postmortem(tmp_path / "run")
    assert summary["attempts"] == 2
    assert [a for a in summary["anomalies"] if a["kind"] == "lr_schedule_drift"] == []


def test_resume_from_an_older_checkpoint_with_the_scheduler_restarted_is_flagged(tmp_path: Path) -> None:
    """The same replay with a fresh scheduler: the warmup climbs again from step 500."""
    _tb_resumed_from_an_older_checkpoint(tmp_path / "run", lambda s: _cosine(s - 500))
    (found,) = [a for a in _postmortem(tmp_path / "run")["anomalies"] if a["kind"] == "lr_schedule_drift"]
    assert found["first_step"] <= 600 and "restarted" in found["hint"]


def test_wandb_export_of_an_hf_run_counts_train_global_step(tmp_path: Path) -> None:
    """HF's WandbCallback logs train/global_step; W&B's _step counts log calls (here one per 10 steps, an
    eval row its own): the run was read as 210 steps long, not 2,000."""
    rng = random.Random(1)
    path = tmp_path / "wandb_export.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        header = "_step,_runtime,_timestamp,train/loss,train/learning_rate,train/global_step,eval/loss,eval/accuracy"
        w.writerow(header.split(","))
        calls = 0
        for s in range(10, 2001, 10):
            w.writerow([calls, 2.0 * s, 1.7e9 + 2.0 * s, round(_loss(s, rng), 4), _cosine(s), s, "", ""])
            calls += 1
            if s % 200 == 0:  # an eval row leaves the train columns empty
                w.writerow([calls, 2.0 * s + 1, 1.7e9 + 2.0 * s + 1, "", "", s, round(_loss(s, rng) + 0.1, 4), 0.6])
                calls += 1
    summary = _postmortem(path)
    assert summary["last_step"] == 2000
    assert summary["steps"] >= 2000


def test_mad_matches_sorting_the_deviations() -> None:
    """The O(log n) MAD gives exactly what sorting |x - median| gives, with ties and duplicates."""
    rng = random.Random(3)

    def reference(values: list[float]) -> float:
        m = statistics.median(values)
        dev = sorted(abs(x - m) for x in values)
        mid = len(dev) // 2
        return 1.4826 * (dev[mid] if len(dev) % 2 else 0.5 * (dev[mid - 1] + dev[mid]))

    for _ in range(2000):
        window = RollingWindow(rng.randint(1, 40))
        pool = [rng.choice([0.0, 1.0, 2.0, 5.0]) for _ in range(5)]
        for _ in range(rng.randint(1, 80)):
            window.add(rng.choice(pool) if rng.random() < 0.5 else rng.gauss(3, 2))
            assert window.mad() == reference(window.values())


def test_fp16_overflows_at_the_start_are_not_called_a_broken_setup(tmp_path: Path) -> None:
    """HF logs the grad norm of the steps the fp16 scaler skipped (NaN/inf) with a finite loss; the first
    steps overflow while the scaler finds its scale. The hint said 'the setup or the initialisation ...
    Stop the run: no step since has trained'."""
    rng = random.Random(2)
    history: list[dict[str, Any]] = []
    for s in range(1, 301):
        norm = float("nan") if s <= 4 else 1.0 + 0.3 * rng.random()
        history.append({"epoch": s / 300, "grad_norm": norm, "learning_rate": 2e-5, "loss": _loss(s, rng), "step": s})
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"global_step": 300, "max_steps": 300, "logging_steps": 1, "log_history": history}))
    (found,) = [a for a in _postmortem(path)["anomalies"] if a["kind"] == "nan_inf"]
    assert found["severity"] == "warning" and found["first_step"] == 1
    assert "Stop the run" not in found["hint"] and "loss scaler" in found["hint"]


def test_llmc_stdout_val_loss_lines_are_evals(tmp_path: Path) -> None:
    """llm.c's stdout prints ``val loss X`` alone on a line after the step line of the steps it follows
    (``printf0("val loss %f\\n")``); they were dropped, so the run had no eval loss at all."""
    rng = random.Random(5)
    lines = ["val loss 10.950000"]  # before the first step: the model as initialised
    for s in range(1, 201):
        lines.append(
            f"step {s:4d}/200 | loss {_loss(s, rng):.6f} (+0.00z)| norm 1.0000 (+0.00z)| lr 6.00e-04 | 300.00 ms "
            "| 42.1% bf16 MFU | 170000 tok/s"
        )
        if s % 100 == 0:
            lines.append(f"val loss {3.0 - s / 1000:.6f}")
            lines += ["generating:", "---", "Once upon a time there was a step", "---"]
    path = tmp_path / "llmc_stdout.log"
    path.write_text("\n".join(lines) + "\n")
    evals = [(e.fields["step"], e.fields["loss"]) for e in read_events(path) if e.kind == "eval"]
    assert evals == [(0, 10.95), (100, 2.9), (200, 2.8)]
    assert _postmortem(path)["final_eval_loss"] == 2.8


def test_wandb_export_eval_accuracy_reads_a_rising_eval_loss_as_over_confidence(tmp_path: Path) -> None:
    """The eval loss rises over the last epochs while eval/accuracy keeps improving. As a trainer_state.json
    this is 'over-confidence, not a regression' (info); as a W&B export the accuracy column was dropped and
    the same run got a warning: 'overfitting ... or leakage'."""
    rng = random.Random(9)
    path = tmp_path / "wandb_export.csv"
    with open(path, "w", newline="") as f:
        f.write("_step,_timestamp,train/loss,train/global_step,eval/loss,eval/accuracy,eval/runtime\n")
        w = csv.writer(f)
        for s in range(10, 3001, 10):
            w.writerow([s, 1.7e9 + s, round(0.3 + 1.2 * math.exp(-s / 400) + rng.gauss(0, 0.02), 4), s, "", "", ""])
            if s % 300 == 0:
                e = s // 300
                loss = 0.6 + 0.3 * math.exp(-e / 2) + (0.04 * (e - 5) if e > 5 else 0)
                w.writerow([s, 1.7e9 + s + 1, "", s, round(loss, 4), round(0.7 + 0.02 * e, 4), 12.0])
    (found,) = [a for a in _postmortem(path)["anomalies"] if a["kind"] == "eval_regression"]
    assert found["severity"] == "info" and "over-confidence" in found["message"]
    evals = [e for e in read_events(path) if e.kind == "eval"]
    assert evals[-1].fields["metrics"] == {"accuracy": 0.9}  # eval/runtime times the eval: not a metric


def test_lightning_tensorboard_val_acc_reads_a_rising_val_loss_as_over_confidence(tmp_path: Path) -> None:
    """Lightning's TensorBoardLogger writes val_loss and val_acc (no slash): val_acc was dropped, and a val
    loss rising while accuracy improved got 'overfitting ... or leakage' (warning)."""
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard not installed (SummaryWriter needs it)")
    rng = random.Random(3)
    w = tb.SummaryWriter(str(tmp_path / "version_0"))
    for s in range(49, 3000, 50):
        w.add_scalar("train_loss_step", 0.3 + 1.2 * math.exp(-s / 400) + rng.gauss(0, 0.02), s, walltime=1e9 + s)
        if s % 300 == 299:
            e = s // 300 + 1
            loss = 0.6 + 0.3 * math.exp(-e / 2) + (0.04 * (e - 5) if e > 5 else 0)
            w.add_scalar("val_loss", loss, s, walltime=1e9 + s + 1)
            w.add_scalar("val_acc", 0.7 + 0.02 * e, s, walltime=1e9 + s + 1)
    w.close()
    (found,) = [a for a in _postmortem(tmp_path / "version_0")["anomalies"] if a["kind"] == "eval_regression"]
    assert found["severity"] == "info" and "over-confidence" in found["message"]


def _sampled_wandb_export(path: Path) -> None:
    """W&B's history export samples a long run to ~500 rows: the steps between two rows vary from 1 to
    hundreds, at 0.5 s a step."""
    rng = random.Random(11)
    steps = sorted(rng.sample(range(20000), 500))
    with open(path, "w", newline="") as f:
        f.write("trainer/global_step,_step,_timestamp,train/loss\n")
        w = csv.writer(f)
        for k, s in enumerate(steps):
            w.writerow([s, k, 1.7e9 + 0.5 * s, round(2 + 2 * math.exp(-4 * s / 20000) + rng.gauss(0, 0.05), 4)])


def test_a_sampled_wandb_export_is_not_a_hang_where_it_skips_many_steps(tmp_path: Path) -> None:
    """Rows at steps 17 and 150 are 66.5 s apart: 133 steps at 0.5 s, not 'no step for 66.5 s'."""
    _sampled_wandb_export(tmp_path / "sampled.csv")
    assert [a for a in _postmortem(tmp_path / "sampled.csv")["anomalies"] if a["kind"] == "hang"] == []
