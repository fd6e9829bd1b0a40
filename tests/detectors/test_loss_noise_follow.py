"""``loss_noise``'s ``_follow`` one entry at a time returns what the numpy follow it replaced
returned, eight rows at a time: the same first entry back under the bar, the same None where a high one would start a
streak or the rise runs to the run's end, on windows with ties, signed zeros, values near the float's limit (infinite
absolute MADs) and baselines scaled to land on every side of ``admit_ratio`` and ``ratio``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.rolling import sorted_mad, sorted_mads


def _numpy_follow(det: LossNoise, run: SimpleNamespace, e: int, bdm: float, bam: float) -> int | None:
    """The follow as session 15 had it: eight rows at a time, the MADs from ``sorted_mads``."""
    c = det.config
    bar, ratio, off, end = c.admit_ratio, c.ratio, run.off, len(run.joins)
    if not bam > 0.0:
        return 0
    j = e
    while j < end:
        rows = np.arange(j, min(end, j + 8)) + off
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            rel = sorted_mads(run.rs[rows]) / bdm
            high = ~(rel < bar) & ~(sorted_mads(np.sort(run.awin[rows], axis=1)) / bam < bar)
        back = np.flatnonzero(~high)
        n = int(back[0]) if len(back) else len(rows)
        if not (rel[:n] < ratio).all():
            return None
        if len(back):
            return j + n - e
        j += len(rows)
    return None


_values = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 5e-324, 1.7e308, -1.7e308]),
    st.floats(-1e3, 1e3),
    st.floats(allow_nan=False, allow_infinity=False),
)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 20),
    st.sampled_from([3, 4, 7, 10, 50]),
    st.integers(0, 3),
    st.data(),
)
def test_follow_one_entry_at_a_time_is_the_numpy_follow(entries: int, w: int, off: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = entries + off
    if data.draw(st.booleans()):  # ordinary noise whose scale drifts: rises that end, streaks that would start
        scale = np.exp(rng.normal(0.0, 0.4, rows))[:, None]
        rel_rows, abs_rows = rng.normal(size=(rows, w)) * scale, rng.normal(size=(rows, w)) * scale
    else:
        rel_rows = np.array(data.draw(st.lists(_values, min_size=rows * w, max_size=rows * w))).reshape(rows, w)
        abs_rows = np.array(data.draw(st.lists(_values, min_size=rows * w, max_size=rows * w))).reshape(rows, w)
    run = SimpleNamespace(rs=np.sort(rel_rows, axis=1), awin=abs_rows, off=off, joins=np.zeros(entries, dtype=bool))
    det = LossNoise(DetectorsConfig().loss_noise)
    e = data.draw(st.integers(0, entries - 1))
    rel0 = sorted_mad(run.rs[e + off].tolist())
    for bdm in {rel0 / 1.7, rel0 / 2.5, rel0 / 1.5, float(rng.uniform(0.1, 2.0)), 1e-300}:
        for bam in (0.0, float(rng.uniform(0.1, 2.0)), 1e-300, 1e300):
            if bdm > 0.0:
                assert det._follow(run, e, bdm, bam) == _numpy_follow(det, run, e, bdm, bam)
