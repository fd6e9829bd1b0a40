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

What a person can trust (issue 14, "a wrong finding is worse than silence"):

* **The rise must leave the run's own band.** Per-entry noise is not the only noise: a loss on a
  plateau also *wanders* (0.09-0.12 around 0.105 for hundreds of steps), and the increments of a
  slow wander are as one-sided as a divergence's for a while (+21 % over 200 entries, 95 % of them
  up). So the detector keeps an envelope of how far the smoothed loss has strayed above its
  running minimum, forgetting with a half-life of ``band_halflife`` entries, and a rise measured
  over a window must take the loss ``band_factor`` times as far as the envelope stood when that
  window began. A healthy falling run sits at its minimum (an envelope of its smoothed noise, a
  few percent); a wandering one has already been 20-30 % above it and back. The first excursion
  of a wander, before the run has shown any, cannot be told from the onset of a divergence; it is
  at most a warning that resolves, and later ones are measured against it.
* **Relative size has a floor in nats**: ``min_rise_abs`` (0.05, 5 % in perplexity). A loss of 0.1
  wandering by 0.03 nats is +30 % and worth nothing.
* **Sustained**: the long window's rise spans ``long_window`` entries with most lagged pairs up; a
  rise only the short window sees must hold for ``short_sustain`` consecutive entries.
* **Rollback advice names a healthy step**: the last step at which the loss (median-filtered,
  dated at the middle of its window: the EMA lags a few entries) was within ``healthy_rel`` of its
  best since the run's first logged loss (not since the detector's gate), and the last checkpoint
  the run reported at or before it. When that step is the start (the first logged loss is the
  lowest the run ever had: it never learned), no checkpoint is healthy and the hint says so
  instead of naming one.
* **Severity**: ``warning`` when it opens; ``critical`` once the loss has stayed ``critical_rel``
  above its minimum for ``critical_entries`` entries (a large, sustained rise: someone should act
  now); back to ``warning`` below ``critical_release`` x that; resolved when the loss is back in
  its band. While open, a finding is sent again when the severity changes, when the level moved
  by ``update_rel`` or every ``update_every`` entries, so the anomaly's message, evidence (how far
  above, its peak, since when) and last step follow the condition.
* **Sparse logs** (most entries ``sparse_min_interval`` or more steps apart, e.g. Hugging Face
  ``logging_steps=500``): each logged loss is already a mean over hundreds of steps, there are too
  few for the median/EMA/window machinery (five points in a whole run, real log 59), and a jump
  between two points cannot be told from a trend within the gap. For them the rule is on the
  logged points: the last ``sparse_points`` points all ``sparse_rise_rel`` above the best earlier
  point (and ``min_rise_abs``; and ``sparse_rise_sigma`` sigma of the points' own scatter once
  there are enough to measure it): the run spent that many logging windows far above its best
  without coming back.

Issue 23 (DESIGN.md, "How a finding earns trust"):

* **The task metric outranks the loss.** Eval events carry the metric the run is for (a task metric
  such as WER or accuracy, read in its own direction by ``eval_regression.metric_direction``; else
  the eval loss). While its latest value is at least as good as its best up to the step at which the
  training loss was last at its best, there is no divergence claim: none opens, and an open one
  closes (info) on such an eval. A memorised fine-tune whose 100-step-mean loss swings 0.003-0.16 at
  epoch boundaries while the WER improved at every eval got a critical "roll back ... lower the LR"
  that would have thrown the best model away.
* **Units of the log's own noise.** Noise is measured on the logged series itself, so a log of
  interval means (N times less variance than one step) is judged in its own units; a rise is never
  only relative: opening, staying open and turning critical each need ``min_rise_abs`` nats as well
  (67 % of 0.006 is noise).
* **Onset, not readiness.** A finding is dated where the rise started, found by looking back past the
  gates and windows: the step after the last one at which the median-filtered loss was still within
  its noise (``healthy_rel``, one raw sigma) of its lowest (sparse logs: the first of the points that
  stayed far above the best); the step it was found at is ``detected_step`` in the evidence. Real log
  97's rise starts at iteration 32 and was opened at 55.

Windows count logged entries, not steps: the noise being averaged is per entry, so a log
written every N steps gets windows N times longer in steps, and the detection delay in steps
grows with N, bounded by the long window. What a finding *says* (extent, healthy step) is in
steps.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import Reading, observe_runs, read
from trainmon.monitor.detectors.eval_regression import metric_direction
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.wire import Event

__all__ = ["Divergence", "DivergenceConfig"]

_GAPS = 16  # the gaps between logged entries that tell a sparse log
_NOISE = 64  # the successive differences whose median is the per-entry noise
_INF = math.inf
_FLOAT: frozenset[type] = frozenset((float,))
_INT: frozenset[type] = frozenset((int,))
_BULK = 32  # step events in a row from which a batch reads them in one look (numpy's fixed cost is a few us)
_EXACT_INT = 2**53  # steps below it: their gaps are exact in int64 and their values in float64


@dataclass
class DivergenceConfig:
    """``divergence``: loss trending up over many steps."""

    window: int = 20
    """Short slope window (logged entries): catches a fast ramp."""
    long_window: int = 200
    """Long slope window (logged entries): catches a slow creep of a fraction of a percent per step."""
    median_of: int = 5
    """Width of the running median that removes single spikes before smoothing."""
    ema_alpha: float = 0.3
    """Smoothing of the median-filtered loss (robust EMA)."""
    min_steps: int = 30
    """Never fire before this step, nor before the declared warmup ends."""
    min_rise_rel: float = 0.15
    """Over the short window the smoothed loss must rise by at least this fraction ..."""
    long_min_rise_rel: float = 0.1
    """... or over the long window by at least this fraction ..."""
    min_rise_sigma: float = 2.0
    """... and by this many robust sigma of the raw per-entry loss noise (clean noisy fine-tunes
    reach 1.3 over 20 entries; a real divergence several) ..."""
    min_rise_abs: float = 0.05
    """... and by this many nats: 5 % in perplexity, the least rise worth acting on whatever its
    relative size (a memorised loss doubling from 0.008 is not a divergence; a fine-tune's loss
    wandering 0.09-0.12 moves 0.03 nats, issue 14). It binds only below a loss of 0.5, where
    ``long_min_rise_rel`` asks for less ..."""
    up_fraction: float = 0.8
    """... with this share of lagged pairs (value half a window later vs now) going up (a trend) ..."""
    max_jump_share: float = 0.5
    """... no 5-step stretch of the smoothed loss carrying more than this share of the rise (a jump
    that stays up is a non-recovered spike, not a trend) ..."""
    above_min_rel: float = 0.1
    """... and the smoothed loss this fraction above its running minimum ..."""
    band_halflife: int = 1000
    """... and ``band_factor`` x as far above it as it had strayed before the current excursion
    began, an excursion being forgotten with this half-life in entries (issue 14: a plateau loss
    wandering 0.09-0.12 rose +21 % over 200 entries with 95 % of its increments up, exactly like a
    slow divergence, but it had been there before; a healthy falling run strays a few percent,
    its smoothed noise) ..."""
    band_factor: float = 3.0
    """... (a wander's new record is a little above its old ones; a divergence leaves them far
    behind: the benchmark's slow divergences open 12-70 % above a band of 1-5 %)."""
    short_sustain: int = 3
    """A rise seen by the short window only must hold on this many consecutive entries before it
    opens (the long window's is sustained over 200 entries by construction): a window that
    crosses the bars for an entry or two is not a sustained rise; a ramp holds (2 entries' delay)."""
    healthy_rel: float = 0.05
    """At its healthy level: within this fraction of the best loss (for the rollback advice and
    for the band: the excursion starts after the last entry within it)."""
    critical_rel: float = 0.5
    """Critical once the loss has stayed this fraction above its best for ``critical_entries``
    entries: half again the best loss, held, undoes most of what the run learned (real log 59:
    +60-74 % for 1,500 steps, a failed fine-tune; 53: +150 %)."""
    critical_entries: int = 10
    """Entries the loss must stay ``critical_rel`` above its best before critical (a large *and*
    sustained rise; sparse logs: ``sparse_points`` points)."""
    critical_release: float = 0.7
    """Back to warning below this fraction of ``critical_rel`` (hysteresis: no flapping)."""
    update_rel: float = 0.1
    """While open, say it again when the loss level moved by this fraction ..."""
    update_every: int = 50
    """... or after this many entries (the anomaly's last step and evidence stay current)."""
    sparse_min_interval: int = 100
    """Entries at least this many steps apart (median) make a sparse log: each logged loss is a
    mean over that many steps, the trend rule has too few entries (real log 59: five in 2,640
    steps) and a jump between two points cannot be told from a trend. Logs every 25 steps are
    not sparse: their points are still noisy (real log 52, batch 2: 0.27, 0.57, 0.46, 0.97)."""
    sparse_rise_rel: float = 0.6
    """Sparse logs: the last ``sparse_points`` logged losses all this fraction above the best
    earlier one. Without enough points to measure their noise the bar is the size: a run whose
    mean loss stays 60 % above its best for two logging windows is not learning (59: 1.24 ->
    2.03 -> 2.16; clean logs' points fall, or wander well under this) ..."""
    sparse_points: int = 2
    """... (the rise sustained over this many consecutive logging windows, never back to the best) ..."""
    sparse_rise_sigma: float = 5.0
    """... and, once there are six point-to-point changes to measure the points' own noise on, this
    many robust sigma of it above the best (the best of many noisy points is a low outlier: a flat
    log whose points scatter 15 % has pairs of points 60 % above its lowest one)."""


_CAUSES = (
    "Likely causes: LR too high for this stage (check the LR against the schedule), a shift in the data mix, "
    "or optimizer state (Adam epsilon/beta2, a bad resume)."
)


def _smoothed(ema: float, alpha: float, medians: Iterable[float]) -> list[float]:
    """The robust EMA after each of ``medians``, starting from ``ema``: a sequential recurrence (each value rounds
    on the previous one), one definition for a step and for a batch of steps."""
    out: list[float] = []
    add = out.append
    for m in medians:
        ema += alpha * (m - ema)
        add(ema)
    return out


_LANE = 40
"""Entries each lane of :func:`_smoothed_all` gives ..."""
_LEAD = 32
"""... after running this many from an approximate start to meet the lane before it (less than ``_LANE``: a lane meets
the one before it within that one's own entries; real logs' lanes meet within 16 entries, most within 3) ..."""
_TAIL = 110
"""... the approximation weighing this many medians before the start (the weight of the older ones on the oldest: with
``ema_alpha`` 0.3, 1e-17 of it, and the start is within an ulp or two)."""
_LANES_FROM = 2048
"""Entries from which the lanes cost less than the loop (a row of lanes costs three numpy calls, ``_LANE + _LEAD`` rows
whatever the length; the loop, and the list it gives turned into an array, 0.09 us an entry)."""


def _smoothed_all(ema: float, alpha: float, medians: np.ndarray) -> np.ndarray:
    """:func:`_smoothed` of ``medians``, as an array: the recurrence run in lanes side by side, a numpy call a row of
    lanes rather than a step an entry (a 5,000-entry batch: 72 rows of 125 lanes).

    Lane 0 starts from ``ema``; each other lane ``_LEAD`` entries before those it gives, from an approximation of the
    EMA there. The recurrence forgets where it started (an entry shrinks a difference by ``1 - alpha``, and values a
    rounding apart round alike), and it is deterministic: a lane whose value is, bit for bit, the lane before it's at
    that lane's last entry goes on with the very values that lane would have. Lane 0 is exact and every meeting is
    checked, so all are (numpy's subtract, multiply and add round as Python's floats do, in the loop's order). Where a
    lane has not met (a short lead for the data), or the start cannot be close (a small ``alpha``), the loop gives
    them."""
    n = len(medians)
    if n < _LANES_FROM or abs(1.0 - alpha) ** _TAIL > 2.0**-52:
        return np.array(_smoothed(ema, alpha, medians.tolist()))
    lanes, rows = -(-n // _LANE), _LANE + _LEAD
    starts = np.arange(lanes) * _LANE - _LEAD
    starts[0] = 0
    # each row's median in each lane (the last lane's rows past the end repeat the last median: they are not kept)
    given = medians[np.minimum(starts + np.arange(rows)[:, None], n - 1)]
    # the EMA before each lane's start: the medians before it weighted as the EMA weighs them, ``ema`` before the first
    before = np.concatenate(([ema], medians))
    weights = alpha * (1.0 - alpha) ** np.arange(_TAIL)
    weights[-1] = (1.0 - alpha) ** (_TAIL - 1)
    cur = np.empty(lanes)
    cur[0] = ema
    out = np.empty((rows, lanes))
    step = np.empty(lanes)
    with np.errstate(all="ignore"):  # an overflow is the loop's too: the caller takes no non-finite EMA
        cur[1:] = before[np.maximum(starts[1:, None] - np.arange(_TAIL), 0)] @ weights
        for row in range(rows):
            np.subtract(given[row], cur, out=step)
            np.multiply(step, alpha, out=step)
            cur = np.add(cur, step, out=out[row])
    met = out[_LEAD - 1, 1:].view(np.int64) == np.concatenate((out[_LANE - 1, :1], out[-1, 1:-1])).view(np.int64)
    if not met.all():
        return np.array(_smoothed(ema, alpha, medians.tolist()))
    return np.concatenate((out[:_LANE, 0], out[_LEAD:, 1:].T.ravel()))[:n]


def _enveloped(env: float, decay: float, aboves: Iterable[float]) -> list[float]:
    """The band's envelope after each of ``aboves``: decayed by ``decay`` an entry, raised to any excursion above
    it (``max(env * decay, above)``, a comparison rather than a call: a NaN above is taken, as max would not)."""
    out: list[float] = []
    add = out.append
    for above in aboves:
        env *= decay
        env = env if env > above else above
        add(env)
    return out


_CLOSE = 1e-9
"""Chains whose logarithms are this close to the greatest may be it (and the closer for each rounding of the longest: a
chain of ``n`` roundings strays from its real value by ``n * 2**-53`` of it at most; a logarithm is off by 1e-13)."""
_NORMAL = -660.0
"""The logarithm above which a chain stays a normal float (2**-952) and its roundings are relative."""
_NEAR = 8
"""More chains that close to the greatest (a rise at the very rate the envelope decays) are left to the loop: decaying
each of them would cost more."""


def _envelope_after(env: float, decay: float, aboves: np.ndarray) -> float:
    """The band's envelope after ``aboves`` (the last value :func:`_enveloped` gives), without a step per entry.

    Each value starts a chain, decayed once per later entry; rounding a product by ``decay`` keeps the order of what it
    rounds, so the envelope is the greatest of the chains (by induction on ``max(env * decay, above)``). The chains that
    can be the greatest are found on their logarithms, and only those are decayed, exactly: ``multiply.accumulate``
    multiplies in order, as the loop does. Where a chain could leave the normal floats (or a value is not finite), or
    too many are that close, the loop itself gives it."""
    n = len(aboves)
    starts = np.concatenate(([env], aboves))
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(starts) + np.arange(n, -1, -1) * math.log(decay)
    top = logs.max()
    near = np.flatnonzero(logs >= top - _CLOSE - n * 2.0**-50)
    if not _NORMAL < top < _INF or len(near) > _NEAR:
        return _enveloped(env, decay, aboves.tolist())[-1]
    best = 0.0
    for j in near.tolist():
        chain = np.full(n - j + 1, decay)
        chain[0] = starts[j]
        best = max(best, np.multiply.accumulate(chain)[-1].item())
    return best


def _envelopes(env: float, decay: float, aboves: np.ndarray, keep: int) -> list[float]:
    """The band's envelopes after the last ``keep`` of ``aboves`` from ``env`` (the end of :func:`_enveloped` of them
    all): the entries before those are skipped at once (:func:`_envelope_after`)."""
    skip = len(aboves) - keep
    if skip > 0:
        env = _envelope_after(env, decay, aboves[:skip])
    return _enveloped(env, decay, aboves[max(skip, 0) :].tolist())


def _medians(values: np.ndarray, size: int) -> np.ndarray:
    """The median of each ``size`` successive ``values`` (one a window, the first ending at ``values[size - 1]``): the
    windows' columns sorted by an odd-even transposition network, ``size`` passes of elementwise min and max over whole
    columns (a few numpy calls, where sorting each window is a step per window). Exact: min and max pick values, and the
    middle two are averaged as a sorted window's are."""
    n = len(values) - size + 1
    cols = [values[j : j + n] for j in range(size)]
    for p in range(size):
        for j in range(p % 2, size - 1, 2):
            lo, hi = cols[j], cols[j + 1]
            cols[j], cols[j + 1] = np.minimum(lo, hi), np.maximum(lo, hi)
    mid = size // 2
    return cols[mid] if size % 2 else 0.5 * (cols[mid - 1] + cols[mid])


def _opening(f: Finding, step: int) -> list[Finding]:
    """An episode dated at its onset and found at ``step``: the anomaly spans both (its last step is where
    the condition is known to hold now)."""
    return [f] if f.step == step else [f, dataclasses.replace(f, step=step)]


def _standing(ep: _Episode, level: float, best: float, best_step: int, above: float) -> dict[str, Any]:
    """Where an episode's loss stands against its best: the evidence every finding of it starts with."""
    return {
        "loss": round(level, 6),
        "best_loss": round(best, 6),
        "best_step": best_step,
        "above_rel": round(above, 4),
        "peak_above_rel": round(ep.peak_above, 4),
        "opened_step": ep.opened,
    }


def _closing(f: Finding) -> list[Finding]:
    """The last word on an episode, then its resolution: the anomaly keeps the message and hint of the last
    finding that is not a resolution, so a closing message sent only with ``resolved`` would leave the
    rollback advice of the open one in place."""
    return [dataclasses.replace(f, resolved=False), f]


class _Health:
    """The best loss of a series since its first value, and the last step at its healthy level
    (within ``rel`` of that best), with the last checkpoint reported at or before that step."""

    __slots__ = ("best", "best_step", "ckpt", "first_step", "loss", "rel", "step")

    def __init__(self, rel: float) -> None:
        self.rel = rel
        self.first_step: int | None = None
        self.best: float | None = None
        self.best_step = 0
        self.step: int | None = None
        self.loss: float | None = None
        self.ckpt: tuple[int, str | None] | None = None

    def add(self, step: int, loss: float, ckpts: collections.deque[tuple[int, str | None]]) -> None:
        if self.first_step is None:
            self.first_step = step
        best = self.best
        if best is None or loss < best:
            best = self.best = loss
            self.best_step = step
        if loss <= best + self.rel * abs(best):
            self.step, self.loss = step, loss
            if ckpts:  # the last one reported at or before the step: most often the last one
                last = ckpts[-1]
                self.ckpt = last if last[0] <= step else next((c for c in reversed(ckpts) if c[0] <= step), self.ckpt)

    def checkpoint(self, ckpt: tuple[int, str | None]) -> None:
        if self.step is not None and ckpt[0] <= self.step:
            self.ckpt = ckpt


@dataclass
class _Episode:
    """An open divergence: what was said last, and what it is measured against."""

    source: str  # "trend" (smoothed loss, dense logs) or "sparse" (logged points)
    opened: int
    band: float  # how far above its best the run had strayed before this excursion
    severity: str = "warning"
    reported_level: float = 0.0  # 1 + above, when last said
    reported_entry: int = 0
    peak_above: float = 0.0
    view: dict[str, Any] = field(default_factory=dict)  # the opening finding's trend numbers


@dataclass(slots=True)
class _Run:
    """Step events in a row, read in one look: what :meth:`Divergence._on_loss` computes for each of them that does
    not depend on what it judges (the median filter, the EMA, the running minimum, how far above it, the health's best;
    the band's envelope, from how far above, only where it is kept: :meth:`Divergence._commit`), and the entries at
    which a bar is reached (``bars``, then the run's length)."""

    fields: list[dict[str, Any]]
    steps: list[int]
    losses: list[float]
    window: list[float]  # the median window's losses before the run, then the run's
    gaps: np.ndarray  # steps from the entry before
    noise: np.ndarray  # |loss - the entry before's|
    medians: np.ndarray
    centers: list[int]  # the middle step of each entry's median window
    smoothed: np.ndarray
    lows: np.ndarray  # the running minimum of the smoothed loss
    new_lows: np.ndarray  # the entries that lowered it
    aboves: np.ndarray  # how far above the running minimum, relative to it
    health_best: np.ndarray  # the entries that lowered the health's best
    healthy: np.ndarray  # the entries within reach of the health's best
    bars: list[int]

    @classmethod
    def read(cls, det: Divergence, batch: Reading, lo: int, hi: int) -> _Run | None:
        """The steps ``lo`` to ``hi`` of ``batch`` as :meth:`Divergence._on_loss` would see them entry by entry
        from ``det``'s state, or None where reading them at once could differ: a loss that is absent or not a finite
        nonzero float (an int rounds and prints otherwise; -0.0 and 0.0 sort in arrival order), steps that do not
        increase or are too large for exact arithmetic, a sparse log, entries before the gate, the first median window,
        or a smoothed loss that overflows.

        Their losses and step numbers are the batch's columns, and their types are looked at once a batch (other
        detectors read and ask them too: D_w1m's divergence CPU in the detection child 0.21 -> 0.14 s)."""
        cfg = det.config
        size = cfg.median_of
        recent = list(det._recent_steps)
        window = det._raw.values()
        if (
            det._entries < size
            or det._ema is None
            or len(det._gaps) < _GAPS
            or not batch.only("loss", _FLOAT, lo, hi)  # (an absent loss reads None)
            or not batch.only("step", _INT, lo, hi)
            or list(map(type, recent)).count(int) != len(recent)
            or 0.0 in window
        ):
            return None
        fields = batch.fields[lo:hi]
        losses, steps = batch.column("loss")[lo:hi], batch.column("step")[lo:hi]
        both = recent + steps  # the window's steps, then the run's
        # (known ints and floats: np.fromiter reads them a fifth to a third faster than np.array)
        try:
            stepped = np.fromiter(both, np.int64, len(both))
        except OverflowError:  # beyond int64
            return None
        if stepped.min() < 0 or stepped.max() >= _EXACT_INT or stepped[len(recent) :].min() < det._gate:
            return None
        conc = np.fromiter(itertools.chain(window, losses), float, len(window) + len(losses))  # the window's, the run's
        loss = conc[size:]
        if not (np.isfinite(loss).all() and loss.all()):
            return None
        between = np.diff(stepped)
        gaps = between[size - 1 :]  # each entry's, from the one before
        wide = int(np.count_nonzero(gaps >= cfg.sparse_min_interval))
        if between.min() <= 0 or 2 * (det._wide_gaps + wide) >= _GAPS:
            return None
        med = _medians(conc[1:], size)  # each entry's median window
        s = _smoothed_all(det._ema, cfg.ema_alpha, med)
        if not np.isfinite(s).all():
            return None
        low = det._min
        lows = np.minimum.accumulate(s)
        if low is not None:
            lows = np.minimum(lows, low)
        with np.errstate(divide="ignore", invalid="ignore"):
            above = np.where(lows != 0, (s - lows) / np.abs(lows), 0.0)
        big = (above >= cfg.critical_rel) & (s - lows >= cfg.min_rise_abs)
        # Above its minimum by above_min_rel, an entry is judged (_open_trend), and finds no trend where neither window
        # rose by its relative bar and min_rise_abs: a noisy run can sit there for thousands of entries.
        before = [e[3] for e in det._hist]
        smoothed_all = np.concatenate((before, s))
        at = np.arange(len(before), len(smoothed_all))  # each entry's place among them
        trend = np.zeros(len(s), dtype=bool)
        for w, rel in ((cfg.long_window, cfg.long_min_rise_rel), (cfg.window, cfg.min_rise_rel)):
            start = smoothed_all[np.maximum(at - w, 0)]
            rise = s - start
            trend |= (at >= w) & ~((rise <= 0) | (rise < rel * np.abs(start)) | (rise < cfg.min_rise_abs))
        health = det._health
        assert health.best is not None  # the first median window gave it one
        best = np.minimum(np.minimum.accumulate(med), health.best)
        return cls(
            fields=fields,
            steps=steps,
            losses=losses,
            window=window + losses,
            gaps=gaps,
            noise=np.abs(np.diff(conc[size - 1 :])),
            medians=med,
            centers=both[1 + (size >> 1) : 1 + (size >> 1) + len(steps)],
            smoothed=s,
            lows=lows,
            new_lows=np.flatnonzero(s < np.concatenate(([_INF if low is None else low], lows[:-1]))),
            aboves=above,
            health_best=np.flatnonzero(med < np.concatenate(([health.best], best[:-1]))),
            healthy=np.flatnonzero(med <= best + health.rel * np.abs(best)),
            bars=[*np.flatnonzero(~(above < cfg.above_min_rel) & trend | big).tolist(), len(steps)],
        )


class Divergence(Detector):
    """Sustained upward trend of a spike-free smoothed loss that leaves the run's own band."""

    kind = "divergence"
    config_class = DivergenceConfig
    order = 120
    priority = 30
    plots = ("loss", "grad")
    localised = True
    consumes = frozenset(("run_start", "checkpoint", "eval", "step"))

    def __init__(self, config: DivergenceConfig) -> None:
        self.config = config
        hist = config.long_window + 1
        self._raw = RollingWindow(config.median_of)
        # (step, middle step of its median window, median-filtered loss, smoothed loss) of each entry since the median
        # window filled: one tuple a step, read only where a rise is judged
        self._hist: collections.deque[tuple[int, int, float, float]] = collections.deque(maxlen=hist)
        # |raw loss - previous raw loss| of the last entries (the finite ones); their median is taken only where a
        # rise is judged (statistics.median of the same values: what a sorted window gives)
        self._noise: collections.deque[float] = collections.deque(maxlen=_NOISE)
        self._gaps: collections.deque[int] = collections.deque(maxlen=_GAPS)  # steps between logged entries
        self._wide_gaps = 0  # how many of them are sparse_min_interval or more
        self._prev_raw = 0.0  # the previous entry's loss (read once there is one: _prev_step is not None)
        self._prev_step: int | None = None
        self._ema: float | None = None
        self._entries = 0  # finite losses seen (logged entries)
        # detection reference: running minimum of the smoothed loss after the gate
        self._min: float | None = None
        self._min_step = 0
        self._envelope = 0.0  # how far above its best the loss has strayed, forgotten slowly
        self._decay = 0.5 ** (1.0 / config.band_halflife)
        self._envelopes: collections.deque[float] = collections.deque(maxlen=hist)  # band = the oldest
        self._critical_run = 0  # consecutive entries at least critical_rel above the best
        self._short_hits = 0  # consecutive entries on which the short window's trend held
        # advice reference: the first logged loss, then the median-filtered loss at the middle step
        # of its window (the EMA lags a few entries: a log every 25 steps would put the healthy
        # step 100 steps into the rise)
        self._health = _Health(config.healthy_rel)
        self._recent_steps: collections.deque[int] = collections.deque(maxlen=config.median_of)
        self._first_center: int | None = None  # middle step of the first median window
        self._ckpts: collections.deque[tuple[int, str | None]] = collections.deque(maxlen=16)
        # sparse logs: the logged points themselves (each a mean over a logging window)
        self._points: collections.deque[tuple[int, float]] = collections.deque(maxlen=config.sparse_points)
        self._pt_health = _Health(config.healthy_rel)
        self._pt_critical_run = 0
        self._gate = config.min_steps  # the first step judged: min_steps, or the declared warmup's end if later
        self._ep: _Episode | None = None
        self._grad_norms: collections.deque[float] = collections.deque(maxlen=hist)
        # the task metric (eval events): the metric the run optimises for outranks the training loss
        self._evals: dict[str, collections.deque[tuple[int, float]]] = {}
        self._eval_sign: dict[str, int] = {}
        self._metric: str | None = None  # the one judged: a task metric (WER, accuracy), else the eval loss

    # -- events ----------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            f = event.fields
            loss = f.get("loss")
            if not finite(loss):
                return []
            return self._on_loss(f["step"], loss, f.get("grad_norm"))  # a float: an Event's floats are decoded
        if kind == "run_start":
            if not event.fields.get("resumed", False):
                self.__init__(self.config)  # a fresh run: forget the previous one's minimum
            sched = event.fields.get("schedule")
            if isinstance(sched, dict) and isinstance(sched.get("warmup_steps"), int):
                self._gate = max(self.config.min_steps, sched["warmup_steps"])
            return []
        if kind == "checkpoint":
            step = event.fields.get("step")
            if isinstance(step, int):
                path = event.fields.get("path")
                ckpt = (step, path if isinstance(path, str) else None)
                self._ckpts.append(ckpt)
                self._health.checkpoint(ckpt)
                self._pt_health.checkpoint(ckpt)
            return []
        if kind == "eval":
            return self._on_eval(event.fields)
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event, walked by :func:`observe_runs`: the step events between two others are read
        in one look (:class:`_Run`: the median filter, the EMA, the running minimum and the band's envelope of all of
        them at once, none of which depends on what is judged), and its entries below every bar with no episode open
        update the state in bulk (:meth:`_commit`); the entries that reach a bar (``above_min_rel`` with a window's
        rise past its bars, ``critical_rel`` and its nats) or meet an open episode go through :meth:`observe`, as do
        the runs it cannot read exactly (:meth:`_Run.read`) and the entries before the gate and the first median
        window."""
        # The batch's fields and where its runs of steps end, from its reading; the loss of a run only where it is
        # read: in the import's own thread divergence is the reading's only user, and a loss column (a look for
        # every field name, then a get per event) cost 0.06 s more a million steps.
        batch = read(events)
        fields, ends = batch.fields, batch.ends
        size = self.config.median_of
        run: _Run | None = None  # the run read (None: it could not be), its first event and its end
        first = end = 0

        def take(i: int) -> int:
            nonlocal run, first, end
            if self._ep is not None or events[i].kind != "step":
                return i
            if not first <= i < end:
                stop = ends[bisect.bisect_right(ends, i)]
                if (
                    stop - i < _BULK
                    or self._entries < size
                    or len(self._gaps) < _GAPS
                    or fields[i]["step"] < self._gate
                ):
                    return i
                run, first, end = _Run.read(self, batch, i, stop), i, stop
            if run is None:
                return i
            k = i - first
            q = run.bars[bisect.bisect_left(run.bars, k)]
            if q == k:
                return i
            self._commit(run, k, q)
            return first + q

        observe_runs(self.observe, events, attempts, out, take)

    def _commit(self, run: _Run, a: int, b: int) -> None:
        """The state after the entries ``a`` to ``b - 1`` of ``run``, all past the gate, none reaching a bar with no
        episode open: what :meth:`_on_loss` leaves, the windows extended with their last values at once."""
        self._entries += b - a
        noise = run.noise[a:b]
        self._noise.extend(noise[np.isfinite(noise)][-_NOISE:].tolist())
        gaps, wide = self._gaps, self.config.sparse_min_interval
        gaps.extend(run.gaps[a:b][-_GAPS:].tolist())
        self._wide_gaps = sum(1 for g in gaps if g >= wide)
        self._prev_step, self._prev_raw = run.steps[b - 1], run.losses[b - 1]
        raw, size = self._raw, self.config.median_of
        raw.clear()  # the window after entry b - 1: the same sorted values (no zero: no -0.0 to tell from 0.0)
        for x in run.window[b : b + size]:
            raw.add(x)
        self._recent_steps.extend(run.steps[max(a, b - size) : b])
        # the health's best falls at each new best and its healthy step is the last within reach of the best: the last
        # entry that set the best before it and that step are all it is given (an add at a new best leaves nothing the
        # next add keeps but the best; steps increase: an entry with no checkpoint at or before it has none before it
        # either, so the last add sets the checkpoint if any does)
        healthy, best = run.healthy, run.health_best
        i = int(healthy.searchsorted(b)) - 1
        if i >= 0 and healthy[i] >= a:
            last = int(healthy[i])
            j = int(best.searchsorted(last)) - 1
            for k in [int(best[j]), last] if j >= 0 and best[j] >= a else [last]:
                self._health.add(run.centers[k], run.medians[k].item(), self._ckpts)
        self._ema = run.smoothed[b - 1].item()
        keep = self._hist.maxlen or 0
        lo = max(a, b - keep)
        self._hist.extend(
            zip(
                run.steps[lo:b], run.centers[lo:b], run.medians[lo:b].tolist(), run.smoothed[lo:b].tolist(), strict=True
            )
        )
        gns: list[Any] = []
        k = b
        while k > a and len(gns) < keep:
            k -= 1
            gn = run.fields[k].get("grad_norm")
            if finite(gn):
                gns.append(gn)
        self._grad_norms.extend(reversed(gns))
        self._min = run.lows[b - 1].item()
        news = run.new_lows
        k = int(news.searchsorted(b)) - 1
        if k >= 0 and news[k] >= a:
            self._min_step = run.steps[news[k]]
        self._critical_run = self._short_hits = 0
        envelopes = _envelopes(self._envelope, self._decay, run.aboves[a:b], b - lo)
        self._envelope = envelopes[-1]
        self._envelopes.extend(envelopes)

    # -- the task metric -------------------------------------------------------------------------

    def _on_eval(self, f: dict[str, Any]) -> list[Finding]:
        step = f.get("step")
        if not isinstance(step, int):
            return []
        values: dict[str, float] = {}
        if finite(f.get("loss")):
            values["eval loss"] = float(f["loss"])
            self._eval_sign.setdefault("eval loss", -1)
        metrics = f.get("metrics")
        if isinstance(metrics, dict):
            for name, v in list(metrics.items())[:32]:
                if not finite(v) or not isinstance(name, str):
                    continue
                if name not in self._eval_sign:
                    sign, task = metric_direction(name)
                    if sign == 0 or not task:
                        continue
                    self._eval_sign[name] = sign
                    if self._metric in (None, "eval loss"):
                        self._metric = name  # the first task metric the run logs
                values[name] = float(v)
        if self._metric is None and "eval loss" in values:
            self._metric = "eval loss"
        for name, v in values.items():
            self._evals.setdefault(name, collections.deque(maxlen=64)).append((step, v))
        ep = self._ep
        if ep is None or self._metric not in values:
            return []
        since = ep.view.get("best_step", ep.opened)
        better = self._metric_improved(since)
        if better is None:
            return []
        self._ep = None
        name, was, was_step, now, now_step = better
        return _closing(
            self.resolve(
                now_step,
                f"the {name} improved to {now:.4g} at step {now_step} (from {was:.4g} at step {was_step}) "
                f"while the training loss was up: not a divergence (open since step {ep.opened}, it peaked "
                f"{ep.peak_above:.0%} above its best)",
                "The task metric outranks the training loss: the model is getting better on what the run is for.",
                {"metric": name, "metric_before": was, "metric_before_step": was_step, "metric_now": now},
            )
        )

    def _metric_improved(self, since: int) -> tuple[str, float, int, float, int] | None:
        """(metric, best value at or before ``since``, its step, latest value, its step) when the latest eval
        after ``since`` is at least as good as every eval up to it; None otherwise or when it cannot tell."""
        name = self._metric
        if name is None:
            return None
        evals = self._evals.get(name)
        sign = self._eval_sign.get(name, -1)
        if not evals:
            return None
        before = [(v, s) for s, v in evals if s <= since]
        now_step, now = evals[-1]
        if not before or now_step <= since:
            return None
        was, was_step = max(before, key=lambda vs: sign * vs[0])
        if sign * now < sign * was:
            return None
        return name, was, was_step, now, now_step

    def _on_loss(self, step: int, loss: float, gn: Any) -> list[Finding]:
        cfg = self.config
        entries = self._entries = self._entries + 1
        prev_step = self._prev_step
        health = self._health
        if prev_step is None:  # the run's start (its first entry): the reference for "did it ever learn"
            health.add(step, loss, self._ckpts)
        else:  # the previous entry's loss and step are those of the last call
            noise = abs(loss - self._prev_raw)
            if noise < _INF:  # finite (the difference of two finite losses can overflow)
                self._noise.append(noise)
            if step > prev_step:
                gap, wide, gaps = step - prev_step, cfg.sparse_min_interval, self._gaps
                if len(gaps) == _GAPS and gaps[0] >= wide:
                    self._wide_gaps -= 1
                gaps.append(gap)
                if gap >= wide:
                    self._wide_gaps += 1
        self._prev_step = step
        self._prev_raw = loss
        gated = step >= self._gate
        out: list[Finding] = []
        if gated:
            following = self._ep is not None and self._ep.source == "sparse"
            # A sparse log: most entries are sparse_min_interval or more steps apart (true before there is a gap:
            # the first point of a sparse log must be kept, it is often its best).
            if following or 2 * self._wide_gaps >= len(self._gaps):
                out = self._on_point(step, loss, following)
        raw = self._raw
        raw.add(loss)
        recent = self._recent_steps
        recent.append(step)
        if entries < cfg.median_of:  # every entry's loss is in the window (finite): it is not full yet
            return out
        m = raw.median()
        center = recent[cfg.median_of >> 1]  # the window is full: median_of entries, each with its step
        if self._first_center is None:
            self._first_center = center
        health.add(center, m, self._ckpts)
        ema = self._ema
        s = self._ema = m if ema is None else _smoothed(ema, cfg.ema_alpha, (m,))[0]
        self._hist.append((step, center, m, s))
        if finite(gn):
            self._grad_norms.append(gn)
        if not gated:
            return out
        low = self._min
        if low is None or s < low:
            low = self._min = s
            self._min_step = step
        above = (s - low) / abs(low) if low else 0.0
        big = above >= cfg.critical_rel and s - low >= cfg.min_rise_abs  # 67% of 0.006 is noise
        self._critical_run = self._critical_run + 1 if big else 0
        env = self._envelope = _enveloped(self._envelope, self._decay, (above,))[0]
        self._envelopes.append(env)
        if self._ep is not None:
            if self._ep.source == "trend":
                out += self._follow(step, s, low, self._min_step, above, self._critical_run)
            return out
        if out:
            return out
        if above < cfg.above_min_rel:
            self._short_hits = 0
            return out
        return self._open_trend(step, s, above)

    # -- dense logs: the trend rule --------------------------------------------------------------

    def _open_trend(self, step: int, s: float, above: float) -> list[Finding]:
        """A trend opening an episode, once the smoothed loss is ``above_min_rel`` above its minimum."""
        cfg = self.config
        # Per-entry noise of the raw loss (robust: MAD of successive differences / sqrt 2).
        sigma = 1.4826 * statistics.median(self._noise) / math.sqrt(2.0) if len(self._noise) >= 8 else 0.0
        hit = None
        band = 0.0
        env = self._envelopes
        for w, rel in ((cfg.long_window, cfg.long_min_rise_rel), (cfg.window, cfg.min_rise_rel)):
            # The run's own band as it was before the rise being measured began.
            band = env[-w - 1] if len(env) > w else env[0]
            if above < cfg.band_factor * band:
                continue
            hit = self._trend(w, rel, sigma)
            if hit is not None:
                break
        if hit is None:
            self._short_hits = 0
            return []
        if hit[0] == cfg.window:  # a fast rise: sustained only once it has held for a few entries
            self._short_hits += 1
            if self._short_hits < cfg.short_sustain:
                return []
        w, start, rise, up = hit
        span = step - self._hist[-w - 1][0]
        view: dict[str, Any] = {
            "window_entries": w,
            "window_steps": span,
            "window_start": round(start, 6),
            "rise_rel": round(rise / abs(start), 4),
            "up_fraction": round(up, 3),
            "noise_sigma": round(sigma, 6),
        }
        gns = list(self._grad_norms)
        if len(gns) > w and gns[-w - 1] > 0:
            view["grad_norm_ratio"] = round(gns[-1] / gns[-w - 1], 3)
        assert self._min is not None
        view["best_step"] = self._health.best_step
        if self._metric_improved(self._health.best_step) is not None:
            return []  # the task metric improved since the loss was at its best: no divergence claim
        onset = self._onset(sigma)
        view["detected_step"] = step
        self._ep = _Episode("trend", onset, band, view=view)
        return _opening(self._finding(onset, s, self._min, self._min_step, above, opening=True), step)

    def _onset(self, sigma: float) -> int:
        """Where the rise started, looking back past the detector's gates: the step after the last one at which
        the median-filtered loss was still within its noise (``healthy_rel``, and one raw sigma) of its lowest."""
        cs = [e[1] for e in self._hist]
        fl = [e[2] for e in self._hist]
        i_min = min(range(len(fl)), key=fl.__getitem__)
        lo = fl[i_min]
        band = max(sigma, self.config.healthy_rel * abs(lo))
        last_in = max(i for i in range(i_min, len(fl)) if fl[i] <= lo + band)
        return cs[min(last_in + 1, len(cs) - 1)]

    def _trend(self, w: int, min_rel: float, sigma: float) -> tuple[int, float, float, float] | None:
        """The rise over the last ``w`` entries if it is a trend: (w, start, rise, up share), else None.

        Cheap tests first; the O(w) pair and jump tests run only when the rise is already large.
        """
        cfg = self.config
        hist = self._hist
        if len(hist) <= w:
            return None
        start = hist[-w - 1][3]
        rise = hist[-1][3] - start
        if rise <= 0 or rise < min_rel * abs(start) or rise < cfg.min_rise_sigma * sigma or rise < cfg.min_rise_abs:
            return None
        window = list(hist)[-w - 1 :]
        fl = [e[2] for e in window]
        if fl[-1] - fl[0] <= 0:
            return None
        # A jump that stays up puts most of the rise into a few steps of the smoothed series;
        # a trend spreads it. (Checked on the EMA: single filtered increments are too noisy.)
        ss = [e[3] for e in window]
        k = min(5, w // 4)
        if max(ss[i + k] - ss[i] for i in range(len(ss) - k)) > cfg.max_jump_share * rise:
            return None
        lag = max(1, w // 2)
        pairs = len(fl) - lag
        up = sum(1 for i in range(pairs) if fl[i + lag] > fl[i]) / pairs
        if up < cfg.up_fraction:
            return None
        return w, start, rise, up

    # -- sparse logs: the logged points ----------------------------------------------------------

    def _on_point(self, step: int, loss: float, following: bool) -> list[Finding]:
        """The rule for logs whose entries are far apart (past the gate); it also follows an episode it
        opened (``following``)."""
        cfg = self.config
        health = self._pt_health
        health.add(step, loss, self._ckpts)
        assert health.best is not None
        best = (health.best_step, health.best)
        self._points.append((step, loss))
        above = (loss - best[1]) / abs(best[1]) if best[1] else 0.0
        big = above >= cfg.critical_rel and loss - best[1] >= cfg.min_rise_abs  # 67% of 0.006 is noise
        self._pt_critical_run = self._pt_critical_run + 1 if big else 0
        if following:
            return self._follow(step, loss, best[1], best[0], above, self._pt_critical_run)
        if self._ep is not None or best[1] <= 0 or len(self._points) < cfg.sparse_points:
            return []
        bar = max(best[1] * (1 + cfg.sparse_rise_rel), best[1] + cfg.min_rise_abs)
        if len(self._noise) >= 6:  # enough points to measure their own noise: the rise must stand out of it
            bar = max(bar, best[1] + cfg.sparse_rise_sigma * 1.4826 * statistics.median(self._noise) / math.sqrt(2.0))
        if any(p[0] <= best[0] or p[1] < bar for p in self._points):
            return []
        if self._metric_improved(best[0]) is not None:
            return []  # the task metric improved since the loss was at its best: no divergence claim
        view = {
            "points": [[p[0], round(p[1], 6)] for p in self._points],
            "log_interval_steps": round(statistics.median(self._gaps)),
            "best_step": best[0],
            "detected_step": step,
        }
        onset = self._points[0][0]  # the first of the points that stayed far above the best
        self._ep = _Episode("sparse", onset, 0.0, view=view)
        return _opening(self._finding(onset, loss, best[1], best[0], above, opening=True), step)

    # -- the open episode -------------------------------------------------------------------------

    def _follow(
        self, step: int, level: float, best: float, best_step: int, above: float, critical_run: int
    ) -> list[Finding]:
        cfg = self.config
        ep = self._ep
        assert ep is not None
        if above < max(cfg.above_min_rel / 2, ep.band) or level - best < cfg.min_rise_abs / 2:
            self._ep = None
            what = "logged loss" if ep.source == "sparse" else "smoothed loss"
            return _closing(
                Finding(
                    kind=self.kind,
                    severity=ep.severity,
                    step=step,
                    message=(
                        f"{what} back to {level:.4g}, near its best {best:.4g} (step {best_step}), at step {step}; "
                        f"open since step {ep.opened}, it peaked {ep.peak_above:.0%} above it"
                    ),
                    hint="The upward trend has reversed.",
                    evidence=_standing(ep, level, best, best_step, above),
                    resolved=True,
                )
            )
        severity = ep.severity
        need = cfg.sparse_points if ep.source == "sparse" else cfg.critical_entries
        if (
            severity == "warning"
            and above >= cfg.critical_rel
            and critical_run >= need
            and level - best >= cfg.min_rise_abs
        ):
            severity = "critical"
        elif severity == "critical" and above < cfg.critical_release * cfg.critical_rel:
            severity = "warning"
        ep.peak_above = max(ep.peak_above, above)
        moved = abs(math.log((1 + above) / ep.reported_level)) >= math.log(1 + cfg.update_rel)
        if severity == ep.severity and not moved and self._entries - ep.reported_entry < cfg.update_every:
            return []
        ep.severity = severity
        return [self._finding(step, level, best, best_step, above, opening=False)]

    def _finding(self, step: int, level: float, best: float, best_step: int, above: float, *, opening: bool) -> Finding:
        cfg = self.config
        ep = self._ep
        assert ep is not None
        sparse = ep.source == "sparse"
        if opening and (
            self._pt_critical_run >= cfg.sparse_points if sparse else self._critical_run >= cfg.critical_entries
        ):
            ep.severity = "critical"  # already far above its best for long: a large, sustained rise
        ep.reported_level = 1 + above
        ep.reported_entry = self._entries
        ep.peak_above = max(ep.peak_above, above)
        health = self._pt_health if sparse else self._health
        healthy_step, healthy_loss, ckpt, never = self._rollback(sparse)
        v = ep.view
        ev: dict[str, Any] = {
            **_standing(ep, level, best, best_step, above),
            "steps_open": step - ep.opened,
            "band_rel": round(ep.band, 4),
            "healthy_step": healthy_step,
            "healthy_loss": round(healthy_loss, 6) if healthy_loss is not None else None,
            "never_learned": never,
            "checkpoint_step": ckpt[0] if ckpt else None,
            "source": "logged points" if sparse else "smoothed loss",
        }
        if opening:
            ev.update(v)  # the rise that opened it
        else:
            ev["opened_with"] = v
        if sparse and opening:
            pts = ", ".join(f"{p[1]:.4g} at {p[0]}" for p in v["points"])
            message = (
                f"loss far above its best on a sparse log: the last {len(v['points'])} logged losses ({pts}) are all "
                f"{cfg.sparse_rise_rel:.0%} or more above the best logged one, {best:.4g} at step {best_step} (each "
                f"a mean over about {v['log_interval_steps']} steps)"
            )
        elif sparse:
            message = (
                f"logged loss {level:.4g} at step {step} is {above:.0%} above the best logged one ({best:.4g} at step "
                f"{best_step}); peak {ep.peak_above:.0%} above, open since step {ep.opened}"
            )
        elif opening:
            message = (
                f"loss trending up since step {ep.opened}: smoothed {v['window_start']:.4g} -> {level:.4g} "
                f"(+{v['rise_rel']:.0%}) over the "
                f"last {v['window_steps']} steps ({v['window_entries']} logged entries), {above:.0%} above its lowest "
                f"smoothed level {best:.4g} (step {best_step})"
            )
        else:
            message = (
                f"loss {above:.0%} above its lowest smoothed level {best:.4g} (step {best_step}): smoothed "
                f"{level:.4g} at step {step}; peak {ep.peak_above:.0%} above, open since step {ep.opened}"
            )
        held = self._pt_critical_run if sparse else self._critical_run
        if ep.severity == "critical" and held >= (cfg.sparse_points if sparse else cfg.critical_entries):
            message += (
                f"; {cfg.critical_rel:.0%} or more above it for {held} logged {'points' if sparse else 'entries'}"
            )
        grad_note = ""
        if v.get("grad_norm_ratio", 0.0) > 1.5:
            grad_note = f" The grad norm grew {v['grad_norm_ratio']:.1f}x over the same window"
            grad_note += ", as in slow LR-driven divergence."
        what = (
            "The loss jumped between logged points and stayed up; the log is too sparse to tell a slow divergence "
            "from a jump, but either way the run is not learning at this setting."
            if sparse
            else "A sustained rise without a single jump: slow divergence."
        )
        advice = self._advice(health, healthy_step, healthy_loss, ckpt, never, sparse)
        hint = f"{what} {_CAUSES}{grad_note} {advice}"
        return Finding(kind=self.kind, severity=ep.severity, step=step, message=message, hint=hint, evidence=ev)

    def _rollback(self, sparse: bool) -> tuple[int | None, float | None, tuple[int, str | None] | None, bool]:
        """(healthy step, loss there, last checkpoint at or before it, never learned)."""
        h = self._pt_health if sparse else self._health
        if h.step is None:
            return None, None, None, False
        # Never learned: the run's healthiest state is its first logged loss (for a dense log, within
        # the first median window: nothing after the start was ever as low).
        start = h.first_step if sparse else self._first_center
        never = start is not None and h.step <= start
        return h.step, h.loss, h.ckpt, never

    def _advice(
        self,
        health: _Health,
        healthy_step: int | None,
        healthy_loss: float | None,
        ckpt: tuple[int, str | None] | None,
        never: bool,
        sparse: bool,
    ) -> str:
        if healthy_step is None or healthy_loss is None or health.best is None:
            return "Lower the LR; the log shows no step at which the run was at a healthy level."
        if never and not sparse:
            gap = statistics.median(self._gaps) if self._gaps else 1
            first = health.first_step if health.first_step is not None else 0
            if first > max(self.config.min_steps, 2 * gap):  # the log starts mid-run (a resumed run's own log)
                return (
                    f"No checkpoint after the start of this log is healthier: its lowest loss was at its first step "
                    f"({health.best:.4g} at step {health.best_step}) and it has been higher ever since. Go back to the "
                    f"checkpoint the run started this log from (step {first} or earlier) with a lower LR."
                )
            return (
                f"No checkpoint of this run is healthier than its start: its lowest loss was at the start "
                f"({health.best:.4g} at step {health.best_step}) and it has been higher ever since, so the run never "
                "learned and rolling back cannot help. Restart from the initial weights (or the pretrained model) with "
                "a lower LR, and check the data and the loss on the first batches."
            )
        if never:  # sparse: the best point is the first one, a mean over the steps before it
            where = (
                f"The best logged loss is the first one ({healthy_loss:.4g} at step {healthy_step}, a mean over the "
                f"steps before it) and the loss never came back to it: roll back to a checkpoint from step "
                f"{healthy_step} or earlier if one exists, or restart from the initial weights, with a lower LR."
            )
        else:
            what = "logged loss" if sparse else f"loss (median of {self.config.median_of} entries)"
            where = (
                f"Roll back to a checkpoint from step {healthy_step} or earlier: the {what} was last at its best level "
                f"there ({healthy_loss:.4g}; best {health.best:.4g} at step {health.best_step}). Lower the LR; check "
                "the data order after it."
            )
        if ckpt is not None:
            where += f" The last checkpoint reported at or before it: step {ckpt[0]}" + (
                f" ({ckpt[1]})." if ckpt[1] else "."
            )
        return where
