"""lr_schedule_drift's :meth:`~LrScheduleDrift.observe_batch` takes the steps of an inferred decay in runs at once
(issue 24): the cases it could get wrong, each checked for the same outputs *and* the same state as
:meth:`~LrScheduleDrift.observe` one event at a time, at random cuts, every 64 events and in one batch.

* a long full-precision cosine whose last steps are "the same" LR (within ``_SAME``), a printed LR held in levels
  (the resolution still learning: ``_Resolution.add`` on the decay's values), a decay of more than ``_DECAY_KEPT``
  points (its halvings);
* a reset mid-decay and a frozen LR (findings open, update and resolve between bulk runs), a step schedule;
* several param groups, a group added mid-run, scheduler counts, skipped steps, NaN, negative and int LRs, steps
  without an LR, a resume from an older checkpoint (the decay rewound) and a fresh start.
"""

from __future__ import annotations

import collections
import math
import random
from typing import Any

import pytest

from tests.detectors.helpers import ev
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.lr_schedule_drift import _DECAY_KEPT, _SAME, LrScheduleDrift
from trainmon.wire import Event


def _state(x: Any) -> Any:
    """A detector's state, comparable: floats by repr (NaN, -0.0), containers by their contents."""
    if isinstance(x, (list, tuple, collections.deque)):
        return [_state(v) for v in x]
    if isinstance(x, set):
        return sorted(map(repr, x))
    if isinstance(x, dict):
        return {k: _state(v) for k, v in x.items()}
    if isinstance(x, float):
        return repr(x)
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return {k: _state(v) for k, v in vars(x).items() if k not in ("config", "bulk")}
    return x


class _Counting(LrScheduleDrift):
    """Counts the steps its bulk path took."""

    bulk = 0

    def _take(self, kind: int, cols: Any, i: int, j: int) -> None:
        self.bulk += j - i
        super()._take(kind, cols, i, j)


def _check(events: list[Event], seed: int) -> int:
    """Outputs and state of observe vs observe_batch at every kind of cut; how many steps the bulk path took."""
    cfg = DetectorsConfig().lr_schedule_drift
    one = LrScheduleDrift(cfg)
    expected = [repr(one.observe(e, 0)) for e in events]
    rng = random.Random(seed)
    bulk = 0
    for cuts in ("random", "even", "whole"):
        det = _Counting(cfg)
        got: list = []
        i = 0
        while i < len(events):
            n = {"random": rng.choice([1, 3, rng.randint(30, 80), rng.randint(100, 3000)]), "even": 64}.get(
                cuts, len(events)
            )
            det.observe_batch(events[i : i + n], [0] * len(events[i : i + n]), got)
            i += n
        assert [repr(o) for o in got] == expected, cuts
        assert _state(det) == _state(one), cuts
        bulk += det.bulk
    return bulk


def _steps(lrs: list[Any], first: int = 1, **extra: Any) -> list[Event]:
    return [
        ev("step", {"step": first + i, "loss": 2.0, "lr": lr if isinstance(lr, list) else [lr], **extra})
        for i, lr in enumerate(lrs)
    ]


def _start(**fields: Any) -> Event:
    return ev("run_start", {"resumed": False, **fields})


def _cosine(n: int, warmup: int = 100, peak: float = 1e-3, floor: float = 0.1) -> list[float]:
    out = []
    for s in range(n):
        if s < warmup:
            out.append(peak * (s + 1) / warmup)
        else:
            u = (s - warmup) / (n - warmup)
            out.append(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * u))))
    return out


@pytest.mark.parametrize("planned", [None, 6000])
def test_a_long_cosine_whose_end_is_the_same_lr(planned: int | None) -> None:
    lrs = _cosine(6000)
    lrs += [lrs[-1] * (1 - _SAME / 3) ** (i + 1) if i % 50 else lrs[-1] * 0.999 for i in range(500)]
    assert any(abs(b - a) <= _SAME * a for a, b in zip(lrs[-500:], lrs[-499:], strict=False))
    assert _check([_start(planned_steps=planned), *_steps(lrs)], 1) > 3 * 5000


def test_printed_lrs_held_in_levels_while_the_resolution_learns() -> None:
    lrs = [float(f"{x:.5g}") for x in _cosine(5000)]
    assert _check([_start(planned_steps=5000), *_steps(lrs)], 2)


def test_a_decay_of_more_change_points_than_kept_is_halved_as_observe_halves_it() -> None:
    lrs = [1e-3 * (1 - i / 4000) for i in range(4000)]
    assert len(lrs) > 8 * _DECAY_KEPT
    assert _check([_start(), *_steps([1e-4] * 10 + [1e-3] * 6 + lrs)], 3)


def test_a_reset_mid_decay_a_frozen_lr_and_a_step_schedule_fire_between_bulk_runs() -> None:
    decay = _cosine(3000)
    reset = decay[:1500] + decay[200:1200] + [decay[1200]] * 400 + decay[1600:]
    steps = [1e-3] * 20 + [1e-4] * 300 + [1e-5] * 300 + [1e-5 * (1 - i / 1000) for i in range(900)]
    assert _check([_start(planned_steps=4000), *_steps(reset)], 4)
    assert _check([_start(planned_steps=2000), *_steps(steps)], 5)


@pytest.mark.parametrize("seed", range(8))
def test_hostile_steps_between_decays(seed: int) -> None:
    rng = random.Random(seed)
    events: list[Event] = [_start(planned_steps=rng.choice([None, 3000]))]
    lrs = _cosine(3000, warmup=rng.choice([0, 50]))
    step = 0
    for i, lr in enumerate(lrs):
        step += 1
        fields: dict[str, Any] = {"step": step, "loss": 2.0, "lr": [lr] * (2 if i > 1500 else 1)}
        r = rng.random()
        if r < 0.01:
            fields["lr"] = rng.choice([[math.nan], [-1.0], [3], [], [lr, math.inf], [lr, lr * 2, lr]])
        elif r < 0.015:
            del fields["lr"]
        elif r < 0.02:
            fields["scheduler_steps"] = rng.choice([0, 1, 2])
        elif r < 0.025:
            fields["skipped"] = rng.choice([True, False, 1])
        elif r < 0.027:
            fields["lr"] = [lr * 3]  # a one-step rise
        events.append(ev("step", fields))
        if r > 0.999:
            events.append(_start(resumed=True))
            step = max(0, step - rng.choice([0, 40, 400]))
        elif 0.997 < r <= 0.999:
            events.append(ev("resume", {"step": step}))
        elif 0.996 < r <= 0.997:
            events.append(ev("run_end", {"step": step}))
    assert _check(events, seed)


def test_a_fresh_start_learns_the_schedule_again() -> None:
    lrs = _cosine(2000)
    events = [_start(planned_steps=2000), *_steps(lrs), _start(), *_steps(lrs)]
    assert _check(events, 6)


@pytest.mark.parametrize("rise", [1.1, 3.0, 30.0])
def test_a_decay_that_ends_halving_then_rises_starts_the_rise_from_where_observe_does(rise: float) -> None:
    """A bulk run's last fall by half or more is where the rise is measured from (``rise_from``)."""
    lrs = [1e-3] * 10 + [1e-3 * 0.9**i for i in range(1, 60)] + [1e-3 * 0.9**59 * 0.4**i for i in range(1, 4)]
    lrs += [lrs[-1] * rise] * 20 + [lrs[-1] * rise * 0.99**i for i in range(1, 100)]
    assert _check([_start(), *_steps(lrs)], 7)


@pytest.mark.parametrize("planned", [None, 3000])
def test_a_constant_lr_and_a_printed_decay_held_at_its_rounding(planned: int | None) -> None:
    """Held LRs are taken at once where no frozen LR can be called; with a planned length and a decay under way
    they go one at a time (the frozen rule reads them)."""
    constant = [1e-3 * (i + 1) / 50 for i in range(50)] + [1e-3] * 3000
    printed = [float(f"{x:.3g}") for x in _cosine(3000)]
    assert _check([_start(planned_steps=planned), *_steps(constant)], 8) > 2 * 2900
    assert _check([_start(planned_steps=planned), *_steps(printed)], 9)


def test_steps_without_an_lr_across_resumes_and_interleaved_with_lrs() -> None:
    bare = [ev("step", {"step": s, "loss": 2.0}) for s in range(1, 3001)]
    resumed = [_start(resumed=True), *[ev("step", {"step": s, "loss": 2.0}) for s in range(2001, 4001)]]
    assert _check([_start(), *bare, ev("run_end", {"step": 3000}), *resumed], 10) > 2 * 4000
    mixed: list[Event] = [_start()]
    for s, lr in enumerate(_cosine(3000), start=1):
        every = 1 if s < 1000 else 2 if s < 2000 else 20
        fields: dict[str, Any] = {"step": s, "loss": 2.0}
        if s % every == 0:
            fields["lr"] = [lr]
        mixed.append(ev("step", fields))
    assert _check(mixed, 11)
