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


def _anomalies(found: list) -> list[tuple[int, int | None]]:
    """The stored anomalies these findings make, as the engine keeps them (trainmon.monitor.collector.engine): the
    first finding opens one, later ones update it, a resolved one closes it and the next finding opens another.
    (first step, step it was resolved at or None while open)."""
    out: list[tuple[int, int | None]] = []
    for f in found:
        if f.resolved:
            if out and out[-1][1] is None:
                out[-1] = (out[-1][0], f.step)
        elif not out or out[-1][1] is not None:
            out.append((f.step, None))
    return out


def test_one_module_settling_leaves_the_anomaly_open_while_another_still_rises() -> None:
    # Two attention modules grow from step 50; blocks.0 collapses toward one-hot (400: critical) and settles at step
    # 90, blocks.1 still grows until step 90 and settles at 110. The anomaly stays open until the last one settles.
    a = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 400.0, 2.0, 2.2, 2.0, 2.0, 2.0]
    b = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 45.0, 50.0, 55.0, 2.0, 2.1, 2.0]
    found = _run([{"blocks.0.attn": x, "blocks.1.attn": y} for x, y in zip(a, b, strict=True)])
    assert [f.step for f in found if f.resolved] == [110]  # not at 90, when blocks.0 alone settled
    assert _anomalies(found) == [(60, 110)]  # one anomaly, open throughout
    settled = next(f for f in found if f.step == 90 and f.evidence["module"] == "blocks.0.attn")
    assert not settled.resolved and settled.severity == "warning"  # what is still open: blocks.1's warning
    assert [o["module"] for o in settled.evidence["open"]] == ["blocks.1.attn"]
    assert "blocks.0.attn back near" in settled.message
    assert "still open: attention_logit_growth in blocks.1.attn (warning since step 50)" in settled.message
    assert "qk-layernorm" in settled.hint
    # While blocks.0 is critical, blocks.1's news does not lower the anomaly's severity.
    assert [(f.step, f.severity) for f in found if f.evidence["module"] == "blocks.1.attn"] == [
        (60, "warning"), (70, "critical"), (80, "critical"), (90, "warning"), (110, "info"),
    ]  # fmt: skip
    assert found[-1].evidence["open"] == []
    # The anomaly names every module it covered, for the plot, on every finding and at its resolution.
    assert found[-1].evidence["modules"] == ["blocks.0.attn", "blocks.1.attn"]


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


# --- the other mechanisms: sampled values of the reference trainer's tiny GPT (bench/early_warning.py), every 10 steps

# lr_too_high, seed 1337: blocks.1.attn.proj's output RMS; the loss-based detectors fire at step 160.
RMS_FAULT = [0.0042, 0.070, 0.22, 1.14, 0.71, 0.67, 0.69, 0.53, 0.28, 0.37, 0.44, 0.92, 2.87, 1.97, 5.78, 47.5, 34.9]
RMS_FAULT += [34.8, 76.8, 92.5, 63.6, 214.0]
# Clean runs: blocks.0.mlp.proj at a peak LR of 3e-2 (grows 1500x from the init scale, then holds) and of 1e-2
# (still rising slowly, 4x over 300 steps).
RMS_CLEAN_HIGH = [0.013, 1.65, 12.7, 18.4, 20.5, 20.0, 20.4, 22.2, 22.7, 25.0, 26.0, 25.2, 26.1, 26.1, 27.6, 26.1]
RMS_CLEAN_HIGH += [26.7, 26.2, 25.6, 27.1, 25.1, 25.0, 26.1, 25.0, 23.9, 23.8, 22.6, 23.1, 21.7, 21.1, 21.6]
RMS_CLEAN = [0.013, 0.15, 0.63, 1.17, 1.69, 2.1, 2.55, 2.85, 3.08, 3.34, 3.56, 3.74, 3.96, 4.05, 4.35, 4.57, 4.64]
RMS_CLEAN += [4.84, 5.01, 5.04, 5.19, 5.3, 5.26, 5.27, 5.45, 5.27, 5.28, 5.41, 5.26, 5.36, 5.3, 5.4]
# Attention entropy (nats) of blocks.1.attn: lr_too_high seed 1337, and the clean run at 3e-2 (low, not one-hot).
ENTROPY_FAULT = [3.2, 3.2, 3.0, 2.3, 2.5, 2.4, 2.9, 3.1, 3.2, 3.2, 3.1, 3.1, 2.7, 1.5, 0.71, 0.016, 0.016, 0.015]
ENTROPY_FAULT += [0.014, 3.6e-17, 0.029, 0.042, 0.0027]
ENTROPY_CLEAN = [3.2, 2.9, 1.2, 0.76, 0.36, 0.24, 0.26, 0.38, 0.25, 0.33, 0.41, 0.15, 0.41, 0.25, 0.41, 0.26]
ENTROPY_CLEAN += [0.32, 0.14, 0.73, 0.44, 0.29, 0.51, 0.48, 0.73, 0.36, 0.52, 0.41, 0.3, 0.83, 0.35, 0.12]


def _signal(field: str, values: list[dict[str, float]], losses: list[float] | None = None) -> list:
    """Sampled ``field`` maps every 10 steps at LR 0.1, the loss of each ten steps ``losses`` (2.0 if None)."""
    det = InstabilityPrecursor(InstabilityPrecursorConfig())
    out = det.observe(_ev("run_start", {"vocab_size": 64}), 0)
    for i, v in enumerate(values):
        loss = losses[i] if losses else 2.0
        out += det.observe(_ev("step", {"step": i * 10, "loss": loss, "lr": [0.1], field: v}), 0)
        for j in range(1, 10):  # the unsampled steps between: the loss only
            out += det.observe(_ev("step", {"step": i * 10 + j, "loss": loss, "lr": [0.1]}), 0)
    for f in out:
        assert f.kind == "instability_precursor" and f.message and f.hint
    return out


def test_linear_output_growth_fires_on_the_sustained_rise_and_names_the_layer() -> None:
    found = _signal("linear_out_rms", [{"blocks.1.attn.proj": v, "blocks.0.attn.qkv": 0.4} for v in RMS_FAULT])
    first = found[0]
    assert (first.step, first.severity) == (150, "warning")  # 5.78 (8.6x) at 140, 47.5 at 150: two in a row
    assert first.evidence["mechanism"] == "linear_output_growth" and first.evidence["module"] == "blocks.1.attn.proj"
    assert first.evidence["since_step"] == 140 and first.evidence["level"] == pytest.approx(0.68)
    assert "blocks.1.attn.proj" in first.message and "Rybakov" in first.hint and "lower peak LR" in first.hint
    assert [(f.step, f.severity) for f in found] == [(150, "warning"), (180, "critical")]  # 76.8: over 100x


@pytest.mark.parametrize("series", [RMS_CLEAN_HIGH, RMS_CLEAN], ids=["peak-3e-2", "peak-1e-2"])
def test_linear_outputs_growing_from_the_init_scale_or_slowly_are_silent(series: list[float]) -> None:
    assert _signal("linear_out_rms", [{"blocks.0.mlp.proj": v} for v in series]) == []


def test_attention_entropy_collapse_fires_when_near_one_hot_against_its_level() -> None:
    found = _signal("attn_entropy", [{"blocks.1.attn": v, "blocks.0.attn": 3.2} for v in ENTROPY_FAULT])
    assert [(f.step, f.severity) for f in found] == [(160, "warning")]  # 0.016 at 150 and 160; one episode
    assert found[0].evidence["mechanism"] == "attention_entropy_collapse"
    assert found[0].evidence["module"] == "blocks.1.attn" and found[0].evidence["since_step"] == 150
    assert "one-hot" in found[0].message and "qk-layernorm" in found[0].hint


def test_low_attention_entropy_that_trains_normally_is_silent() -> None:
    assert _signal("attn_entropy", [{"blocks.1.attn": v} for v in ENTROPY_CLEAN]) == []


def test_a_head_one_hot_by_design_is_judged_against_itself() -> None:
    assert _signal("attn_entropy", [{"prev_token_head": v} for v in [0.01, 0.012, 0.008, 0.01, 0.011] * 6]) == []


def test_adam_second_moments_under_eps_fire_per_group_with_the_eps_remedy_then_resolve() -> None:
    shares = [0.003, 0.001, 0.0006, 0.0006, 0.0006, 0.4, 0.55, 0.6, 0.0006, 0.0006]
    found = _signal("adam_eps_frac", [{"0": v, "1": 0.0714} for v in shares])
    assert [(f.step, f.severity, f.resolved) for f in found] == [(60, "warning", False), (90, "info", True)]
    assert found[0].evidence["mechanism"] == "adam_epsilon" and found[0].evidence["module"] == "0"
    assert "55.0% of its second moments" in found[0].message
    assert "lower eps" in found[0].hint and "not a lower LR" in found[0].hint and "eps was lowered" in found[1].hint


def test_adam_shares_that_fall_or_hold_high_are_silent() -> None:
    shares = [0.003, 0.0012, 0.0006, 0.0006, 7e-5, 7e-5, 9e-6, 9e-6] * 3
    assert _signal("adam_eps_frac", [{"0": v, "1": 0.0714, "2": 0.6} for v in shares]) == []


def test_collapsed_attention_resolves_only_once_it_spreads_again() -> None:
    hovering = [0.029, 0.042, 0.03, 0.05]  # just over the floor: still collapsed
    found = _signal("attn_entropy", [{"blocks.1.attn": v} for v in ENTROPY_FAULT[:17] + hovering + [1.5, 2.0]])
    assert [(f.step, f.severity, f.resolved) for f in found] == [(160, "warning", False), (220, "info", True)]
    assert "spread again" in found[-1].message


def test_growth_that_follows_the_loss_is_info_not_a_warning() -> None:
    # The divergence fault (random targets from step 150, a loss-only failure), seed 1337: the loss jumps 3.5x at
    # step 160, then blocks.1.attn.proj's output grows 80x; the loss-based detectors lead, the growth is a consequence.
    rms = [0.0042, 0.0066, 0.011, 0.012, 0.016, 0.014, 0.017, 0.020, 0.018, 0.020, 0.022, 0.022, 0.020, 0.024]
    rms += [0.028, 0.027, 0.028, 0.34, 1.05, 1.63, 1.82, 1.92, 1.95, 2.01, 2.09, 2.11, 2.12, 2.2, 2.23, 2.32, 2.37]
    loss = [4.19, 3.5, 2.55, 1.98, 1.45, 1.46, 1.34, 1.26, 1.24, 1.3, 1.21, 1.3, 1.17, 1.22, 1.22, 1.57] + [4.3] * 15
    found = _signal("linear_out_rms", [{"blocks.1.attn.proj": v} for v in rms], loss)
    assert [(f.step, f.severity) for f in found] == [(180, "info")]  # and stays info, however far it grows
    assert "the loss has already risen" in found[0].message


# adam_eps_frac of the reference trainer's tiny GPT (seed 1337, --detail-every 10), groups "0" (matrices) and "1"
# (biases and gains; 7.1% are the key biases, whose gradient softmax's shift invariance makes zero). Clean: the same
# to four digits at the bench's peak LRs 1e-3, 3e-3, 1e-2 and 3e-2, 400 steps.
EPS_CLEAN = [{"0": v, "1": 0.0714} for v in [0.003] + [0.0012] * 39]
# Peak LR 3e-3, the loss (and so every gradient) x1e-6 from step 150, as a loss normalised twice (a token mean divided
# again by a million-token batch's count) would, or as a model whose gradients sit near eps: the second moments can
# fall only by beta2 (0.95) per step, a decade every 45 steps, and sat 8-10 decades above eps^2.
EPS_SCALED_0 = [0.003] + [0.0012] * 43 + [0.0016, 0.005, 0.0196, 0.0461, 0.0661, 0.0764, 0.0938, 0.1274, 0.1465]
EPS_SCALED_0 += [0.1504, 0.1522, 0.1682, 0.2235, 0.3066, 0.3898, 0.4546, 0.5052, 0.5708, 0.6835, 0.7987, 0.8661]
EPS_SCALED_1 = [0.0714] * 46 + [0.0731, 0.0854, 0.0982, 0.1044, 0.1094, 0.1278, 0.1562, 0.1685, 0.1758, 0.1802]
EPS_SCALED_1 += [0.1964, 0.2494, 0.3248, 0.4068, 0.4531, 0.5017, 0.5658, 0.6423, 0.7137]


def test_adam_epsilon_fires_on_a_real_capture_of_gradients_sinking_under_eps() -> None:
    found = _signal("adam_eps_frac", [{"0": a, "1": b} for a, b in zip(EPS_SCALED_0, EPS_SCALED_1, strict=True)])
    # 450 steps after the change: the slow start of the rise (0.1% -> 15% over 280 steps) joins the level, the jump
    # from there to 50% in 30 steps is the finding. Late, not early: the updates shrank 50x within 60 steps of it.
    assert [(f.step, f.evidence["module"], f.severity) for f in found] == [(600, "0", "warning"), (610, "1", "warning")]
    assert found[0].evidence["since_step"] == 590 and found[0].evidence["level"] == pytest.approx(0.1504, abs=0.02)
    assert [o["module"] for o in found[1].evidence["open"]] == ["0", "1"]  # one anomaly, both groups named


def test_adam_shares_of_the_clean_runs_are_silent() -> None:
    assert _signal("adam_eps_frac", EPS_CLEAN) == []


def test_an_episode_open_when_the_attempt_ends_is_closed_by_the_next_attempt() -> None:
    # The run restarts while blocks.1 is still growing: the new attempt re-learns the levels, so the episode is
    # closed at its run_start, naming what was open, and the new attempt's growth opens a new anomaly.
    det = InstabilityPrecursor(InstabilityPrecursorConfig())
    found = det.observe(_ev("run_start", {"vocab_size": 64}), 0)
    series = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 45.0]
    for i, v in enumerate(series):
        found += det.observe(_ev("step", {"step": i * 10, "loss": 2.0, "lr": [0.1], "attn_logit_max": {"b1": v}}), 0)
    assert _anomalies(found) == [(60, None)]
    closed = det.observe(_ev("run_start", {"vocab_size": 64, "resumed": True}), 1)
    (f,) = closed
    assert f.resolved and f.step == 70 and [o["module"] for o in f.evidence["open"]] == ["b1"]
    assert "attention_logit_growth in b1" in f.message and "new attempt" in f.message
    assert det.observe(_ev("run_start", {"vocab_size": 64}), 2) == []  # nothing open: nothing to close
