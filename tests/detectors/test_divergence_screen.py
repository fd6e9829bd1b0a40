"""The shortcuts divergence's bulk path takes to read a run of steps (issue 24), each against the rule it stands for:
the medians of the run's windows (a transposition network over their columns, not a sort per window), the band's
envelope after a stretch of entries (the greatest of the chains each value starts, not a step per entry) and the checks
on the run's steps (on their int64 array)."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

import trainmon.monitor.detectors.divergence as divergence
from tests.detectors.test_divergence_batch import _check, _rise, _stream
from trainmon.monitor.detectors.divergence import _envelope_after, _enveloped, _envelopes, _medians


@pytest.mark.parametrize("size", range(1, 8))
def test_medians_are_the_sorted_windows_middles(size: int) -> None:
    rng = random.Random(size)
    for values in (
        [rng.gauss(0, 1) for _ in range(300)],
        [float(rng.randint(0, 3)) for _ in range(300)],  # ties
        sorted(rng.random() for _ in range(100)) + sorted((rng.random() for _ in range(100)), reverse=True),
    ):
        got = _medians(np.array(values), size).tolist()
        want = [statistics.median(values[i : i + size]) for i in range(len(values) - size + 1)]
        assert got == want


def _aboves(rng: random.Random, n: int) -> list[float]:
    """How far above its minimum a loss stood: mostly at it or near, now and then an excursion."""
    return [0.0 if rng.random() < 0.3 else rng.random() ** 4 * (3.0 if rng.random() < 0.01 else 0.2) for _ in range(n)]


@pytest.mark.parametrize("halflife", [1, 7, 200, 1000])
def test_the_envelope_after_a_stretch_is_the_loops_last(halflife: int, monkeypatch: pytest.MonkeyPatch) -> None:
    decay = 0.5 ** (1.0 / halflife)
    rng = random.Random(halflife)
    looped: list[int] = []
    monkeypatch.setattr(divergence, "_enveloped", lambda *a: looped.append(1) or _enveloped(*a))
    for n in (1, 2, 50, 3000):
        for env in (0.0, 0.3, 5.0, rng.random()):
            aboves = _aboves(rng, n)
            before = len(looped)
            assert _envelope_after(env, decay, np.array(aboves)) == _enveloped(env, decay, aboves)[-1]
            if env > 0 and halflife > 1:  # its chain stays a normal float: the greatest is found without the loop
                assert len(looped) == before
            for keep in (1, 200, n, n + 5):
                assert _envelopes(env, decay, np.array(aboves), keep) == _enveloped(env, decay, aboves)[-keep:]


def test_an_envelope_that_could_leave_the_normal_floats_is_looped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the normal floats a rounding is no longer relative: the chains' logarithms cannot tell the greatest; and
    where many chains are as great, decaying each would cost more than the loop."""
    looped: list[int] = []
    monkeypatch.setattr(divergence, "_enveloped", lambda *a: looped.append(1) or _enveloped(*a))
    cases = (
        (0.0, [0.0] * 100),
        (1e-300, [0.0, 1e-310, 0.0] * 200),
        (1.0, [0.0] * 5000),  # decayed by half an entry: 2**-5000
        (0.1, [0.2, math.inf, 0.1]),
        (0.01, [0.01 * 0.5**i for i in range(1, 40)]),  # falling as fast as the envelope decays: every chain as great
    )
    for env, aboves in cases:
        assert _envelope_after(env, 0.5, np.array(aboves)) == _enveloped(env, 0.5, aboves)[-1]
    assert len(looped) == len(cases)


def test_steps_beyond_exact_arithmetic_or_int64_are_left_to_observe() -> None:
    """A step of 2**53 or more (gaps inexact in float64) or of 2**63 (no int64) in a run: observe reads it."""
    losses = _rise(1500, 5, 10**6, 0.0, 0.05)
    for big in (2**53, 2**63, 2**70):
        steps = list(range(600)) + [big + i for i in range(900)]
        assert _check(_stream(losses, steps, extras=True), 5) > 0
    steps = [i - 700 for i in range(1500)]  # negative steps, then past the gate
    assert _check(_stream(losses, steps, extras=True), 5) > 0
