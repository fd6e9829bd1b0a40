"""loss_spike's observe_batch leaves the detector exactly as observe does, batch after batch (issue 24).

The screen accepts runs of steps in bulk from the windows and gate schedule it reads off the known series, so
every piece of state it moves (both windows, sorted lists included, the gate, the deques of recent steps, LRs, gaps
and norms, the counters) is compared after every batch, not only the findings: on series built to hit its edges
(the episode's closing entry inside a screened run, excursions, a resume that forgets the previous loss, ``-0.0``
beside ``0.0`` in the level window, constant stretches, differences that overflow, fields of other types) and on
windows down to the smallest the screen takes (two losses, four differences).
"""

from __future__ import annotations

import math
import random

import pytest

from tests.detectors.helpers import ev, start
from trainmon.monitor.detectors.loss_spike import LossSpike, LossSpikeConfig
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.wire import Event

_CONFIGS = [
    LossSpikeConfig(),
    LossSpikeConfig(episode_quiet=7, episode_quiet_max=9),  # episodes close inside screened runs
    LossSpikeConfig(window=2, min_history=2, episode_quiet=5),  # the smallest windows the screen takes
    LossSpikeConfig(window=3, min_history=2, z=1.0, tail_min_z=1.0, min_abs=0.0, min_rel=0.0),
    LossSpikeConfig(window=9, min_history=4, z=1.5, tail_min_z=0.5, min_abs=0.0, min_rel=0.0, episode_quiet=20),
    LossSpikeConfig(window=1, min_history=1),  # never screened: the differences' window holds two
]


def _state(det: LossSpike) -> dict[str, str]:
    """Every attribute, windows as their values in order and their sorted lists (repr: -0.0 is not 0.0)."""
    out = {}
    for name, value in vars(det).items():
        if isinstance(value, RollingWindow):
            value = (value.values(), value._sorted)
        out[name] = repr(value)
    return out


def _loss(rng: random.Random, level: float, noise: float, prev: object) -> object:
    r = rng.random()
    if level == 0.0 and r < 0.8:
        return rng.choice([0.0, -0.0])  # a memorised run: the windows' sorted lists keep each zero's sign in place
    if r < 0.01:
        return level * rng.uniform(1.5, 30) + rng.uniform(0, 3) * max(noise, 1.0)  # a spike
    if r < 0.03:
        return level + rng.uniform(2, 7) * noise  # an excursion, or near the gate's bars
    if r < 0.035:
        return rng.choice([math.nan, math.inf, -math.inf, None])
    if r < 0.038:
        return rng.choice([0.0, -0.0])
    if r < 0.0385:
        return rng.choice([1.7976931348623157e308, -1.7976931348623157e308])  # a difference that overflows
    if r < 0.039:
        return rng.choice([2, True, "1.5"])  # not a float: the whole run is observe's
    if r < 0.1:
        return prev  # a tie
    return round(level + rng.gauss(0, noise), rng.choice([2, 4, 12]))


def _stream(rng: random.Random, n: int) -> list[Event]:
    level = rng.choice([rng.uniform(0.5, 10), 0.0, 1e-3, 1e6])
    noise = rng.choice([0.0, 1e-9, 0.01, 0.1]) * max(1.0, abs(level))
    events, step, prev = [start()], 0, None
    for t in range(n):
        level *= 1 - rng.uniform(0, 0.002)
        if rng.random() < 0.003:
            noise = rng.choice([0.0, 0.01, 0.1]) * max(1.0, abs(level))  # a constant stretch, or noise again
        loss = _loss(rng, level, noise, prev)
        prev = loss
        step += rng.choice([1, 1, 1, 10]) if rng.random() > 0.005 else rng.choice([-5, 0])
        fields: dict[str, object] = {"step": step, "loss": loss}
        if rng.random() < 0.97:
            fields["grad_norm"] = rng.choice([abs(rng.gauss(1, 0.3)), abs(rng.gauss(1, 0.3)), 0.0, -1.0, math.inf])
        if rng.random() < 0.95:
            fields["lr"] = [1e-3 * (1 + t // 300)] if rng.random() < 0.99 else 5e-3
        if loss is None:
            del fields["loss"]
        events.append(ev("step", fields, float(t)))
        if rng.random() < 0.002:
            events.append(start(resumed=rng.random() < 0.7))  # a resume forgets the previous loss, or a new run
        elif rng.random() < 0.001:
            events.append(ev("run_end", {"status": "finished", "step": step}))
    return events


@pytest.mark.parametrize("cfg", _CONFIGS)
def test_observe_batch_leaves_the_state_observe_leaves(cfg: LossSpikeConfig) -> None:
    rng = random.Random(17)
    found = 0
    for seed in range(10):
        events = _stream(rng, rng.choice([300, 2000, 6000]))
        one, cut = LossSpike(cfg), LossSpike(cfg)
        i = 0
        while i < len(events):
            batch = events[i : i + rng.choice([1, 5, 63, 64, 65, 200, 1000, 5000])]
            i += len(batch)
            attempts = [0] * len(batch)
            want = list(map(one.observe, batch, attempts))
            got: list[list] = []
            cut.observe_batch(batch, attempts, got)
            assert repr(got) == repr(want), (seed, i)
            assert _state(cut) == _state(one), (seed, i)
            found += sum(map(len, want))
    assert found  # the streams do spike
