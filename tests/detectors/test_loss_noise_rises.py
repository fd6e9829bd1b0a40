"""``loss_noise``'s screen follows short rises and decides its baselines from floors (issue 24). ``mad_floors`` holds
under every window's ``sorted_mad`` (ties, signed zeros, subnormals, spans that overflow) and stays near it on
ordinary noise; ``sorted_mads`` is ``sorted_mad`` of each row; and the detector fed in batches at random cuts reports,
and ends in, what ``observe`` one event at a time does on streams whose noise hovers about ``admit_ratio`` (rises of
a few entries all the time, each keeping entries out of the baseline), crosses ``ratio`` now and then (streaks that
start and fail, findings that open and resolve) and rises in the relative noise alone (a falling loss), with the
screen shown to take most entries, rises included."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.detectors.helpers import ev, start
from tests.detectors.test_loss_noise_batch import _state
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.rolling import LazyWindow, mad_floors, sorted_mad, sorted_mads
from trainmon.wire import Event

finite_values = st.one_of(
    st.integers(-3, 3).map(float),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1e-300, 1.7e308, -1.7e308, 1e308]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e3, 1e3),
)


@settings(max_examples=1500)
@given(
    st.lists(finite_values, min_size=1, max_size=90),
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 11, 20, 33]),
    st.integers(1, 12),
)
def test_mad_floors_hold_under_every_windows_mad(xs: list[float], size: int, block: int) -> None:
    if len(xs) < size:
        xs = xs * (size // len(xs) + 1)
    floors = mad_floors(np.array(xs), size, block)
    assert len(floors) == len(xs) - size + 1
    for j, floor in enumerate(floors.tolist()):
        assert floor <= sorted_mad(sorted(xs[j : j + size])), (j, floor)


def test_mad_floors_stay_near_the_mad_of_ordinary_noise() -> None:
    """Not vacuous: on gaussian changes a floor is most of its window's MAD (a ninth under it, on average, for the
    baseline's windows)."""
    rng = np.random.default_rng(3)
    for size, block in [(150, 8), (151, 8), (50, 4)]:
        xs = rng.standard_normal(2000)
        floors = mad_floors(xs, size, block).tolist()
        exact = [sorted_mad(sorted(xs[j : j + size].tolist())) for j in range(len(floors))]
        shares = [f / m for f, m in zip(floors, exact, strict=True)]
        assert min(shares) > 0.5 and statistics.mean(shares) > 0.78, (size, block)


@settings(max_examples=800)
@given(st.lists(st.lists(finite_values, min_size=1, max_size=40), min_size=1, max_size=6), st.integers(1, 40))
def test_sorted_mads_are_each_rows_sorted_mad(rows: list[list[float]], size: int) -> None:
    rows = [sorted((r * (size // len(r) + 1))[:size]) for r in rows]
    got = sorted_mads(np.array(rows)).tolist()
    assert got == [sorted_mad(r) for r in rows]  # as numbers: a zero MAD may differ in sign


def test_lazy_window_values_are_its_last_finite_values_oldest_first() -> None:
    lazy = LazyWindow(3)
    lazy.extend([1.0, math.nan, 2.0, math.inf, 3.0, 4.0])
    assert lazy.values() == [2.0, 3.0, 4.0]


def _stream(seed: int) -> list[Event]:
    """A quiet baseline, then bursts of noise 1.8-2.6x it lasting 10-30 entries between quiet stretches (the recent
    noise crossing the bar and back all the time: rises of a few entries, each keeping entries out of the baseline,
    some crossing ``ratio``), once noise 3x it for long enough to open a finding, once the relative noise up while the
    loss falls (the absolute one under the bar); a steady LR but for a few doublings."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": 0})]
    level, base, lr = rng.uniform(1.0, 4.0), rng.choice([0.004, 0.02]), 1e-3
    plan = [(1.0, 0.0, 600)]
    for n in range(50):
        if n == 20:
            plan.append((3.0, 0.0, 300))  # a streak that opens a finding
        elif n == 35:
            plan.append((1.8, 0.004, 300))  # falling ~0.4% an entry: the absolute noise lags
        else:
            plan.append((rng.uniform(1.8, 2.6), 0.0, rng.randint(10, 30)))
        plan.append((1.0, 0.0, rng.randint(30, 150)))
    t = 0
    for factor, fall, length in plan:
        if rng.random() < 0.03:
            lr *= 2.0
        for _ in range(length):
            level *= 1.0 - fall
            fields: dict[str, Any] = {"step": t, "loss": level * math.exp(base * factor * rng.gauss(0, 1)), "lr": [lr]}
            if rng.random() < 0.2:
                fields["batch_fingerprint"] = f"{seed}-{t % 97}"
            evs.append(ev("step", fields, float(t)))
            t += 1
    return evs


def _compare(evs: list[Event], seed: int, monkeypatch: Any) -> tuple[int, int, int, int]:
    """Outputs and state of observe one event at a time vs observe_batch at random cuts, after every batch; the
    rises, findings and unmeasured relative rises of the stream, and the rises observe took from the quiet state."""
    cfg = DetectorsConfig().loss_noise
    observe = LossNoise.observe
    observed = 0

    def counted(self: LossNoise, event: Event, attempt: int) -> list:
        nonlocal observed
        quiet = self._quiet()
        found = observe(self, event, attempt)
        observed += quiet and self._high
        return found

    rng = random.Random(seed)
    one, cut, ref = LossNoise(cfg), LossNoise(cfg), LossNoise(cfg)
    want: list[list] = []
    rises = unmeasured = 0
    high = False
    for e in evs:
        want.append(one.observe(e, 0))
        rises += one._high and not high
        high = one._high
        if one._judged and one._bd.mad() > 0 and one._ba.mad() == 0:
            unmeasured += one._rd.mad() / one._bd.mad() >= cfg.admit_ratio
    monkeypatch.setattr(LossNoise, "observe", counted)
    got: list[list] = []
    i = 0
    while i < len(evs):
        batch = evs[i : i + rng.choice([1, 7, rng.randint(60, 300), rng.randint(300, 3000)])]
        cut.observe_batch(batch, [0] * len(batch), got)
        for e in batch:
            observe(ref, e, 0)
        assert repr(got[-len(batch) :]) == repr(want[i : i + len(batch)]), f"seed {seed}, batch at {i}"
        assert _state(cut) == _state(ref), f"seed {seed}, after the batch at {i}"
        i += len(batch)
    monkeypatch.setattr(LossNoise, "observe", observe)
    return rises, sum(map(len, want)), unmeasured, observed


def test_rises_followed_by_the_screen_report_and_leave_what_observe_does(monkeypatch: Any) -> None:
    rises = fired = observed = 0
    for seed in range(8):
        r, f, _, o = _compare(_stream(seed), seed, monkeypatch)
        rises, fired, observed = rises + r, fired + f, observed + o
    assert rises > 250, "the streams must rise past the bar and back all the time"
    assert fired >= 4, "and open findings"
    assert observed < rises // 5, "the screen must follow most rises"


def test_follow_takes_an_entry_whose_absolute_noise_is_unmeasured_or_under_the_bar_for_quiet() -> None:
    """``_follow`` on its own: recent windows whose relative noise is 1.8x the baseline's (high, no streak) are a rise
    to the run's end only where the absolute noise is high too; an absolute baseline whose MAD is zero leaves the
    entry unmeasured (``_measured``), quiet, whatever the absolute ratio."""
    rng = np.random.default_rng(5)
    rows = np.tile(np.sort(rng.standard_normal(50)), (12, 1))
    absolute = rng.standard_normal((12, 50))
    run = SimpleNamespace(rs=rows, awin=absolute, off=0, joins=np.zeros(12, dtype=bool))
    det = LossNoise(DetectorsConfig().loss_noise)
    bdm, bam = sorted_mad(rows[0].tolist()) / 1.8, sorted_mads(np.sort(absolute, axis=1)).min()
    assert det._follow(run, 0, bdm, bam / 2) is None  # both high to the run's end
    assert det._follow(run, 0, bdm, bam * 2) == 0  # the absolute noise under the bar
    assert det._follow(run, 0, bdm, 0.0) == 0  # not measured
    assert det._follow(run, 0, bdm / 1.5, bam / 2) is None  # 2.7x: a streak would start
