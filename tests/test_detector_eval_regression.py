"""eval_regression: eval rising while train falls; eval jump after a resume."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from detector_helpers import curve, ev, run_reference, start

from trainmon.hooks.wire import Event
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.eval_regression import EvalRegression


def _run(train, evals, every: int, resume_at: int | None = None) -> list[Event]:
    evs = [start()]
    for t, v in enumerate(train):
        if resume_at is not None and t == resume_at:
            evs.append(start(resumed=True))
        evs.append(ev("step", {"step": t, "loss": v}, float(t)))
        if t and t % every == 0:
            evs.append(ev("eval", {"step": t, "loss": evals(t)}, float(t)))
    return evs


def _feed_attempts(det, events) -> list:
    out, attempt = [], -1
    for e in events:
        if e.kind == "run_start":
            attempt += 1
        out.extend(det.observe(e, attempt))
    return out


def _det() -> EvalRegression:
    return EvalRegression(DetectorsConfig().eval_regression)


def test_overfitting_fires_on_the_second_consecutive_rise() -> None:
    train = curve(400, 1, 0.02)
    found = _feed_attempts(_det(), _run(train, lambda t: 2.0 if t <= 200 else 2.0 + 0.004 * (t - 200), every=25))
    assert found and found[0].step == 250 and found[0].severity == "warning"
    assert "overfitting" in found[0].hint


def test_jump_after_resume() -> None:
    train = curve(300, 2, 0.02)
    found = _feed_attempts(
        _det(), _run(train, lambda t: 2.0 - 0.001 * t + (0.6 if t > 150 else 0.0), every=25, resume_at=151)
    )
    assert found[0].step == 175 and "resume" in found[0].message


@pytest.mark.parametrize("seed", range(6))
def test_clean_evals_are_silent(seed: int) -> None:
    rng = random.Random(seed)
    train = curve(600, seed, 0.02)
    evs = _run(train, lambda t: 1.5 + 3 * math.exp(-t / 150) + rng.gauss(0, 0.01), every=50, resume_at=300)
    assert _feed_attempts(_det(), evs) == []


def test_reference_trainer_overfits_tiny_dataset(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 3000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 64, 3000).astype(np.uint16).tofile(tmp_path / "val.bin")
    args = ["--data", str(tmp_path / "train.bin"), "--val-data", str(tmp_path / "val.bin"), "--eval-every", "10"]
    anomalies, _ = run_reference(tmp_path, "over", *args, "--lr", "0.01", "--dropout", "0", steps=150)
    hits = [a for a in anomalies if a["kind"] == "eval_regression"]
    assert hits and hits[0]["first_step"] <= 149, anomalies
    anomalies, _ = run_reference(tmp_path, "clean", "--eval-every", "20", steps=100)
    assert [a for a in anomalies if a["kind"] == "eval_regression"] == []
