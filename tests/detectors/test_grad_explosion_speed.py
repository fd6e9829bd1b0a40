"""grad_explosion's cheaper steps find exactly what its every-step rule found (issue 24): the median of the accepted
log norms is taken only where its floor does not decide, and the degenerate-loss count is taken only where a spike
asks for it; on random and adversarial streams (ties, flat and zero losses, non-finite and missing values, spikes,
bursts, level shifts, resumes, tiny windows)."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.base import Finding, finite
from trainmon.monitor.detectors.grad_explosion import GradExplosion, GradExplosionConfig, _lower_middle, _Spike
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow
from trainmon.wire import Event


class _Former(GradExplosion):
    """The rule as it was: a window kept sorted, its median read at every step; the flat losses counted at every
    step."""

    def __init__(self, config: GradExplosionConfig) -> None:
        super().__init__(config)
        self._logs = RollingWindow(config.window)  # type: ignore[assignment]
        self._last_loss: float | None = None
        self._flat: collections.deque[bool] = collections.deque(maxlen=config.window)
        self._n_flat = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        out = super().observe(event, attempt)  # a fresh run_start: __init__ forgot the flat losses
        loss = event.fields.get("loss")
        if event.kind == "step" and finite(loss):  # after the step's norm was judged, as it was
            flat = loss == 0.0 or loss == self._last_loss
            flats = self._flat
            if len(flats) == flats.maxlen:
                self._n_flat += flat - flats[0]
            else:
                self._n_flat += flat
            flats.append(flat)
            self._last_loss = loss
        return out

    def _flats(self) -> tuple[int, int]:
        return len(self._flat), self._n_flat

    def _norm(self, step: int, norm: float, layers: Any, out: list[Finding], loss: Any) -> bool:
        cfg = self.config
        x = math.log(norm)
        spike = changed = False
        if len(self._logs) >= cfg.min_history:
            med = self._logs.median()
            if x - med > math.log(cfg.min_ratio):
                sigma = self._sigma()
                spike = x - med > cfg.z * sigma and x - self._all.quantile(cfg.tail_quantile) > math.log(cfg.tail_ratio)
            ep = self._ep
            if spike and ep is None and self._degenerate():
                out.extend(self._note(step, norm, math.exp(med)))
            elif spike:
                with_loss = ep is None and self._loss_spiked(loss)
                self._spike(_Spike(step, norm, math.exp(x - med), math.exp(med)), sigma, layers, with_loss)
                changed = True
            elif ep is not None and not self._still_high(ep, x):
                ep.median = math.exp(med)
                changed = ep.run > 0
                ep.run = 0
                ep.calm += 1
            if self._ep is not None:
                changed |= self._level(self._ep, step, x)
        if not spike:
            self._accept(x)
        self._all.add(x)
        return changed


def _stream(seed: int, n: int = 1200) -> list[Event]:
    """Log-normal norms (some quantised: ties) with single spikes, bursts, a heavy upper mode, level shifts up and
    down, slow drifts; losses noisy, flat, zero, integer or missing; non-finite, zero and missing norms; resumes and
    restarts."""
    rng = random.Random(seed)
    evs = [start()]
    base, spread = rng.uniform(1e-3, 50.0), rng.choice([0.0, 0.01, 0.2, 0.6, 1.2])
    heavy, quantum, drift = rng.choice([0.0, 0.0, 0.2]), rng.choice([0.0, 0.0, 0.5]), rng.choice([1.0, 0.999, 1.002])
    burst = 0
    for t in range(n):
        if rng.random() < 0.01:
            burst = rng.choice([1, 1, 3, 6, 30])
        if rng.random() < 0.003:
            base *= rng.choice([0.1, 0.3, 4.0, 20.0])
        base *= drift
        x = math.log(base) + spread * rng.gauss(0, 1)
        if quantum:
            x = round(x / quantum) * quantum
        norm: Any = math.exp(x)
        if rng.random() < heavy:
            norm *= rng.uniform(3, 7)
        if burst:
            norm *= rng.choice([3.5, 5.0, 40.0, 2000.0])
            burst -= 1
        loss: Any = 2.0 * math.exp(0.02 * rng.gauss(0, 1)) * (rng.choice([1.0, 3.0]) if burst else 1.0)
        if t % 600 > 450:
            loss = rng.choice([0.0, 0.0, 1.5, 1])  # flat stretches: zeros, repeats, an integer
        if rng.random() < 0.01:
            loss = rng.choice([None, math.nan, math.inf])
        if rng.random() < 0.01:
            norm = rng.choice([math.nan, math.inf, 0.0, -1.0, None])
        fields: dict[str, Any] = {"step": t, "loss": loss, "grad_norm": norm}
        if rng.random() < 0.3:
            fields["clip_coef"] = min(1.0, 1.0 / norm) if finite(norm) and norm > 0 else 1.0
        if rng.random() < 0.002:
            evs.append(start(resumed=rng.random() < 0.7))
        evs.append(ev("step", fields, float(t)))
    evs.append(ev("run_end", {}, float(n)))
    return evs


_CONFIGS = [
    DetectorsConfig().grad_explosion,
    dataclasses.replace(DetectorsConfig().grad_explosion, window=5, min_history=4),
    dataclasses.replace(DetectorsConfig().grad_explosion, window=16, min_history=4, min_ratio=1.5, z=3.0),
    dataclasses.replace(DetectorsConfig().grad_explosion, window=7, min_history=7, quiet_entries=20),
]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=["default", "tiny", "low-bar", "odd"])
def test_grad_explosion_finds_exactly_what_its_every_step_rule_found(cfg: GradExplosionConfig) -> None:
    fired = degenerate = 0
    for seed in range(40):
        now, was = GradExplosion(cfg), _Former(cfg)
        found: list[Finding] = []
        for e in _stream(seed):
            got = now.observe(e, 0)
            assert got == was.observe(e, 0), f"seed {seed}, {e.kind} {e.fields}"
            assert now._flats() == was._flats()
            if now._floor is not None:  # the floor bounds the median it stands for
                assert now._floor <= now._logs.median() == was._logs.median()
            found += got
        fired += bool(found)
        degenerate += any("not judged" in f.message for f in found)
    assert fired >= 10, "the streams must exercise spike episodes"
    assert degenerate >= 1, "and the degenerate-loss note"


@pytest.mark.parametrize("seed", range(300))
def test_the_lower_middle_is_the_sorted_values_at_half_of_n_minus_one(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([1, 2, 3, 4, 5, 16, 63, 64, 65, 1000])
    w = LazyWindow(size)
    for _ in range(rng.randrange(1, 2 * size + 2)):
        w.add(rng.choice([rng.gauss(0, 1), float(rng.randrange(-2, 3)), -0.0, 0.0, 1e-300, -700.0, 700.0]))
        values = sorted(w._order)
        assert _lower_middle(w) == values[(len(values) - 1) // 2]
