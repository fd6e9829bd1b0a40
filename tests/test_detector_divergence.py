"""divergence: a sustained rise fires, a spike or a jump that stays up does not."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from trainer_helpers import run_trainer

from hooks.wire import Event
from monitor.config import DetectorsConfig
from monitor.detectors.divergence import Divergence
from monitor.postmortem import import_file, summarize
from monitor.storage import Storage


def _ev(kind: str, fields: dict, t: float = 0.0) -> Event:
    return Event(kind, "r", 0, "h", "s", 0, t, fields)


def _start(**fields) -> Event:
    base = {"vocab_size": 256, "world_size": 1, "accum_steps": 1, "resumed": False}
    base.update(fields)
    return _ev("run_start", base)


def _curve(n: int, seed: int, noise: float, warmup: int = 20) -> list[float]:
    """A tiny model's loss: exponential decay from ln V to a floor, multiplicative noise."""
    rng = random.Random(seed)
    l0, floor, tau = math.log(256), rng.uniform(1.2, 2.5), rng.uniform(n / 8, n / 3)
    return [(floor + (l0 - floor) * math.exp(-t / tau)) * math.exp(noise * rng.gauss(0, 1)) for t in range(n)]


def _feed(det, events) -> list:
    out = []
    for ev in events:
        out.extend(det.observe(ev, 0))
    return out


def _run_reference(tmp_path: Path, name: str, *args: str, steps: int = 120) -> tuple[list[dict], list[dict]]:
    out = tmp_path / name
    run_trainer(out, "--threads", "1", *args, steps=steps, run=name, timeout=180)
    storage = Storage("sqlite://")
    import_file(out / "events.jsonl", storage)
    anomalies = summarize(storage, name)["anomalies"]
    labels = json.loads((out / "labels.json").read_text()) if (out / "labels.json").exists() else []
    return anomalies, labels


def _steps(losses) -> list[Event]:
    evs = [_start(schedule={"name": "cosine", "peak_lr": 1e-3, "total_steps": len(losses), "warmup_steps": 20})]
    evs += [_ev("step", {"step": t, "loss": v, "grad_norm": 1.0}, float(t)) for t, v in enumerate(losses)]
    return evs


def _det() -> Divergence:
    return Divergence(DetectorsConfig().divergence)


@pytest.mark.parametrize(("slope", "noise"), [(0.002, 0.005), (0.005, 0.02), (0.01, 0.05), (0.002, 0.05)])
def test_slow_rise_fires(slope: float, noise: float) -> None:
    losses = _curve(700, 11, noise)
    losses = [v * (1 + slope * max(0, t - 300)) for t, v in enumerate(losses)]
    found = _feed(_det(), _steps(losses))
    assert found and 300 < found[0].step <= 500 and not found[0].resolved
    assert "slow divergence" in found[0].hint and "LR" in found[0].hint


def test_fast_ramp_fires_within_a_few_steps() -> None:
    losses = _curve(200, 12, 0.02)
    losses = [v + 3.0 * min(1.0, max(0, t - 100) / 20) for t, v in enumerate(losses)]
    found = _feed(_det(), _steps(losses))
    assert found and 100 < found[0].step <= 120 and found[0].severity == "warning"
    assert any(f.severity == "critical" for f in found[1:])


def test_spike_and_step_jump_are_not_divergence() -> None:
    losses = _curve(400, 13, 0.02)
    losses[200] *= 5
    losses[201] *= 4
    for t in range(300, 400):
        losses[t] *= 3  # a jump that stays up: loss_spike escalates that
    assert _feed(_det(), _steps(losses)) == []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("noise", [0.005, 0.02, 0.05])
def test_clean_runs_are_silent(seed: int, noise: float) -> None:
    losses = _curve(600, seed, noise)
    if seed % 2:
        losses = [v * 0.97 ** (t // 100) for t, v in enumerate(losses)]
    assert _feed(_det(), _steps(losses)) == []


def test_resolves_when_back_near_minimum() -> None:
    losses = [2.0] * 100 + [2.0 + 0.05 * t for t in range(40)] + [2.0] * 60
    found = _feed(_det(), _steps(losses))
    assert found[0].step > 100 and found[-1].resolved


def test_reference_trainer(tmp_path: Path) -> None:
    anomalies, labels = _run_reference(tmp_path, "div", "--inject", "divergence@60", steps=100)
    hits = [a for a in anomalies if a["kind"] == "divergence"]
    assert hits and labels[0]["first_step"] <= hits[0]["first_step"] <= labels[0]["first_step"] + 30, hits
    anomalies, _ = _run_reference(tmp_path, "spike", "--inject", "weight_scale@60", steps=100)
    assert [a for a in anomalies if a["kind"] == "divergence"] == []
    anomalies, _ = _run_reference(tmp_path, "clean", "--eval-every", "30", "--checkpoint-every", "40", steps=100)
    assert [a for a in anomalies if a["kind"] == "divergence"] == []
