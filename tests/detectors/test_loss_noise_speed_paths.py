"""``loss_noise``'s fast paths of session 18 (issue 24) leave what ``observe`` one event at a time leaves: the screen
that carries on past a rise it followed, one entry at a time, into the next rise of a cluster (``_carry``), and the
floors an even window's two middle deviations share (``mad_floors``). Streams whose noise hovers about
``admit_ratio`` in bursts a few entries apart (rises in clusters, each keeping entries out of the baseline, some
crossing ``ratio``: streaks that start and fail, findings that open and resolve), with missing, NaN, infinite,
non-positive and non-float losses, resumes, and batches from one event to thousands; the carry shown to follow
rises of its own and to hand back to a new scan."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.detectors.helpers import ev, start
from tests.detectors.test_loss_noise_batch import _state
from tests.detectors.test_loss_noise_rises import finite_values
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import loss_noise
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.rolling import mad_floors, sorted_mad
from trainmon.wire import Event


def _stream(seed: int, n: int = 5000) -> list[Event]:
    """A quiet baseline, then bursts of noise 1.6-2.4x it, 3-25 entries long and 1-60 apart (the recent MAD crossing
    the bar and back in clusters), a long one at 3x now and then (a finding), a slow fall (the relative noise alone
    up); odd losses, resumes and LR doublings scattered through."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": rng.choice([0, 40])})]
    level, base, lr = rng.uniform(0.5, 4.0), rng.choice([0.005, 0.02]), 1e-3
    plan = [(1.0, 0.0, 500)]
    while sum(p[2] for p in plan) < n:
        roll = rng.random()
        if roll < 0.04:
            plan.append((3.0, 0.0, rng.randint(150, 300)))
        elif roll < 0.07:
            plan.append((1.8, 0.004, 200))
        else:
            plan.append((rng.uniform(1.6, 2.4), 0.0, rng.randint(3, 25)))
        plan.append((1.0, 0.0, rng.choice([rng.randint(1, 12), rng.randint(20, 60), rng.randint(100, 300)])))
    t = 0
    for factor, fall, length in plan:
        if rng.random() < 0.03:
            lr *= 2.0
        for _ in range(length):
            if rng.random() < 0.0004:
                evs.append(start(resumed=True, schedule={"warmup_steps": t + rng.choice([0, 60])}))
            level *= 1.0 - fall
            loss: Any = level * math.exp(base * factor * rng.gauss(0, 1))
            roll = rng.random()
            if roll < 0.002:
                loss = rng.choice([None, math.nan, math.inf, -math.inf, 0.0, -1.0, 3, "1.0"])
            elif roll < 0.0025:
                loss = rng.choice([1e-300, 1e300, 5e-324])
            fields: dict[str, Any] = {"step": t, "loss": loss, "lr": [lr]}
            if rng.random() < 0.2:
                fields["batch_fingerprint"] = f"{seed}-{t % 97}"
            evs.append(ev("step", fields, float(t)))
            t += 1
    return evs


def test_clustered_rises_carried_leave_what_observe_does(monkeypatch: Any) -> None:
    cfg = DetectorsConfig().loss_noise
    carry, follow = LossNoise._carry, LossNoise._follow
    carried = handed_back = followed = 0
    inside = False

    def counted_carry(self: LossNoise, *args: Any) -> Any:
        nonlocal carried, handed_back, inside
        inside = True
        got = carry(self, *args)
        inside = False
        carried += 1
        handed_back += not got[4] and got[0] < len(args[0].joins)
        return got

    def counted_follow(self: LossNoise, *args: Any) -> Any:
        nonlocal followed
        got = follow(self, *args)
        followed += inside and bool(got)
        return got

    monkeypatch.setattr(LossNoise, "_carry", counted_carry)
    monkeypatch.setattr(LossNoise, "_follow", counted_follow)
    fired = 0
    for seed in range(10):
        rng = random.Random(seed)
        evs = _stream(seed)
        one, cut = LossNoise(cfg), LossNoise(cfg)
        got: list[list[Any]] = []
        i = 0
        while i < len(evs):
            size = rng.choice([1, 7, rng.randint(64, 300), rng.randint(300, 3000)])
            batch = evs[i : i + size]
            want = [one.observe(e, 0) for e in batch]
            cut.observe_batch(batch, [0] * len(batch), got)
            assert repr(got[-len(batch) :]) == repr(want), f"seed {seed}, batch at {i}"
            assert _state(cut) == _state(one), f"seed {seed}, after the batch at {i}"
            fired += sum(map(len, want))
            i += size
    assert fired >= 5, "the streams must open findings"
    assert carried > 60 and followed > 40, "the carry must follow rises of its own"
    assert handed_back > 30, "and hand back to a new scan"


def test_a_carry_of_one_entry_leaves_what_observe_does(monkeypatch: Any) -> None:
    """The carry left after each quiet entry (and never taking one: ``_CARRY`` 0) changes nothing either."""
    cfg = DetectorsConfig().loss_noise
    for carry in (0, 1):
        monkeypatch.setattr(loss_noise, "_CARRY", carry)
        for seed in (11, 12):
            evs = _stream(seed, 3000)
            one, cut = LossNoise(cfg), LossNoise(cfg)
            got: list[list[Any]] = []
            want = [one.observe(e, 0) for e in evs]
            for i in range(0, len(evs), 1000):
                cut.observe_batch(evs[i : i + 1000], [0] * len(evs[i : i + 1000]), got)
            assert repr(got) == repr(want) and _state(cut) == _state(one), (carry, seed)


@settings(max_examples=1000)
@given(
    st.lists(finite_values, min_size=1, max_size=90),
    st.sampled_from([2, 4, 6, 10, 20, 50, 150]),
    st.integers(1, 12),
)
def test_an_even_windows_shared_floor_holds_under_its_mad(xs: list[float], size: int, block: int) -> None:
    if len(xs) < size:
        xs = xs * (size // len(xs) + 1)
    floors = mad_floors(np.array(xs), size, block)
    for j, floor in enumerate(floors.tolist()):
        assert floor <= sorted_mad(sorted(xs[j : j + size])), (j, floor)
