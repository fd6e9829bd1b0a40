"""The anchors' spike rules, reimplemented for the benchmark, behave as their sources say."""

from __future__ import annotations

import math

import pytest

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import anchors
from trainmon.monitor.detectors.loss_spike import LossSpike
from trainmon.wire import Event


def _toy_trace() -> list[float]:
    """The seed notebook's toy trace (§14): seed 7, linear decay, noise 0.015, +0.45 at step 120."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    loss = 3.0 - 0.002 * np.arange(200) + rng.normal(0, 0.015, 200)
    loss[120] += 0.45
    return loss.tolist()


def test_seed_notebook_rule_flags_step_120_only() -> None:
    assert anchors.seed_notebook_rolling_median(_toy_trace()) == [120]


def test_loss_spike_flags_the_toy_trace_at_120_only() -> None:
    det = LossSpike(DetectorsConfig().loss_spike)
    found = []
    for t, v in enumerate(_toy_trace()):
        found += det.observe(Event("step", "r", 0, "h", "s", t, float(t), {"step": t, "loss": v}), 0)
    assert [f.step for f in found if not f.resolved and f.evidence.get("spike_step") == f.step] == [120]
    assert all(f.step in (120, 121) for f in found)  # the spike, and its recovery (news: the hint changes)


def test_olmo_core_six_sigma_over_128() -> None:
    flat = [1.0 + 0.01 * ((i * 7919) % 13 - 6) / 6 for i in range(300)]
    spiky = list(flat)
    spiky[200] = 2.0
    assert anchors.olmo_core_stability(spiky) == [200]
    assert anchors.olmo_core_stability(flat) == []


def test_olmo_core_is_blinded_by_an_earlier_spike() -> None:
    base = [1.0 + 0.01 * ((i * 7919) % 13 - 6) / 6 for i in range(400)]
    base[200] = 5.0
    base[250] = 1.3  # 30 noise widths, but the 5.0 inflates the 128-step sigma
    assert anchors.olmo_core_stability(base) == [200]


def test_llm_foundry_needs_five_consecutive_outliers() -> None:
    losses = [1.0] * 150
    losses[120] = 3.0  # one outlier: not a spike
    for t in range(130, 140):
        losses[t] = 3.0
    assert anchors.llm_foundry_kill_loss_spike(losses) == list(range(134, 140))


def test_lightning_rtol_two_over_ten() -> None:
    losses = [1 / i for i in range(1, 10)]
    losses[4] = 3.0  # Lightning's own test: the 5th batch spikes
    assert anchors.lightning_spike_detection(losses) == [4]
    assert anchors.lightning_spike_detection([1.0, 2.0, math.nan, 1.0]) == [2]


def test_registry_names() -> None:
    assert {"olmo_core", "llm_foundry", "lightning", "seed_notebook"} <= set(anchors.ANCHOR_RULES)
    for rule in anchors.ANCHOR_RULES.values():
        assert rule([]) == [] and rule([None, math.nan]) in ([], [1])


def test_trainpulse_when_installed() -> None:
    pytest.importorskip("trainpulse")
    losses = [1.0] * 100
    losses[80] = 6.0
    assert anchors.trainpulse_loss_spike(losses) == [80]
