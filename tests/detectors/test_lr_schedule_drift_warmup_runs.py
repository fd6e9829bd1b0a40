"""lr_schedule_drift takes a warmup's steps in runs at once (issue 24): before the peak of an inferred schedule, steps
each above the one before and not the same value find nothing and leave the count, the last steps and the peak. Fed
in batches cut at random, the detector ends every batch in the state, with the outputs, of one fed event by event
(as ``test_lr_schedule_drift_batch.py`` compares them), on warmups of every shape: from 0.0 (no ratios learnt yet) or
not, linear or geometric, rising by less than ``_SAME`` (the same value), held in levels (printed, or stepped as
``ConstantLR`` does: a level held long enough ends the warmup, the next rise starts it again), cut by a dip (a
decay), one or two param groups, with odd steps (no LR, NaN, an int, scheduler counts, skips), resumes and fresh
starts, under ``infer_points`` of 1 (a single point makes the peak), 2 and the default."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.helpers import ev
from tests.detectors.test_lr_schedule_drift_batch import _state
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.lr_schedule_drift import _RISE, _SAME, LrScheduleDrift, LrScheduleDriftConfig
from trainmon.wire import Event


class _Counting(LrScheduleDrift):
    """Counts the steps its bulk path took, by kind of run."""

    def __init__(self, config: LrScheduleDriftConfig) -> None:
        super().__init__(config)
        self.bulk: collections.Counter[int] = collections.Counter()  # (not compared: _state leaves "bulk" out)

    def _take(self, kind: int, cols: Any, i: int, j: int) -> None:
        self.bulk[kind] += j - i
        super()._take(kind, cols, i, j)


def _check(events: list[Event], cfg: LrScheduleDriftConfig, rng: random.Random) -> collections.Counter[int]:
    """Outputs and state of observe_batch at random cuts against observe, after every batch; the steps taken at once
    by kind."""
    one, cut = LrScheduleDrift(cfg), _Counting(cfg)
    i = 0
    while i < len(events):
        batch = events[i : i + rng.choice([1, 3, rng.randint(30, 100), rng.randint(100, 3000)])]
        expected = [repr(one.observe(e, 0)) for e in batch]
        got: list = []
        cut.observe_batch(batch, [0] * len(batch), got)
        assert [repr(o) for o in got] == expected, f"outputs differ in the batch from event {i}"
        assert _state(cut) == _state(one), f"state differs after the batch from event {i}"
        i += len(batch)
    return cut.bulk


def _next(rng: random.Random, regime: str, lr: float) -> float:
    """The LR after ``lr`` in ``regime``."""
    if regime == "linear":
        return lr + 1e-7
    if regime == "geometric":
        return lr * (1.0 + rng.uniform(1e-4, 1e-2)) if lr > 0 else 1e-6
    if regime == "same":  # up, but by less than _SAME: the same value
        return lr * (1.0 + _SAME / 3)
    if regime == "printed":  # a rise printed to 3 digits: held in levels
        return float(f"{(lr + 3e-7) * 1.0001:.3g}")
    if regime == "stepped":  # ConstantLR: a level held for a while, then higher
        return lr * 2.0 if rng.random() < 0.02 else lr
    if regime == "dip":
        return lr * 0.95
    return lr


def _warmups(seed: int, n: int = 4000) -> list[Event]:
    rng = random.Random(seed)
    planned = rng.choice([None, n])
    evs = [ev("run_start", {"resumed": False, "planned_steps": planned})]
    lr, step, groups, regime = rng.choice([0.0, 1e-7, 1e-4]), 0, rng.choice([1, 1, 2]), "linear"
    for _ in range(n):
        if rng.random() < 0.01:
            regime = rng.choice(["linear", "linear", "geometric", "geometric", "same", "printed", "stepped", "dip"])
        lr = _next(rng, regime, lr)
        step += 1
        fields: dict[str, Any] = {"step": step, "loss": 2.0, "lr": [lr, lr / 10][:groups]}
        r = rng.random()
        if r < 0.005:
            fields["lr"] = rng.choice([[math.nan], [3], [], [lr, lr, lr]])
        elif r < 0.008:
            del fields["lr"]
        elif r < 0.01:
            fields[rng.choice(["scheduler_steps", "skipped"])] = rng.choice([1, 2, True])
        evs.append(ev("step", fields))
        if r > 0.999:  # resumed from a few steps back, or started over
            fresh = rng.random() < 0.5
            evs.append(ev("run_start", {"resumed": not fresh, "planned_steps": planned}))
            step = 0 if fresh else max(0, step - rng.choice([0, 5, 50]))
            lr = rng.choice([0.0, 1e-7]) if fresh else lr
        elif r > 0.998:
            evs.append(ev("resume", {"step": step}))
    return evs


@pytest.mark.parametrize("seed", range(12))
def test_warmups_taken_at_once_end_in_the_state_of_one_step_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    cfg = dataclasses.replace(DetectorsConfig().lr_schedule_drift, infer_points=rng.choice([1, 2, 5, 5]))
    taken = _check(_warmups(seed), cfg, rng)[_RISE]
    assert (taken > 0) == (cfg.infer_points > 1)  # a single point makes the peak: no warmup to take


def test_a_long_warmup_is_taken_in_runs() -> None:
    """A linear warmup of 3,000 steps from 0.0, then a cosine: nearly every warmup step is taken at once."""
    n, warmup, peak = 6000, 3000, 1e-3
    lrs = [peak * s / warmup for s in range(warmup)]
    lrs += [peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (n - warmup))) for s in range(warmup, n)]
    events = [ev("run_start", {"resumed": False}), *(ev("step", {"step": s, "lr": [x]}) for s, x in enumerate(lrs))]
    assert _check(events, DetectorsConfig().lr_schedule_drift, random.Random(0))[_RISE] > 0.8 * warmup
