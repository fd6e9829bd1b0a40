"""init_loss skips the steps it has nothing left to check (issue 24): the findings are those of the detector that
checks every step, over fresh runs, resumes, restarts, declared floors, leaks and steps that go back."""

from __future__ import annotations

import math
import random

from tests.detectors.helpers import ev
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.base import Finding
from trainmon.monitor.detectors.init_loss import InitLoss, InitLossConfig


class _Always(InitLoss):
    """The rule as it was: every step checked."""

    def _busy_until(self) -> float:
        return math.inf


def _run_start(rng: random.Random) -> dict:
    f: dict = {"resumed": rng.random() < 0.3}
    if rng.random() < 0.7:
        f["vocab_size"] = rng.choice([2, 256, 50257])
    if rng.random() < 0.2:
        f["pretrained"] = True
    if rng.random() < 0.3:
        f["loss_floor"] = rng.choice([0.5, 1.6, math.nan])
    if rng.random() < 0.3:
        f["accum_steps"] = rng.choice([1, 4])
    return f


def _loss(rng: random.Random, ln_v: float) -> float:
    return rng.choice(
        [
            ln_v + rng.uniform(-0.4, 0.4),  # a fresh model's first losses
            ln_v * rng.choice([2, 4]),  # summed over micro-batches
            rng.uniform(0.0, 0.09),  # under the leak floor
            rng.uniform(1.0, 3.0),
            math.log(2),  # a pairwise objective at its start
            math.nan,
            math.inf,
        ]
    )


def _feed(det: InitLoss, events: list[tuple[str, dict, int]]) -> list[Finding]:
    out = []
    for kind, fields, attempt in events:
        out.extend(det.observe(ev(kind, fields), attempt))
    return out


def test_skipping_the_steps_with_nothing_left_to_check_changes_no_finding() -> None:
    rng = random.Random(3)
    cfgs = [DetectorsConfig().init_loss, InitLossConfig(early_steps=40, first_steps=1, leak_consecutive=1)]
    fired = 0
    for trial in range(300):
        events, step, attempt = [], 0, 0
        for _ in range(rng.choice([1, 2, 3])):
            fields = _run_start(rng)
            events.append(("run_start", fields, attempt))
            ln_v = math.log(fields.get("vocab_size", 256))
            for _ in range(rng.choice([3, 50, 300])):
                step = max(0, step + rng.choice([1, 1, 1, 10, -5]))  # steps go back after a rollback too
                events.append(("step", {"step": step, "loss": _loss(rng, ln_v)}, attempt))
            attempt += rng.random() < 0.5
            step = rng.choice([step, step // 2, 0, 3000])
        for cfg in cfgs:
            got, want = _feed(InitLoss(cfg), events), _feed(_Always(cfg), events)
            assert got == want, trial
            fired += bool(want)
    assert fired > 50  # the comparison saw findings of both rules, not only silence
