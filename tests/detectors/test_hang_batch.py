"""hang's observe_batch learns steps in a row whose columns prove them ordinary in one go (issue 24): it ends every
batch in the state, with the outputs and then the ticks, of the detector fed one event at a time, on streams of one
or two ranks that switch between steady stretches and everything that makes a step not ordinary (intervals of zero,
backwards, tiny, or long enough to be a pause, a recurring pause or a stall; phases; clock offsets; step numbers that
repeat, go back or are not ints; other kinds and restarts between the steps), under the default configuration and
small ones with every kind of ``recurring_factor``."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from tests.detectors.batch_state import check_batches
from trainmon.monitor.detectors import hang
from trainmon.monitor.detectors.hang import Hang, HangConfig
from trainmon.wire import Event

_GAPS = {
    "steady": lambda rng, t: 1.0,
    "jitter": lambda rng, t: rng.uniform(0.5, 1.5),
    "zeros": lambda rng, t: rng.choice([0.0, 0.0, 1.0]),
    "back": lambda rng, t: rng.choice([1.0, 1.0, -0.5]),
    "rewind": lambda rng, t: -0.25,
    "slow": lambda rng, t: rng.uniform(20.0, 40.0),
    "lumpy": lambda rng, t: rng.choice([10.0, 10.0, 10.0, 35.0]),  # a stall under a low timeout_factor
    "tiny": lambda rng, t: rng.choice([1e-9, 1.0]),
    "pauses": lambda rng, t: 30.0 if t % 7 == 0 else 1.0,
    "stalls": lambda rng, t: rng.choice([1.0] * 20 + [90.0, 400.0]),
}


def _stream(seed: int, n: int = 3000) -> list[Event]:
    rng = random.Random(seed)
    ranks = rng.choice([1, 1, 2])
    evs = [Event("run_start", "r", r, "h", "s", 0, 1e9, {"planned_steps": 10**6}) for r in range(ranks)]
    t, steps, regime, odd, mixed, live = 1e9, [0] * ranks, "steady", False, False, False
    for i in range(n):
        if rng.random() < 0.02:  # mostly steady stretches, learnt at once, and what breaks them
            regime = rng.choice([*_GAPS, "steady", "steady", "steady", "jitter", "jitter"])
            odd, mixed, live = rng.random() < 0.2, rng.random() < 0.2, rng.random() < 0.3
        rank = rng.randrange(ranks) if mixed else 0
        t += _GAPS[regime](rng, i)
        offset = rng.choice([None, 0.5, -2.0, rng.random()]) if live else None
        kind = "step" if not odd or rng.random() < 0.9 else rng.choice(["heartbeat", "checkpoint", "eval", "run_end"])
        fields: dict[str, Any] = {}
        if kind == "step":
            steps[rank] += rng.choice([1, 1, 1, 10, 0, -3]) if odd else rng.choice([1, 1, 1, 2, 5])
            fields["step"] = steps[rank]
            if odd and rng.random() < 0.2:
                fields["phases"] = rng.choice([{}, {"checkpoint": 5.0}, {"eval": 0.0}, {"data": 1.0}])
            if odd and rng.random() < 0.05:
                fields["step"] = rng.choice([True, float(steps[rank])])
        elif kind in ("checkpoint", "eval"):
            fields = {"step": steps[rank], "duration": rng.choice([0.0, 20.0])}
        elif kind == "run_end":
            fields = {"step": steps[rank], "status": rng.choice(["finished", "failed"])}
        evs.append(Event(kind, "r", rank, "h", "s", i + 1, t, fields, offset))
        if odd and rng.random() < 0.003:
            evs.append(Event("run_start", "r", rank, "h", "s", i + 1, t, {}))
    return evs


def _config(rng: random.Random) -> HangConfig:
    return HangConfig(
        min_timeout=rng.choice([2.0, 60.0]),
        first_step_timeout=rng.choice([5.0, 300.0]),
        history=rng.choice([1, 2, 4, 64]),
        timeout_factor=rng.choice([20.0, 2.0]),
        pause_factor=rng.choice([2.0, 0.5]),
        recurring_factor=rng.choice([5.0, 5.0, 5.0, 5.0, 1.0, 0.5, 0.0, -1.0, math.inf, math.nan]),
    )


@pytest.mark.parametrize("seed", range(32))
def test_batches_end_in_the_state_of_one_event_at_a_time(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    config = HangConfig() if seed % 4 == 0 else _config(rng)
    # pieces as small as a run learnt at once, so that most of a stream that breaks often is learnt at once
    monkeypatch.setattr(hang, "_PIECE", rng.choice([hang._AT_ONCE, 50, 100, hang._PIECE]))
    check_batches(Hang, config, _stream(seed), rng, ticks=True)


def test_the_streams_find_stalls_and_hangs() -> None:
    """The streams reach the stalls, pauses and hangs: the proof above is not only of steady stretches."""
    assert sum(check_batches(Hang, HangConfig(), _stream(seed), random.Random(seed), ticks=True) for seed in range(4))


def test_times_that_run_back_are_not_learnt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps whose times run back, under a ``recurring_factor`` below 1 (whose bar, times a negative interval, lies
    above it): no interval of theirs is learnt."""
    monkeypatch.setattr(hang, "_PIECE", hang._AT_ONCE)
    config = HangConfig(recurring_factor=0.5, min_timeout=2.0, first_step_timeout=5.0)
    times = [1e9 + t for t in range(200)] + [1e9 + 200 - 0.25 * t for t in range(200)]
    events = [Event("run_start", "r", 0, "h", "s", 0, 1e9, {})]
    events += [Event("step", "r", 0, "h", "s", i + 1, t, {"step": i}) for i, t in enumerate(times)]
    check_batches(Hang, config, events, random.Random(0), ticks=True)
