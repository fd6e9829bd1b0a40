"""bad_resume's observe_batch learns a run of steps that no resume check reads in one go (issue 24): it ends every
batch in the state, and with the outputs, of the detector fed one event at a time, on streams that switch between
plain stretches and everything a step can carry (LRs missing, empty, non-finite, ints, huge enough that their sum
overflows, signed zeros at the peak; losses and grad norms missing or unusable; batch fingerprints; step numbers
that are not ints), with checkpoints and resumes between them, under the default and a tiny configuration."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.batch_state import check_batches
from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.bad_resume import BadResume
from trainmon.wire import Event


def _lr(rng: random.Random, regime: str, t: int) -> Any:
    lr = 1e-3 * min(1.0, (t + 1) / 50) * (1 - t / 10_000)
    if regime == "odd_lr":
        return rng.choice([None, [], [math.nan], [math.inf], [3], [True], [1e308], [-1e308], [0.0], [-0.0], [lr, 2]])
    if regime == "zeros":
        return [rng.choice([0.0, -0.0])]
    if regime == "missing":
        return None if rng.random() < 0.5 else [lr]
    return [lr]


def _stream(seed: int, n: int = 4000) -> list[Event]:
    rng = random.Random(seed)
    evs = [start(framework="hf")]
    regime, step = "zeros", 0  # first, a peak of zero: 0.0 or -0.0 stays, whichever came first
    zeros = rng.randrange(600)
    for t in range(n):
        if t >= zeros and rng.random() < 0.02:
            regime = rng.choice(["plain", "plain", "odd_lr", "zeros", "missing", "odd", "fingerprints", "steps"])
        fields: dict[str, Any] = {"step": step, "loss": 2.0 + 0.1 * rng.gauss(0, 1), "grad_norm": rng.uniform(0.5, 2)}
        lr = _lr(rng, regime, t)
        if lr is not None:
            fields["lr"] = lr
        if regime == "odd":
            fields["loss"] = rng.choice([math.nan, None, 3, -0.0, fields["loss"]])
            fields["grad_norm"] = rng.choice([math.nan, math.inf, 0.0, -1.0, 4, None, fields["grad_norm"]])
        if regime == "fingerprints":
            fields["batch_fingerprint"] = rng.choice([f"b{step % 300}", None, 7])
        if regime == "steps" and rng.random() < 0.1:
            fields["step"] = rng.choice([True, float(step), step])
        fields = {k: v for k, v in fields.items() if v is not None}
        step += rng.choice([1, 1, 1, 1, 2, 0])
        roll = rng.random()
        if roll < 0.004:
            fingerprint = {"next_step": step + 1, "scheduler.last_epoch": step}
            evs.append(ev("checkpoint", {"step": step, "fingerprint": fingerprint}, float(t)))
        elif roll < 0.007:
            back = rng.choice([0, step // 2, step])
            evs.append(start(resumed=True, framework="hf"))
            if rng.random() < 0.5:
                evs.append(ev("resume", {"step": back, "fingerprint": {"next_step": back + rng.choice([1, 0])}}))
            step = back + 1
        evs.append(ev("step", fields, float(t)))
    return evs


_TINY = {"loss_window": 1, "batch_memory": 1, "batch_head": 1, "check_steps": 1, "shock_steps": 2}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tiny", [False, True])
def test_batches_end_in_the_state_of_one_event_at_a_time(seed: int, tiny: bool) -> None:
    config = DetectorsConfig().bad_resume
    if tiny:
        config = dataclasses.replace(config, **_TINY)
    check_batches(BadResume, config, _stream(seed), random.Random(seed))


def test_the_streams_resume_and_find() -> None:
    """The streams reach the checks a resume makes, and find something: the proof above is not only of quiet
    stretches."""
    found = sum(check_batches(BadResume, DetectorsConfig().bad_resume, _stream(s), random.Random(s)) for s in range(4))
    assert found
