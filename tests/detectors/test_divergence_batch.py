"""divergence's :meth:`~Divergence.observe_batch` reads runs of steps in one look (issue 24): the cases its bulk path
could get wrong, each checked for the same outputs *and* the same state as :meth:`~Divergence.observe` one event at
a time, at every kind of cut.

* a slow divergence, a fast ramp, a wander that crosses ``above_min_rel`` over and over without opening, a critical
  episode that closes and a second that opens: the entries reaching a bar go one at a time between bulk stretches;
* checkpoints and evals between the steps (the health's checkpoint, the task metric closing an episode);
* losses of 0.0 and -0.0 (sorted in arrival order by the median window), ints, NaN and infinities, 1e308 (the EMA
  overflows), steps that repeat or go back, a log that turns sparse, a declared warmup gate.
"""

from __future__ import annotations

import collections
import math
import random
from typing import Any

import pytest

from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.divergence import Divergence, _Run
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.wire import Event


def _state(x: Any) -> Any:
    """A detector's state, comparable: windows as their contents, floats by repr (NaN, -0.0)."""
    if isinstance(x, RollingWindow):
        return ("window", [repr(v) for v in x._order], [repr(v) for v in x._sorted])
    if isinstance(x, (list, tuple, collections.deque)):
        return [_state(v) for v in x]
    if isinstance(x, dict):
        return {k: _state(v) for k, v in x.items()}
    if isinstance(x, float):
        return repr(x)
    if hasattr(x, "__slots__"):
        return {k: _state(getattr(x, k)) for k in x.__slots__}
    if hasattr(x, "__dict__"):
        return {k: _state(v) for k, v in vars(x).items() if k != "config"}
    return x


def _stream(losses: list[Any], steps: list[Any] | None = None, every: int = 1, extras: bool = False) -> list[Event]:
    steps = steps if steps is not None else [i * every for i in range(len(losses))]
    out = [start()]
    for i, (s, loss) in enumerate(zip(steps, losses, strict=True)):
        out.append(ev("step", {"step": s, "loss": loss, "grad_norm": 1.0 + (i % 7) / 10}))
        if extras and i % 97 == 50:
            out.append(ev("checkpoint", {"step": s, "path": f"ckpt-{s}"}))
        if extras and i % 211 == 100:
            out.append(ev("eval", {"step": s, "loss": 2.0 - i / 10_000, "metrics": {"accuracy": 0.5 + i / 10_000}}))
    return out


class _Counting(Divergence):
    """Counts the entries its bulk path read."""

    bulk = 0

    def _commit(self, run: _Run, a: int, b: int) -> None:
        self.bulk += b - a
        super()._commit(run, a, b)


def _check(events: list[Event], seed: int) -> int:
    """Outputs and state of observe one at a time vs observe_batch at random cuts, at every 64 events and in one
    batch; how many entries the bulk path read (a case it never reads proves nothing)."""
    cfg = DetectorsConfig().divergence
    one, cut, whole, even = Divergence(cfg), _Counting(cfg), _Counting(cfg), _Counting(cfg)
    rng = random.Random(seed)
    expected = [one.observe(e, 0) for e in events]
    got: list = []
    i = 0
    while i < len(events):
        n = rng.choice([1, 3, rng.randint(30, 80), rng.randint(100, 3000)])
        cut.observe_batch(events[i : i + n], [0] * len(events[i : i + n]), got)
        i += n
    everything: list = []
    whole.observe_batch(events, [0] * len(events), everything)
    evenly: list = []
    for i in range(0, len(events), 64):
        even.observe_batch(events[i : i + 64], [0] * len(events[i : i + 64]), evenly)
    assert [repr(o) for o in got] == [repr(o) for o in expected]
    assert [repr(o) for o in everything] == [repr(o) for o in expected]
    assert [repr(o) for o in evenly] == [repr(o) for o in expected]
    assert {**_state(even), "bulk": 0} == {**_state(one), "bulk": 0}
    assert {**_state(cut), "bulk": 0} == {**_state(one), "bulk": 0}
    assert {**_state(whole), "bulk": 0} == {**_state(one), "bulk": 0}
    return cut.bulk + whole.bulk + even.bulk


def _rise(n: int, seed: int, onset: int, slope: float, noise: float) -> list[float]:
    rng = random.Random(seed)
    return [
        (2.0 + 3.0 * math.exp(-i / 300) + slope * max(0, i - onset)) * math.exp(noise * rng.gauss(0, 1))
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_slow_and_fast_divergences_read_in_bulk_report_what_observe_reports(seed: int) -> None:
    assert _check(_stream(_rise(6000, seed, 3000, 0.002, 0.05), extras=True), seed)
    assert _check(_stream(_rise(4000, seed, 2500, 0.02, 0.02)), seed)


@pytest.mark.parametrize("seed", range(4))
def test_a_wander_crossing_the_bar_again_and_again_reports_what_observe_reports(seed: int) -> None:
    rng = random.Random(seed)
    losses = [0.105 + 0.015 * math.sin(i / (40 + seed * 30)) + 0.004 * rng.gauss(0, 1) for i in range(6000)]
    assert _check(_stream(losses, extras=True), seed)


def test_critical_episode_closes_and_another_opens() -> None:
    rng = random.Random(7)
    shape = [2.0] * 1000 + [2.0 + 0.004 * i for i in range(800)] + [2.0] * 1500 + [2.0 + 0.01 * i for i in range(600)]
    losses = [v * math.exp(0.01 * rng.gauss(0, 1)) for v in shape] + [2.0] * 1200
    assert _check(_stream(losses, extras=True), 7)


def test_hostile_losses_and_steps_report_what_observe_reports() -> None:
    odd = [0.0, -0.0, 0, 3, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -1.0, True]
    bulk = 0
    for seed in range(6):
        rng = random.Random(seed)
        rate = 0.01 if seed % 2 else 0.002  # a 1e308 among them can leave the EMA non-finite for good
        losses: list[Any] = []
        steps: list[Any] = []
        step = 0
        for i in range(5000):
            level = 3.0 * math.exp(-i / 2000) + (0.5 if 2500 < i < 3500 else 0.0) + 0.05 * rng.gauss(0, 1)
            losses.append(rng.choice(odd) if rng.random() < rate else level)
            step += rng.choice([0, -3, 50, 500]) if rng.random() < rate else 1
            steps.append(step)
        bulk += _check(_stream(losses, steps, extras=True), seed)
    assert bulk


def test_zero_losses_among_ties_keep_the_median_window_as_observe_keeps_it() -> None:
    ties = [1.0, 0.0, -0.0, 1.0, 0.0, 2.0, -0.0] * 100
    falling = [0.0 if i % 250 == 0 else -0.0 if i % 250 == 125 else 3.0 - i / 3000 for i in range(6000)]
    assert _check(_stream(falling + ties), 1)


def test_a_log_turning_sparse_and_a_declared_warmup_gate() -> None:
    losses = _rise(3000, 3, 2000, 0.001, 0.03)
    steps = [i if i < 1500 else 1500 + (i - 1500) * 200 for i in range(3000)]
    events = _stream(losses, steps)
    events[0] = start(schedule={"name": "cosine", "warmup_steps": 700, "peak_lr": 1e-3, "total_steps": 10**6})
    assert _check(events, 3)


def test_the_bulk_path_reads_clean_dense_runs() -> None:
    """The cases above are read in bulk, not all one at a time (else they would prove nothing)."""
    assert _check(_stream(_rise(3000, 0, 10**6, 0.0, 0.05)), 0) > 30


@pytest.mark.parametrize("slope", [0.0011, 0.002, 0.02])
def test_a_clean_ramp_opens_where_its_rise_first_crosses_the_relative_bar(slope: float) -> None:
    """On a quiet plateau the relative rise is the bar that binds: an entry above ``above_min_rel`` is let through
    by the batch's screen exactly from where a window's rise reaches it (a screen a little too strict opens later)."""
    rng = random.Random(5)
    losses = [2.0 * (1 + 0.001 * rng.gauss(0, 1)) + slope * max(0, i - 3000) for i in range(4000)]
    assert _check(_stream(losses), 12)


def test_a_fresh_start_and_a_resume_between_runs_of_steps() -> None:
    """A run read before a fresh start (the state forgotten, the first median window again) or a resume says nothing
    about the steps after it."""
    first = _stream(_rise(3000, 8, 10**6, 0.0, 0.02))
    again = _stream(_rise(3000, 9, 2000, 0.002, 0.02))
    resumed = _stream(_rise(2000, 10, 10**6, 0.0, 0.02), list(range(1500, 3500)))
    resumed[0] = start(resumed=True)
    assert _check(first + again + resumed, 13)
