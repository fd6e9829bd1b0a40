"""``instability_precursor``: growth of a module's attention-logit bound against its own level."""

from __future__ import annotations

import math
import random

import pytest

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.base import SEVERITIES
from trainmon.monitor.detectors.instability_precursor import InstabilityPrecursor, InstabilityPrecursorConfig
from trainmon.wire import Event


def _ev(kind: str, fields: dict) -> Event:
    return Event(kind, "run", 0, "host", "s", 0, 0.0, fields)


def _run(
    bounds: list[dict[str, float]], every: int = 10, lr: float = 0.1, peak: float | None = 0.3, warmup: int = 200
) -> list:
    """Sampled bounds every ``every`` steps at LR ``lr``, the declared schedule peaking at ``peak`` (None: none)
    after ``warmup`` steps."""
    det = InstabilityPrecursor(InstabilityPrecursorConfig())
    schedule = {"name": "cosine", "peak_lr": peak, "warmup_steps": warmup}
    start = {"vocab_size": 64} | ({"schedule": schedule} if peak else {})
    out = det.observe(_ev("run_start", start), 0)
    for i, b in enumerate(bounds):
        out += det.observe(_ev("step", {"step": i * every, "loss": 2.0, "lr": [lr], "attn_logit_max": b}), 0)
        out += det.observe(_ev("step", {"step": i * every + 1, "loss": 2.0, "lr": [lr]}), 0)  # unsampled step
    for f in out:
        assert f.kind == "instability_precursor" and f.severity in SEVERITIES and f.message and f.hint
    return out


def test_clean_training_growth_is_silent() -> None:
    # The reference trainer's clean runs: the bound rises from ~0.3 at init to a few units and wanders there.
    rng = random.Random(0)
    for seed in range(20):
        rng.seed(seed)
        series = [0.3, 1.4, 2.0 + rng.random()] + [rng.uniform(0.5, 8.0) for _ in range(60)]
        assert _run([{"blocks.0.attn": v, "blocks.1.attn": v / 2} for v in series]) == []


def test_a_model_with_large_logits_by_design_is_judged_against_itself() -> None:
    series = [rng_v for rng_v in [60.0, 80.0, 70.0, 90.0, 75.0, 85.0, 65.0] * 5]
    assert _run([{"attn": v} for v in series]) == []


def test_sustained_growth_warns_names_the_layer_then_escalates_and_resolves() -> None:
    series = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 90.0, 400.0, 2.0, 2.2]
    found = _run([{"blocks.0.attn": 2.0, "blocks.1.attn": v} for v in series])
    first = found[0]
    assert first.severity == "warning" and first.step == 60  # the second sampled step of the growth
    assert first.evidence["module"] == "blocks.1.attn" and first.evidence["since_step"] == 50
    assert "blocks.1.attn" in first.message and "qk-layernorm" in first.hint and "0.1" in first.hint
    assert "still rising toward the declared peak 0.3" in first.message
    assert [f.severity for f in found] == ["warning", "warning", "critical", "info"]
    assert found[-1].resolved and found[-1].step == 100


@pytest.mark.parametrize(
    ("peak", "warmup"), [(0.1, 200), (0.15, 200), (None, 200), (0.3, 10)], ids=["at-peak", "near", "none", "decay"]
)
def test_growth_at_the_peak_lr_is_info_until_it_collapses(peak: float | None, warmup: int) -> None:
    # The tiny GPT at a peak of 3e-2: the bound grows 17-27x and the loss trains normally, also as the LR decays.
    series = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 45.0, 400.0]
    found = _run([{"blocks.1.attn": v} for v in series], lr=0.1, peak=peak, warmup=warmup)
    assert [f.severity for f in found] == ["info", "info", "critical"]
    assert "worth watching" in found[0].message and "100x" in found[0].message


def test_a_rise_still_under_the_floor_does_not_raise_the_level() -> None:
    # The reference trainer's seed 1 under lr_too_high: 19.7 (11x the level, under the floor of 20), then 28 and 25.
    found = _run([{"blocks.1.attn": v} for v in [0.3, 1.7, 8.7, 19.7, 28.2, 25.5, 17.6]])
    assert found and found[0].step == 50 and found[0].evidence["level"] == 1.7


def test_one_sampled_batch_is_not_a_trend() -> None:
    assert _run([{"a": v} for v in [1.0, 1.2, 1.1, 1.3, 60.0, 1.2, 1.1, 1.3]]) == []


def test_small_values_never_fire_however_fast_they_rise() -> None:
    assert _run([{"a": v} for v in [0.01, 0.012, 0.011, 0.5, 1.0, 5.0, 15.0, 19.0]]) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0])
def test_degenerate_values(bad: float) -> None:
    assert _run([{"a": bad} for _ in range(30)]) == []
    assert _run([{"a": v} for v in [1.0, 1.0, 1.0, bad, bad, 1.0]]) == []


def test_configured_in_the_detectors_section() -> None:
    assert isinstance(DetectorsConfig().instability_precursor, InstabilityPrecursorConfig)
