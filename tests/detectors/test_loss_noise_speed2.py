"""``loss_noise``'s absolute baseline is sorted only when read (issue 24): its MAD, which most entries need only
positive, is proven so from its ties for as many admissions as they allow. The proof holds through every admission
it covers, whatever is admitted (the most repeated value again and again, signed zeros, subnormals, overflowing
medians), and the detector finds exactly what its former every-entry rule found on logs whose differences tie: a
linear decline (every absolute difference equal, a zero MAD the relative one does not share), quantised losses,
a constant loss."""

from __future__ import annotations

import collections
import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.detectors.helpers import ev, start
from tests.detectors.test_loss_noise_speed import _FormerLossNoise
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.wire import Event

tied = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 5e-324, -5e-324, 1e-310, 1.7e308, -1.7e308]),
    st.integers(-2, 2).map(float),
    st.floats(allow_nan=False, allow_infinity=False),
)


def _admit(det: LossNoise, x: float) -> None:
    det._ba.add(x)
    det._admitted += 1


@settings(max_examples=3000)
@given(st.lists(tied, min_size=1, max_size=80), st.integers(1, 40), st.lists(tied, max_size=60), st.booleans())
def test_ties_prove_the_absolute_baselines_mad_positive_through_the_admissions_they_cover(
    xs: list[float], size: int, later: list[float], repeat: bool
) -> None:
    cfg = DetectorsConfig().loss_noise
    cfg.baseline = size
    det = LossNoise(cfg)
    for x in xs:
        _admit(det, x)
    det._ba_retry = det._admitted  # counted now
    proven = det._ba_positive()
    assert proven == (det._ba.mad() > 0)
    if det._ba_proven < det._admitted:
        return  # nothing proven ahead
    assert det._ba_retry == det._admitted  # a proof is no failed try
    for x in later if not repeat else [collections.Counter(det._ba._order).most_common(1)[0][0]] * len(later):
        if det._admitted >= det._ba_proven:
            break
        _admit(det, x)
        assert det._ba.mad() > 0, (xs, later, repeat)


def test_a_window_more_than_half_one_value_proves_nothing() -> None:
    det = LossNoise(DetectorsConfig().loss_noise)
    for x in [0.5] * 76 + [float(i) for i in range(74)]:
        _admit(det, x)
    assert det._ba.mad() == 0 and not det._ba_positive() and det._ba_proven < det._admitted
    assert det._ba_retry > det._admitted  # counted again only some admissions later


def _tied_stream(seed: int, n: int = 3000) -> list[Event]:
    """Segments of a linear decline (equal absolute differences: the absolute baseline's MAD zero, the relative
    one's not), a constant loss, losses quantised to 0.01-1 (ints too), and continuous noise quiet or 2-4x louder,
    with warmups, resumes and missing losses: the ties' proof made, failed, retried and covering noise rises."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": rng.choice([0, 40])})]
    level, left, shape, sigma, step = rng.uniform(1.0, 6.0), 0, "noise", 0.02, 1e-4
    for t in range(n):
        if not left:
            left = rng.randint(150, 700)
            shape = rng.choice(["noise", "noise", "linear", "constant", "quantised"])
            sigma = 0.02 * rng.choice([1.0, 1.0, 2.5, 4.0])
            step = rng.choice([1e-4, 2**-14])
        left -= 1
        if rng.random() < 0.0005:
            evs.append(start(resumed=True))
        if shape == "linear":
            level = max(0.05, level - step)
            loss: Any = level
        elif shape == "constant":
            loss = level
        elif shape == "quantised":
            q = rng.choice([0.01, 0.1, 1.0])
            loss = max(q, round(level * math.exp(sigma * rng.gauss(0, 1)) / q) * q)
            loss = int(loss) if q == 1.0 else loss
        else:
            loss = level * math.exp(sigma * rng.gauss(0, 1))
        if rng.random() < 0.003:
            loss = rng.choice([None, math.nan, 0.0])
        evs.append(ev("step", {"step": t, "loss": loss, "lr": [1e-3]}, float(t)))
    return evs


def test_loss_noise_finds_exactly_what_its_former_rule_found_on_tied_differences() -> None:
    cfg = DetectorsConfig().loss_noise
    fired = proven = failed = 0
    for seed in range(30):
        now, was = LossNoise(cfg), _FormerLossNoise(cfg)
        for e in _tied_stream(seed):
            found = now.observe(e, 0)
            assert found == was.observe(e, 0), f"seed {seed}, {e.fields}"
            fired += bool(found)
            proven += now._admitted < now._ba_proven
            failed += now._admitted < now._ba_retry
            assert (now._since, now._settled, now._hits, now._calm, now._open) == (
                was._since,
                was._settled,
                was._hits,
                was._calm,
                was._open,
            )
    assert fired and proven and failed, (fired, proven, failed)
