"""``loss_scale_collapse``: the fp16 loss scale keeps falling (an overflow storm).

Why the rule is what it is (failure-modes.md S3): metaseq's OPT logbooks and
ymcui/Chinese-LLaMA-Alpaca#534 show the scale halving step after step (64 → … → 1, "already at
minimum") while the skipped-iteration counter climbs and the loss goes flat. A dynamic scaler
halves on every overflow and doubles only after thousands of clean steps, so a few halvings in
a short window, a run of consecutive skipped steps, a skip rate far above the one-in-thousands
of a healthy run, or a scale under 1 all mean gradients are overflowing persistently.

The scaler's start-up calibration is not a collapse: an initial scale of 2^16 (or more) is
halved on the first steps until the gradients fit, so steps are only counted once a run (or a
resumed attempt) has taken its first non-skipped step. A scale reset on resume is
``bad_resume``'s finding.
"""

from __future__ import annotations

import collections
from typing import Any

from trainmon.hooks.wire import Event
from trainmon.monitor.config import LossScaleCollapseConfig
from trainmon.monitor.detectors.base import Detector, Finding, finite

__all__ = ["LossScaleCollapse"]


class LossScaleCollapse(Detector):
    """Repeated halvings, consecutive skips, a high skip rate, or a scale under the minimum."""

    kind = "loss_scale_collapse"

    def __init__(self, config: LossScaleCollapseConfig) -> None:
        self.config = config
        self._scale: float | None = None
        self._calibrated = False
        self._events: collections.deque[tuple[bool, bool]] = collections.deque(maxlen=config.window)  # (halved, skip)
        self._halvings = 0
        self._skips = 0
        self._consecutive = 0
        self._open: str | None = None  # the severity of the open anomaly
        self._quiet = 0  # steps since the last skip or halving

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            self._calibrated = False
            self._scale = None
            self._consecutive = 0
            return []
        if event.kind != "step":
            return []
        f = event.fields
        scale = f.get("loss_scale")
        skipped = f.get("skipped")
        if not finite(scale) and not isinstance(skipped, bool):
            return []
        step = f["step"]
        halved = finite(scale) and self._scale is not None and scale < self._scale
        if finite(scale):
            self._scale = scale
        skip = bool(skipped) if isinstance(skipped, bool) else halved
        if not self._calibrated:
            if skip:
                return []
            self._calibrated = True
        self._push(halved, skip)
        self._consecutive = self._consecutive + 1 if skip else 0
        self._quiet = 0 if (skip or halved) else self._quiet + 1
        return self._judge(step, scale if finite(scale) else None, skip or halved)

    def _push(self, halved: bool, skip: bool) -> None:
        d = self._events
        if len(d) == d.maxlen:
            h, s = d[0]
            self._halvings -= h
            self._skips -= s
        d.append((halved, skip))
        self._halvings += halved
        self._skips += skip

    def _judge(self, step: int, scale: float | None, bad: bool) -> list[Finding]:
        cfg = self.config
        evidence = {
            "loss_scale": scale,
            "halvings_in_window": self._halvings,
            "skips_in_window": self._skips,
            "consecutive_skips": self._consecutive,
            "window": len(self._events),
        }
        tiny = scale is not None and scale < cfg.min_scale
        if bad or tiny:
            return self._fire(step, scale, tiny, evidence)
        if self._open is not None and self._quiet >= cfg.resolve_after:
            self._open = None
            return [
                Finding(
                    kind=self.kind,
                    severity="info",
                    step=step,
                    message=f"no overflow for {self._quiet} steps, loss scale {scale} (step {step})",
                    hint="The overflow storm has passed.",
                    evidence=evidence,
                    resolved=True,
                )
            ]
        return []

    def _fire(self, step: int, scale: float | None, tiny: bool, evidence: dict[str, Any]) -> list[Finding]:
        """Judged only on a step that overflowed (or with a scale under the minimum)."""
        cfg = self.config
        reasons = []
        severity = None
        if tiny:
            reasons.append(f"scale {scale:.3g} < {cfg.min_scale:g}")
            severity = "critical"
        if self._consecutive >= cfg.consecutive_skips:
            reasons.append(f"{self._consecutive} consecutive skipped steps")
            severity = "critical"
        if self._halvings >= cfg.halvings:
            reasons.append(f"{self._halvings} scale halvings in the last {len(self._events)} steps")
            severity = severity or "warning"
        n = len(self._events)
        rate = self._skips / n if n else 0.0
        if n == cfg.window and rate > cfg.max_skip_rate:
            reasons.append(f"skip rate {rate:.1%} over {n} steps")
            severity = severity or "warning"
        if severity is None or self._open == severity or self._open == "critical":
            return []
        self._open = severity
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=step,
                message=f"fp16 loss scale collapsing at step {step}: " + ", ".join(reasons),
                hint=(
                    "Gradients overflow fp16 on most steps (an overflow storm): optimizer steps are being "
                    "skipped, so the LR schedule and the data move on without updates. Look for the cause of "
                    "the large gradients (grad_explosion / loss_spike findings just before, LR too high, "
                    "attention logits growing); switch to bf16 if the hardware allows; a scale under 1 means "
                    "gradients are underflowing too - roll back to the last checkpoint before the halvings."
                ),
                evidence=evidence,
            )
        ]
