"""``instability_precursor``: attention logits growing without bound, before the loss shows it (issue 28).

The mechanism (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities"): without qk-layernorm, at a peak LR too high, the
query and key norms of some attention layer grow step after step; the attention logits q·k/√d grow
with them until the softmax saturates to one-hot (attention entropy collapse), and then the loss
diverges. The hooks send, on sampled steps, ``attn_logit_max``: per attention module an upper bound
on the largest logit (largest query row norm x largest key row norm / √d, see
``trainmon.hooks.precursors``).

Why the rule is what it is ("How a finding earns trust" in DESIGN.md):

* **The run's own history.** Each module's level is the median of its last ``window`` sampled values;
  a growth is ``growth_ratio`` x that level, so a model whose logits are large by design is judged
  against itself. Values ``growth_ratio`` x the level or more never join it, whether or not they pass
  the floor yet (the growth would raise its own bar: a bound of 19.7, 11x its level, let in one
  sample before 28 delayed a warning by 110 steps on the reference trainer).
* **A floor in the value's own units.** A bound under ``min_logit`` is not judged, however fast it
  rose: early training multiplies it 5-20x from its initial ~0.3.
* **Sustained, not one batch:** ``sustain`` consecutive sampled steps.
* **Calibrated where it can be checked.** On the reference trainer's tiny GPT the bound stays within
  0.3-6 on clean runs at peak LRs 1e-3 to 1e-2 (three seeds each), grows to 130-270 at 3e-2 where the
  loss still trains normally (hence the severity rule below), and passes 20 in the warmup to a peak of
  0.3, 50-120 steps before the first loss-based finding (``bench/early_warning.py``).
* **Severity follows what is still to come.** The growth follows the LR (Wortsman et al. 2023). A
  growth in the declared schedule's warmup, its peak LR still ``lr_headroom`` x the step's LR or more, is
  a warning: the LR that made it will rise further (the ``lr_too_high`` runs, warned at LR 0.06 on the
  way to 0.3). At the peak, or with no declared schedule, it is info: at a peak of 3e-2 the bound
  grows 17-27x and the loss trains as the clean runs' do, so a warning there would be wrong. Either
  becomes critical once the bound reaches ``critical_ratio`` x its level (attention collapsing now).
  Severity never drops within an episode; it resolves when the bound is back under ``growth_ratio`` x
  its level for ``sustain`` samples.
* **Only what was reproduced alarms.** The output log Z (``output_logz``) is captured but not alarmed
  on: no fault here reproduced output-logit divergence (a removed final norm with a 10x head trained
  normally), and on clean runs log Z climbs from ln V to ~9 by itself, so a rule would be a guess.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import SEVERITIES, Detector, Finding, finite
from trainmon.wire import Event

__all__ = ["InstabilityPrecursor", "InstabilityPrecursorConfig"]


@dataclass
class InstabilityPrecursorConfig:
    """``instability_precursor``: attention logits growing before the loss moves (issue 28).

    Calibrated on the reference trainer's tiny GPT (bench/early_warning.py): the attention-logit bound
    stays within 0.3-6 on clean runs at peak LRs 1e-3 to 1e-2 over three seeds each, grows to 130-270
    after the warmup at 3e-2 while the loss trains normally (info, see ``lr_headroom``), and passes 20 in
    the warmup to 0.3 (``lr_too_high``), 50-120 steps before the first loss-based finding."""

    window: int = 10
    """Sampled values per module that make its level (their median), the run's own history; values in a
    growth episode never join it."""
    min_baseline: int = 3
    """Samples needed before a growth can be judged."""
    growth_ratio: float = 10.0
    """A sample this many times the module's level is growth (an order of magnitude: the clean runs' bound
    wanders 2-3x around its level after the first steps)."""
    min_logit: float = 20.0
    """And the bound must be at least this, however fast it rose from a small level (early training
    multiplies it 5-20x from its initial ~0.3): a floor in the value's own units, 2.5x above the largest
    bound the clean runs reached (8)."""
    sustain: int = 2
    """Consecutive sampled steps of growth before a warning: one sampled batch is not a trend."""
    critical_ratio: float = 100.0
    """Growth to this many times the level is critical: attention is collapsing now (the loss follows
    within tens of steps on the tiny GPT)."""
    lr_headroom: float = 2.0
    """A growth seen in the declared schedule's warmup, its peak LR at least this many times the step's LR, is a
    warning: the LR that made the logits grow is still going up (the growth follows the LR, Wortsman et al.
    2023). At the peak, or with no declared schedule, a growth is info until ``critical_ratio``: at a peak
    of 3e-2 the tiny GPT's bound grows 17-27x and its loss trains as the clean runs' (1.17 after 400 steps)."""
    max_modules: int = 1024
    """Attention modules tracked per rank (bounded state)."""


_HINT = (
    "attention logit growth (Dehghani et al. 2023; Wortsman et al. 2023): query and key norms grow until the "
    "softmax saturates to one-hot, then the loss diverges. Remedies: qk-layernorm (normalise q and k per head "
    "before the dot product), a lower peak LR, a longer warmup; lowering the LR now (or rolling back to a "
    "checkpoint before step {since}) is cheaper than after the loss moves. The LR at step {step}: {lr}."
)


_STATE = {
    "critical": "; attention is collapsing to one-hot",
    "warning": "; the LR is still rising toward the declared peak {peak:.3g}: the growth follows it",
    "info": "; at the LR's peak (or no declared schedule): worth watching, critical if it reaches {critical:g}x",
}


class _Series:
    """One attention module's sampled bounds: its level, and the growth episode in progress."""

    __slots__ = ("calm", "level", "open", "peak_ratio", "run", "severity", "since")

    def __init__(self, window: int) -> None:
        self.level: collections.deque[float] = collections.deque(maxlen=window)
        self.run = 0  # consecutive samples of growth
        self.since: int | None = None  # first sampled step of the growth
        self.open = False
        self.peak_ratio = 0.0
        self.severity = ""
        self.calm = 0  # consecutive samples back under the growth ratio while open


class InstabilityPrecursor(Detector):
    """Sustained growth of a module's attention-logit bound against its own level."""

    kind = "instability_precursor"
    config_class = InstabilityPrecursorConfig
    order = 110
    priority = 150
    plots = ("loss",)
    localised = False

    def __init__(self, config: InstabilityPrecursorConfig) -> None:
        self.config = config
        self._series: dict[str, _Series] = {}
        self._peak_lr: float | None = None  # the declared schedule's peak
        self._warmup = 0  # and its warmup steps: the LR rises only then (the declared shapes decay after it)

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            self._series.clear()  # a new attempt: its model may differ (resumed or not, levels are re-learnt)
            schedule = event.fields.get("schedule")
            peak = schedule.get("peak_lr") if isinstance(schedule, dict) else None
            self._peak_lr = float(peak) if finite(peak) and peak > 0 else None
            warmup = schedule.get("warmup_steps") if isinstance(schedule, dict) else None
            self._warmup = warmup if isinstance(warmup, int) else 0
            return []
        if event.kind != "step":
            return []
        bounds = event.fields.get("attn_logit_max")
        if not isinstance(bounds, dict):
            return []
        step = event.fields["step"]
        out = []
        for module, value in bounds.items():
            if not finite(value):
                continue  # non-finite values are nan_inf's
            series = self._series.get(module)
            if series is None:
                if len(self._series) >= self.config.max_modules:
                    continue
                series = self._series[module] = _Series(self.config.window)
            finding = self._sample(module, series, step, float(value), event.fields.get("lr"))
            if finding is not None:
                out.append(finding)
        return out

    def _sample(self, module: str, s: _Series, step: int, value: float, lr: Any) -> Finding | None:
        cfg = self.config
        if len(s.level) < cfg.min_baseline:
            s.level.append(value)
            return None
        level = statistics.median(s.level)
        ratio = value / level if level > 0 else float("inf")
        growing = value >= cfg.min_logit and ratio >= cfg.growth_ratio
        if not growing:
            if s.open:
                s.calm += 1
                if s.calm >= cfg.sustain:
                    s.open, s.run, s.since, s.calm = False, 0, None, 0
                    return self._finding(module, s, step, value, level, lr, resolved=True)
                return None
            s.run, s.since = 0, None
            if ratio < cfg.growth_ratio:  # a rise held under the floor is not the level either
                s.level.append(value)
            return None
        s.calm = 0
        s.run += 1
        if s.since is None:
            s.since = step
        if s.run < cfg.sustain:
            return None
        lrs = [x for x in lr if finite(x)] if isinstance(lr, list) else []
        rising = (
            step < self._warmup
            and self._peak_lr is not None
            and bool(lrs)
            and self._peak_lr >= cfg.lr_headroom * max(lrs)
        )
        severity = "critical" if ratio >= cfg.critical_ratio else ("warning" if rising else "info")
        if s.open:
            severity = max(severity, s.severity, key=SEVERITIES.index)  # an episode never de-escalates
            if severity == s.severity and ratio <= s.peak_ratio:
                return None  # nothing new: the anomaly already says this
        s.open = True
        s.severity = severity
        s.peak_ratio = max(s.peak_ratio, ratio)
        return self._finding(module, s, step, value, level, lr)

    def _finding(
        self, module: str, s: _Series, step: int, value: float, level: float, lr: Any, resolved: bool = False
    ) -> Finding:
        ratio = value / level if level > 0 else float("inf")
        evidence = {
            "module": module,
            "mechanism": "attention_logit_growth",
            "attn_logit_bound": value,
            "level": level,
            "ratio": ratio,
            "since_step": s.since,
            "samples": s.run,
        }
        lr_text = ", ".join(f"{x:.3g}" for x in lr if finite(x)) if isinstance(lr, list) else "not logged"
        if resolved:
            return self.resolve(
                step,
                f"attention logits in {module} back near their level: bound {value:.3g} at step {step} "
                f"({ratio:.2g}x its level {level:.3g})",
                "the growth stopped; if the LR was lowered, that worked. It can come back while the LR stays high.",
                evidence,
            )
        where = f"since step {s.since}" if s.since is not None else ""
        return Finding(
            self.kind,
            s.severity,
            step,
            f"attention logits growing in {module}: max-logit bound {value:.3g} at step {step}, {ratio:.3g}x its "
            f"level {level:.3g}, {s.run} sampled steps in a row {where}"
            + _STATE[s.severity].format(peak=self._peak_lr, critical=self.config.critical_ratio),
            _HINT.format(since=s.since, step=step, lr=lr_text),
            evidence,
        )
