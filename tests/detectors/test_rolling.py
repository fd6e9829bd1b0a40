"""RollingWindow agrees with the statistics module on every window it holds."""

from __future__ import annotations

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from trainmon.monitor.detectors.rolling import RollingWindow

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=500)
@given(st.lists(st.one_of(finite, st.just(math.nan), st.just(math.inf)), min_size=1, max_size=200), st.integers(1, 40))
def test_matches_statistics_over_the_last_values(xs: list[float], size: int) -> None:
    w = RollingWindow(size)
    for x in xs:
        w.add(x)
    kept = [x for x in xs if math.isfinite(x)][-size:]
    assert w.values() == kept and len(w) == len(kept)
    if kept:
        assert w.median() == statistics.median(kept)
        assert math.isclose(w.mean(), statistics.fmean(kept), rel_tol=1e-9, abs_tol=1e-6)
        assert math.isclose(w.std(), statistics.pstdev(kept), rel_tol=1e-6, abs_tol=1e-3)
        m = statistics.median(kept)
        assert math.isclose(w.mad(), 1.4826 * statistics.median([abs(x - m) for x in kept]), rel_tol=1e-9)
        assert min(kept) == w.quantile(0.0) and max(kept) == w.quantile(1.0)


def test_a_value_replacing_its_equal_leaves_every_statistic_as_a_fresh_window_has_it() -> None:
    """``add`` skips the sorted list when the value leaving equals the one arriving (a constant LR): the
    statistics must still be those of a window built from the same values, signed zeros included."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        size = rng.randint(1, 9)
        w = RollingWindow(size)
        for _ in range(40):
            x = rng.choice([0.0, -0.0, 1.0, 1.0, 2.5, -3.0, rng.random()])
            w.add(x)
            fresh = RollingWindow(size)
            for v in w.values():
                fresh.add(v)
            assert [math.copysign(1, v) for v in w._sorted] == [math.copysign(1, v) for v in fresh._sorted]
            assert w._sorted == fresh._sorted
            assert w.median() == fresh.median() and w.mad() == fresh.mad()
            assert w.mad_bounds()[0] <= w.mad() <= w.mad_bounds()[1]
