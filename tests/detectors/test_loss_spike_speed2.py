"""loss_spike's gate decides what the full rule would (issue 24): most steps are decided by a floor of the level and a
floor of sigma that hold for ``window // 4`` accepted losses, without the level's median or sigma; and the grad norms'
median, taken from a plain deque, is the window's."""

from __future__ import annotations

import collections
import math
import random
import statistics

import pytest

from tests.detectors.helpers import ev, feed, start
from trainmon.monitor.detectors.loss_spike import LossSpike, LossSpikeConfig, _median_floor
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow

_SPECIAL = [0.0, -0.0, 1e-300, -1e-300, 1e308, -1e308, 1.7976931348623157e308, 5e-324, math.nan, math.inf, -math.inf]


def _value(rng: random.Random, pool: list[float]) -> float:
    r = rng.random()
    if r < 0.1:
        return rng.choice(_SPECIAL)
    if r < 0.4 and pool:
        return rng.choice(pool)  # a tie
    return round(rng.gauss(rng.choice([0.0, 2.0, -5.0]), rng.choice([1e-6, 0.1, 3.0, 1e6])), rng.choice([1, 3, 12]))


def test_the_median_floor_holds_for_its_adds() -> None:
    rng = random.Random(3)
    for trial in range(4000):
        w = RollingWindow(rng.choice([1, 2, 3, 4, 5, 8, 9, 64, 128]))
        pool: list[float] = []
        for _ in range(rng.choice([0, 1, 2, 3, 5, 17, 40, 200])):
            x = _value(rng, pool)
            pool.append(x)
            w.add(x)
        adds = rng.choice([0, 1, 2, 3, 8, 16, 32, 63])
        floor = _median_floor(w, adds)
        for _ in range(rng.randint(0, adds)):
            x = _value(rng, pool)
            pool.append(x)
            w.add(x)
            assert not len(w) or floor <= w.median(), (trial, floor, w.median())
        assert not len(w) or floor <= w.median(), (trial, floor, w.median())


def test_the_norms_median_is_the_windows() -> None:
    rng = random.Random(4)
    for _ in range(3000):
        size = rng.choice([4, 5, 64])
        lazy, plain = LazyWindow(size), collections.deque(maxlen=size)
        for _ in range(rng.choice([4, 5, 6, 63, 64, 65, 300])):
            x = rng.choice([rng.uniform(0, 1e-3), rng.lognormvariate(0, 3), 1.7976931348623157e308, 5e-324, 1.0])
            x = round(x, rng.choice([2, 12])) or 5e-324
            lazy.add(x)
            plain.append(x)
        assert statistics.median(plain) == lazy.median()


class _Reference(LossSpike):
    """The rule as it was: the level's median and sigma read at every warm step (no gate)."""

    def _open_gate(self) -> None:
        self._left, self._floor, self._bar = math.inf, -math.inf, -math.inf


_CONFIGS = [
    LossSpikeConfig(),
    LossSpikeConfig(z=2.0, tail_min_z=3.0, min_abs=0.0, min_rel=0.0),
    LossSpikeConfig(z=0.5, tail_min_z=0.1, window=4, min_history=2, min_abs=0.0, min_rel=0.0),
    LossSpikeConfig(window=1, min_history=1),
    LossSpikeConfig(window=3, min_history=2, z=1.0, tail_min_z=1.0, min_abs=0.0, min_rel=0.0),
    LossSpikeConfig(window=9, min_history=4, z=1.5, tail_min_z=0.5, min_abs=0.0, min_rel=0.0),
]


def _series(rng: random.Random, n: int) -> list[float]:
    level, out = rng.choice([rng.uniform(-3, 10), 0.0, 1e6, 1e300]), []
    noise = rng.choice([0.0, 1e-9, 0.01, 0.1, 1.0]) * max(1.0, abs(level))
    for t in range(n):
        level *= 1 - rng.uniform(0, 0.003)
        x = level + rng.gauss(0, noise)
        r = rng.random()
        if r < 0.03:
            x = level * rng.uniform(1.2, 30) + rng.uniform(0, 3) * max(noise, 1.0)  # a spike
        elif r < 0.04:
            x = rng.choice([math.nan, math.inf, -math.inf, 1.7976931348623157e308, -1.7976931348623157e308])
        elif r < 0.1 and t:
            x = out[-1]  # a tie
        elif r < 0.12:
            x = level + rng.uniform(2, 6) * noise  # a step near the gate's bars
        out.append(round(x, rng.choice([2, 4, 12])) if math.isfinite(x) else x)
    return out


@pytest.mark.parametrize("cfg", _CONFIGS)
def test_the_gated_detector_finds_what_the_reference_does(cfg: LossSpikeConfig) -> None:
    rng = random.Random(13)
    found = 0
    for seed in range(14):
        losses = _series(rng, rng.choice([10, 70, 400, 1500]))
        events = [start()]
        step = 0
        for t, loss in enumerate(losses):
            step += rng.choice([1, 1, 1, 10]) if rng.random() > 0.01 else -5  # a log every N steps, a rewind
            f = {"step": step, "loss": loss, "grad_norm": abs(rng.gauss(1, 0.3)), "lr": [1e-3]}
            events.append(ev("step", f, float(t)))
            if t in (len(losses) // 3, 2 * len(losses) // 3):
                events.append(start(resumed=rng.random() < 0.5))  # a resume, or a restart from scratch
        events.append(ev("run_end", {"status": "finished", "step": step}))
        got, want = feed(LossSpike(cfg), events), feed(_Reference(cfg), events)
        assert got == want, seed
        found += len(got)
    assert found  # the series do spike
