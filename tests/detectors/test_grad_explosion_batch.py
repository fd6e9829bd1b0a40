"""grad_explosion's observe_batch proves runs of norms within the floor's bar from numpy's logs, with a slack for
numpy's rounding, and moves their baselines in one go (issue 24): it ends every batch in the state, and with the
outputs, of the detector fed one step at a time. On the streams of its speed test (spikes, bursts, heavy upper modes,
level shifts, flat and missing losses, clip coefficients, resumes) under its configurations, on streams with
per-layer norms, and on norms placed at the bar itself: within a few ulps of the floor (as it falls along a batch)
times ``min_ratio``, where numpy's log and ``math.log`` may disagree."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from tests.detectors.batch_state import check_batches
from tests.detectors.helpers import ev, start
from tests.detectors.test_grad_explosion_speed import _CONFIGS, _stream
from trainmon.monitor.detectors.grad_explosion import GradExplosion, GradExplosionConfig
from trainmon.wire import Event


@pytest.mark.parametrize("cfg", _CONFIGS, ids=["default", "tiny", "low-bar", "odd"])
def test_grad_explosion_batches_keep_the_state_of_one_step_at_a_time(cfg: GradExplosionConfig) -> None:
    rng = random.Random(24)
    found = sum(check_batches(GradExplosion, cfg, _stream(seed, 3000), rng) for seed in range(16))
    assert found > 20  # the streams open and close episodes: the check is not only of quiet steps


def _at_the_bar(seed: int, cfg: GradExplosionConfig, n: int = 3000) -> list[Event]:
    """Norms whose log is the floor plus log(min_ratio), give or take a few ulps or 1e-9, a third of the time: the
    floor read off a detector fed the stream so far; now and then a low norm lowers it, and per-layer norms."""
    rng = random.Random(seed)
    ref = GradExplosion(cfg)
    evs = [start()]
    ref.observe(evs[0], 0)
    for t in range(n):
        norm = math.exp(rng.gauss(0.0, 0.3))
        floor = ref._floor
        if floor is not None and rng.random() < 0.3:
            norm = math.exp(floor + ref._min_bar + rng.choice([-1e-9, -1e-12, 0.0, 1e-12]))
            for _ in range(rng.choice([0, 0, 1, 2, 3])):
                norm = math.nextafter(norm, rng.choice([0.0, math.inf]))
        elif rng.random() < 0.02:
            norm *= 0.2
        fields: dict[str, Any] = {"step": t, "loss": 2.0 * math.exp(0.05 * rng.gauss(0, 1)), "grad_norm": norm}
        if rng.random() < 0.1:
            fields["layer_grad_norms"] = {"a": norm / 2, "b": rng.choice([norm / 3, math.nan])}
        e = ev("step", fields, float(t))
        ref.observe(e, 0)
        evs.append(e)
    return evs


@pytest.mark.parametrize("cfg", _CONFIGS, ids=["default", "tiny", "low-bar", "odd"])
def test_grad_explosion_batches_decide_norms_at_the_bar_as_one_step_at_a_time(cfg: GradExplosionConfig) -> None:
    rng = random.Random(24)
    for seed in range(8):
        check_batches(GradExplosion, cfg, _at_the_bar(seed, cfg), rng)


def _split_pair() -> tuple[float, float] | None:
    """Norms ``low`` and ``high`` where numpy's log puts ``high`` within ``min_ratio`` of ``low`` and ``math.log``
    puts it just past: ``high`` a spike over a flat baseline of ``low`` only by ``math.log``'s reckoning."""
    rng = random.Random(7)
    bar = math.log(GradExplosionConfig().min_ratio)
    highs = [math.exp(rng.uniform(-1.0, 1.0)) for _ in range(20000)]  # numpy and math disagree near 1
    for high, x_np in zip(highs, np.log(np.array(highs)).tolist(), strict=True):
        x = math.log(high)
        if x_np >= x:
            continue
        low = high / 3
        for _ in range(200):
            low = math.nextafter(low, 0.0)
        for _ in range(400):
            floor = math.log(low)
            if x - floor > bar and x_np - floor <= bar:
                return low, high
            low = math.nextafter(low, math.inf)
    return None


def test_grad_explosion_batches_take_a_norm_past_the_bar_by_an_ulp_as_a_spike() -> None:
    pair = _split_pair()
    if pair is None:
        pytest.skip("numpy's log agrees with math.log here: no norm to split")
    low, high = pair
    norms = [low] * 40 + [high] + [low] * 20
    losses = [2.0 + 0.01 * (t * 7 % 5) for t in range(len(norms))]  # not flat: the spike is judged
    steps = [{"step": t, "loss": loss, "grad_norm": v} for t, (loss, v) in enumerate(zip(losses, norms, strict=True))]
    evs = [start(), *(ev("step", fields, float(t)) for t, fields in enumerate(steps))]
    cfg = GradExplosionConfig()
    one = GradExplosion(cfg)
    found = [f for e in evs for f in one.observe(e, 0)]
    assert found[0].message.startswith("grad-norm spike at step 40")  # the spike, by math.log's reckoning
    for seed in range(20):
        check_batches(GradExplosion, cfg, evs, random.Random(seed))
