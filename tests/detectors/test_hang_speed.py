"""The shortcuts that make hang cheaper per step decide what the computations they replace decided, on random
and adversarial step intervals: ties, zeros, bursts, heavy tails, tiny windows (issue 24).

* A long pause (``recurring_factor`` x the median interval) is told on most steps by a lower bound of the median
  (``Hang._on_step``): the pauses recorded are those the median itself gives, for any factor.
* A silence shorter than the least timeout is no hang without computing the timeout (``Hang._check``): no
  timeout is ever below it.
"""

from __future__ import annotations

import collections
import math
import random
import statistics

import pytest

from tests.detectors.helpers import ev, start
from trainmon.monitor.detectors.hang import Hang, HangConfig


def _gaps(rng: random.Random) -> list[float]:
    """Step intervals: regular, jittery, tied, mostly zero, heavy-tailed, or with recurring long pauses."""
    n = rng.randrange(1, 400)
    kind = rng.randrange(6)
    if kind == 0:
        return [1.0] * n
    if kind == 1:
        return [rng.uniform(0.5, 1.5) for _ in range(n)]
    if kind == 2:
        return [rng.choice([0.0, 1.0, 2.0]) for _ in range(n)]
    if kind == 3:
        return [rng.choice([0.0, 0.0, 0.0, 1.0, 7.0]) for _ in range(n)]
    if kind == 4:
        return [rng.lognormvariate(0.0, 2.0) for _ in range(n)]
    every = rng.randrange(2, 12)
    return [rng.choice([30.0, 45.0]) if i % every == 0 else rng.uniform(0.9, 1.1) for i in range(n)]


@pytest.mark.parametrize("seed", range(300))
def test_the_long_pauses_are_those_the_median_gives(seed: int) -> None:
    rng = random.Random(seed)
    history = rng.choice([1, 2, 3, 4, 5, 7, 8, 64])
    factor = rng.choice([5.0, 5.0, 1.0, 0.5, 0.0, -1.0, math.inf])
    # no timeout is ever reached, so every interval is learnt: the window is the last ``history`` of them
    det = Hang(HangConfig(history=history, recurring_factor=factor, min_timeout=1e12, first_step_timeout=1e12))
    det.observe(start(), 0)
    learnt: collections.deque[float] = collections.deque(maxlen=history)
    t, last = 0.0, None
    for step, dt in enumerate(_gaps(rng)):
        t += dt
        det.observe(ev("step", {"step": step}, t=t), 0)
        st = det._ranks[0]
        if last is not None:
            gap = t - last  # the interval as the detector computes it
            long = bool(learnt) and gap >= factor * statistics.median(learnt)
            assert (bool(st.long_gaps) and st.long_gaps[-1] == (step, gap)) == long
            learnt.append(gap)
            assert st.median_floor <= statistics.median(learnt)
        last = t


@pytest.mark.parametrize("seed", range(100))
def test_no_timeout_is_below_the_least_one(seed: int) -> None:
    rng = random.Random(seed)
    config = HangConfig(
        min_timeout=rng.choice([0.0, 1.0, 60.0]),
        first_step_timeout=rng.choice([0.0, 5.0, 300.0]),
        history=rng.choice([1, 4, 64]),
    )
    det = Hang(config)
    det.observe(start(), 0)
    t = 0.0
    for step, dt in enumerate(_gaps(rng)):
        t += dt * rng.choice([1.0, 1.0, 100.0])
        det.observe(ev("step", {"step": step}, t=t), 0)
        st = det._ranks[0]
        assert det.timeout(st) >= det._least_timeout
        assert det.timeout(st, step + rng.randrange(1, 50)) >= det._least_timeout
