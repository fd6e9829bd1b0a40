"""lr_schedule_drift's per-step shortcuts (issue 24) against the definitions they replace.

* ``_Resolution.add`` is skipped for an LR at or above ``inert_from``: the resolution then learns exactly
  what adding every LR teaches it.
* The count of consecutive decreases stops at 3 (only whether it reached 2 is read): ``_decaying`` is what
  the uncounted definition gives, and a step is "the same LR" as before by the definition with ``abs``.
"""

from __future__ import annotations

import math
import random

import pytest

from tests.detectors.helpers import ev
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.lr_schedule_drift import _SAME, LrScheduleDrift, _Resolution


def _lrs(rng: random.Random, n: int) -> list[float]:
    kind = rng.randrange(4)
    if kind == 0:  # full precision, a decay
        return [1e-3 * (1 - i / n) + rng.random() * 1e-12 for i in range(n)]
    if kind == 1:  # printed: 3 significant digits, levels held
        return [float(f"{1e-3 * math.cos(i / n):.3g}") for i in range(n)]
    if kind == 2:  # ties, zeros, tiny and huge values
        pool = [0.0, -0.0, 1e-31, 5e-324, 1e-3, 1e-3, 2e-3, 1.7976931348623157e308, 0.1, 1e-7, 9.99e-8]
        return [rng.choice(pool) for _ in range(n)]
    return [rng.choice([1.0, 0.5, 0.25, 3e-4, 2.9999999999999997e-4, 1e-10]) * rng.random() for _ in range(n)]


@pytest.mark.parametrize("seed", range(200))
def test_skipping_inert_values_learns_what_adding_every_value_does(seed: int) -> None:
    rng = random.Random(seed)
    values = _lrs(rng, rng.randrange(1, 300)) + _lrs(rng, rng.randrange(1, 300))
    min_values = rng.choice([1, 2, 8])
    every, skipping = _Resolution(min_values), _Resolution(min_values)
    for x in values:
        every.add(x)
        if x < skipping.inert_from:
            skipping.add(x)
        assert (skipping.sig, skipping.decimals) == (every.sig, every.decimals)
        for q in (x, 1e-3, 0.5):
            assert skipping.quantum(q) == every.quantum(q)


def _trace(rng: random.Random) -> list[float]:
    """LRs that warm up, decay, hold, jump back up and step down, with ties and values near zero."""
    out: list[float] = []
    lr = rng.choice([1e-3, 1e-25, 1e-31, 0.0])
    for _ in range(rng.randrange(1, 400)):
        move = rng.random()
        if move < 0.35:
            lr *= rng.choice([0.999, 0.9, 0.4])
        elif move < 0.6:
            pass  # held
        elif move < 0.75:
            lr = lr * (1 + _SAME / 2) if rng.random() < 0.5 else lr + 1e-4  # within _SAME, or a rise
        elif move < 0.85:
            lr = rng.choice([0.0, -0.0, 1e-31, 1e-25, 1e-3])
        else:
            lr = rng.choice([lr * 0.5, lr * 2, 1e-3])
        out.append(lr)
    return out


@pytest.mark.parametrize("seed", range(300))
def test_decaying_and_equal_runs_follow_the_uncounted_definition(seed: int) -> None:
    rng = random.Random(seed)
    det = LrScheduleDrift(DetectorsConfig().lr_schedule_drift)
    ref = {"decreases": 0, "decaying": False}
    check = det._check_inferred
    fresh = det._fresh_start

    def fresh_start() -> None:
        fresh()
        ref["decreases"], ref["decaying"] = 0, False

    def checked(step: int, lr: float) -> object:
        prev, equal_run = det._prev, det._equal_run
        out = check(step, lr)
        if prev is not None:
            scale = abs(prev)
            same = abs(lr - prev) <= _SAME * (scale if scale >= 1e-30 else 1e-30)
            assert det._equal_run == (equal_run + 1 if same else 0)
            if not same and lr < prev:
                ref["decaying"] = ref["decreases"] >= 2
                ref["decreases"] += 1
            elif not same:
                ref["decaying"], ref["decreases"] = False, 0
        assert det._decaying == ref["decaying"]
        return out

    det._check_inferred = checked  # type: ignore[method-assign]
    det._fresh_start = fresh_start  # type: ignore[method-assign]
    step = 0
    for attempt in range(rng.randrange(1, 4)):
        det.observe(ev("run_start", {"planned_steps": 1000}), attempt)
        if attempt and rng.random() < 0.5:
            step = 0  # the run starts over: its inferred schedule is learnt again
        for lr in _trace(rng):
            step += 1
            det.observe(ev("step", {"step": step, "lr": [lr]}), attempt)
