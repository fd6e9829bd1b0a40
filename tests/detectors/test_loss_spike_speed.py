"""loss_spike's cheap steps decide what the full rule would (issue 24): a loss at or below the level, or less than
min(z, tail_min_z) sigma above it, is neither a spike nor an excursion, so sigma and the threshold are not asked."""

from __future__ import annotations

import math
import random

import pytest

from tests.detectors.helpers import ev, feed, start
from trainmon.monitor.detectors.loss_spike import LossSpike, LossSpikeConfig

_CONFIGS = [
    LossSpikeConfig(),  # the defaults
    LossSpikeConfig(z=2.0, tail_min_z=3.0),  # the spike bar below the excursion bar
    LossSpikeConfig(z=3.0, tail_min_z=3.0, min_abs=0.0, min_rel=0.0),
    LossSpikeConfig(z=0.5, tail_min_z=0.1, window=4, min_history=2),
]


class _Ungated(LossSpike):
    """The rule as it was: sigma, the threshold and the excursion test asked at every loss above the level."""

    def __init__(self, config: LossSpikeConfig) -> None:
        super().__init__(config)
        self._least_z = -math.inf


def _losses(losses: list[float]) -> list[float]:
    out = []
    for x in losses:
        out += [x, math.nextafter(x, math.inf), math.nextafter(x, -math.inf)]
    return out


@pytest.mark.parametrize("cfg", _CONFIGS)
def test_a_loss_the_gate_lets_pass_is_neither_a_spike_nor_an_excursion(cfg: LossSpikeConfig) -> None:
    rng = random.Random(7)
    for trial in range(400):
        det = LossSpike(cfg)
        scale = rng.choice([1e-9, 1e-3, 1.0, 7.0, 1e6])
        for _ in range(rng.choice([0, 3, 5, 40, 200])):  # a short, a tiny and a full window of differences
            det._diffs.add(round(abs(rng.gauss(0, scale)), rng.choice([2, 6, 12])))  # ties when rounded
        level = rng.choice([0.0, -scale, scale, scale * rng.uniform(-3, 3)])
        sigma = det._sigma(level)
        threshold = det._threshold(level, sigma, cfg.z)
        bars = [level, level + det._least_z * sigma, level + cfg.tail_min_z * sigma, threshold]
        for loss in _losses(bars + [level + rng.uniform(-5, 10) * sigma for _ in range(5)]):
            if loss > level and loss - level >= det._least_z * sigma:
                continue
            assert not loss > threshold, (trial, loss, level, sigma)
            assert not loss - level >= cfg.tail_min_z * sigma, (trial, loss, level, sigma)


def test_sigma_is_its_definition() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        det = LossSpike(LossSpikeConfig())
        scale = rng.choice([0.0, 1e-12, 1e-6, 1e-3, 1.0, 1e300])
        for _ in range(rng.choice([4, 5, 9, 128, 300])):
            det._diffs.add(round(abs(rng.gauss(0, scale)), rng.choice([2, 12])))
        n = len(det._diffs)
        for level in (0.0, 1e-4, -1e-4, rng.uniform(-1e4, 1e4), 1e300):
            raw = 1.4826 * det._diffs.median() / math.sqrt(2.0) * (1.0 + 1.7 / math.sqrt(n))
            assert det._sigma(level) == max(raw, abs(level) * 1e-3, 1e-6)


def _series(rng: random.Random, n: int) -> list[float]:
    level, out = rng.uniform(-1, 10), []
    for t in range(n):
        level *= 1 - rng.uniform(0, 0.002)
        x = level + rng.gauss(0, rng.choice([0.01, 0.1]))
        r = rng.random()
        if r < 0.02:
            x = level * rng.uniform(1.5, 30) + rng.uniform(0, 2)  # a spike
        elif r < 0.03:
            x = rng.choice([math.nan, math.inf, -math.inf])
        elif r < 0.05 and t:
            x = out[-1]  # a tie
        out.append(round(x, rng.choice([2, 4, 12])) if math.isfinite(x) else x)
    return out


@pytest.mark.parametrize("cfg", _CONFIGS)
def test_the_gated_detector_finds_what_the_ungated_one_does(cfg: LossSpikeConfig) -> None:
    rng = random.Random(11)
    for seed in range(12):
        losses = _series(rng, rng.choice([30, 400, 1500]))
        events = [start()]
        for t, loss in enumerate(losses):
            f = {"step": t, "loss": loss, "grad_norm": abs(rng.gauss(1, 0.3)), "lr": [1e-3]}
            events.append(ev("step", f, float(t)))
            if t == len(losses) // 2:
                events.append(start(resumed=seed % 2 == 0))  # a resume, or a restart from scratch
        events.append(ev("run_end", {"status": "finished", "step": len(losses) - 1}))
        got, want = feed(LossSpike(cfg), events), feed(_Ungated(cfg), events)
        assert got == want, seed
