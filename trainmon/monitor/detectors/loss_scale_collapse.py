"""``loss_scale_collapse``: the fp16 loss scale keeps falling (an overflow storm).

Why the rule is what it is (failure-modes.md S3): metaseq's OPT logbooks and
ymcui/Chinese-LLaMA-Alpaca#534 show the scale halving step after step (64 → … → 1, "already at
minimum") while the skipped-iteration counter climbs and the loss goes flat. A dynamic scaler
halves on every overflow and doubles only after thousands of clean steps, so a few halvings in
a short window, a run of consecutive skipped steps, a skip rate far above the one-in-thousands
of a healthy run, or a scale under 1 all mean gradients are overflowing persistently.

The scaler's start-up calibration is not a collapse: an initial scale of 2^16 (or more; Megatron
starts at 2^32) is halved on the first steps until the gradients fit, so steps are only counted
once a run (or a resumed attempt) has taken its first non-skipped step. A scale reset on resume is
``bad_resume``'s finding. The search is bounded, though: a scale under ``min_scale`` is an
underflow whether or not a step was ever applied, and an attempt that *ends* without one applied
step never trained: one warning saying every step was skipped (not a collapse: the scale of 5e8
it stopped at is not collapsed, the run just never got past its search).

A collapse is a fall, not a count of halvings: a dynamic scaler regrows after N clean steps and
halves on the next overflow, a sawtooth that repeats for the whole run (DeepSpeed-Chat: 65536 ->
32768 each time the scale regrows, 139 skips in 7,360 steps). What says gradients overflow at any
scale is the scale ending ``halvings`` powers of two below the highest it held within the window,
and the window is counted in steps, not logged lines (a log printed every 10 steps would otherwise
stretch "100 steps" to 1,000). It resolves once no step has been that far down for
``resolve_after`` steps; a later oscillation within fewer powers of two is the sawtooth again.

A scale is a positive multiplier: a value <= 0 is what a trainer prints when its own scaler is off
(Megatron-DeepSpeed's ``loss scale: -1.0`` under the DeepSpeed engine), ignored like a missing one.
Importers drop such placeholders already; this keeps the rule true for any producer.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.quiet import observe_quiet, steps_without
from trainmon.wire import Event

__all__ = ["LossScaleCollapse", "LossScaleCollapseConfig"]

_QUIET_UNTIL = steps_without("loss_scale", "skipped")


@dataclass
class LossScaleCollapseConfig:
    """``loss_scale_collapse``: fp16 loss scale falling repeatedly."""

    window: int = 100
    """Steps over which halvings and skips are counted."""
    halvings: int = 3
    """This many scale decreases within the window is a warning."""
    consecutive_skips: int = 5
    """This many skipped steps in a row is critical."""
    max_skip_rate: float = 0.05
    """A skip rate above this over a full window is a warning."""
    min_scale: float = 1.0
    """A scale below this is critical: fp16 gradients are underflowing."""
    resolve_after: int = 100
    """Steps with no decrease (and the scale above min_scale) after which it resolves."""


class LossScaleCollapse(Detector):
    """Repeated halvings, consecutive skips, a high skip rate, or a scale under the minimum."""

    kind = "loss_scale_collapse"
    config_class = LossScaleCollapseConfig
    order = 140
    priority = 120
    plots = ("loss",)
    localised = False
    consumes = frozenset(("run_start", "run_end", "step"))

    def __init__(self, config: LossScaleCollapseConfig) -> None:
        self.config = config
        self._scale: float | None = None
        self._calibrated = False
        # (step, scale or None, skip) of the logged steps within the last ``window`` steps
        self._events: collections.deque[tuple[int, float | None, bool]] = collections.deque()
        # (step, scale) of the window's decreasing maxima: its high in O(1) a step (a 1M-step log imports fast)
        self._highs: collections.deque[tuple[int, float]] = collections.deque()
        self._skips = 0
        self._consecutive = 0
        self._open: str | None = None  # the severity of the open anomaly
        self._last_bad: int | None = None  # the last step that was overflowing, or that far down
        self._searching: list[tuple[int, float | None]] = []  # (step, scale) skipped before the first applied step

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            f = event.fields
            if "loss_scale" in f or "skipped" in f:  # most logs carry neither: one test a step
                return self._on_step(f)
            return []
        if kind == "run_start":
            self._calibrated = False
            self._scale = None
            self._consecutive = 0
            self._searching = []
            self._events.clear()
            self._highs.clear()
            self._skips = 0
            return []
        if kind == "run_end":
            return self._never_applied()
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step with neither a loss scale nor a skip flag is quiet (:mod:`.quiet`)."""
        observe_quiet(self.observe, events, attempts, out, _QUIET_UNTIL)

    def _on_step(self, f: dict[str, Any]) -> list[Finding]:
        scale = f.get("loss_scale")
        if finite(scale) and scale <= 0:
            scale = None  # a placeholder: no scaler of this trainer's own to watch
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
                self._searching.append((step, scale if finite(scale) else None))
                if finite(scale) and scale < self.config.min_scale:
                    evidence = {"loss_scale": scale, "skips_before_any_update": len(self._searching)}
                    return self._fire(step, scale, True, evidence)
                return []
            self._calibrated = True
            self._searching = []
        self._push(step, scale if finite(scale) else None, skip)
        self._consecutive = self._consecutive + 1 if skip else 0
        return self._judge(step, scale if finite(scale) else None, skip or halved)

    def _never_applied(self) -> list[Finding]:
        """The attempt ended while still skipping every step: it never trained."""
        if self._calibrated or not self._searching:
            return []
        (first, start), (last, end) = self._searching[0], self._searching[-1]
        n = len(self._searching)
        scales = f" (loss scale {start:.4g} -> {end:.4g})" if start is not None and end is not None else ""
        evidence = {"skipped_steps": n, "first_skipped_step": first, "loss_scale_first": start, "loss_scale_last": end}
        message = f"every step skipped so far: no optimizer update in the {n} logged steps {first}-{last}{scales}"
        hint = (
            "The run never trained: the fp16 scaler was still searching for a scale at which the gradients do not "
            "overflow when the run ended. A search from 2^32 takes a dozen or more skipped steps; one that lasts "
            "longer means the gradients overflow at any scale (NaN/inf in the forward pass, a bad initialisation, "
            "an LR far too high): check the first steps' loss and activations, or switch to bf16."
        )
        out = [Finding(kind=self.kind, severity="warning", step=first, message=message, hint=hint, evidence=evidence)]
        if last != first:
            out.append(
                Finding(kind=self.kind, severity="warning", step=last, message=message, hint=hint, evidence=evidence)
            )
        return out

    def _push(self, step: int, scale: float | None, skip: bool) -> None:
        d, highs, oldest = self._events, self._highs, step - self.config.window
        d.append((step, scale, skip))
        self._skips += skip
        while d and d[0][0] <= oldest:
            self._skips -= d.popleft()[2]
        if scale is not None:
            while highs and highs[-1][1] <= scale:
                highs.pop()
            highs.append((step, scale))
        while highs and highs[0][0] <= oldest:
            highs.popleft()

    def _fall(self, scale: float | None) -> int:
        """Powers of two between the highest scale held within the window and ``scale``."""
        high = self._highs[0][1] if self._highs else None
        if scale is None or high is None or scale >= high:
            return 0
        ratio = high / scale  # inf for a subnormal scale under a huge one: then the difference of the logs
        return math.floor((math.log2(ratio) if ratio < math.inf else math.log2(high) - math.log2(scale)) + 1e-9)

    def _judge(self, step: int, scale: float | None, bad: bool) -> list[Finding]:
        cfg = self.config
        fall = self._fall(scale)
        evidence = {
            "loss_scale": scale,
            "halvings_in_window": fall,
            "skips_in_window": self._skips,
            "consecutive_skips": self._consecutive,
            "window_steps": cfg.window,
            "logged_steps_in_window": len(self._events),
        }
        tiny = scale is not None and scale < cfg.min_scale
        if tiny or (bad and fall >= cfg.halvings):
            self._last_bad = step  # still overflowing that far down: the storm goes on
        if bad or tiny:
            found = self._fire(step, scale, tiny, evidence)
            if found:
                self._last_bad = step
            return found
        quiet = step - self._last_bad if self._last_bad is not None else 0
        if self._open is not None and quiet >= cfg.resolve_after:
            self._open = None
            return [
                self.resolve(
                    step,
                    f"no overflow storm for {quiet} steps, loss scale {scale:g} (step {step})"
                    if scale is not None
                    else f"no overflow storm for {quiet} steps (step {step})",
                    "The overflow storm has passed.",
                    evidence,
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
        fall = evidence.get("halvings_in_window", 0)
        if fall >= cfg.halvings:
            reasons.append(f"scale {2**fall}x below its high within the last {cfg.window} steps")
            severity = severity or "warning"
        n = len(self._events)
        rate = self._skips / n if n else 0.0
        covered = n > 1 and self._events[-1][0] - self._events[0][0] >= cfg.window - 1
        if covered and rate > cfg.max_skip_rate:
            reasons.append(f"skip rate {rate:.1%} of the logged steps over {cfg.window} steps")
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
