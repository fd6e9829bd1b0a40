"""JSON lines of metrics (W&B run history, a hand-written loop's metrics.jsonl) read as the table they are.

Before, every such file failed at detection ("unrecognised log format ... JSON lines with keys "step",
"loss", ..."), although the same values as a CSV were read.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import detect_format, read_events
from trainmon.monitor.store.storage import Storage

N = 600
SPIKE = 400


def _loss(step: int, rng: random.Random) -> float:
    return 1.8 + 2.5 * math.exp(-4 * step / N) + rng.gauss(0, 0.02)


def _write(path: Path, rows: list[dict], *, raw: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for i, text in (raw or {}).items():
        lines.insert(i, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def _anomalies(path: Path, **kw: object) -> list[dict]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage, **kw)
    return summarize(storage, run)["anomalies"]


def _history(spike: bool) -> list[dict]:
    """W&B's run history as ``wandb-history.jsonl`` holds it: a row per ``wandb.log`` call, the train metrics
    and the evals in rows of their own."""
    rng = random.Random(1)
    rows: list[dict] = []
    for s in range(N):
        loss = _loss(s, rng) * (3.0 if spike and s == SPIKE else 1.0)
        rows.append(
            {
                "_step": len(rows),
                "_timestamp": 1.7e9 + s,
                "_runtime": float(s),
                "train/global_step": s + 1,
                "train/loss": loss,
                "train/learning_rate": 3e-4,
                "train/grad_norm": 1.0 + rng.gauss(0, 0.05),
            }
        )
        if (s + 1) % 100 == 0:
            rows.append({"_step": len(rows), "_timestamp": 1.7e9 + s, "train/global_step": s + 1, "eval/loss": 2.0})
    return rows


def test_wandb_history_is_read_as_its_table(tmp_path: Path) -> None:
    path = _write(tmp_path / "wandb-history.jsonl", _history(spike=False))
    assert detect_format(path) == "json_table"
    events = list(read_events(path))
    steps = [e.fields for e in events if e.kind == "step"]
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [f["step"] for f in steps] == list(range(1, N + 1))  # train/global_step, not W&B's _step
    assert all(f["lr"] == [3e-4] for f in steps)
    assert [f["step"] for f in evals] == [100, 200, 300, 400, 500, 600]
    start = next(e for e in events if e.kind == "run_start")
    assert start.fields["config"]["column_mapping"]["loss"] == "train/loss"


def test_a_loss_spike_in_a_metrics_jsonl_is_found_at_its_step(tmp_path: Path) -> None:
    spiked = [a for a in _anomalies(_write(tmp_path / "a.jsonl", _history(spike=True))) if a["kind"] == "loss_spike"]
    assert [a["first_step"] for a in spiked] == [SPIKE + 1]
    assert not _anomalies(_write(tmp_path / "b.jsonl", _history(spike=False)))


def test_nested_records_non_finite_values_and_damaged_lines(tmp_path: Path) -> None:
    rng = random.Random(2)
    rows = [{"step": s, "train": {"loss": _loss(s, rng), "lr": 1e-4}} for s in range(300)]
    path = _write(tmp_path / "metrics.jsonl", rows, raw={50: "{not json", 80: "[1, 2]"})
    text = path.read_text().replace(json.dumps(rows[200]["train"]["loss"]), "NaN", 1)
    path.write_text(text)
    events = list(read_events(path))
    steps = {e.fields["step"]: e.fields for e in events if e.kind == "step"}
    assert sorted(steps) == list(range(300))  # the two damaged lines cost nothing else
    assert math.isnan(steps[200]["loss"])
    start = next(e for e in events if e.kind == "run_start")
    assert "2 lines that are not JSON objects skipped" in start.fields["config"]["notes"]
    nan = [a for a in _anomalies(path) if a["kind"] == "nan_inf"]
    assert [a["first_step"] for a in nan] == [200]


def test_a_mapping_names_columns_of_any_name(tmp_path: Path) -> None:
    rng = random.Random(3)
    path = _write(tmp_path / "log.jsonl", [{"it": s, "objective": _loss(s, rng)} for s in range(200)])
    with pytest.raises(ValueError, match="unrecognised log format"):
        detect_format(path)
    events = list(read_events(path, mapping="step=it,loss=objective"))
    assert [e.fields["step"] for e in events if e.kind == "step"] == list(range(200))
