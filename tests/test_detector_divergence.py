"""divergence: a sustained rise fires, a spike or a jump that stays up does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from detector_helpers import curve, ev, feed, run_reference, start

from trainmon.hooks.wire import Event
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.divergence import Divergence


def _steps(losses) -> list[Event]:
    evs = [start(schedule={"name": "cosine", "peak_lr": 1e-3, "total_steps": len(losses), "warmup_steps": 20})]
    evs += [ev("step", {"step": t, "loss": v, "grad_norm": 1.0}, float(t)) for t, v in enumerate(losses)]
    return evs


def _det() -> Divergence:
    return Divergence(DetectorsConfig().divergence)


@pytest.mark.parametrize(("slope", "noise"), [(0.002, 0.005), (0.005, 0.02), (0.01, 0.05), (0.002, 0.05)])
def test_slow_rise_fires(slope: float, noise: float) -> None:
    losses = curve(700, 11, noise)
    losses = [v * (1 + slope * max(0, t - 300)) for t, v in enumerate(losses)]
    found = feed(_det(), _steps(losses))
    assert found and 300 < found[0].step <= 500 and not found[0].resolved
    assert "slow divergence" in found[0].hint and "LR" in found[0].hint


def test_fast_ramp_fires_within_a_few_steps() -> None:
    losses = curve(200, 12, 0.02)
    losses = [v + 3.0 * min(1.0, max(0, t - 100) / 20) for t, v in enumerate(losses)]
    found = feed(_det(), _steps(losses))
    assert found and 100 < found[0].step <= 120 and found[0].severity == "warning"
    assert any(f.severity == "critical" for f in found[1:])


def test_spike_and_step_jump_are_not_divergence() -> None:
    losses = curve(400, 13, 0.02)
    losses[200] *= 5
    losses[201] *= 4
    for t in range(300, 400):
        losses[t] *= 3  # a jump that stays up: loss_spike escalates that
    assert feed(_det(), _steps(losses)) == []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("noise", [0.005, 0.02, 0.05])
def test_clean_runs_are_silent(seed: int, noise: float) -> None:
    losses = curve(600, seed, noise)
    if seed % 2:
        losses = [v * 0.97 ** (t // 100) for t, v in enumerate(losses)]
    assert feed(_det(), _steps(losses)) == []


def test_resolves_when_back_near_minimum() -> None:
    losses = [2.0] * 100 + [2.0 + 0.05 * t for t in range(40)] + [2.0] * 60
    found = feed(_det(), _steps(losses))
    assert found[0].step > 100 and found[-1].resolved


def test_reference_trainer(tmp_path: Path) -> None:
    anomalies, labels = run_reference(tmp_path, "div", "--inject", "divergence@60", steps=100)
    hits = [a for a in anomalies if a["kind"] == "divergence"]
    assert hits and labels[0]["first_step"] <= hits[0]["first_step"] <= labels[0]["first_step"] + 30, hits
    anomalies, _ = run_reference(tmp_path, "spike", "--inject", "weight_scale@60", steps=100)
    assert [a for a in anomalies if a["kind"] == "divergence"] == []
    anomalies, _ = run_reference(tmp_path, "clean", "--eval-every", "30", "--checkpoint-every", "40", steps=100)
    assert [a for a in anomalies if a["kind"] == "divergence"] == []
