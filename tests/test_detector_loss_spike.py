"""loss_spike: fires on the spike step, tells recoverable from not, stays silent on clean runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from detector_helpers import curve, ev, feed, run_reference, start

from trainmon.hooks.wire import Event
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_spike import LossSpike


def _steps(losses, norms=None, fingerprint=True, lr=None) -> list[Event]:
    evs = [start()]
    for t, v in enumerate(losses):
        f = {"step": t, "loss": v, "grad_norm": 1.0 if norms is None else norms[t], "lr": [lr(t) if lr else 1e-3]}
        if fingerprint:
            f["batch_fingerprint"] = f"fp{t:04d}"
        evs.append(ev("step", f, float(t)))
    return evs


def _det() -> LossSpike:
    return LossSpike(DetectorsConfig().loss_spike)


@pytest.mark.parametrize("seed", range(4))
def test_recoverable_spike_fires_on_the_step_and_resolves(seed: int) -> None:
    losses = curve(400, seed, 0.02)
    losses[250] *= 1.6
    found = feed(_det(), _steps(losses))
    assert [(f.step, f.severity, f.resolved) for f in found] == [(250, "warning", False), (251, "warning", True)]
    assert "fp0250" in found[0].hint and "[248, 250]" in found[0].hint
    assert "did not rise first" in found[0].hint


def test_unrecovered_spike_escalates_with_rollback_hint() -> None:
    losses = curve(300, 1, 0.02)
    for t in range(200, 300):
        losses[t] *= 3.0
    found = feed(_det(), _steps(losses))
    assert found[0].step == 200 and found[0].severity == "warning"
    assert found[1].step == 220 and found[1].severity == "critical" and not found[1].resolved
    assert "roll back to the checkpoint before step 200" in found[1].hint
    assert "skip the batches in [198, 200]" in found[1].hint


def test_grad_norm_rising_first_is_named() -> None:
    losses = curve(300, 2, 0.02)
    norms = [1.0] * 300
    norms[197], norms[198], norms[199], norms[200] = 2.5, 15.0, 140.0, 900.0  # BLOOM's ordering
    losses[200] *= 2.0
    found = feed(_det(), _steps(losses, norms))
    assert found[0].step == 200
    assert "grad norm rose first" in found[0].hint and found[0].evidence["grad_norm_rose_at"] == 197


def test_lr_jump_is_named() -> None:
    losses = curve(300, 3, 0.02)
    losses[201] *= 2.5
    found = feed(_det(), _steps(losses, lr=lambda t: 0.1 if t in (200, 201) else 1e-3))
    assert found[0].step == 201 and "LR of param group 0 jumped" in found[0].hint


def test_earlier_spike_does_not_blind_the_baseline() -> None:
    """The window never admits a spike: a second, smaller one 20 steps later is still caught."""
    losses = curve(400, 4, 0.01)
    losses[200] *= 10
    losses[220] *= 1.3
    steps = [f.step for f in feed(_det(), _steps(losses)) if not f.resolved]
    assert steps == [200, 220]


def test_small_spike_beats_olmo_six_sigma() -> None:
    from trainmon.monitor.detectors.anchors import olmo_core_stability

    losses = curve(600, 5, 0.02)
    losses[300] *= 5.0  # a big spike first, which inflates OLMo's 128-step sigma
    losses[350] *= 1.3
    ours = [f.step for f in feed(_det(), _steps(losses)) if not f.resolved]
    assert ours == [300, 350]
    assert 350 not in olmo_core_stability(losses)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("noise", [0.005, 0.02, 0.05])
def test_clean_runs_are_silent(seed: int, noise: float) -> None:
    losses = curve(600, seed, noise)
    if seed % 3 == 1:  # epoch boundaries: benign drops
        losses = [v * 0.97 ** (t // 150) for t, v in enumerate(losses)]
    if seed % 3 == 2:  # a declared LR rewarm nudges the loss up slowly
        losses = [v * (1 + 0.03 * max(0, min(1, (t - 300) / 30))) for t, v in enumerate(losses)]
    assert feed(_det(), _steps(losses)) == []


def test_seed_notebook_toy_trace_flagged_at_120_only() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    loss = 3.0 - 0.002 * np.arange(200) + rng.normal(0, 0.015, 200)
    loss[120] += 0.45
    found = feed(_det(), _steps(loss.tolist()))
    assert [f.step for f in found if not f.resolved] == [120]


def test_reference_trainer_faults(tmp_path: Path) -> None:
    for spec in ("loss_spike@60:scale=50", "lr_burst@60", "weight_scale@60"):
        name = spec.split("@")[0]
        anomalies, labels = run_reference(tmp_path, name, "--inject", spec, steps=90)
        spikes = [a for a in anomalies if a["kind"] == "loss_spike"]
        assert spikes, (spec, anomalies)
        lab = labels[0]
        assert lab["expected_detection"] == "loss_spike"
        assert lab["first_step"] <= spikes[0]["first_step"] <= lab["last_step"] + 1, (spec, spikes)
    anomalies, _ = run_reference(tmp_path, "clean", "--eval-every", "30", "--checkpoint-every", "40", steps=90)
    assert [a for a in anomalies if a["kind"] == "loss_spike"] == []
