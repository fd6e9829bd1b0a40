"""The shortcuts that make lr_schedule_drift, divergence, hang and degenerate cheaper per event give what
the computations they replace gave, on random and adversarial inputs (issue 24)."""

from __future__ import annotations

import collections
import math
import random
import statistics
from decimal import Decimal

import pytest

from trainmon.monitor.detectors.lr_schedule_drift import _Resolution
from trainmon.monitor.detectors.rolling import RollingWindow


def _parsed(x: float) -> tuple[int, int]:
    """(significant digits, decimals) of ``x``'s repr: what _Resolution learnt from every value before."""
    t = Decimal(repr(x)).normalize().as_tuple()
    assert isinstance(t.exponent, int)
    return len(t.digits), -t.exponent


def _lrs(rng: random.Random) -> list[float]:
    """LR streams: full precision, printed to a few digits or decimals, near and at powers of ten, tiny."""
    kind = rng.randrange(6)
    n = rng.randrange(1, 400)
    peak = 10.0 ** rng.uniform(-7, 0)
    full = [peak * 0.5 * (1 + math.cos(math.pi * i / n)) for i in range(n)]
    if kind == 0:
        return full
    if kind == 1:
        digits = rng.randrange(1, 8)
        return [float(f"{x:.{digits}g}") for x in full]
    if kind == 2:
        return [round(x, rng.randrange(3, 12)) for x in full]
    if kind == 3:  # the floats nearest to powers of ten, and their neighbours
        out = []
        for _ in range(n):
            p = float(f"1e{rng.randrange(-30, 3)}")
            out.append(rng.choice([p, math.nextafter(p, 0.0), math.nextafter(p, math.inf)]))
        return out
    if kind == 4:  # subnormal and huge
        return [rng.choice([5e-324, 1e-310, 2.5e-320, 1e300, 1.7976931348623157e308, 0.0, -1e-3]) for _ in range(n)]
    return [rng.choice(full + [float(f"{x:.3g}") for x in full]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(300))
def test_the_printing_resolution_is_what_parsing_every_value_gives(seed: int) -> None:
    rng = random.Random(seed)
    values = _lrs(rng) + _lrs(rng)
    res = _Resolution(min_values=rng.choice([1, 2, 8]))
    sig = decimals = 0
    for x in values:
        res.add(x)
        if x > 0:
            s, d = _parsed(x)
            sig, decimals = max(sig, s), max(decimals, d)
        assert (res.sig, res.decimals) == (sig, decimals)


def _windows(rng: random.Random) -> list[float]:
    kind = rng.randrange(4)
    n = rng.randrange(1, 300)
    if kind == 0:
        return [rng.gauss(0, 1) for _ in range(n)]
    if kind == 1:  # ties, signed zeros
        return [rng.choice([0.0, -0.0, 1.0, 1.0, 2.5, -2.5]) for _ in range(n)]
    if kind == 2:  # huge and tiny magnitudes: the mean of the two middle values rounds
        return [rng.choice([1.7976931348623157e308, -1.7976931348623157e308, 5e-324, 3.0, 0.1]) for _ in range(n)]
    return [float(rng.randrange(-3, 4)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(200))
def test_a_median_taken_on_demand_is_the_rolling_windows(seed: int) -> None:
    """divergence's loss noise, degenerate's train losses and grad norms, hang's strides: a deque of the
    last values, their median taken only where a rule needs it (statistics.median, or a window built
    from them), equals the rolling window kept at every event before; odd, even and tiny windows."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 3, 4, 5, 32, 64])
    window, recent = RollingWindow(size), collections.deque(maxlen=size)
    for x in _windows(rng):
        window.add(x)
        recent.append(x)
        built = RollingWindow(len(recent))
        for y in recent:
            built.add(y)
        want = window.median()
        for got in (statistics.median(recent), built.median()):
            assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def test_the_quantum_only_raises_the_bar() -> None:
    """lr_schedule_drift compares an LR with ``floor * (1 + tol) + quantum`` only when it is above
    ``floor * (1 + tol)``: a float sum with a non-negative term is never below the other term."""
    rng = random.Random(0)
    for _ in range(200_000):
        bar = 10.0 ** rng.uniform(-12, 2) * rng.choice([1.0, 1.01])
        q = rng.choice([0.0, 5e-324, 10.0 ** rng.uniform(-20, 0)])
        lr = bar * rng.choice([1.0, 1 + 1e-16, 1 - 1e-16, rng.uniform(0.9, 1.1)])
        assert not (lr > bar + q) or lr > bar
