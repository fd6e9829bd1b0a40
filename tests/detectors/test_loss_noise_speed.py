"""``loss_noise``'s cheaper entries equal the definitions they replace (issue 24): the MAD's bounds are the ones the
former code gave, bit for bit; a MAD floor holds through the adds it covers; and the detector finds exactly what
its former every-entry rule found, with each field read as before, on random and adversarial streams (ties that
zero a baseline's MAD, signed zeros, subnormals, ints, missing and non-finite values, noise rises, resumes)."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.detectors.helpers import ev, start
from tests.detectors.test_detectors_speed import _FormerLossNoise as _FormerRule
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.base import Finding, finite
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow
from trainmon.wire import Event

adversarial = st.one_of(
    st.integers(-3, 3).map(float),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1e-300, 1.7e308, -1.7e308, math.nan, math.inf]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e6, 1e6),
)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)  # equal floats, signed zeros and NaNs told apart


# -- the MAD's bounds: the former code, with its own block position ----------------------------------------------


class _FormerBounds:
    """The former ``mad_bounds`` of a window, called after each change (the window keeps them until the next)."""

    def __init__(self) -> None:
        self.shift = 0

    def __call__(self, w: RollingWindow) -> tuple[float, float]:
        s = sorted(w.values())
        n = len(s)
        k = n // 2
        if n % 2:
            m = s[k]
            j = min(max(k // 2 + self.shift, 0), k)
            a, b = m - s[j], s[j + k] - m
            self.shift = j - k // 2 + (a > b) - (a < b)
            return (1.4826 * a, 1.4826 * b) if a <= b else (1.4826 * b, 1.4826 * a)
        if n < 4:
            mad = w.mad()
            return mad, mad
        m = 0.5 * (s[k - 1] + s[k])
        j = min(max(k // 2 + self.shift, 1), k - 1)
        a, b, d = m - s[j], s[j + k - 1] - m, s[j + k] - m
        self.shift = j - k // 2 + (a > d) - (a < b)
        lo, hi = (a + a, b + d) if a <= b else (b + a, a + d) if a <= d else (b + d, a + a)
        return 1.4826 * (0.5 * lo), 1.4826 * (0.5 * hi)


@settings(max_examples=1500)
@given(st.lists(adversarial, min_size=1, max_size=150), st.integers(1, 60), st.integers(0, 3))
def test_mad_bounds_are_the_former_codes_bit_for_bit(xs: list[float], size: int, every: int) -> None:
    w, former = RollingWindow(size), _FormerBounds()
    changed = False
    for i, x in enumerate(xs):
        w.add(x)
        changed |= math.isfinite(x)
        if len(w) and (every == 0 or i % every == 0):
            if changed:
                was = former(w)
            assert list(map(_bits, w.mad_bounds())) == list(map(_bits, was))
            changed = False


# -- a window sorted on demand: the same MAD, read between adds ----------------------------------------------------


@settings(max_examples=1000)
@given(st.lists(adversarial, min_size=1, max_size=150), st.integers(1, 60), st.integers(1, 4))
def test_a_window_sorted_on_demand_has_the_kept_ones_mad(xs: list[float], size: int, every: int) -> None:
    lazy, kept = LazyWindow(size), RollingWindow(size)
    for i, x in enumerate(xs):
        lazy.add(x)
        kept.add(x)
        if len(kept) and i % every == 0:
            mad = _bits(kept.mad())
            assert _bits(lazy.mad()) == mad and list(map(_bits, lazy.mad_bounds())) == [mad, mad]
            assert _bits(lazy.median()) == _bits(kept.median())


# -- loss_noise: the rule as it was before issue 24's second pass --------------------------------------------------


class _FormerLossNoise(_FormerRule):
    """Every field read as before, every entry judged on four exact MADs (``_FormerRule``, session 10's
    reference), the LR and the level asked first."""

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            out = []
            if self._open:
                out.append(self._finding(None, "a new attempt: its noise is judged afresh", {}, resolved=True))
                self._open = False
            sched = event.fields.get("schedule")
            warmup = sched.get("warmup_steps") if isinstance(sched, dict) else None
            self._reset(warmup_end=warmup if isinstance(warmup, int) else 0)
            return out
        if event.kind != "step":
            return []
        f = event.fields
        loss, step = f.get("loss"), f["step"]
        if not finite(loss) or loss <= 0:
            self._prev = None
            return []
        prev, self._prev = self._prev, float(loss)
        if prev is None:
            return []
        lrs = f.get("lr")
        lr = lrs[0] if isinstance(lrs, list) and lrs and finite(lrs[0]) else None
        return self._add(step, float(loss), math.log(loss / prev), loss - prev, lr, f.get("batch_fingerprint"))


def _stream(seed: int, n: int = 2500) -> list[Event]:
    """Segments of quiet, louder (1.5-4x) and quieter noise, some quantised so coarsely that the differences tie
    (a baseline MAD of zero, which no floor may prove positive), long steady stretches (floors reused for many
    entries), LR warmup and steps, ints, signed zeros, missing, non-finite and non-positive losses, odd LR lists."""
    rng = random.Random(seed)
    evs = [start(schedule={"warmup_steps": rng.choice([0, 30, 200])})]
    level, base, lr = rng.uniform(0.5, 5.0), rng.choice([0.005, 0.03, 0.1]), 1e-3
    sigma, quantum, left = base, 0.0, 0
    for t in range(n):
        if not left:
            left = rng.randint(100, 900)
            sigma = base * rng.choice([1.0, 1.0, 1.0, 0.5, 1.5, 3.0, 4.0])
            quantum = rng.choice([0.0, 0.0, 0.0, 0.01, 0.1, 1.0])
            if rng.random() < 0.3:
                lr *= rng.choice([0.5, 1.05, 3.0])
        left -= 1
        if rng.random() < 0.0005:
            evs.append(start(resumed=True, schedule={"warmup_steps": t + rng.choice([0, 20])}))
        level *= 1.0 - rng.choice([0.0, 0.0, 0.0002, 0.002])
        loss: Any = level * math.exp(sigma * rng.gauss(0, 1))
        if quantum:
            loss = max(quantum, round(loss / quantum) * quantum)
            if quantum == 1.0:
                loss = int(loss)
        if rng.random() < 0.005:
            loss = rng.choice([None, math.nan, math.inf, 0.0, -0.0, -1.0, True, "1.0"])
        fields: dict[str, Any] = {"step": t, "loss": loss}
        roll = rng.random()
        if roll < 0.9:
            fields["lr"] = [lr]
        elif roll < 0.93:
            fields["lr"] = rng.choice([[], [None], [math.nan], [1], [True], "1e-3", (lr,)])
        if rng.random() < 0.5:
            fields["batch_fingerprint"] = f"{seed}-{t % 300}"
        evs.append(ev("step", fields, float(t)))
    return evs


def test_loss_noise_finds_exactly_what_its_former_rule_found() -> None:
    cfg = DetectorsConfig().loss_noise
    fired = floored = 0
    for seed in range(40):
        now, was = LossNoise(cfg), _FormerLossNoise(cfg)
        for e in _stream(seed):
            found = now.observe(e, 0)
            assert found == was.observe(e, 0), f"seed {seed}, {e.fields}"
            fired += bool(found)
            floored += now._admitted < now._ba_proven
            assert (now._since, now._settled, now._hits, now._calm, now._open, now._prev) == (
                was._since,
                was._settled,
                was._hits,
                was._calm,
                was._open,
                was._prev,
            )
    assert fired >= 5, "the streams must exercise findings, not only quiet entries"
    assert floored, "the streams must exercise the baseline's floor"
