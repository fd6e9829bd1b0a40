"""``grad_explosion``: the pre-clip gradient norm jumps, or clipping becomes the rule.

Why the rule is what it is (failure-modes.md S1): in BLOOM-176B's first spike the grad norm
went 0.17 → 0.95 → 2.4 → 15.9 → 145 → 960 before the loss peaked, and OLMo 2 reports the same
ordering, so the pre-clip norm is the earliest first-level signal of an instability. Norms are
log-normal-ish and span decades, so the rule works on log(norm): a value more than ``z`` robust
sigma (MAD of accepted step-to-step differences, which a warmup trend does not inflate) above the
median of the last ``window`` accepted values, and at least ``min_ratio`` times that median.
Spikes are never admitted to the window, so an earlier explosion does not blind the rule (the
failure of a mean/std over a window that contains the outlier). The value must also be
``tail_ratio`` times the ``tail_quantile`` of *all* recent norms, spikes included: some runs have
a heavy upper mode (real log 15, a multimodal LoRA fine-tune: a fifth of the batches at 3-7x the
median norm), and a norm inside the run's own tail is not an explosion however many sigma of the
main mode it is; since rejected values never enter the baseline, without this the whole upper
mode would read as a stream of spikes. The listed spikes of the real logs sit 3.6-15x above that
quantile, log 15's early 12.2 (7x its median) 1.5x. Known limit: mode switches inflate the
difference-based sigma (0.46 on log 15), so on such runs only spikes beyond ~e^(z sigma) fire.
Clipping hides explosions from the update but not from the pre-clip norm; a clip rate climbing
far above its own baseline is the slow version of the same story and is reported separately. When the step carries
``layer_grad_norms`` the hint names the parameter whose norm grew most since the last sample.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from trainmon.hooks.wire import Event
from trainmon.monitor.config import GradExplosionConfig
from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["GradExplosion"]


class GradExplosion(Detector):
    """Pre-clip grad-norm spike (log-norm robust z) and a rising clip rate."""

    kind = "grad_explosion"

    def __init__(self, config: GradExplosionConfig) -> None:
        self.config = config
        self._logs = RollingWindow(config.window)
        self._all = RollingWindow(config.window)  # every recent log norm, spikes included: the tail
        self._diffs = RollingWindow(config.window)
        self._prev: float | None = None
        self._layers: dict[str, float] | None = None
        self._open: str | None = None  # "spike" or "clip" while an anomaly is open
        self._calm = 0
        self._peak = 0.0
        self._clips: collections.deque[bool] = collections.deque(maxlen=config.clip_recent + config.clip_baseline)
        self._recent_clipped = 0  # clipped steps among the last clip_recent
        self._base_clipped = 0  # clipped steps among the clip_baseline before them

    def _sigma(self, level: float) -> float:
        if len(self._diffs) < 4:
            return 0.1
        return max(1.4826 * self._diffs.median() / math.sqrt(2.0), 0.01)

    def _accept(self, x: float) -> None:
        if self._prev is not None:
            self._diffs.add(abs(x - self._prev))
        self._prev = x
        self._logs.add(x)

    def _push_clip(self, clipped: bool) -> None:
        cfg = self.config
        d = self._clips
        if len(d) == d.maxlen:
            self._base_clipped -= d[0]
        d.append(clipped)
        self._recent_clipped += clipped
        if len(d) > cfg.clip_recent:
            moved = d[-cfg.clip_recent - 1]  # left the recent window, joined the baseline
            self._recent_clipped -= moved
            self._base_clipped += moved

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            if not event.fields.get("resumed", False):
                self.__init__(self.config)  # a fresh run: a new baseline
            self._prev = None
            return []
        if event.kind != "step":
            return []
        f = event.fields
        step = f["step"]
        norm = f.get("grad_norm")
        layers = f.get("layer_grad_norms")
        out: list[Finding] = []
        if not finite(norm) or norm <= 0:
            return out  # non-finite norms are nan_inf's business
        x = math.log(norm)
        cfg = self.config
        spike = False
        if len(self._logs) >= cfg.min_history:
            med = self._logs.median()
            sigma = self._sigma(med)
            tail = self._all.quantile(cfg.tail_quantile)
            spike = x - med > max(cfg.z * sigma, math.log(cfg.min_ratio)) and x - tail > math.log(cfg.tail_ratio)
            if spike:
                self._calm = 0
                ratio = math.exp(x - med)
                if self._open != "spike" or ratio > 2 * self._peak:
                    out.append(self._spike_finding(step, norm, math.exp(med), sigma, ratio, layers))
                    self._peak = max(self._peak, ratio)
                    self._open = "spike"
            elif self._open == "spike":
                self._calm += 1
                if self._calm >= cfg.resolve_after:
                    self._open = None
                    self._peak = 0.0
                    out.append(
                        Finding(
                            kind=self.kind,
                            severity="info",
                            step=step,
                            message=f"grad norm back to {norm:.3g} (median {math.exp(med):.3g}) at step {step}",
                            hint="The explosion has passed; watch the loss for a delayed spike.",
                            evidence={"grad_norm": norm, "median": round(math.exp(med), 6)},
                            resolved=True,
                        )
                    )
        if not spike:
            self._accept(x)
        self._all.add(x)
        if isinstance(layers, dict):
            self._layers = {k: v for k, v in layers.items() if finite(v)}
        coef = f.get("clip_coef")
        if finite(coef):
            self._push_clip(coef < 1.0)
            if self._open != "spike":
                out.extend(self._clip_rate(step))
        return out

    def _clip_rate(self, step: int) -> list[Finding]:
        cfg = self.config
        if len(self._clips) < cfg.clip_recent + cfg.clip_baseline:
            return []
        recent = self._recent_clipped / cfg.clip_recent
        base = self._base_clipped / cfg.clip_baseline
        rising = recent >= cfg.clip_min_rate and recent - base >= cfg.clip_rise
        ev = {"clip_rate_recent": round(recent, 3), "clip_rate_baseline": round(base, 3)}
        if rising and self._open is None:
            self._open = "clip"
            return [
                Finding(
                    kind=self.kind,
                    severity="warning",
                    step=step,
                    message=(
                        f"gradient clipping on {recent:.0%} of the last {cfg.clip_recent} steps at step {step}, "
                        f"up from {base:.0%} before"
                    ),
                    hint=(
                        "The pre-clip grad norm is drifting up; it usually leads a loss spike or divergence. "
                        "Check the LR (too high for this stage?), the fp16 loss scale and per-layer grad norms; "
                        "consider lowering the LR before the loss moves."
                    ),
                    evidence=ev,
                )
            ]
        if self._open == "clip" and recent - base < cfg.clip_rise / 2:
            self._open = None
            return [
                Finding(
                    kind=self.kind,
                    severity="info",
                    step=step,
                    message=f"clip rate back to {recent:.0%} at step {step}",
                    hint="Clipping is back to its usual rate.",
                    evidence=ev,
                    resolved=True,
                )
            ]
        return []

    def _spike_finding(self, step: int, norm: float, med: float, sigma: float, ratio: float, layers: Any) -> Finding:
        cfg = self.config
        evidence: dict[str, Any] = {
            "grad_norm": norm,
            "median": round(med, 6),
            "ratio": round(ratio, 2),
            "log_sigma": round(sigma, 4),
        }
        where = ""
        if isinstance(layers, dict) and self._layers:
            best = None
            for name, v in layers.items():
                was = self._layers.get(name)
                if finite(v) and was and was > 0:
                    r = v / was
                    if best is None or r > best[1]:
                        best = (name, r, was, v)
            if best is not None:
                evidence["layer"] = best[0]
                evidence["layer_ratio"] = round(best[1], 2)
                where = f" The largest growth is in {best[0]} ({best[2]:.3g} -> {best[3]:.3g}, {best[1]:.0f}x)."
        elif isinstance(layers, dict) and layers:
            name, v = max(((k, v) for k, v in layers.items() if finite(v)), key=lambda kv: kv[1], default=("", 0))
            if name:
                evidence["layer"] = name
                where = f" The largest per-parameter norm is {name} ({v:.3g})."
        return Finding(
            kind=self.kind,
            severity="critical" if ratio >= cfg.critical_ratio else "warning",
            step=step,
            message=f"pre-clip grad norm {norm:.4g} at step {step}, {ratio:.1f}x its median of {med:.3g}",
            hint=(
                "Grad norm usually leads the loss: expect a loss spike in the next steps. Likely causes: LR too high "
                "(check the LR of each group at this step), a bad batch, fp16 overflow or attention-logit growth."
                + where
                + " If it repeats, lower the LR or tighten clipping, and roll back past it if the loss follows."
            ),
            evidence=evidence,
        )
