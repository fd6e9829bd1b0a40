"""``loss_noise``'s ``observe_batch`` (issue 24): the numpy screen and the windows' bulk moves it rests on equal what
they replace. ``window_bounds`` gives each window's median and bounds that hold on its ``sorted_mad``;
``RollingWindow.extend`` and ``LazyWindow.extend`` leave a window as adds one by one do (signed zeros, ties,
non-finite values); ``_lrs`` reads the LRs ``_lr`` reads; and the detector fed in batches at random cuts reports, and
ends in, what ``observe`` one event at a time does, on streams that leave and re-enter the quiet state all the time
(noise rises just over and under the bar, quantised losses whose baseline MAD is zero, warmups, resumes, gaps, losses
hundreds of decades apart, odd LR lists), with the screen shown to take most entries."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import loss_noise
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow, sorted_mad, sorted_median, window_bounds
from trainmon.wire import Event

finite_values = st.one_of(
    st.integers(-3, 3).map(float),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1e-300, 1e300, -1e300]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300),
    st.floats(-1e3, 1e3),
)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@settings(max_examples=600)
@given(st.lists(finite_values, min_size=1, max_size=120), st.sampled_from([1, 3, 4, 5, 6, 7, 8, 11, 20, 33, 50]))
def test_window_bounds_hold_each_windows_median_and_mad(xs: list[float], size: int) -> None:
    if len(xs) < size:
        xs = xs * (size // len(xs) + 1)
    s, m, lo, hi = window_bounds(np.array(xs), size)
    assert len(m) == len(xs) - size + 1
    for j in range(len(m)):
        row = sorted(xs[j : j + size])
        assert s[j].tolist() == row  # as numbers: numpy's sort leaves signed zeros in no particular order
        assert m[j] == sorted_median(row)
        mad = sorted_mad(row)
        assert lo[j] <= mad <= hi[j], (j, lo[j], mad, hi[j])


@settings(max_examples=800)
@given(
    st.lists(st.one_of(finite_values, st.sampled_from([math.nan, math.inf, -math.inf])), max_size=80),
    st.lists(st.one_of(finite_values, st.sampled_from([math.nan, math.inf])), max_size=80),
    st.integers(1, 30),
)
def test_extend_leaves_a_window_as_adds_do(before: list[float], xs: list[float], size: int) -> None:
    one, bulk = RollingWindow(size), RollingWindow(size)
    lazy_one, lazy_bulk = LazyWindow(size), LazyWindow(size)
    for x in before:
        one.add(x)
        bulk.add(x)
        lazy_one.add(x)
        lazy_bulk.add(x)
    for x in xs:
        one.add(x)
        lazy_one.add(x)
    bulk.extend(xs)
    lazy_bulk.extend(xs)
    assert list(map(_bits, bulk.values())) == list(map(_bits, one.values()))
    assert list(map(_bits, bulk._sorted)) == list(map(_bits, one._sorted))  # signed zeros where adds put them
    assert list(map(_bits, lazy_bulk._order)) == list(map(_bits, lazy_one._order))
    if len(one):
        assert _bits(bulk.mad()) == _bits(one.mad()) and _bits(bulk.median()) == _bits(one.median())
        assert _bits(lazy_bulk.mad()) == _bits(lazy_one.mad())
        bulk.add(0.0)
        one.add(0.0)
        assert list(map(_bits, bulk._sorted)) == list(map(_bits, one._sorted))


def test_lrs_reads_each_steps_lr_as_lr_does() -> None:
    rng = random.Random(2)
    odd = [[], [None], [math.nan], [1], [True], "1e-3", (1e-3,), [math.inf], None, [2e-3, 1e-3], [-1e-3]]
    for _ in range(300):
        fields: list[dict[str, Any]] = [{"lr": [rng.uniform(0, 1e-3)]} for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.5:
            fields[rng.randrange(len(fields))] = {"lr": rng.choice(odd)} if rng.random() < 0.8 else {}
        got, want = loss_noise._lrs(fields), list(map(loss_noise._lr, fields))
        assert [repr(x) for x in got] == [repr(x) for x in want] and list(map(type, got)) == list(map(type, want))


def _stream(seed: int, n: int = 6000) -> list[Event]:
    """Long quiet stretches (the screen's), noise that steps to just under and just over the admit ratio (stops,
    entries the bounds cannot decide, streaks, findings that open and resolve), quantised stretches (a baseline
    MAD of zero), a fast descent, warmups, resumes, gaps of missing, non-finite, non-positive and non-float losses,
    losses hundreds of decades apart, odd LR lists and LR rises, fingerprints."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": rng.choice([0, 30, 400])})]
    level, base, lr = rng.uniform(0.5, 5.0), rng.choice([0.005, 0.03]), 1e-3
    sigma, quantum, trend, left = base, 0.0, 0.0, 0
    for t in range(n):
        if not left:
            left = rng.randint(200, 1500)
            sigma = base * rng.choice([1.0, 1.0, 1.0, 1.5, 1.6, 1.7, 2.5, 4.0])
            quantum = rng.choice([0.0] * 6 + [0.01, 1.0])
            trend = rng.choice([0.0] * 5 + [0.01])
            if rng.random() < 0.2:
                lr *= rng.choice([0.5, 3.0])
        left -= 1
        if rng.random() < 0.0003:
            evs.append(start(resumed=True, schedule={"warmup_steps": t + rng.choice([0, 60])}))
        level *= 1.0 - trend
        loss: Any = level * math.exp(sigma * rng.gauss(0, 1))
        if quantum:
            loss = max(quantum, round(loss / quantum) * quantum)
        roll = rng.random()
        if roll < 0.002:
            loss = rng.choice([None, math.nan, math.inf, 0.0, -1.0, 3, "1.0"])
        elif roll < 0.0025:
            loss = rng.choice([1e-300, 1e300, 5e-324])
        fields: dict[str, Any] = {"step": t, "loss": loss}
        roll = rng.random()
        if roll < 0.97:
            fields["lr"] = [lr]
        elif roll < 0.98:
            fields["lr"] = rng.choice([[], [None], [math.nan], [1], "1e-3"])
        if rng.random() < 0.3:
            fields["batch_fingerprint"] = f"{seed}-{t % 500}"
        evs.append(ev("step", fields, float(t)))
    return evs


def _state(det: LossNoise) -> str:
    """Everything observe's rule reads later, as repr (signed zeros and NaNs told apart by their bits)."""
    windows = [det._rd, det._bd]
    lazy = [det._ra, det._ba, det._rlr, det._blr]
    return repr(
        (
            det._prev,
            list(det._recent),
            list(det._levels),
            [list(map(_bits, w.values())) for w in windows],
            [list(map(_bits, w._sorted)) for w in windows],
            [list(w._order) for w in lazy],
            list(det._prints),
            det._settled,
            det._high,
            det._since,
            det._hits,
            det._calm,
            det._open,
            det._reported,
            det._judged,
            det._admitted,
            det._warmup_end,
        )
    )


def test_batches_at_random_cuts_report_and_leave_what_observe_does(monkeypatch: Any) -> None:
    cfg = DetectorsConfig().loss_noise
    screened = 0
    screen = LossNoise._screen

    def counted(self: LossNoise, run: Any, k: int, out: list) -> tuple[int, bool]:
        nonlocal screened
        j, whole = screen(self, run, k, out)
        screened += j - k
        return j, whole

    monkeypatch.setattr(LossNoise, "_screen", counted)
    fired = total = 0
    for seed in range(12):
        rng = random.Random(seed)
        evs = _stream(seed)
        one, cut = LossNoise(cfg), LossNoise(cfg)
        got: list[list] = []
        cut.observe_batch([], [], got)  # the engine hands a detector empty batches too
        assert got == []
        i = 0
        while i < len(evs):
            n = rng.choice([1, 7, rng.randint(60, 300), rng.randint(300, 3000)])
            batch = evs[i : i + n]
            i += n
            want = [one.observe(e, 0) for e in batch]
            cut.observe_batch(batch, [0] * len(batch), got)
            assert repr(got[-len(batch) :]) == repr(want), f"seed {seed}, batch at {i - n}"
            assert _state(cut) == _state(one), f"seed {seed}, after the batch at {i - n}"
            fired += sum(map(len, want))
        total += len(evs)
    assert fired >= 5, "the streams must open findings, not only stay quiet"
    assert screened > total // 2, "the screen must take most entries"
