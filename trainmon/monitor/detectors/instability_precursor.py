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

Three more mechanisms, each judged the same way (its own level, sustained, one finding per episode
and escalation, resolved when back for ``sustain`` samples) and named with its layer or group:

* **Linear-layer output growth** (Rybakov et al. 2024), ``linear_out_rms`` per ``nn.Linear``: the RMS
  ``rms_growth_ratio`` x its level or more. The first ``rms_settle`` samples are not the level: from the
  init scale the outputs grow 100x in the first 30 steps of every run. On the reference trainer the
  clean runs (peak LRs 1e-3 to 3e-2, two seeds each) stay within 1.6x their level; under ``lr_too_high``
  the attention and MLP projections pass 4x at steps 120-170 (the loss-based detectors fire at
  98-160), growing 2x every ~40 steps on the way.
* **Attention entropy collapse** (Wortsman et al. 2023; Zhai et al. 2023), ``attn_entropy`` per
  attention module: under ``entropy_floor`` nats (near one-hot: one key takes ~99.7% of the weight)
  and under ``entropy_drop`` x its level. The clean runs at 3e-2 fall from 3.2 to 0.12 nats and train
  normally (hence the floor); ``lr_too_high`` reaches it at steps 150-170, as the loss diverges.
* **Adam's epsilon** (Wortsman et al. 2023), ``adam_eps_frac`` per parameter group: the share of
  second moments under eps^2 ``eps_rise`` above its level. There the update is mostly eps and shrinks
  silently; the remedy is a lower eps, not a lower LR. The clean runs' share holds (0.12% of the
  matrices; 7.1% of the biases and gains: the key biases, whose gradient is zero) at every bench LR.
  No fault here reproduces it: no failure of the tiny GPT does in a few hundred steps at eps 1e-8,
  its second moments sit 8-10 decades above eps^2 (median ~1e-6) and can fall only by beta2 per step
  (a decade every 45 steps at 0.95). Tried, 400-650 steps: an eps too large (1e-4, 1e-3) holds the
  share high from the first samples (15%; 34-49%, rising slowly) while the loss trains as at 1e-8, a
  level, not a rise, and no failure; the loss falling to 0.002 (``labels_unshifted@150``) leaves the
  share at 0.1% by step 390; the loss, so every gradient, x1e-6 from step 150 (a loss normalised twice,
  or a model whose gradients sit near eps) fires, at step 600: the slow start of the rise (0.1% to 15%
  in 280 steps) joins the level, the jump to 50% in 30 steps is the finding, long after the updates
  shrank 50x (within 60 steps of the change). A share high from a run's first samples (the loss scaled
  from step 0) is its level and never fires.

One anomaly per run and rank holds every mechanism and module (the engine keeps one per run, kind and
rank). It is open while any episode is: its severity is that of the most severe open episode (one
module's milder news does not lower it; it eases when that episode settles), every finding's evidence
lists the open episodes (``open``), an episode that settles while others go on says what is still open
without closing the anomaly, and only the last one to settle resolves it.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import SEVERITIES, Detector, Finding, finite
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet
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
    """Series (attention modules, linear layers, parameter groups) tracked per rank (bounded state)."""
    rms_growth_ratio: float = 4.0
    """A linear layer's output RMS this many times its level is growth (the clean runs stay within 1.6x)."""
    rms_settle: int = 3
    """A layer's first samples that are not its level: the growth from the init scale (100x in 30 steps on
    the tiny GPT, within three samples at its ``detail_every`` of 10; within the first at the default 100)."""
    entropy_floor: float = 0.02
    """Attention entropy (nats) under which a module is near one-hot (one key takes ~99.7% of the weight):
    6x under the lowest the clean runs at a peak LR of 3e-2 reached (0.12)."""
    entropy_drop: float = 0.1
    """And at most this fraction of the module's level: a head that is one-hot by design is judged against itself."""
    loss_moved_ratio: float = 1.5
    """Linear-output growth or entropy collapse seen once the loss has risen to this many times its median before
    the episode (the median of the latest five steps' losses, against the steps before it) is info: a
    consequence there, not a precursor (the loss-based findings lead). Random targets ramped in at step 150
    (the ``divergence`` fault, a loss-only failure) raise the loss 3.5x, then the projections' outputs 80x."""
    eps_rise: float = 0.25
    """A parameter group's share of Adam second moments under eps^2 this much above its level (a quarter of
    the group newly updating mostly by eps) is the epsilon mechanism."""


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

_RMS_HINT = (
    "linear-layer output growth (Rybakov et al. 2024): the outputs of the QKV, attention and MLP output "
    "projections grow step by step before the loss diverges. Remedies: a lower peak LR, a longer warmup, "
    "qk-layernorm and normalised layer inputs; lowering the LR now (or rolling back to a checkpoint before step "
    "{since}) is cheaper than after the loss moves. The LR at step {step}: {lr}."
)
_ENTROPY_HINT = (
    "attention entropy collapse (Wortsman et al. 2023; Zhai et al. 2023): the attention logits grew until the "
    "softmax is near one-hot, and the loss diverges next. Remedies: qk-layernorm, a lower peak LR, a longer "
    "warmup; roll back to a checkpoint before step {since} with the LR lowered. The LR at step {step}: {lr}."
)
_EPS_HINT = (
    "Adam's epsilon (Wortsman et al. 2023): where a second moment is under eps^2 the update is mostly eps and "
    "shrinks silently, as if that part of the model had a lower LR. The remedy is a lower eps (Wortsman et al. "
    "use 1e-15), not a lower LR; if the group's gradients vanished (a frozen or detached part), that is the cause."
)


_AFTER_LOSS = "; the loss has already risen: a consequence here rather than a warning ahead of it"
_CALMED = "the growth stopped; if the LR was lowered, that worked. It can come back while the LR stays high."


class _Series:
    """One module's (layer's, group's) sampled values: its level, and the episode in progress."""

    __slots__ = ("after_loss", "calm", "hint", "level", "open", "peak_ratio", "run", "seen", "severity", "since")

    def __init__(self, window: int) -> None:
        self.level: collections.deque[float] = collections.deque(maxlen=window)
        self.seen = 0  # samples received (the first ``settle`` of a mechanism are not its level)
        self.run = 0  # consecutive samples of growth
        self.since: int | None = None  # first sampled step of the growth
        self.open = False
        self.peak_ratio = 0.0
        self.severity = ""
        self.calm = 0  # consecutive samples back under the growth ratio while open
        self.after_loss = False  # the episode began once the loss had moved: info throughout
        self.hint = ""  # the latest finding's hint: what the anomaly says while this episode leads it


class _Mechanism:
    """How one sampled signal is judged against its own level; subclasses say what is abnormal and say it."""

    field = ""
    name = ""
    settle = 0  # first samples of a series that are neither judged nor its level
    escalates_on_peaks = False  # a new highest ratio is news (not only a worse severity)
    evidence_key = ""  # the evidence's name for the value (the field's unless said otherwise)
    follows_loss = False  # seen once the loss moved, it is a consequence: info (``loss_moved_ratio``)
    calmed = _CALMED  # the hint of the finding that resolves an episode

    def __init__(self, config: InstabilityPrecursorConfig) -> None:
        self.config = config

    def assess(self, value: float, level: float) -> tuple[bool, bool, float]:
        """(abnormal, joins the level when not in an episode, ratio: how far from the level, larger is worse)."""
        raise NotImplementedError

    def severity(self, ratio: float, rising: bool) -> str:
        return "warning"

    def recovered(self, value: float, level: float) -> bool:
        """An open episode's sample that counts toward its end (by default: any sample that is not abnormal)."""
        return not self.assess(value, level)[0]

    def message(self, module: str, s: _Series, step: int, value: float, level: float, ratio: float) -> str:
        raise NotImplementedError

    def resolved(self, module: str, step: int, value: float, level: float, ratio: float) -> str:
        raise NotImplementedError

    def hint(self, since: int | None, step: int, lr: str) -> str:
        raise NotImplementedError

    def state(self, severity: str, peak_lr: float | None) -> str:
        """What the severity means here, appended to the message."""
        return _AFTER_LOSS if self.follows_loss and severity == "info" else ""


def _ratio(value: float, level: float) -> float:
    return value / level if level > 0 else float("inf")


class _LogitGrowth(_Mechanism):
    field = "attn_logit_max"
    name = "attention_logit_growth"
    escalates_on_peaks = True
    evidence_key = "attn_logit_bound"

    def assess(self, value: float, level: float) -> tuple[bool, bool, float]:
        ratio = _ratio(value, level)
        cfg = self.config
        return value >= cfg.min_logit and ratio >= cfg.growth_ratio, ratio < cfg.growth_ratio, ratio

    def severity(self, ratio: float, rising: bool) -> str:
        return "critical" if ratio >= self.config.critical_ratio else ("warning" if rising else "info")

    def message(self, module: str, s: _Series, step: int, value: float, level: float, ratio: float) -> str:
        where = f"since step {s.since}" if s.since is not None else ""
        return (
            f"attention logits growing in {module}: max-logit bound {value:.3g} at step {step}, {ratio:.3g}x its "
            f"level {level:.3g}, {s.run} sampled steps in a row {where}"
        )

    def resolved(self, module: str, step: int, value: float, level: float, ratio: float) -> str:
        return (
            f"attention logits in {module} back near their level: bound {value:.3g} at step {step} "
            f"({ratio:.2g}x its level {level:.3g})"
        )

    def hint(self, since: int | None, step: int, lr: str) -> str:
        return _HINT.format(since=since, step=step, lr=lr)

    def state(self, severity: str, peak_lr: float | None) -> str:
        return _STATE[severity].format(peak=peak_lr, critical=self.config.critical_ratio)


class _OutputGrowth(_Mechanism):
    field = "linear_out_rms"
    name = "linear_output_growth"
    follows_loss = True

    def __init__(self, config: InstabilityPrecursorConfig) -> None:
        super().__init__(config)
        self.settle = config.rms_settle

    def assess(self, value: float, level: float) -> tuple[bool, bool, float]:
        ratio = _ratio(value, level)
        growing = ratio >= self.config.rms_growth_ratio
        return growing, not growing, ratio

    def severity(self, ratio: float, rising: bool) -> str:
        return "critical" if ratio >= self.config.critical_ratio else "warning"

    def message(self, module: str, s: _Series, step: int, value: float, level: float, ratio: float) -> str:
        return (
            f"output of {module} growing: RMS {value:.3g} at step {step}, {ratio:.3g}x its level {level:.3g}, "
            f"{s.run} sampled steps in a row since step {s.since}"
        )

    def resolved(self, module: str, step: int, value: float, level: float, ratio: float) -> str:
        return f"output of {module} back near its level: RMS {value:.3g} at step {step} ({ratio:.2g}x {level:.3g})"

    def hint(self, since: int | None, step: int, lr: str) -> str:
        return _RMS_HINT.format(since=since, step=step, lr=lr)


class _EntropyCollapse(_Mechanism):
    field = "attn_entropy"
    name = "attention_entropy_collapse"
    follows_loss = True

    def assess(self, value: float, level: float) -> tuple[bool, bool, float]:
        cfg = self.config
        collapsed = value <= cfg.entropy_floor and value <= cfg.entropy_drop * level
        return collapsed, not collapsed, level / value if value > 0 else float("inf")

    def recovered(self, value: float, level: float) -> bool:
        return value > self.config.entropy_drop * level  # spread again, not hovering just over the floor

    def message(self, module: str, s: _Series, step: int, value: float, level: float, ratio: float) -> str:
        return (
            f"attention in {module} collapsing to one-hot: entropy {value:.3g} nats at step {step}, its level "
            f"{level:.3g}, {s.run} sampled steps in a row since step {s.since}"
        )

    def resolved(self, module: str, step: int, value: float, level: float, ratio: float) -> str:
        return f"attention in {module} spread again: entropy {value:.3g} nats at step {step} (its level {level:.3g})"

    def hint(self, since: int | None, step: int, lr: str) -> str:
        return _ENTROPY_HINT.format(since=since, step=step, lr=lr)


class _EpsilonShare(_Mechanism):
    field = "adam_eps_frac"
    name = "adam_epsilon"
    calmed = "the share is back near its level; if eps was lowered, that worked."

    def assess(self, value: float, level: float) -> tuple[bool, bool, float]:
        rose = value >= level + self.config.eps_rise
        return rose, not rose, value

    def message(self, module: str, s: _Series, step: int, value: float, level: float, ratio: float) -> str:
        return (
            f"Adam updates shrinking in {module}: {value:.1%} of its second moments under eps^2 at step {step}, up "
            f"from its level {level:.1%}, {s.run} sampled steps in a row since step {s.since}"
        )

    def resolved(self, module: str, step: int, value: float, level: float, ratio: float) -> str:
        return f"Adam second moments under eps^2 in {module} back to {value:.1%} at step {step} (level {level:.1%})"

    def hint(self, since: int | None, step: int, lr: str) -> str:
        return _EPS_HINT


_MECHANISMS = (_LogitGrowth, _OutputGrowth, _EntropyCollapse, _EpsilonShare)

_LOSS_HISTORY = 200  # steps of loss kept to tell a precursor from a consequence
_RECENT_LOSSES = 5


class InstabilityPrecursor(Detector):
    """Sustained growth of a module's precursor signals against its own level."""

    kind = "instability_precursor"
    config_class = InstabilityPrecursorConfig
    order = 110
    priority = 150
    plots = ("loss",)
    localised = False
    consumes = frozenset(("run_start", "step"))

    def __init__(self, config: InstabilityPrecursorConfig) -> None:
        self.config = config
        self._mechanisms = [m(config) for m in _MECHANISMS]
        self._names = {m.field: m.name for m in self._mechanisms}
        self._fields = frozenset(self._names)  # a step without any of them (most logs) costs one test
        self._series: dict[tuple[str, str], _Series] = {}  # (field, module or group) -> its series
        self._peak_lr: float | None = None  # the declared schedule's peak
        self._warmup = 0  # and its warmup steps: the LR rises only then (the declared shapes decay after it)
        self._losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=_LOSS_HISTORY)
        self._covered: dict[str, None] = {}  # every module the open anomaly has named, in order (the plot's lines)

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            f = event.fields
            loss = f.get("loss")
            if finite(loss):
                self._losses.append((f["step"], float(loss)))
            return [] if self._fields.isdisjoint(f) else self._on_step(f)
        if kind == "run_start":
            out = self._closed_by_restart()
            self._series.clear()  # a new attempt: its model may differ (resumed or not, levels are re-learnt)
            self._losses.clear()
            schedule = event.fields.get("schedule")
            peak = schedule.get("peak_lr") if isinstance(schedule, dict) else None
            self._peak_lr = float(peak) if finite(peak) and peak > 0 else None
            warmup = schedule.get("warmup_steps") if isinstance(schedule, dict) else None
            self._warmup = warmup if isinstance(warmup, int) else 0
            return out
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step without module statistics is quiet (:mod:`.quiet`): it only adds its loss to the last
        ``_LOSS_HISTORY`` finite losses."""
        observe_quiet(self.observe, events, attempts, out, self._quiet_until, _LOSS_HISTORY)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        return batch.quiet_end(i, self._fields)

    def _on_step(self, f: dict[str, Any]) -> list[Finding]:
        """A step that carries module statistics: each mechanism's values, module by module."""
        out = []
        step = f["step"]
        for mechanism in self._mechanisms:
            values = f.get(mechanism.field)
            if not isinstance(values, dict):
                continue
            for module, value in values.items():
                if not finite(value):
                    continue  # non-finite values are nan_inf's
                series = self._series.get((mechanism.field, module))
                if series is None:
                    if len(self._series) >= self.config.max_modules:
                        continue
                    series = self._series[(mechanism.field, module)] = _Series(self.config.window)
                finding = self._sample(mechanism, module, series, step, float(value), f.get("lr"))
                if finding is not None:
                    out.append(finding)
        return out

    def _sample(self, m: _Mechanism, module: str, s: _Series, step: int, value: float, lr: Any) -> Finding | None:
        cfg = self.config
        s.seen += 1
        if s.seen <= m.settle:
            return None
        if len(s.level) < cfg.min_baseline:
            s.level.append(value)
            return None
        level = statistics.median(s.level)
        abnormal, joins, ratio = m.assess(value, level)
        if not abnormal:
            if s.open and not m.recovered(value, level):
                s.calm = 0  # between abnormal and recovered: the episode goes on, nothing new to say
                return None
            if s.open:
                s.calm += 1
                if s.calm >= cfg.sustain:
                    s.open, s.run, s.since, s.calm = False, 0, None, 0
                    return self._settled(m, module, s, step, value, level, ratio)
                return None
            s.run, s.since = 0, None
            if joins:  # a rise held under the floor is not the level either
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
        if not s.open:
            s.after_loss = m.follows_loss and self._loss_moved(s.since)
        severity = "info" if s.after_loss else m.severity(ratio, rising)
        if s.open:
            severity = max(severity, s.severity, key=SEVERITIES.index)  # an episode never de-escalates
            if severity == s.severity and (not m.escalates_on_peaks or ratio <= s.peak_ratio):
                return None  # nothing new: the anomaly already says this
        s.open = True
        self._covered[module] = None
        s.severity = severity
        s.peak_ratio = max(s.peak_ratio, ratio)
        lr_text = ", ".join(f"{x:.3g}" for x in lrs) if isinstance(lr, list) else "not logged"
        s.hint = m.hint(s.since, step, lr_text)
        return Finding(
            self.kind,
            self._severity(),
            step,
            m.message(module, s, step, value, level, ratio) + m.state(s.severity, self._peak_lr),
            s.hint,
            self._evidence(m, module, s, value, level, ratio),
        )

    def _closed_by_restart(self) -> list[Finding]:
        """A new attempt re-learns every level, so an episode still open when the previous attempt ended can
        neither settle nor grow any more: it is closed here, saying so, rather than left open for ever (it is
        reported again if the new attempt rises again)."""
        still = self._open()
        if not still:
            return []
        last = self._losses[-1][0] if self._losses else None
        rising = ", ".join(f"{name} in {mod} ({o.severity} since step {o.since})" for name, mod, o in still)
        evidence = {"open": self._open_list(), "modules": list(self._covered)}
        self._covered.clear()
        return [
            self.resolve(
                last,
                f"the attempt ended with {rising} still open; a new attempt started and its levels are learnt afresh",
                "Look at the new attempt's precursors: a growth that comes back is reported again.",
                evidence,
            )
        ]

    def _loss_moved(self, since: int | None) -> bool:
        """The loss of the latest steps is ``loss_moved_ratio`` x its median before ``since`` or more."""
        before = [loss for step, loss in self._losses if since is not None and step < since]
        if len(before) < _RECENT_LOSSES:
            return False
        recent = statistics.median(loss for _, loss in list(self._losses)[-_RECENT_LOSSES:])
        return recent >= self.config.loss_moved_ratio * statistics.median(before)

    def _open(self) -> list[tuple[str, str, _Series]]:
        """The episodes still open (mechanism name, module, series), the most severe first, then the earliest."""
        found = [(self._names[f], module, s) for (f, module), s in self._series.items() if s.open]
        return sorted(found, key=lambda o: (-SEVERITIES.index(o[2].severity), o[2].since or 0))

    def _severity(self) -> str:
        """The anomaly's severity: that of its most severe open episode (one module's milder news does not lower
        it; it eases once that episode settles)."""
        return self._open()[0][2].severity

    def _evidence(
        self, m: _Mechanism, module: str, s: _Series, value: float, level: float, ratio: float
    ) -> dict[str, Any]:
        return {
            "module": module,
            "mechanism": m.name,
            m.evidence_key or m.field: value,
            "level": level,
            "ratio": ratio,
            "since_step": s.since,
            "samples": s.run,
            "open": self._open_list(),
            "modules": list(self._covered),
        }

    def _open_list(self) -> list[dict[str, Any]]:
        """What the evidence says is still open: the reader's list of the episodes behind the one anomaly."""
        return [
            {"mechanism": name, "module": mod, "severity": o.severity, "since_step": o.since}
            for name, mod, o in self._open()
        ]

    def _settled(
        self, m: _Mechanism, module: str, s: _Series, step: int, value: float, level: float, ratio: float
    ) -> Finding:
        """One episode settled: the anomaly resolves if it was the last one open; otherwise it stays open, saying
        what is still rising (one anomaly per run, kind and rank: a resolved finding would close the others too)."""
        evidence = self._evidence(m, module, s, value, level, ratio)
        text = m.resolved(module, step, value, level, ratio)
        still = self._open()
        if not still:
            self._covered.clear()  # the anomaly closes: the next one names its own modules
            return self.resolve(step, text, m.calmed, evidence)
        rising = ", ".join(f"{name} in {mod} ({o.severity} since step {o.since})" for name, mod, o in still)
        return Finding(self.kind, self._severity(), step, f"{text}; still open: {rising}", still[0][2].hint, evidence)
