"""``loss_noise``'s judged entries whose noise is not quiet (issue 24): ``_judge`` compares each ratio with its bars
from the MADs' O(1) bounds where they decide (``_under``) instead of computing both ratios. It must report, and leave,
what the rule on the exact ratios does, entry by entry and batch by batch, on the streams that live there: noise held
between ``admit_ratio`` and ``ratio`` for long stretches (high, dated, no streak; the baseline frozen), streaks that
start and fail, and a rise that opens a finding and resolves."""

from __future__ import annotations

import math
import random
from typing import Any

from tests.detectors.helpers import ev, start
from tests.detectors.test_loss_noise_batch import _state
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.base import Finding
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.wire import Event


class _Exact(LossNoise):
    """The rule as it was before ``_judge`` decided from bounds: both ratios computed exactly on every judged entry."""

    def _judge(self, step: int) -> list[Finding]:
        c = self.config
        ratios = self._ratios()
        assert ratios is not None  # judged, both baselines' MADs positive
        rel, ab = ratios
        noise = min(rel, ab)
        self._high = noise >= c.admit_ratio
        if noise < c.admit_ratio:
            self._since, self._settled = None, True
        elif self._since is None and self._settled:
            self._since = step
        held = noise >= c.admit_ratio and self._settled and (self._hits or rel >= c.ratio)
        self._hits = self._hits + 1 if held and self._lr_steady() and self._level_steady() else 0
        if self._hits < c.sustain or rel < c.ratio:
            return []
        self._open, self._calm, self._reported = True, 0, step
        return [self._report(step, rel, ab)]


def _stream(seed: int) -> list[Event]:
    """A quiet baseline, then stretches whose noise is 1.6-2.1x it (high without a streak, crossing the bar now and
    then), quiet stretches between them, one stretch 3-4x it long enough to open a finding, and quiet again to resolve
    it; a steady LR and level, some fingerprints."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": 0})]
    level, base = rng.uniform(1.0, 4.0), rng.choice([0.004, 0.02])
    plan = [(1.0, 500)]
    for _ in range(6):
        plan += [(rng.uniform(1.6, 2.1), rng.randint(150, 600)), (1.0, rng.randint(60, 300))]
    plan += [(rng.uniform(3.0, 4.0), 400), (1.0, 600)]
    t = 0
    for factor, length in plan:
        for _ in range(length):
            fields: dict[str, Any] = {"step": t, "loss": level * math.exp(base * factor * rng.gauss(0, 1))}
            fields["lr"] = [1e-3]
            if rng.random() < 0.2:
                fields["batch_fingerprint"] = f"{seed}-{t % 97}"
            evs.append(ev("step", fields, float(t)))
            t += 1
    return evs


def _rule(det: LossNoise) -> tuple[Any, ...]:
    """What the rule keeps besides its windows (``_state`` has it all, at a cost per entry)."""
    return det._high, det._settled, det._since, det._hits, det._calm, det._open, det._reported, det._admitted


def test_judged_entries_report_and_leave_what_the_exact_ratios_do() -> None:
    cfg = DetectorsConfig().loss_noise
    steady = opened = resolved = 0
    for seed in range(4):
        now, exact = LossNoise(cfg), _Exact(cfg)
        for i, e in enumerate(_stream(seed)):
            found = now.observe(e, 0)
            assert repr(found) == repr(exact.observe(e, 0)), f"seed {seed}, {e.fields}"
            assert _rule(now) == _rule(exact), f"seed {seed}, after {e.fields}"
            assert i % 50 or _state(now) == _state(exact), f"seed {seed}, after {e.fields}"
            steady += now._high and now._settled and not (now._hits or now._open)
            opened += sum(not f.resolved for f in found)
            resolved += sum(f.resolved for f in found)
    assert steady > 1000, "the streams must hold the noise high without a streak for long"
    assert opened >= 4 and resolved >= 4, "and open findings that resolve"


def test_batches_at_random_cuts_report_and_leave_what_the_exact_ratios_do() -> None:
    cfg = DetectorsConfig().loss_noise
    for seed in range(6):
        rng = random.Random(seed)
        evs = _stream(seed)
        cut, exact = LossNoise(cfg), _Exact(cfg)
        got: list[list[Finding]] = []
        i = 0
        while i < len(evs):
            batch = evs[i : i + rng.choice([1, 7, rng.randint(60, 300), rng.randint(300, 2000)])]
            want = [exact.observe(e, 0) for e in batch]
            cut.observe_batch(batch, [0] * len(batch), got)
            assert repr(got[-len(batch) :]) == repr(want), f"seed {seed}, batch at {i}"
            assert _state(cut) == _state(exact), f"seed {seed}, after the batch at {i}"
            i += len(batch)
