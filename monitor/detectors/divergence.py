"""``divergence``: the loss trends up over many steps and stays well above its best.

Why the rule is what it is (failure-modes.md S2): slow divergence ("diverged slowly without any
spikes", bigscience tr8b-104B) is a sustained rise, not a jump. The rule is "after warmup, the
slope of a robust EMA of the loss over a long window is significantly > 0", made concrete:

* a running median of ``median_of`` steps removes single spikes, an EMA on top removes noise;
* over the last ``window`` logged entries the smoothed loss must rise by ``min_rise_rel`` of its
  level, by ``min_rise_sigma`` sigma of the *raw* per-entry loss noise (MAD of successive raw
  differences) and by ``min_rise_abs`` nats, with most of the increments positive (a trend, not a
  wander). The noise is measured on the raw loss because the smoothed series is what is tested:
  its own step-to-step differences are tiny even when the batches are very noisy, and a 20-entry
  rise of one raw sigma is routine in a noisy fine-tune (real logs: a clean SFT with ~10 % per-step
  noise rose 16 % over 20 entries three times in 4,000 steps; a multimodal LoRA run +30 %; a
  24-epoch QLoRA run's periodic 5-entry sawtooth +22 %; all at most 1.3 raw sigma; the
  benchmark's slow divergences pass 2 within a few entries of crossing the other gates). The
  absolute floor keeps a memorised loss (0.008 -> 0.016 nats, a doubling worth nothing) from
  reading as a divergence, as ``loss_spike``'s ``min_abs`` does;
* no single increment of the median-filtered loss may carry more than ``max_jump_share`` of the
  rise: a step jump that stays up is a non-recovered spike (``loss_spike`` escalates that), not
  a trend;
* the smoothed loss must sit ``above_min_rel`` above its running minimum (so a wiggle on a
  plateau never fires), and nothing fires before ``min_steps`` or the declared warmup's end.

Windows count logged entries, not steps: the noise being averaged is per entry, so a log
written every N steps (Hugging Face ``logging_steps``) gets windows N times longer in steps, and
the detection delay in steps grows with N, bounded by the long window.

It resolves when the smoothed loss is back near its minimum.
"""

from __future__ import annotations

import collections
import math

from trainmon.hooks.wire import Event
from trainmon.monitor.config import DivergenceConfig
from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["Divergence"]


class Divergence(Detector):
    """Sustained upward trend of a spike-free smoothed loss."""

    kind = "divergence"

    def __init__(self, config: DivergenceConfig) -> None:
        self.config = config
        self._raw = RollingWindow(config.median_of)
        self._filtered: collections.deque[float] = collections.deque(maxlen=config.long_window + 1)
        self._smooth: collections.deque[float] = collections.deque(maxlen=config.long_window + 1)
        self._noise = RollingWindow(64)  # |raw loss - previous raw loss| of the last entries
        self._prev_raw: float | None = None
        self._ema: float | None = None
        self._min: float | None = None
        self._warmup_end = 0
        self._open = False
        self._critical = False
        self._grad_norms: collections.deque[float] = collections.deque(maxlen=config.long_window + 1)

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            if not event.fields.get("resumed", False):
                self.__init__(self.config)  # a fresh run: forget the previous one's minimum
            sched = event.fields.get("schedule")
            if isinstance(sched, dict) and isinstance(sched.get("warmup_steps"), int):
                self._warmup_end = sched["warmup_steps"]
            return []
        if event.kind != "step":
            return []
        f = event.fields
        loss = f.get("loss")
        if not finite(loss):
            return []
        cfg = self.config
        step = f["step"]
        if self._prev_raw is not None:
            self._noise.add(abs(loss - self._prev_raw))
        self._prev_raw = loss
        self._raw.add(loss)
        if len(self._raw) < cfg.median_of:
            return []
        m = self._raw.median()
        self._filtered.append(m)
        self._ema = m if self._ema is None else self._ema + cfg.ema_alpha * (m - self._ema)
        s = self._ema
        self._smooth.append(s)
        gn = f.get("grad_norm")
        if finite(gn):
            self._grad_norms.append(gn)
        if step < max(cfg.min_steps, self._warmup_end):
            return []
        if self._min is None or s < self._min:
            self._min = s
        above = (s - self._min) / abs(self._min) if self._min else 0.0
        if self._open:
            return self._follow(step, s, above)
        if above < cfg.above_min_rel:
            return []
        # Per-entry noise of the raw loss (robust: MAD of successive differences / sqrt 2).
        sigma = 1.4826 * self._noise.median() / math.sqrt(2.0) if len(self._noise) >= 8 else 0.0
        hit = None
        for w, rel in ((cfg.window, cfg.min_rise_rel), (cfg.long_window, cfg.long_min_rise_rel)):
            hit = self._trend(w, rel, sigma)
            if hit is not None:
                break
        if hit is None:
            return []
        w, start, rise, up = hit
        self._open = True
        self._critical = above >= cfg.critical_rel
        ev = {
            "smoothed_loss": round(s, 6),
            "window_start": round(start, 6),
            "running_min": round(self._min, 6),
            "rise_rel": round(rise / abs(start), 4),
            "up_fraction": round(up, 3),
            "window": w,
            "noise_sigma": round(sigma, 6),
        }
        gns = list(self._grad_norms)
        grad_note = ""
        if len(gns) > w and gns[-w - 1] > 0:
            g_ratio = gns[-1] / gns[-w - 1]
            ev["grad_norm_ratio"] = round(g_ratio, 3)
            if g_ratio > 1.5:
                grad_note = f" The grad norm grew {g_ratio:.1f}x over the same window, as in slow LR-driven divergence."
        return [
            Finding(
                kind=self.kind,
                severity="critical" if self._critical else "warning",
                step=step,
                message=(
                    f"loss trending up: smoothed {start:.4g} -> {s:.4g} (+{rise / abs(start):.0%}) over the last "
                    f"{w} steps, {above:.0%} above its minimum {self._min:.4g}"
                ),
                hint=(
                    "A sustained rise without a single jump: slow divergence. Likely causes: LR too high for this "
                    "stage (check the LR against the schedule), a shift in the data mix, or optimizer state "
                    "(Adam epsilon/beta2, a bad resume)." + grad_note + " Roll back to a checkpoint from before the "
                    f"rise (about step {step - w}) and lower the LR; check the data order there."
                ),
                evidence=ev,
            )
        ]

    def _trend(self, w: int, min_rel: float, sigma: float) -> tuple[int, float, float, float] | None:
        """The rise over the last ``w`` steps if it is a trend: (w, start, rise, up share), else None.

        Cheap tests first; the O(w) pair and jump tests run only when the rise is already large.
        """
        cfg = self.config
        sm = self._smooth
        if len(sm) <= w:
            return None
        start = sm[-w - 1]
        rise = sm[-1] - start
        if rise <= 0 or rise < min_rel * abs(start) or rise < cfg.min_rise_sigma * sigma or rise < cfg.min_rise_abs:
            return None
        fl = list(self._filtered)[-w - 1 :]
        if fl[-1] - fl[0] <= 0:
            return None
        # A jump that stays up puts most of the rise into a few steps of the smoothed series;
        # a trend spreads it. (Checked on the EMA: single filtered increments are too noisy.)
        ss = list(sm)[-w - 1 :]
        k = min(5, w // 4)
        if max(ss[i + k] - ss[i] for i in range(len(ss) - k)) > cfg.max_jump_share * rise:
            return None
        lag = max(1, w // 2)
        pairs = len(fl) - lag
        up = sum(1 for i in range(pairs) if fl[i + lag] > fl[i]) / pairs
        if up < cfg.up_fraction:
            return None
        return w, start, rise, up

    def _follow(self, step: int, s: float, above: float) -> list[Finding]:
        cfg = self.config
        if above < cfg.above_min_rel / 2:
            self._open = self._critical = False
            return [
                Finding(
                    kind=self.kind,
                    severity="info",
                    step=step,
                    message=f"smoothed loss back to {s:.4g}, near its minimum {self._min:.4g}, at step {step}",
                    hint="The upward trend has reversed.",
                    evidence={"smoothed_loss": round(s, 6), "running_min": round(self._min or 0.0, 6)},
                    resolved=True,
                )
            ]
        if not self._critical and above >= cfg.critical_rel:
            self._critical = True
            return [
                Finding(
                    kind=self.kind,
                    severity="critical",
                    step=step,
                    message=f"loss still rising: smoothed {s:.4g} is {above:.0%} above its minimum {self._min:.4g}",
                    hint="Divergence is not recovering: stop, roll back before the rise and lower the LR.",
                    evidence={"smoothed_loss": round(s, 6), "running_min": round(self._min or 0.0, 6)},
                )
            ]
        return []
