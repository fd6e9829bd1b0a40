"""``loss_spike``: a loss far above its recent robust level; one finding per incident, as trusted as its evidence.

Why the rule is what it is (failure-modes.md S1, and §2 "spike rules shipped in open-source
code"; issue 14, "a wrong finding is worse than silence"):

* The level is the **median** of the last ``window`` accepted losses and the noise scale sigma is the
  MAD of their step-to-step differences (÷√2). A spike is never admitted to the window, so an
  earlier outlier inflates neither the level nor sigma: OLMo-core's mean + 6sigma over 128 steps is
  blinded for 128 steps by the very spike it just saw, and a falling trend inflates a plain
  std. Differences cancel the trend, so the rule stays sensitive through warmup and decay.
* It fires on the spike step itself (a rollback decision wants the exact step and batch).
* **The severity is what the evidence supports.** The MAD sigma describes the core of the noise,
  not its tail: a healthy run with heavy-tailed per-batch losses (56_modded-nanogpt-1b: ~60 one-step
  excursions of 1.3-1.9x, each back in 1-3 steps) is many "sigma" out every few hundred steps. So:

  - a spike with a cause in evidence (the grad norm rose first, or jumped ``norm_jump_ratio``x with
    it; the LR jumped), or at least ``1 + warn_rel`` x the baseline and outside the run's own tail,
    opens as a **warning**; any other spike opens as **info** and becomes a warning only if the loss
    is not back in the band within ``quick_steps`` entries;
  - the run's tail is learned: accepted losses ``tail_min_z`` sigma out and spikes that came back at
    once (with no cause) are remembered; a spike is inside the tail when ``tail_count`` of them were
    at least 1/``tail_factor`` of its size;
  - a spike that came back at once, with nothing repeating or growing, de-escalates to info;
  - not back within ``recover_steps``: **critical** with the rollback recipe (PaLM/BLOOM: restart
    before the spike, skip the batches around it; BLOOM's first spike took ~30 iterations). Critical
    means act now: once the loss is back in the band on its own there is nothing to roll back, and the
    episode settles to a warning that says how long it took (an early burst at the peak LR, 50 steps
    up and back by itself, is not the run's critical problem; a burst that grew stays critical).
* **The initial descent.** While the level falls fast (``descent_drop`` per window) the band is
  stale and per-batch losses of a fast-changing model jump 1.3-3.7x: a spike with no cause in
  evidence must then be ``descent_ratio`` x the baseline.
* **One finding per incident.** Spikes are grouped into an episode, one anomaly: the first spike
  opens it at its step, each later spike updates its message (count, period, largest, trend) and
  extent, and it closes (resolved) after a quiet stretch (``episode_quiet`` entries, or a few of the
  run's recent spike intervals) or at the run's end if the loss is back. Recurring spikes that grow
  (in size or frequency) are **critical**; recurring spikes with a cause in evidence stay a warning.
  An episode of info-level noise does not swallow a real spike: that one closes it and opens its own
  anomaly at its step.
* **The hint follows the evidence.** An LR jump names the LR, not the batch; grad norm rising first
  (BLOOM 0.17 → 960 over ~5 steps) names optimisation instability; otherwise the batch, by its
  fingerprint. Only a log with grad norms can say "the grad norm did not rise first".

Issue 23 ("a finding earns trust" in DESIGN.md):

* **Few points are evidence when the jump is large.** Before the window holds ``min_history`` losses,
  a loss ``early_ratio`` x every earlier one (two at least), or ``early_vocab_ratio`` x ln(vocab) (the
  untrained model's loss) and above every earlier one, is an explosion; it must also stand
  ``early_spread`` x the earlier losses' own spread above the highest (a signed or near-zero loss is not
  measured by a ratio). Megatron logs explode at their 2nd-4th entry (12.4 -> 44); the rolling rule
  alone saw nothing there. "Earlier" means the last few accepted losses, less their own outliers (over
  ``early_ratio`` x their median: a first loss of 3e13 among 60-100 is not their level): a level shift inside the
  warm-up (0.2 -> 5.3 at a log's 12th entry, after a fast descent from 9) is far above them though not
  above the descent's start, and is found at its onset instead of hundreds of steps later with "skip the
  batches" named after the detection step. With a single earlier loss (a log every 10 iterations whose
  first interval was skipped) a jump of ``early_confirm_ratio`` x is held until its shape tells: back in
  the band before it within ``quick_steps`` entries, it was a spike (dated at its step); still up, it is
  the run's own level and joins the baseline. On a log every N steps the batches to skip run from the
  entry after the last good one. Such a spike is never admitted to the baseline, so huge early values
  (1e12-4e14 among losses of 60-100) do not hide the blow-ups after them.
* **A spike departs from the loss's path.** The last step must carry at least half the excess the
  threshold asks for: a loss creeping up 0.1-0.5 per entry past a lagging median is a trend
  (``divergence``), and "skip the batch" would be the wrong advice for it.
* **Noise in the log's own units.** A logged loss that averages N steps (``run_start.config``'s
  ``loss_mean_over_steps``, stated by the importer: a logging window's mean, an EMA) carries one hard
  batch for about N / (steps between entries) entries: "back at once" is back within ``quick_steps``
  plus those entries. nanochat's EMA (beta 0.9, ~19 steps) decays a 1.2x bump over 7-9 steps, which
  read as "not back in the band" and made its wiggles a WARNING 'loss spikes recurring'.
* **A ratio to a level near zero is not evidence.** When the level is within its own noise (or
  ``min_abs``) of zero, a spike's size is read in sigma, it has no "Nx" and opens as a warning only on
  an LR jump or a loss that stays up: a memorised run's 0.005 -> 0.13 is "27x" and 0.13 nats, and its
  grad norm, ~0 as well, jumps 10x with the same batch (told in the hint, not a cause for a warning).
* **A pattern is one finding with its period and trend.** Spikes at regular intervals (three or more,
  each gap within half a period of the median) are one cause that recurs with that period: the hint
  says so and names what recurs that way (a loader worker or shard, an accumulation or logging
  boundary, a periodic hook), never "skip this batch". The trend is what the spikes do now (the
  longest run of significant spikes each larger than the last); an episode that grew stays critical.
* **Hints match the state.** Every recovery is news (the anomaly keeps the last message and hint, so
  "if the loss is not back within N steps, roll back" must not outlive it), and "skip the batches"
  says how (fast-forward the data loader past them).

State is bounded: fixed windows, a fixed tail memory and the last few spikes of an episode.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainmon.monitor.core.fmt import fmt
from trainmon.monitor.detectors.base import NOTHING, POSITIVE, Detector, Finding, finite
from trainmon.monitor.detectors.batch import Columns, Reading, columns, read
from trainmon.monitor.detectors.rolling import RollingWindow, sorted_median, sorted_quantile
from trainmon.wire import Event

__all__ = ["LossSpike", "LossSpikeConfig"]


@dataclass
class LossSpikeConfig:
    """``loss_spike``: robust deviation of the loss from its recent trend; recoverable or not."""

    window: int = 64
    """Accepted (non-spike) losses that form the baseline: their median is the level."""
    min_history: int = 16
    """Accepted losses needed before the robust rule can fire (no baseline in the first steps)."""
    early_ratio: float = 3.0
    """Before ``min_history``: a loss at least this many times every earlier one (two at least) is an
    explosion seen with few points (Megatron logs: 12.4, 12.4 -> 44 at the 3rd entry). A fine-tune's
    first interval means move 2x (0.27 -> 0.57 -> 0.46) and are not."""
    early_vocab_ratio: float = 2.0
    """...or a loss at least this many times ln(vocab) (an untrained model's loss) and above every
    earlier one (a 10-iteration log interval: 12.1 -> 26.5 at the 2nd entry, ln V = 10.8)."""
    early_confirm_ratio: float = 2.0
    """With one earlier loss only, a loss this many times it is held, and is a spike when the loss is back in
    the band before it within ``quick_steps`` entries (a 10-iteration log interval: 12.1 -> 26.5 -> 13.8 ->
    10.2); one that does not come back is the run's own level (a fine-tune's first interval means 0.27 ->
    0.57 -> 0.46 -> 0.57), and the held losses join the baseline."""
    early_spread: float = 5.0
    """...and at least this many times the spread of the earlier losses above the highest of them (a
    signed or near-zero loss is not measured by a ratio)."""
    z: float = field(default=6.5, metadata=POSITIVE)
    """A loss more than this many robust sigma above the baseline median is a spike. sigma comes from
    the MAD of the last ``2 * window`` accepted step-to-step differences, so a trend does not
    inflate it and earlier spikes (never admitted) do not either; it is inflated by
    (1 + 1.7/sqrt(n)) while few differences are known (a MAD of 20 values can be 2x too small)."""
    min_rel: float = 0.1
    """...and at least this fraction of the baseline above it (ignores tiny-but-many-sigma blips)."""
    min_abs: float = 0.05
    """...and at least this many nats above it."""
    recover_steps: int = 20
    """A spike whose loss is back within the band within this many steps is recoverable;
    otherwise the anomaly escalates to critical with a rollback hint."""
    recover_z: float = 4.0
    """The band a recovered loss must be back in, in robust sigma above the baseline median."""
    skip_back: int = 2
    """Batches before the spike step to suggest skipping, [X - skip_back, X]."""
    precursor_steps: int = 3
    """Steps before the spike inspected for a grad-norm rise (BLOOM ordering)."""
    precursor_ratio: float = 2.0
    """A grad norm this many times its baseline median in those steps means it rose first."""
    norm_jump_ratio: float = 10.0
    """A grad norm this many times its median at the spike step itself is an instability in evidence
    (recurring spikes that each carry a 20-78x norm); below that, a norm that rises with the loss is
    what one hard batch does to the gradient, and names no cause."""
    lr_jump_ratio: float = 3.0
    """An LR that is this many times the LR of the entry before it (in the precursor steps) jumped.
    Entry to entry, so a linear warmup from a tiny LR (4x over four steps) is a ramp, not a jump."""
    quick_steps: int = 3
    """A spike whose loss is back in the band within this many logged entries came back at once: a
    hard batch. Heavy-tailed healthy runs (56_modded-nanogpt-1b: ~60 excursions of 1.3-1.9x) come back
    in 1-3 steps; a spike still up after that opens (or stays) a warning."""
    keep_warning_ratio: float = 10.0
    """A spike at least this many times the baseline stays a warning even when the loss is back at once:
    noise does not reach 10x, a corrupt sample or a tokenizer bug does, and it is worth a look."""
    warn_rel: float = 1.0
    """A spike with no cause in evidence (no grad-norm rise, no LR jump) opens as a warning only when
    the loss is at least (1 + warn_rel) x the baseline and outside the run's own tail; a smaller one
    opens as info and escalates only if it does not come back within ``quick_steps``. Real logs' readings
    call one-step excursions of up to 1.9x (48, 56) and 2.3x (57) single-batch noise, and a wrong
    warning costs more than a late one: the rule that fires still fires on the spike step."""
    tail_min_z: float = field(default=3.0, metadata=POSITIVE)
    """An accepted loss this many robust sigma above the baseline is an excursion the run's tail is
    learned from (with the spikes that came back at once): the MAD sigma describes the core of the
    noise, not a heavy tail."""
    tail_factor: float = 1.5
    """A spike is inside the run's tail when at least ``tail_count`` remembered excursions were at
    least 1/tail_factor of its size (relative to the baseline). A pattern that grows by more than
    tail_factor ** (1/tail_count) (14%) per spike therefore never counts as its own tail."""
    tail_count: int = 3
    """...this many excursions (one large excursion is not a tail; PaLM/BLOOM spikes came alone)."""
    tail_memory: int = 64
    """Excursions remembered for the tail (the most recent ones)."""
    tail_horizon: int = 2000
    """...and only those of the last this many logged entries (a run that calmed down forgets its
    noisy start)."""
    descent_drop: float = 0.35
    """The level is in a fast descent (in practice the initial one) while it falls by more than this
    fraction per ``window`` entries (median of the oldest quarter of the window against the newest).
    The benchmark's slowest synthetic curves fall ~20% per window where spikes are injected."""
    descent_ratio: float = 4.0
    """During a fast descent a spike with no cause in evidence must be this many times the baseline:
    the band is stale and per-batch losses of a model that changes this fast jump 1.3-3.7x (34 false
    warnings in one real first descent). A spike with a cause (LR jump, grad norm) uses the normal rule."""
    growth_min: int = 3
    """Spikes needed before an episode can be called growing: the last this many significant spikes
    (with a cause, or outside the tail) each larger than the one before ..."""
    growth_ratio: float = 1.5
    """... the last at least this many times the first of them (or, for frequency, the last two gaps
    both this many times shorter than the median gap before). A growing episode is critical."""
    episode_quiet: int = 200
    """An episode (one anomaly for a run of repeated spikes) closes, resolved, after this many logged
    entries with no spike, or ``episode_quiet_periods`` of its period if longer, or at the run's end."""
    episode_quiet_periods: float = 3.0
    """...in units of the median interval between the run's recent spikes (across episodes: two spikes
    are too few to know a period); a run that spikes every ~200 steps keeps one episode open."""
    episode_quiet_max: int = 1000
    """...but never more than this many entries."""


_KEEP = 16
"""Spikes an episode keeps (steps, entries, sizes) for its period, trend and evidence."""


_EARLY_RECENT = 4
"""Recent accepted losses an explosion is measured against while the window is short."""


_SQRT2 = math.sqrt(2.0)


def _noise(mid: float, n: int, level: float) -> float:
    """sigma from the median ``mid`` of ``n`` accepted differences, with a small floor; monotone in ``mid`` and in
    ``abs(level)``, rounding included (the gate relies on it)."""
    sigma = 1.4826 * mid / _SQRT2 * (1.0 + 1.7 / math.sqrt(n))
    # max(sigma, abs(level) * 1e-3, 1e-6) spelled out (asked at every candidate step, and max() of three costs more
    # than the rest of this line)
    floor = abs(level) * 1e-3
    if floor > sigma:
        sigma = floor
    return 1e-6 if sigma < 1e-6 else sigma


def _noises(mids: np.ndarray, n: int, levels: np.ndarray | float) -> np.ndarray:
    """:func:`_noise` of each of ``mids`` (with its level), the same operations in the same order over arrays (numpy
    rounds each as Python's floats do): the screen asks it of every gate it opens and every loud entry, 0.13 M calls
    on a million steps where a call cost 0.5 us."""
    sigma = 1.4826 * mids / _SQRT2 * (1.0 + 1.7 / math.sqrt(n))
    floor = np.abs(levels) * 1e-3
    sigma = np.where(floor > sigma, floor, sigma)
    return np.where(sigma < 1e-6, 1e-6, sigma)


def _gaps(xs: Any) -> list[Any]:
    return [b - a for a, b in itertools.pairwise(xs)]


def _median_floor(window: Any, adds: int) -> Any:
    """A lower bound of ``window.median()`` that holds until ``adds`` more values joined it; ``-inf`` when it has
    too few values for one. ``window`` is a :class:`RollingWindow` or the :class:`_Windows` a batch passes through
    (then one bound per window).

    Why exact: an add inserts one value (and, into a full window, drops one), so each order statistic moves down
    at most one place and after ``r`` adds the ``i``-th smallest value is at least the current ``(i - r)``-th. The
    median is at least the lower of the middle values (the mean of two is at least the smaller: float addition is
    monotone), whose place only moves up (a window never shrinks), so it is at least the current
    ``((n - 1) // 2 - r)``-th, read as the nearest-rank quantile at that index (``i / (n - 1)`` times ``n - 1`` is
    within an ulp of ``i``)."""
    n = len(window)
    i = (n - 1) // 2 - adds
    return window.quantile(i / (n - 1)) if i >= 0 and n > 1 else -math.inf


class _Windows:
    """The windows of ``size`` consecutive values of ``series`` that start at ``starts``, sorted: what a
    :class:`RollingWindow` holding each of them reads (its length, median and quantiles, by the same functions of a
    sorted list), for all of them at once, one column per window.

    Why exact: a window's sorted list is the stable sort of its values in arrival order (``insort`` puts a value
    after its equals, and the removal of the oldest value takes the first of its equals, which is it), and equal
    floats are the same float but for ``0.0`` and ``-0.0``: without a ``-0.0`` any sort is that one, with one numpy's
    stable sort is."""

    __slots__ = ("_sorted",)

    def __init__(self, series: np.ndarray, size: int, starts: np.ndarray) -> None:
        rows = sliding_window_view(series, size)[starts]
        self._sorted = np.sort(rows, axis=1, kind="stable" if (np.signbit(series) & (series == 0)).any() else None).T

    def __len__(self) -> int:
        return len(self._sorted)

    def quantile(self, q: float) -> np.ndarray:
        return sorted_quantile(self._sorted, q)  # type: ignore[arg-type]

    def median(self) -> np.ndarray:
        return sorted_median(self._sorted)  # type: ignore[arg-type]


def _grad_norm(fields: dict[str, Any]) -> float | None:
    """The step's grad norm as the detector keeps it: finite and positive, or None."""
    norm = fields.get("grad_norm")
    return norm if finite(norm) and norm > 0 else None


def _stands_out(loss: float, level: float, sigma: float, least_z: float) -> bool:
    """A loss at least ``least_z`` sigma above the level: a spike and an excursion both lie there (see
    :meth:`LossSpike.observe`); every other loss is accepted without more."""
    return loss > level and loss - level >= least_z * sigma


_SCREEN_MIN = 192
"""Steps in a row that ``observe_batch`` screens at once; fewer are read one at a time (the screen's set-up costs
about what ``observe`` does for this many: a batch of 128 steps 2.6 us a step screened against 2.0 observed, of 256
1.5 against 1.9)."""

_OPTIONAL_FLOATS: frozenset[type] = frozenset((float, type(None)))
_INTS: frozenset[type] = frozenset((int,))


class LossSpike(Detector):
    """Robust loss-spike detector: evidence-graded severity, episodes, recoverable or not."""

    kind = "loss_spike"
    config_class = LossSpikeConfig
    order = 90
    priority = 20
    plots = ("loss", "grad")
    localised = True
    consumes = frozenset(("run_start", "run_end", "step"))

    def __init__(self, config: LossSpikeConfig) -> None:
        self.config = config
        self._level = RollingWindow(config.window)
        self._warm = len(self._level) >= config.min_history  # the level window holds min_history losses
        self._least_z = min(config.z, config.tail_min_z)  # sigma above the level below which no rule speaks
        self._diffs = RollingWindow(2 * config.window)
        # the gate (see _open_gate): a loss less than `bar` above `floor` is neither a spike nor an excursion (-inf:
        # no gate, the step is read in full); it holds for `reach` accepted losses after it was set, `left` of them
        # to go (below 0: set it again)
        self._reach = max(1, config.window // 4)
        self._left = -1
        self._floor = self._bar = -math.inf
        self._prev: float | None = None
        # the accepted grad norms (finite, positive), read only when a spike's cause is asked: a plain deque, its
        # median taken then (statistics.median sorts it: the same value as a window's)
        self._norms: collections.deque[float] = collections.deque(maxlen=config.window)
        self._recent: collections.deque[tuple[int, float | None, float | None]] = collections.deque(
            maxlen=config.precursor_steps + 1
        )
        self._lrs: collections.deque[tuple[int, list[Any]]] = collections.deque(maxlen=config.precursor_steps + 1)
        self._n = 0  # entries (steps with a finite loss) seen
        self._ln_vocab: float | None = None
        self._mean_over = 1.0  # steps each logged loss averages (the importer says so in run_start.config)
        self._gaps: collections.deque[int] = collections.deque(maxlen=16)  # steps between logged entries
        self._last_step: int | None = None
        self._prev_step: int | None = None  # the logged step before the current one
        self._pending: dict[str, Any] | None = None  # a large jump after a single loss, until its shape tells
        self._tail: collections.deque[tuple[int, float]] = collections.deque(maxlen=config.tail_memory)
        self._excursion: list[Any] | None = None  # [entry, peak size, length] of an accepted excursion
        self._spike: dict[str, Any] | None = None  # the spike whose loss is not back in the band yet
        self._ep: dict[str, Any] | None = None  # the open episode
        self._spiked: collections.deque[int] = collections.deque(maxlen=_KEEP)  # entries of recent spikes, any episode

    # -- statistics --------------------------------------------------------------------------

    def _sigma(self, level: float) -> float:
        """Noise scale from the MAD of accepted step-to-step differences, with a small floor."""
        n = len(self._diffs)
        if n < 4:
            return max(abs(level) * 0.01, 1e-6)
        return _noise(self._diffs.median(), n, level)

    def _open_gate(self) -> None:
        """Set the gate that decides most steps without the level or sigma: a floor of the level and a bar,
        ``_least_z`` x a floor of sigma, that hold for the next ``_reach`` accepted losses (the bar once the
        differences' window is full: sigma's factor depends on their count).

        Why exact: a loss that is a spike or an excursion lies at least ``_least_z`` sigma above the level (see
        observe); the level is at least the floor, and sigma at least the noise of the differences' median floor
        (monotone in it and in ``abs(level)``, at least 0), so ``loss - floor < bar`` rules both out (float
        subtraction and products are monotone too)."""
        reach = self._reach
        self._left = reach
        self._floor = _median_floor(self._level, reach)
        diffs = self._diffs
        self._bar = self._gate_bar(_median_floor(diffs, reach) if diffs.full and len(diffs) >= 4 else -math.inf)

    def _gate_bar(self, mid: float) -> float:
        """The gate's bar from a floor ``mid`` of the full differences' window's median (``-inf``: none)."""
        return -math.inf if mid == -math.inf else self._least_z * _noise(mid, self._diffs.size, 0.0)

    def _threshold(self, level: float, sigma: float, z: float) -> float:
        return level + max(z * sigma, self.config.min_rel * abs(level), self.config.min_abs)

    def _near_zero(self, level: float, sigma: float) -> bool:
        """The level is within its own noise (or ``min_abs``) of zero: a ratio to it is not evidence (a memorised
        fine-tune's 0.005 -> 0.13 is '27x' and 0.13 nats), so its size is read in sigma and only a cause in
        evidence, or a loss that stays up, makes it a warning."""
        return level <= max(sigma, self.config.min_abs)

    @staticmethod
    def _size(loss: float, level: float, sigma: float) -> float:
        """How far above the baseline, relative to it (1.0 = twice the baseline); in sigma if the
        baseline is about zero or negative."""
        return (loss - level) / (abs(level) if abs(level) > sigma else sigma)

    def _accept(self, loss: float) -> None:
        self._left -= 1
        if self._prev is not None:
            self._diffs.add(abs(loss - self._prev))
        self._prev = loss
        self._level.add(loss)
        if not self._warm:  # the window only grows: once it holds min_history losses, the robust rule applies
            self._warm = len(self._level) >= self.config.min_history

    def _descending(self) -> bool:
        """The level falls by more than ``descent_drop`` per window: oldest quarter against newest.

        Each quarter is read at its lower quartile: the path the loss descends along, not the
        upward per-batch jumps that cluster in a fast descent."""
        vals = self._level.values()
        q = len(vals) // 4
        if q < 4:
            return False
        old, new = sorted(vals[:q])[q // 4], sorted(vals[-q:])[q // 4]
        if new <= 0 or old <= new:
            return False
        gap = len(vals) - q  # entries between the two quarters' centres
        return math.log(old / new) * self.config.window / gap >= math.log1p(self.config.descent_drop)

    def _in_tail(self, size: float) -> int:
        """How many remembered excursions were at least 1/tail_factor of ``size``."""
        floor = size / self.config.tail_factor
        since = self._n - self.config.tail_horizon
        return sum(1 for entry, s in self._tail if entry >= since and s >= floor)

    def _track(self, loss: float, level: float, sigma: float) -> None:
        """Remember accepted excursions (``tail_min_z`` sigma out, back within ``quick_steps``)."""
        if loss - level >= self.config.tail_min_z * sigma:
            size = self._size(loss, level, sigma)
            if self._excursion is None:
                self._excursion = [self._n, size, 1]
            else:
                self._excursion[1] = max(self._excursion[1], size)
                self._excursion[2] += 1
        elif self._excursion is not None:
            self._end_excursion()

    def _end_excursion(self) -> None:
        """The accepted excursion is over: one that came back at once is part of the run's tail."""
        assert self._excursion is not None
        entry, size, length = self._excursion
        self._excursion = None
        if length <= self._quick() and not self._descending():
            self._tail.append((entry, size))

    def _early(self, loss: float) -> tuple[float, float, float] | None:
        """(level, sigma, threshold) when ``loss`` is an explosion seen with too few points for the robust
        rule: ``early_ratio`` x every recent loss (the last ``_EARLY_RECENT``, two at least: a fast first
        descent leaves its start far above the level the jump leaves), or ``early_vocab_ratio`` x ln(vocab)
        and above them; and ``early_spread`` x their own spread above the highest. The level is theirs."""
        cfg = self.config
        vals = self._level.values()[-_EARLY_RECENT:]
        if not vals:
            return None
        mid = statistics.median(vals)
        if mid > 0:  # robust to its own outliers: a first loss of 3e13 among 60-100 is not the level
            vals = [v for v in vals if v <= cfg.early_ratio * mid]
        top, low = max(vals), min(vals)
        if top <= 0:
            return None
        bar = top + max(cfg.early_spread * (top - low), cfg.min_abs, cfg.min_rel * top)
        vocab_bar = math.inf
        if self._ln_vocab is not None:
            vocab_bar = max(cfg.early_vocab_ratio * self._ln_vocab, top * (1 + cfg.min_rel))
        if len(vals) >= 2 and loss >= cfg.early_ratio * top:
            threshold = cfg.early_ratio * top
        elif loss >= vocab_bar:
            threshold = vocab_bar
        else:
            return None
        if loss < bar:
            return None
        level = statistics.median(vals)
        return level, self._sigma(level), max(bar, threshold)

    def _hold(self, event: Event, step: int, loss: float, norm: float | None) -> bool:
        """With one earlier loss only: hold a loss ``early_confirm_ratio`` x it until its shape tells (True: held)."""
        cfg = self.config
        vals = self._level.values()
        if len(vals) != 1 or vals[0] <= 0 or loss < cfg.early_confirm_ratio * vals[0]:
            return False
        level = vals[0]
        sigma = self._sigma(level)
        if loss < level + max(cfg.min_abs, cfg.min_rel * level) or self._near_zero(level, sigma):
            return False
        band = self._threshold(level, sigma, cfg.recover_z)
        cause = self._cause(norm)
        self._pending = {"event": event, "step": step, "loss": loss, "level": level, "sigma": sigma, "band": band}
        self._pending.update(cause=cause, held=[], threshold=cfg.early_confirm_ratio * level, prev=self._prev_step)
        return True

    def _confirm(self, event: Event, step: int, loss: float, norm: float | None, out: list[Finding]) -> bool:
        """A loss after a held one: back in the band before it (the held one was a spike: reported at its step,
        and this loss is its recovery), still up (held too; True), or up too long (the run's level: accepted)."""
        p = self._pending
        assert p is not None
        if loss <= p["band"]:
            self._pending = None
            now_prev, self._prev_step = self._prev_step, p["prev"]  # the spike's own entry before it
            out.extend(
                self._new_spike(p["event"], p["step"], p["loss"], p["level"], p["sigma"], p["threshold"], p["cause"])
            )
            self._prev_step = now_prev
            out.extend(self._follow(event, step, loss, norm))
            return False
        if len(p["held"]) + 1 < self._quick():
            p["held"].append(loss)
            return True
        self._pending = None
        for v in [p["loss"], *p["held"]]:
            self._accept(v)
        return False

    def _quick(self) -> int:
        """Entries within which a spike that came back counts as 'back at once': ``quick_steps``, plus the
        entries one batch stays in a logged value that averages ``loss_mean_over_steps`` steps (an EMA of
        beta 0.9 carries a bad batch for ~19 logged steps; a logging window's mean is one entry)."""
        if self._mean_over <= 1 or not self._gaps:
            return self.config.quick_steps
        gap = max(1.0, statistics.median(self._gaps))
        return self.config.quick_steps + max(0, math.ceil(self._mean_over / gap) - 1)

    def _lr_jump(self) -> tuple[int, float, float, int] | None:
        """(group, before, after, step) of the first entry-to-entry LR jump in the precursor steps."""
        entries = list(self._lrs)
        for (_, was_lrs), (s, now_lrs) in itertools.pairwise(entries):
            if len(was_lrs) != len(now_lrs):
                continue
            for g, (was, now) in enumerate(zip(was_lrs, now_lrs, strict=True)):
                if finite(was) and finite(now) and was > 0 and now > self.config.lr_jump_ratio * was:
                    return g, float(was), float(now), s
        return None

    def _cause(self, norm: float | None, near_zero: bool = False) -> dict[str, Any]:
        """What the evidence says about the spike at the current step (before it is recorded). On a loss
        level near zero (a memorised run: gradients ~0 too) the grad norm's ratios are ratios to ~0 as well:
        they are told, but name no cause that makes the spike a warning."""
        cfg = self.config
        norm_med = statistics.median(self._norms) if len(self._norms) >= 4 else None
        c: dict[str, Any] = {"norm": norm, "norm_med": norm_med, "precursor": None, "jump": False, "lr": None}
        if norm_med:
            before = [(s, n) for s, _, n in self._recent if n is not None][-cfg.precursor_steps :]
            risen = [(s, n) for s, n in before if n > cfg.precursor_ratio * norm_med]
            if risen:
                c["precursor"] = risen[0]
            elif norm is not None and norm > cfg.precursor_ratio * norm_med:
                c["jump"] = True
        c["lr"] = self._lr_jump()
        big_jump = norm is not None and norm_med is not None and norm >= cfg.norm_jump_ratio * norm_med
        c["named"] = c["lr"] is not None or (not near_zero and (c["precursor"] is not None or big_jump))
        return c

    # -- events ------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind != "step":
            return self._on_run(event)
        f = event.fields
        step = f["step"]
        loss = f.get("loss")
        norm = _grad_norm(f)
        lrs = f.get("lr")
        if isinstance(lrs, list):
            self._lrs.append((step, lrs[:64]))  # a slice is a copy
        if not finite(loss):
            self._recent.append((step, None, norm))
            return []  # non-finite values are nan_inf's business
        out: list[Finding] = []
        self._n += 1
        last = self._prev_step = self._last_step
        if last is not None and step > last:
            self._gaps.append(step - last)
        self._last_step = step
        if self._spike is not None:
            out.extend(self._follow(event, step, loss, norm))
        elif self._pending is not None:
            held = self._confirm(event, step, loss, norm, out)
            if held:
                self._recent.append((step, loss, norm))
                return out
        elif not self._warm:
            early = self._early(loss)
            if early is not None:
                level, sigma, threshold = early
                cause = self._cause(norm, self._near_zero(level, sigma))
                out.extend(self._new_spike(event, step, loss, level, sigma, threshold, cause))
            elif self._hold(event, step, loss, norm):
                self._recent.append((step, loss, norm))
                return out
        else:
            if self._left < 0:
                self._open_gate()
            # A spike (over z sigma above the level, and more) and an excursion (tail_min_z sigma above it) both
            # lie at least _least_z sigma above the level (z and tail_min_z are positive, sigma > 0): a loss under
            # the gate, nearly every step of a healthy run, needs neither, and most others no threshold.
            if loss - self._floor >= self._bar and _stands_out(
                loss, level := self._level.median(), sigma := self._sigma(level), self._least_z
            ):
                cfg = self.config
                threshold = self._threshold(level, sigma, cfg.z)
                # a spike departs from the loss's path: the last step carries at least half of the excess
                # the threshold asks for; a creep of small steps past a lagging median is a trend (divergence's)
                jumped = self._prev is None or loss - self._prev >= 0.5 * (threshold - level)
                if loss > threshold and jumped:
                    cause = self._cause(norm, self._near_zero(level, sigma))
                    if not cause["named"] and level > 0 and self._descending():
                        threshold = max(threshold, cfg.descent_ratio * level)
                    if loss > threshold:
                        out.extend(self._new_spike(event, step, loss, level, sigma, threshold, cause))
                if self._spike is None:
                    self._track(loss, level, sigma)
            elif self._excursion is not None:
                self._end_excursion()
        if self._spike is None:
            self._accept(loss)
            if norm is not None:
                self._norms.append(norm)
            if self._ep is not None and self._n - self._ep["last_entry"] >= self._ep["quiet"]:
                out.extend(self._close(f"no spike for {self._n - self._ep['last_entry']} entries"))
        self._recent.append((step, loss, norm))
        return out

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """``observe`` of each event, with every run of at least ``_SCREEN_MIN`` steps screened at once while nothing is
        up (:meth:`_screen`); run events and the steps of a spike, a held loss or a warm-up are read one at a time."""
        n = len(events)
        if n < _SCREEN_MIN:
            out.extend(map(self.observe, events, attempts))
            return
        observe = self.observe
        reading = read(events)
        with reading:  # one reading for the columns and the screens (the engine's is of another list where it leaves
            # kinds out)
            batch = columns(events, "loss", "step")
        i = 0
        for end in [*batch.others, n]:
            while i < end:
                if end - i >= _SCREEN_MIN and self._settled():
                    i = self._screen(events, attempts, reading, batch, i, end, out)
                else:
                    out.append(observe(events[i], attempts[i]))
                    i += 1
            if end < n:
                out.append(observe(events[end], attempts[end]))
                i = end + 1

    def _settled(self) -> bool:
        """Warm, full windows, nothing up, held or tracked: every loss ``observe`` sees next goes through the gate."""
        diffs = self._diffs
        return (
            self._warm
            and self._spike is None
            and self._pending is None
            and self._excursion is None
            and self._level.full
            and diffs.full
            and diffs.size >= 4
        )

    @np.errstate(over="ignore", invalid="ignore")  # two huge losses' sum or difference is inf, as Python's floats
    def _screen(
        self,
        events: list[Event],
        attempts: list[int],
        reading: Reading,
        batch: Columns,
        lo: int,
        hi: int,
        out: list[list[Finding]],
    ) -> int:
        """Steps ``lo`` to ``hi`` of a settled detector, as ``observe`` reads them: the entries it reads in full found
        in one look at the batch, every other step applied to the state in bulk. Returns where it stopped: ``hi``, or
        the step after a spike opened (the losses it screened are then no longer the ones accepted).

        Why exact: while nothing is up every finite loss is accepted, so the windows each entry is measured against
        are the last ``window`` losses and ``2 * window`` differences of the known series before it, and the gate
        opens on a known schedule (when ``_left`` runs out, then every ``reach + 1`` entries), read from those
        windows by the same functions (:class:`_Windows`). An entry under its gate, or not standing out
        (:func:`_stands_out`, with its level and sigma read so), is one ``observe`` accepts without more: each
        window takes it, the grad norms a positive finite norm, and the deques of the last few steps, LRs and gaps
        keep their last values, which is what the bulk update leaves. Every other entry, the one that closes the
        open episode and those while an excursion is tracked are read by ``observe`` itself, which accepts them on
        the same schedule unless a spike opens."""
        observe = self.observe
        fields = batch.fields[lo:hi]
        losses, steps = (column[lo:hi] for column in batch.values)
        ds = None
        # (the batch's types and loss array, read once for the detectors that read them; a batch with a loss of
        # another type elsewhere reads its own)
        if reading.only("loss", _OPTIONAL_FLOATS, lo, hi) and reading.only("step", _INTS, lo, hi):
            whole = reading.only("loss", _OPTIONAL_FLOATS)
            x = reading.floats("loss")[lo:hi] if whole else np.array(losses, dtype=float)  # None: NaN
            finite_loss = np.isfinite(x)
            taken = np.flatnonzero(finite_loss)  # the entries
            xs = x[taken]
            prev = self._prev
            ds = np.abs(np.diff(xs if prev is None else np.concatenate(([prev], xs))))
        if ds is None or not np.isfinite(ds).all():  # fields of other types, or a difference a window drops: observe
            out.extend(map(observe, events[lo:hi], attempts[lo:hi]))
            return hi
        # the windows each entry is measured against: values[j : j + size] of these series (the first entry after a
        # (re)start adds no difference)
        level, diffs, reach = self._level, self._diffs, self._reach
        w, d = level.size, diffs.size
        series = np.concatenate((level.values(), xs))
        dseries = np.concatenate((diffs.values(), ds))
        m = len(xs)
        j = np.arange(m)
        shift = int(prev is None)
        dstart = np.maximum(j - shift, 0)
        # the gate each entry meets: self's until _left runs out, then a new one every reach + 1 entries
        left = self._left
        k0 = int(min(m, max(0, left + 1)))
        floor, bar = np.full(m, self._floor), np.full(m, self._bar)
        opens = j[k0 :: reach + 1]
        if len(opens):
            block = (j[k0:] - k0) // (reach + 1)
            floor[k0:] = np.broadcast_to(_median_floor(_Windows(series, w, opens), reach), len(opens))[block]
            mids = np.broadcast_to(_median_floor(_Windows(dseries, d, dstart[opens]), reach), len(opens))
            bar[k0:] = np.where(mids == -math.inf, -math.inf, self._least_z * _noises(mids, d, 0.0))[block]
        # the entries observe reads in full: over their gate, above their level and standing out
        # (the gate's bar holds against the level itself too: standing out needs at least that much above it)
        loud = np.flatnonzero(xs - floor >= bar)
        lv = _Windows(series, w, loud).median()
        up = xs[loud] - lv
        above = (up > 0) & (up >= bar[loud])
        loud, lv = loud[above], lv[above]
        mids = _Windows(dseries, d, dstart[loud]).median()
        loud_xs = xs[loud]
        # _stands_out of each, over the arrays
        stands = (loud_xs > lv) & (loud_xs - lv >= self._least_z * _noises(mids, d, lv))
        read = [*loud[stands].tolist(), m]
        keep, keep_gaps = self._recent.maxlen or 0, self._gaps.maxlen or 0  # what the deques keep of a run
        # the grad norms the window keeps (finite and positive: _grad_norm's), from the batch's array where every one
        # is a float or absent (a run of accepted steps a look in C, not _grad_norm of each of its last ``w`` steps:
        # 62k calls on D_w1m)
        grads = reading.floats("grad_norm")[lo:hi] if reading.only("grad_norm", _OPTIONAL_FLOATS) else None
        usable = None if grads is None else np.isfinite(grads) & (grads > 0)

        def accept(pa: int, pb: int, ja: int, jb: int) -> None:
            """Steps pa..pb, entries ja..jb among them, as observe takes them while nothing stands out."""
            if jb > ja:
                level.extend(xs[ja:jb][-w:].tolist())  # what the windows keep of the run (all finite)
                diffs.extend(ds[max(ja - shift, 0) : jb - shift][-d:].tolist())
                self._prev = xs[jb - 1].item()
                self._n += jb - ja
                last = jb - 1
                if last < k0:
                    self._left = left - jb
                else:
                    self._left = reach - 1 - (last - k0) % (reach + 1)
                    self._floor, self._bar = floor[last].item(), bar[last].item()
                at = taken[ja:jb]
                if grads is not None and usable is not None:
                    self._norms.extend(grads[at[usable[at]][-w:]].tolist())
                else:
                    kept: list[float] = []  # the last norms the window keeps
                    for t in at[::-1]:
                        norm = _grad_norm(fields[t])
                        if norm is not None:
                            kept.append(norm)
                            if len(kept) == w:
                                break
                    self._norms.extend(reversed(kept))
                was = self._last_step
                self._prev_step = steps[at[-2]] if len(at) > 1 else was
                self._last_step = steps[at[-1]]
                gaps: list[int] = []
                t = len(at) - 1
                while t >= 0 and len(gaps) < keep_gaps:
                    a = steps[at[t - 1]] if t else was
                    if a is None:
                        break
                    if steps[at[t]] > a:
                        gaps.append(steps[at[t]] - a)
                    t -= 1
                self._gaps.extend(reversed(gaps))
            for t in range(max(pa, pb - keep), pb):
                self._recent.append((steps[t], losses[t] if finite_loss[t] else None, _grad_norm(fields[t])))
            lrs: list[tuple[int, list[Any]]] = []
            t = pb - 1
            while t >= pa and len(lrs) < keep:
                lr = fields[t].get("lr")
                if isinstance(lr, list):
                    lrs.append((steps[t], lr[:64]))
                t -= 1
            self._lrs.extend(reversed(lrs))

        n = hi - lo
        pos = k = r = 0  # the next step, the entries before it, the next of `read` not behind it
        while pos < n and self._spike is None and self._pending is None:
            if self._excursion is None:  # accept up to the next entry observe reads
                stop = read[r]
                ep = self._ep
                if ep is not None:  # the entry that closes the episode
                    stop = min(stop, k - 1 + max(1, math.ceil(ep["quiet"]) - (self._n - ep["last_entry"])))
                end = int(taken[stop]) if stop < m else n
                if end > pos:
                    accept(pos, end, k, stop)
                    out.extend(itertools.repeat(NOTHING, end - pos))
                    pos, k = end, stop
                    if pos == n:
                        break
            out.append(observe(events[lo + pos], attempts[lo + pos]))
            k += int(finite_loss[pos])
            pos += 1
            while read[r] < k:
                r += 1
        return lo + pos

    def _on_run(self, event: Event) -> list[Finding]:
        """A run's start (a fresh baseline unless it resumes) or end (an episode back in the band closes)."""
        kind = event.kind
        if kind == "run_start":
            out: list[Finding] = []
            if not event.fields.get("resumed", False):
                if self._ep is not None:
                    out = self._close("the run restarted from scratch")
                self.__init__(self.config)  # a fresh run (same id, restarted from scratch): a new baseline
                vocab = event.fields.get("vocab_size")
                if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 1:
                    self._ln_vocab = math.log(vocab)
            config = event.fields.get("config")
            mean_over = config.get("loss_mean_over_steps") if isinstance(config, dict) else None
            if finite(mean_over) and mean_over >= 1:
                self._mean_over = float(mean_over)
            self._prev = None  # a resume may legitimately move the level a little; keep the window
            return out
        if kind == "run_end":
            if self._ep is not None and self._spike is None:
                return self._close("the run ended with the loss back in the band")
            return []  # a spike still up at the end stays open: it did not pass
        return []

    # -- spikes and episodes -----------------------------------------------------------------

    def _new_spike(
        self, event: Event, step: int, loss: float, level: float, sigma: float, threshold: float, cause: dict[str, Any]
    ) -> list[Finding]:
        cfg = self.config
        size = self._size(loss, level, sigma)
        tail_n = self._in_tail(size)
        in_tail = tail_n >= cfg.tail_count
        significant = cause["named"] or (size >= cfg.warn_rel and not in_tail and not self._near_zero(level, sigma))
        out: list[Finding] = []
        ep = self._ep
        if ep is not None and not (ep["real"] or ep["slow"]) and significant:
            # An episode of info-level noise does not swallow a real spike: it opens its own anomaly here.
            out.extend(self._close(f"a larger spike followed at step {step}"))
            ep = None
        if ep is None:
            ep = self._ep = {
                "first_step": step,
                "count": 0,
                "steps": collections.deque(maxlen=_KEEP),
                "entries": collections.deque(maxlen=_KEEP),
                "sizes": collections.deque(maxlen=_KEEP),
                "significant": collections.deque(maxlen=_KEEP),
                "largest": None,
                "caused": 0,
                "real": False,
                "slow": False,
                "stuck": False,
                "growth": None,
                "grew": False,
                "recovered": None,
                "severity": None,
                "last_entry": self._n,
            }
        self._spike = {
            "step": step,
            "entry": self._n,
            "loss": loss,
            "level": level,
            "sigma": sigma,
            "threshold": threshold,
            "band": self._threshold(level, sigma, cfg.recover_z),
            "peak": loss,
            "above": True,
            "warned": False,
            "escalated": False,
            "caused": cause["named"],
            "significant": significant,
            "fingerprint": event.fields.get("batch_fingerprint"),
            "prev_step": self._prev_step,
        }
        self._record(step, loss, level, sigma, size, in_tail, tail_n, cause, significant, event)
        out.append(self._finding(step))
        return out

    def _record(
        self,
        step: int,
        loss: float,
        level: float,
        sigma: float,
        size: float,
        in_tail: bool,
        tail_n: int,
        cause: dict[str, Any],
        significant: bool,
        event: Event,
    ) -> None:
        """Add a spike to the open episode (its count, period, largest, trend, and the latest spike)."""
        ep = self._ep
        assert ep is not None
        ep["count"] += 1
        ep["steps"].append(step)
        ep["entries"].append(self._n)
        self._spiked.append(self._n)
        ep["sizes"].append(size)
        ep["significant"].append(significant)
        ep["caused"] += bool(cause["named"])
        ep["real"] = ep["real"] or significant
        ep["last_entry"] = self._n
        ep["recovered"] = None
        ratio = None if self._near_zero(level, sigma) else loss / level
        if ep["largest"] is None or size > ep["largest"][0]:
            ep["largest"] = (size, step, ratio)
        ep["latest"] = {
            "step": step,
            "loss": loss,
            "level": level,
            "sigma": sigma,
            "z": (loss - level) / sigma,
            "ratio": ratio,
            "size": size,
            "in_tail": in_tail,
            "tail_n": tail_n,
            "cause": cause,
            "significant": significant,
            "fingerprint": event.fields.get("batch_fingerprint"),
            "prev_step": self._prev_step,
        }
        ep["quiet"] = self._quiet()
        ep["growth"] = self._growth(ep)  # the trend now: a message says what the spikes do, not what they did
        ep["grew"] = ep["grew"] or ep["growth"] is not None

    def _growth(self, ep: dict[str, Any]) -> str | None:
        """'growing' / 'more frequent' once the last significant spikes grow; None otherwise."""
        cfg = self.config
        m = cfg.growth_min
        if len(ep["sizes"]) < m or not all(list(ep["significant"])[-m:]):
            return None
        sizes, sig = list(ep["sizes"]), list(ep["significant"])
        k = len(sizes) - 1  # the start of the run of significant spikes each larger than the one before
        while k > 0 and sig[k - 1] and sizes[k - 1] < sizes[k]:
            k -= 1
        if len(sizes) - k >= m and sizes[-1] >= cfg.growth_ratio * sizes[k]:
            return "growing"
        gaps = _gaps(ep["entries"])
        if len(gaps) >= 3:
            med = statistics.median(gaps[:-2])
            if all(g * cfg.growth_ratio <= med for g in gaps[-2:]):
                return "more frequent"
        return None

    def _periodic(self, ep: dict[str, Any]) -> int | None:
        """The period of an episode whose spikes come at regular intervals (three or more, every gap within
        half a period of the median gap): a pattern with one cause, not one bad batch each time."""
        steps = list(ep["steps"])
        if len(steps) < 3:
            return None
        gaps = _gaps(steps)
        med = statistics.median(gaps)
        if med <= 0 or any(abs(g - med) > 0.5 * med for g in gaps):
            return None
        return round(med)

    def _trend(self, ep: dict[str, Any]) -> str | None:
        if ep["growth"] is not None:
            return ep["growth"]
        if ep["count"] < 3:
            return None
        *earlier, last = ep["sizes"]
        if last * self.config.growth_ratio <= statistics.median(earlier):
            return "shrinking"
        return "steady"

    def _period(self, ep: dict[str, Any]) -> int | None:
        steps = list(ep["steps"])
        if len(steps) < 2:
            return None
        return round(statistics.median(_gaps(steps)))

    def _quiet(self) -> float:
        """Entries without a spike after which the open episode is over: a few of the run's recent spike
        intervals (across episodes: two spikes are too few to know a period), at least ``episode_quiet``."""
        cfg = self.config
        quiet = float(cfg.episode_quiet)
        entries = list(self._spiked)
        if len(entries) >= 3:
            quiet = max(quiet, cfg.episode_quiet_periods * statistics.median(_gaps(entries)))
        return min(quiet, float(cfg.episode_quiet_max))

    def _severity(self) -> str:
        ep, sp = self._ep, self._spike
        assert ep is not None
        if ep["stuck"] or ep["grew"]:
            return "critical"
        if sp is not None and (sp["significant"] or self._n - sp["entry"] > self._quick()):
            return "warning"
        if ep["slow"] or ep["caused"] >= 2:
            return "warning"
        ratio = ep["largest"][2]
        if ratio is not None and ratio >= self.config.keep_warning_ratio:
            return "warning"  # back at once, but a batch this far off is worth a look (corrupt sample, tokenizer)
        return "info"

    def _follow(self, event: Event, step: int, loss: float, norm: float | None) -> list[Finding]:
        """While a spike is up: back in the band, another spike, or escalation."""
        sp, ep = self._spike, self._ep
        assert sp is not None and ep is not None
        cfg = self.config
        sp["peak"] = max(sp["peak"], loss)
        since = self._n - sp["entry"]
        if loss <= sp["band"]:
            self._spike = None
            quick = since <= self._quick()
            if quick and not sp["caused"] and not self._descending():  # a hard batch: part of the run's tail
                self._tail.append((sp["entry"], self._size(sp["peak"], sp["level"], sp["sigma"])))
            ep["slow"] = ep["slow"] or not quick
            # critical means act now: a loss that came back on its own needs no rollback; the episode settles to
            # a warning (it was slow), unless it grew
            ep["stuck"] = False
            ep["recovered"] = (step, step - sp["step"])
            ep["last_entry"] = self._n
            # always news: the finding's message and hint must say it is back (the engine keeps the last
            # ones; "if the loss is not back within N steps, roll back" must not outlive the recovery)
            return [self._finding(step)]
        out: list[Finding] = []
        above = loss > sp["threshold"]
        if above and not sp["above"]:  # over the threshold again after dipping below it: another spike
            level, sigma = sp["level"], sp["sigma"]
            cause = self._cause(norm, self._near_zero(level, sigma))
            size = self._size(loss, level, sigma)
            significant = cause["named"] or (
                size >= cfg.warn_rel and self._in_tail(size) < cfg.tail_count and not self._near_zero(level, sigma)
            )
            sp["caused"] = sp["caused"] or cause["named"]
            sp["significant"] = sp["significant"] or significant
            self._record(step, loss, level, sigma, size, False, 0, cause, significant, event)
            ep["recovered"] = None
            out.append(self._finding(step))
        sp["above"] = above
        if not sp["escalated"] and step - sp["step"] >= cfg.recover_steps and since > self._quick():
            sp["escalated"] = True
            ep["stuck"] = True
            out.append(self._finding(step, stuck=(sp, loss, step - sp["step"])))
        elif not sp["warned"] and since > self._quick():
            sp["warned"] = True
            if self._severity() != ep["severity"]:
                out.append(self._finding(step))
        return out

    def _close(self, why: str) -> list[Finding]:
        ep = self._ep
        assert ep is not None
        self._ep = None
        self._spike = None
        step = ep["recovered"][0] if ep["recovered"] else ep["latest"]["step"]
        return [
            Finding(
                kind=self.kind,
                severity=ep["severity"] or "info",
                step=step,
                message=f"{self._head(ep)}; over: {why}",
                hint="",
                evidence={"episode": self._episode_evidence(ep)},
                resolved=True,
            )
        ]

    # -- what a finding says -----------------------------------------------------------------

    def _head(self, ep: dict[str, Any]) -> str:
        last = ep["latest"]
        if ep["count"] == 1:
            level = last["level"]
            if last["ratio"] is not None:
                return (
                    f"loss spike at step {last['step']}: {last['loss']:.4g} vs a median of {level:.4g} "
                    f"({fmt(last['ratio'], 3)}x, {fmt(last['z'], 3)} robust sigma)"
                )
            return (
                f"loss spike at step {last['step']}: {last['loss']:.4g} vs a median of {level:.4g} "
                f"({fmt(last['z'], 3)} robust sigma; a level this close to zero makes a ratio meaningless)"
            )
        _, big_step, big_ratio = ep["largest"]
        big_size = ep["largest"][0]
        big = f"{fmt(big_ratio, 3)}x" if big_ratio is not None else f"{fmt(big_size, 3)} sigma"
        now = f"{fmt(last['ratio'], 3)}x" if last["ratio"] is not None else f"{fmt(last['z'], 3)} sigma"
        trend = self._trend(ep)
        return (
            f"loss spikes recurring: {ep['count']} spikes since step {ep['first_step']} "
            f"(every ~{self._period(ep)} steps), largest {big} at step {big_step}, latest {now} at step "
            f"{last['step']}" + (f"; {trend}" if trend else "")
        )

    def _episode_evidence(self, ep: dict[str, Any]) -> dict[str, Any]:
        _, big_step, big_ratio = ep["largest"]
        return {
            "count": ep["count"],
            "first_step": ep["first_step"],
            "spike_steps": list(ep["steps"]),
            "period": self._period(ep),
            "largest_ratio": round(big_ratio, 3) if big_ratio is not None else None,
            "largest_step": big_step,
            "trend": self._trend(ep),
        } | ({"recovered_at": ep["recovered"][0]} if ep["recovered"] else {})

    def _cause_text(self, last: dict[str, Any]) -> tuple[str, bool]:
        """The cause the evidence names, and whether the batch is a suspect."""
        c = last["cause"]
        if c["lr"] is not None:
            g, was, now, s = c["lr"]
            text = (
                f"the LR of param group {g} jumped {now / was:.0f}x ({was:.3g} -> {now:.3g}) at step {s}, just "
                "before the spike: the step size, not the batch, is the likely cause; check the scheduler and "
                "the param groups (a scheduler re-created or re-stepped on resume, scheduler.step() per "
                "micro-batch, a manual LR override)"
            )
            if c["precursor"] is not None or c["jump"]:
                text += "; the grad norm rose with it"
            return text, False
        med = c["norm_med"]
        if c["precursor"] is not None:
            s, n = c["precursor"]
            return (
                f"the grad norm rose first (step {s}: {n:.3g} vs median {med:.3g}): optimisation instability "
                "(BLOOM/OLMo ordering): lower the LR or lengthen warmup, check the fp16 loss scale and "
                "attention-logit growth",
                True,
            )
        if c["jump"]:
            return (
                f"the grad norm jumped at the same step ({c['norm']:.3g} vs median {med:.3g}) with no build-up: "
                "a bad batch or a sudden change to the weights or LR",
                True,
            )
        if med:
            return "the grad norm did not rise first: most likely the data of this batch", True
        if c["norm"] is not None:
            return (
                f"the grad norm ({c['norm']:.3g}) has too little history yet to tell an instability from a bad batch",
                True,
            )
        return "no grad norm is logged to tell an instability from a bad batch", True

    def _finding(self, step: int, stuck: tuple[dict[str, Any], float, int] | None = None) -> Finding:
        cfg = self.config
        ep, sp = self._ep, self._spike
        assert ep is not None
        last = ep["latest"]
        severity = self._severity()
        ep["severity"] = severity
        head = self._head(ep)
        cause, batch_suspect = self._cause_text(last)
        x = last["step"] if stuck is None else stuck[0]["step"]  # the spike to roll back before
        lo = max(0, x - cfg.skip_back)
        prev = (stuck[0] if stuck is not None else last).get("prev_step")
        if prev is not None and prev < x:  # a log every N steps: the batch is somewhere after the last good entry
            lo = max(0, min(lo, prev + 1))
        fp = last["fingerprint"]
        batch = (
            (f"; inspect batch {fp} (step {x})" if fp else f"; inspect the batch of step {x}") if batch_suspect else ""
        )
        if batch_suspect:
            rollback = (
                f"roll back to the checkpoint before step {x} and skip the batches in [{lo}, {x}] (resume with "
                f"the data loader fast-forwarded past them: advance its sampler or data offset by those "
                f"{x - lo + 1} steps' batches)"
            )
        else:  # the LR jumped before the spike: the checkpoint to go back to is before the jump
            rollback = f"roll back to the checkpoint before step {min(x, last['cause']['lr'][3])} with the LR fixed"

        if stuck is not None:
            s, loss, since = stuck
            fpx = f" (batch {s['fingerprint']})" if s["fingerprint"] else ""
            message = (
                f"loss has not recovered {since} steps after the spike at step {x}{fpx}: {loss:.4g} vs "
                f"{s['level']:.4g} before it. {rollback[0].upper()}{rollback[1:]}."
            )
            if ep["count"] > 1:
                message = f"{head}. {message}"
            hint = (
                f"Not recoverable on its own: {rollback}, and lower the LR if it happens again (PaLM/BLOOM "
                f"practice). Cause: {cause}."
            )
        else:
            message = head
            if sp is not None:
                if self._n - sp["entry"] > self._quick():
                    message += f"; not back in the band after {step - sp['step']} steps"
            elif ep["recovered"] is not None:
                at, took = ep["recovered"]
                message += f"; back in the band at step {at} ({took} step{'s' if took != 1 else ''} after the spike)"
            advice = self._advice(ep, sp, severity, rollback)
            period = self._periodic(ep)
            if period is not None:  # a pattern: its cause recurs with it, skipping one batch does not help
                norm = "; the grad norm jumped with them" if ep["caused"] >= 2 else ""
                hint = (
                    f"A pattern, not one bad batch: {ep['count']} spikes about every {period} steps since step "
                    f"{ep['first_step']}{norm}. Look for what recurs every ~{period} steps: a data-loader worker or "
                    "shard that yields bad batches in turn, a gradient-accumulation or logging boundary, a "
                    "periodic hook (eval, checkpoint, EMA swap) that changes the model's state. " + advice
                )
            else:
                hint = cause[0].upper() + cause[1:] + batch + ". " + advice
        evidence: dict[str, Any] = {
            "spike_step": last["step"],
            "loss": last["loss"],
            "baseline_median": round(last["level"], 6),
            "sigma": round(last["sigma"], 6),
            "z": round(last["z"], 1),
            "ratio": round(last["ratio"], 3) if last["ratio"] is not None else None,
            "in_tail": last["in_tail"],
            "episode": self._episode_evidence(ep),
        }
        c = last["cause"]
        if c["norm"] is not None:
            evidence["grad_norm"] = c["norm"]
        if c["norm_med"]:
            evidence["grad_norm_median"] = round(c["norm_med"], 6)
        if c["precursor"] is not None:
            evidence["grad_norm_rose_at"] = c["precursor"][0]
        if c["lr"] is not None:
            evidence["lr_jump"] = list(c["lr"])
        if fp:
            evidence["batch_fingerprint"] = fp
        return Finding(kind=self.kind, severity=severity, step=step, message=message, hint=hint, evidence=evidence)

    def _advice(self, ep: dict[str, Any], sp: dict[str, Any] | None, severity: str, rollback: str) -> str:
        cfg = self.config
        last = ep["latest"]
        if ep["grew"]:
            how = ep["growth"] or "that grew earlier"
            return (
                f"Recurring spikes, {how}: an instability building up; lower the LR (or lengthen warmup, "
                f"tighten clipping) and, if they keep growing, roll back to the checkpoint before step "
                f"{ep['first_step']}."
            )
        if ep["caused"] >= 2:
            return (
                "Recurring spikes with the grad norm or the LR in evidence: lower the LR (or lengthen warmup, "
                "tighten clipping) before they grow."
            )
        if sp is not None and severity != "info":
            return f"If the loss is not back within {cfg.recover_steps} steps, {rollback}."
        if sp is not None:
            if last["in_tail"]:
                return self._tail_text(last) + " Escalates if the loss stays up."
            return (
                f"A spike below {1 + cfg.warn_rel:.1f}x with no cause in evidence is most often one hard batch: "
                f"it escalates if the loss is not back within {self._quick()} entries."
            )
        if ep["stuck"]:
            return (
                f"It was not back within {cfg.recover_steps} steps: check that the loss is back on its earlier "
                "curve before trusting the run, and lower the LR if spikes recur."
            )
        if ep["slow"]:
            return "It took a while to come back: watch for a repeat; lower the LR if spikes recur."
        if last["cause"]["lr"] is not None:
            return (
                "Back at once, but an LR jump like this is more often a bug than a choice: check it before it repeats."
            )
        if last["in_tail"]:
            return self._tail_text(last) + " Nothing to do unless they grow or stop coming back."
        return "Back at once: no action needed unless spikes recur and grow; then lower the LR."

    def _tail_text(self, last: dict[str, Any]) -> str:
        floor = last["size"] / self.config.tail_factor
        at_least = f"{1 + floor:.2f}x the baseline" if last["ratio"] is not None else f"{floor:.1f} sigma"
        return (
            f"Inside this run's own tail: {last['tail_n']} recent excursions of at least {at_least} came back "
            "at once (heavy-tailed per-batch noise)."
        )
