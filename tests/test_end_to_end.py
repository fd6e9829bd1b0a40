"""One thin path through every layer: reference trainer → hooks → HTTP → collector → store,
/metrics and the post-mortem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import LiveCollector
from tests.trainer_helpers import run_trainer
from trainmon.monitor.analysis.postmortem import summarize
from trainmon.monitor.store.storage import runs, steps, streams

pytestmark = pytest.mark.slow


def test_reference_trainer_through_a_live_collector(live_collector: LiveCollector, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_trainer(
        out, "--collector", live_collector.url, "--threads", "1", "--inject", "nan@35", steps=40, run="e2e", timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    with live_collector.collector.storage.connect() as conn:
        rows = conn.execute(select(steps).where(steps.c.run == "e2e").order_by(steps.c.step)).all()
        vocab = conn.execute(select(runs.c.vocab_size).where(runs.c.run == "e2e")).scalar_one()
        (end,) = conn.execute(select(streams.c.end_status, streams.c.missing).where(streams.c.run == "e2e")).all()
    assert [r.step for r in rows] == list(range(40))
    for r in rows[:35]:
        assert math.isfinite(r.loss) and r.grad_norm > 0 and r.grad_norm_clipped <= 1.0 + 1e-5
        assert (r.lr > 0 or r.step == 0) and r.step_time > 0 and r.tokens > 0  # warmup starts at LR 0
    assert math.isnan(rows[35].loss)
    assert rows[0].loss == pytest.approx(math.log(vocab), abs=0.3)  # a fresh model starts at ≈ ln V
    assert tuple(end) == ("finished", 0)

    _, text = live_collector.get("/metrics")
    exposition = text.decode()
    assert 'trainmon_step{rank="0",run="e2e"} 39.0' in exposition
    for name in (
        "trainmon_loss",
        "trainmon_grad_norm",
        "trainmon_grad_norm_clipped",
        "trainmon_learning_rate",
        "trainmon_step_time_seconds",
        "trainmon_tokens_per_second",
        "trainmon_last_step_timestamp_seconds",
    ):
        assert f"{name}{{" in exposition, name

    summary = summarize(live_collector.collector.storage, "e2e")
    assert (summary["steps"], summary["attempts"], summary["status"]) == (40, 1, "finished")
    assert [(a["kind"], a["first_step"]) for a in summary["anomalies"]] == [("nan_inf", 35)]
    labels = json.loads((out / "labels.json").read_text())
    assert [(lab["kind"], lab["first_step"], lab["expected_detection"]) for lab in labels] == [("nan", 35, "nan_inf")]
