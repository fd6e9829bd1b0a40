"""``loss_noise``: the loss got noisier step to step, and stayed so, while the LR held.

SmolLM3's incident (seeds 004): after a dataloader change the loss became noticeably noisier; the
new loader read each document's sequences in order, so one long or odd document could fill a
whole batch. Nothing spiked for long and nothing diverged: the run was quietly worse. Why the
rule is what it is:

* **Noise is measured on first differences**, as the MAD around their median: differences cancel
  the loss's trend, the median cancels a steady slope, the MAD ignores single spikes (those are
  ``loss_spike``'s) and the one-step drops of epoch boundaries.
* **Relative and absolute, both.** Differences of the log loss factor the level out; differences
  of the loss itself do not. A loss falling towards zero (memorising fine-tunes) raises only the
  relative noise, a diverging loss only the absolute one; batches of less mixed data raise both.
* **Against the attempt's own baseline.** Entries leave the recent window into a baseline window,
  but only while the noise is not already rising (a rise is judged against the noise before it,
  a slow drift is followed), after the declared warmup, and not while the loss descends faster
  than its noise (the first fast fall makes differences look quiet). A resume starts afresh.
* **At a steady LR.** A higher LR is noisier by itself: no finding while the recent LR is above
  the baseline's (warmup, restarts, re-warming); a decay only makes the loss quieter.
* **Sustained.** The rise must hold for ``sustain`` consecutive entries, it is a warning (the run
  learns worse, nothing is burning), and it resolves when the noise is back near its baseline.

The hint names sequence-level shuffling and batch composition; batch fingerprints, when the run
sends them, tell replayed batches (repeats) from new but less mixed ones. State is bounded: a
few fixed windows.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow
from trainmon.wire import Event

__all__ = ["LossNoise", "LossNoiseConfig", "shuffling_hint"]

_isfinite, _log = math.isfinite, math.log
_RETRY_ADDS = 16
"""Admissions after which the absolute baseline's ties are counted again where they proved nothing (a quantised log)."""


@dataclass
class LossNoiseConfig:
    """``loss_noise``: the loss's step-to-step noise sustained well above the attempt's own baseline at a steady
    LR (SmolLM3's loader that read documents' sequences in order: one long or odd document filled whole batches).
    Noise is the MAD of the first differences of the log loss (relative) and of the loss (absolute): differences
    cancel the trend, the log cancels the level, and both must rise (a falling loss raises only the relative
    noise, a rising one only the absolute). A warning: the run learns worse from less diverse batches; never
    critical."""

    window: int = 50
    """Recent logged entries whose noise is compared with the baseline's."""
    baseline: int = 150
    """Earlier entries of the same attempt forming the baseline, judged once it holds this many: MADs of 50
    against 50 iid entries differ 2x once in 500 windows, 50 against 150 once in 10^5."""
    ratio: float = 2.2
    """The relative noise this many times the baseline's ... (clean real logs wander 1.7-2x for 100+ entries:
    39_llmc-gpt2-124m around step 9,700, 56_modded-nanogpt-1b around 11,150 and 12,100; a doubling cannot be
    told from that, the reference trainer's unshuffled batches reach 3-4x) ..."""
    sustain: int = 80
    """... and both noises at least ``admit_ratio`` x since the relative one first got there, for this many
    consecutive entries, opens the finding (the absolute noise must rise too: a falling loss raises only the
    relative one). A single spike moves a MAD by nothing; the longest such streak in the real logs is 43 entries
    (56_modded-nanogpt-1b at 12,100); a loader that stopped shuffling stays noisy to the end."""
    admit_ratio: float = 1.6
    """Entries leave the recent window into the baseline only while the relative or the absolute noise is under
    this many times the baseline's: a rise is judged against the noise before it, a slow drift is followed."""
    release_ratio: float = 1.2
    """Once open, both noises under this many times the baseline's for ``sustain`` entries resolve it."""
    trend_max: float = 0.5
    """Entries whose window's median log-loss change exceeds this share of its noise are a descent (the first
    fast fall, a decay's drop) and never join the baseline: a consistent fall makes differences look quiet."""
    lr_rise: float = 0.1
    """No finding while the recent window's median LR is more than this fraction above the baseline's: a
    higher LR is noisier by itself (warmup, a restart, a re-warm)."""
    level_drift: float = 0.15
    """No finding unless the recent window's median loss is within this fraction of the oldest third of the
    baseline's: noise is compared at one level (a pretraining descent's relative noise grows as the loss falls,
    MiniMind's 1.5-2x from loss 6 to 4; the reference trainer's unshuffled batches move the level 5%)."""


def shuffling_hint(since: int | None, than: str = "before") -> str:
    """What a noisier loss at a steady LR usually means, and what to check (also used by ``compare``,
    with ``than="in A"``)."""
    where = f" around step {since}" if since is not None else ""
    return (
        f"Batches look less diverse than {than}: check sequence-level shuffling. A loader that reads each "
        "document's sequences in order lets one long or odd document fill a whole batch (SmolLM3's noisier "
        "loss; they pre-shuffled the tokenized sequences offline, per node and epoch). Check any data loader, "
        f"mixture or packing change{where}, and the batch size per step."
    )


def _fingerprint_note(prints: list[Any]) -> tuple[str, dict[str, int]]:
    sent = [p for p in prints if isinstance(p, str)]
    if not sent:
        return (
            " The run sends no batch fingerprints, so replayed batches cannot be ruled out "
            "(TrainMonitor.step_end(batch_fingerprint=...)).",
            {},
        )
    repeated = len(sent) - len(set(sent))
    counts = {"sent": len(sent), "repeated": repeated}
    if repeated:
        return (
            f" {repeated} of the last {len(sent)} batch fingerprints repeat: batches are being replayed "
            "(check the sampler's seed and epoch and the restored data position).",
            counts,
        )
    return (
        f" The last {len(sent)} batch fingerprints are all distinct: the batches are new data, not replays, "
        "so their mixing is what changed.",
        counts,
    )


class LossNoise(Detector):
    """A sustained rise of the loss's step-to-step noise over the attempt's own baseline, at a steady LR."""

    kind = "loss_noise"
    config_class = LossNoiseConfig
    order = 170
    priority = None
    plots = ()
    localised = False
    consumes = frozenset(("run_start", "step"))

    def __init__(self, config: LossNoiseConfig) -> None:
        self.config = config
        self._open = False
        self._reset(warmup_end=0)

    def _reset(self, warmup_end: int) -> None:
        c = self.config
        self._warmup_end = warmup_end
        self._prev: float | None = None
        self._recent: collections.deque[tuple[float, float, float, float | None, int]] = collections.deque()
        self._levels: collections.deque[float] = collections.deque(maxlen=c.baseline)  # the baseline's losses
        self._settled = False  # the noise was once near the baseline's: a rise after it is an onset
        self._rd = RollingWindow(c.window)
        self._ra = LazyWindow(c.window)  # read only where the relative noise does not decide an entry
        self._bd = RollingWindow(c.baseline)
        self._ba = LazyWindow(c.baseline)  # read only where the relative noise does not decide an entry
        self._rlr, self._blr = LazyWindow(c.window), LazyWindow(c.baseline)  # read only when judging or reporting
        self._prints: collections.deque[Any] = collections.deque(maxlen=c.window)
        self._hits = 0
        self._calm = 0
        self._high = False  # both noises were admit_ratio x their baseline's at the last entry
        self._since: int | None = None  # step at which the noise first rose past admit_ratio
        self._reported = 0  # step of the last finding of the open anomaly
        self._judged = False  # the recent window and the baseline full: so until the next attempt
        self._admitted = 0  # entries admitted to the baseline
        self._ba_proven = -1  # the admission through which the absolute baseline's MAD is proven positive
        self._ba_retry = 0  # the admission from which its ties are counted again

    # -- events ----------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "step":  # the common kind first, each field read once: called on every logged step
            f = event.fields
            loss = f.get("loss")
            if type(loss) is not float:
                loss = float(loss) if finite(loss) else math.nan
            if not _isfinite(loss) or loss <= 0:
                self._prev = None  # no difference across a gap in the losses
                return []
            prev, self._prev = self._prev, loss
            if prev is None:
                return []
            lrs = f.get("lr")
            lr = lrs[0] if isinstance(lrs, list) and lrs else None
            if lr is not None and not (_isfinite(lr) if type(lr) is float else finite(lr)):
                lr = None
            ratio = loss / prev  # 0 or inf where the two are hundreds of decades apart: then the difference of the logs
            d = _log(ratio) if 0.0 < ratio < math.inf else _log(loss) - _log(prev)
            return self._add(f["step"], loss, d, loss - prev, lr, f.get("batch_fingerprint"))
        if event.kind != "run_start":
            return []
        out = []
        if self._open:
            out.append(self._finding(None, "a new attempt: its noise is judged afresh", {}, resolved=True))
            self._open = False
        sched = event.fields.get("schedule")
        warmup = sched.get("warmup_steps") if isinstance(sched, dict) else None
        self._reset(warmup_end=warmup if isinstance(warmup, int) else 0)
        return out

    # -- the rule --------------------------------------------------------------------------------

    def _ratios(self) -> tuple[float, float] | None:
        """(relative, absolute) noise of the recent window over the baseline's, once both are judged."""
        if len(self._recent) < self.config.window or not self._bd.full:
            return None
        bd, ba = self._bd.mad(), self._ba.mad()
        if bd <= 0 or ba <= 0:
            return None  # a baseline with no measurable noise (a quantised or constant log)
        return self._rd.mad() / bd, self._ra.mad() / ba

    def _judging(self) -> bool:
        """The windows full enough to judge (``_ratios`` judges then); they stay so until the attempt ends."""
        self._judged = len(self._recent) >= self.config.window and self._bd.full
        return self._judged

    def _ba_positive(self) -> bool:
        """The absolute baseline's MAD positive, which is all the rule asks of it on most entries (the relative ratio
        decides them): proven from its ties for as many admissions as they allow (``LazyWindow.mad_positive_for``),
        counted once for all of them (the window is kept sorted only when read); where they prove nothing (a tied,
        quantised log), computed, and the ties counted again ``_RETRY_ADDS`` admissions later."""
        n = self._admitted
        if n >= self._ba_retry:
            left = self._ba.mad_positive_for()
            if left >= 0:
                self._ba_proven = n + left
                return True
            self._ba_retry = n + _RETRY_ADDS
        return self._ba.mad() > 0

    def _absolute_quiet(self, bar: float) -> bool:
        """The absolute noise proven under ``bar`` x its baseline's from the MADs' bounds (the baseline's positive)."""
        ba = self._ba.mad_bounds()[0]
        return ba > 0 and self._ra.mad_bounds()[1] / ba < bar

    def _descending(self) -> bool:
        """The recent window's median log-loss change exceeds ``trend_max`` x its noise. The MAD is computed only
        when its bounds straddle the answer (``t * lo <= t * mad <= t * hi`` for ``t >= 0``, rounding included)."""
        t = self.config.trend_max
        trend = abs(self._rd.median())
        if t >= 0:
            lo, hi = self._rd.mad_bounds()
            if trend <= t * lo or trend > t * hi:
                return trend > t * hi
        return trend > t * self._rd.mad()

    def _lr_steady(self) -> bool:
        if not len(self._rlr) or not len(self._blr):
            return True  # no LR logged: nothing says it rose
        return self._rlr.median() <= self._blr.median() * (1 + self.config.lr_rise)

    def _level_steady(self) -> bool:
        """The oldest third of the baseline and the recent window at about the same loss."""
        old = sorted(list(self._levels)[: len(self._levels) // 3])
        now = sorted(x[0] for x in self._recent)
        a, b = old[len(old) // 2], now[len(now) // 2]
        return max(a, b) <= min(a, b) * (1 + self.config.level_drift)

    def _add(self, step: int, loss: float, d: float, a: float, lr: float | None, fingerprint: Any) -> list[Finding]:
        c = self.config
        rising = self._settled and self._high  # the noise before this entry (the windows are as the last left them)
        recent = self._recent
        recent.append((loss, d, a, lr, step))
        self._rd.add(d)
        self._ra.add(a)
        if lr is not None:
            self._rlr.add(lr)
        self._prints.append(fingerprint)
        if len(recent) > c.window:
            old_loss, old_d, old_a, old_lr, old_step = recent.popleft()
            # the descent last: it decides the entry's admission only while nothing else excludes it
            if not (rising or self._open or old_step < self._warmup_end or self._descending()):
                self._levels.append(old_loss)
                self._bd.add(old_d)
                self._ba.add(old_a)  # finite, as the values its ties are counted on: losses positive and finite
                self._admitted += 1
                if old_lr is not None:
                    self._blr.add(old_lr)
        if not self._open and (self._judged or self._judging()):
            # Judged, and one noise proven under admit_ratio x its baseline's: what the rule below does with such a
            # noise, on most entries from the MADs' O(1) bounds, then from the relative ratio itself, before the four
            # exact MADs. Exact: with both baselines' MADs positive (their lower bounds) the ratios exist, and each is
            # at most its recent window's upper bound over its baseline's lower bound (float division is monotone).
            bd = self._bd.mad_bounds()[0]
            if bd > 0 and (self._admitted <= self._ba_proven or self._ba_positive()):
                bar = c.admit_ratio
                rd = self._rd
                if rd.mad_bounds()[1] / bd < bar or rd.mad() / self._bd.mad() < bar or self._absolute_quiet(bar):
                    self._since, self._settled, self._high, self._hits = None, True, False, 0
                    return []
        ratios = self._ratios()
        if ratios is None:
            self._high = False
            return []
        rel, ab = ratios
        noise = min(rel, ab)
        self._high = noise >= c.admit_ratio
        if noise < c.admit_ratio:
            self._since, self._settled = None, True
        elif self._since is None and self._settled:
            self._since = step
        if not self._open:
            # A streak starts at ``ratio`` and holds while the noise stays ``admit_ratio`` up (hysteresis).
            # (the LR and the level, dearest, asked last: only of an entry that starts or holds a streak)
            held = noise >= c.admit_ratio and self._settled and (self._hits or rel >= c.ratio)
            self._hits = self._hits + 1 if held and self._lr_steady() and self._level_steady() else 0
            if self._hits < c.sustain or rel < c.ratio:
                return []
            self._open, self._calm, self._reported = True, 0, step
            return [self._report(step, rel, ab)]
        self._calm = self._calm + 1 if noise < c.release_ratio else 0
        if self._calm >= c.sustain:
            self._open = False
            msg = f"loss noise back to {noise:.1f}x its baseline (relative {rel:.1f}x, absolute {ab:.1f}x)"
            return [self._finding(step, msg, {"relative_ratio": rel, "absolute_ratio": ab}, resolved=True)]
        if step - self._reported >= c.window:
            self._reported = step
            return [self._report(step, rel, ab)]
        return []

    def _report(self, step: int, rel: float, ab: float) -> Finding:
        c = self.config
        note, prints = _fingerprint_note(list(self._prints))
        lr = f"at a steady LR ({self._rlr.median():.3g})" if len(self._rlr) else "(the run logs no LR)"
        since = f"first seen at step {self._since}" if self._since is not None else "rising"
        msg = (
            f"loss noise {rel:.1f}x its baseline for {c.sustain}+ entries {lr}, {since}: step-to-step MAD "
            f"{self._rd.mad():.3g} vs {self._bd.mad():.3g} of the log loss ({rel:.1f}x), "
            f"{self._ra.mad():.3g} vs {self._ba.mad():.3g} of the loss ({ab:.1f}x)"
        )
        evidence = {
            "relative_ratio": rel,
            "absolute_ratio": ab,
            "recent_mad_log": self._rd.mad(),
            "baseline_mad_log": self._bd.mad(),
            "recent_mad": self._ra.mad(),
            "baseline_mad": self._ba.mad(),
            "window": c.window,
            "baseline_entries": len(self._bd),
            "rise_first_seen": self._since,
            "lr_recent": self._rlr.median() if len(self._rlr) else None,
            "lr_baseline": self._blr.median() if len(self._blr) else None,
        }
        if prints:
            evidence["batch_fingerprints"] = prints
        return self._finding(step, msg, evidence, hint=shuffling_hint(self._since) + note)

    def _finding(
        self, step: int | None, message: str, evidence: dict[str, Any], *, hint: str = "", resolved: bool = False
    ) -> Finding:
        return Finding(self.kind, "warning", step, message, hint, evidence, resolved=resolved)
