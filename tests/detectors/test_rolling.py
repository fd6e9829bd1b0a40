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
