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

What a spike *means* is decided by what happens next, so spikes are reported as **episodes**, one
anomaly per incident (issue 14: a healthy long run raised 26 near-identical warnings, another 10
anomalies, 7 of them critical, for spikes that were back at the next step and that the loss never
noticed). The first spike opens the episode at its step; later spikes within ``quiet_entries`` of
the last one join it, and every update keeps the message current: how many, the largest, whether
the norm is back, whether the loss followed. After each spike the loss is watched for
``follow_entries`` entries against its median before the spike. The severity is graded by
magnitude *and* consequence, and moves both ways while the episode is open:

* info: the spikes stay below ``warn_ratio`` x the median, or are no larger than what this run has
  already had and survived (a repeat), and the loss did not follow;
* warning: a spike of ``warn_ratio`` x or more, a new largest for the run, with no consequence; or
  a smaller one followed by the loss, or one that lasts ``sustain_entries`` entries;
* critical ("act now"): ``warn_ratio`` x or more *and* the loss followed, or it lasted
  ``sustain_entries`` entries in a row and is not yet over (still up, or its loss watch still
  running). Once such a burst has passed and the loss did not follow, it settles to a warning; so
  does one whose loss followed and then came back into its band before the spike with the norm in
  band too: the consequence passed, there is nothing to roll back (82: a 49x spike lifted the loss
  1.6 -> 2.9 for a few steps at 401, and 13 spikes over 200 steps were one critical to the end).

The hint says only what the data supports: while the loss watch runs it says the loss *may*
follow; afterwards it says whether it did. An episode ends, ``resolved``, after ``quiet_entries``
in-band entries or at the run's end (one that ends with the norm still up stays open). Its
evidence lists the spikes (the ``max_listed`` largest, with the count of all), so a spike inside
an episode is as findable as one that opens it. While the loss is degenerate (exactly 0.0 or
constant on most recent entries: nothing learned, labels all masked, NaNs logged as 0) the
gradients are ~0 and their spikes are not judged; the first one raises one plain note instead.

**A level that stays is not back in band** (issue 23; DESIGN.md "onset, extent, persistence"). The
tail test lets a new level stop reading as spikes after a few entries, which used to end the episode
as "back in band ... nothing to do" while the norm sat 4x higher with clipping on every step (gradient
accumulation that stopped dividing the loss by the number of micro-batches). So, from the episode's
first spike, the norm is also compared with its median *before* the episode: while it stays above
sqrt(``min_ratio``) x that, the episode is not calm; ``shift_entries`` entries in a row at ``min_ratio`` x
or more, a new level below ``warn_ratio`` x that the loss did not feel, make it a level shift: a
warning dated at its onset, naming its likely causes (accumulation scaling, a loss-reduction change,
an LR or weight-decay change) and the clip rate since against before; it stays open while the level
holds (also at the run's end) and says when the norm came back down. An episode whose norm came back
down before that is a spike episode and is judged spike by spike, as before.

Clipping hides explosions from the update but not from the pre-clip norm; a clip rate climbing
far above its own baseline is the slow version of the same story and is reported separately. When the step carries
``layer_grad_norms`` the hint names the parameter whose norm grew most since the last sample.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import columns, observe_runs, read
from trainmon.monitor.detectors.rolling import LazyWindow
from trainmon.wire import Event

__all__ = ["GradExplosion", "GradExplosionConfig"]

_log = math.log

_SLACK = 1e-9
"""How far below its bar a batch's numpy log norm must be to prove a norm within it: numpy's log and ``math.log``
differ by an ulp now and then (3e-13 at the largest norms), which this covers many times over."""
_MIN_RUN = 64
"""Shorter runs of steps within the bar are observed one at a time: moving the baselines in one go costs about what
observing a window's worth of steps does."""


def _lower_middle(w: LazyWindow) -> float:
    """The ``r = (n - 1) // 2``-th smallest of the ``n`` values of ``w`` (0-based: the lower of a median's two middle
    values), read as the nearest-rank quantile ``r / (n - 1)``: ``r / (n - 1) * (n - 1)`` is within an ulp of ``r`` and
    rounds back to it."""
    n = len(w)
    return w.quantile((n - 1) // 2 / (n - 1)) if n > 1 else w.quantile(0.0)


@dataclass
class GradExplosionConfig:
    """``grad_explosion``: pre-clip grad-norm spike episodes (graded by magnitude and consequence) or a rising
    clip rate."""

    window: int = 64
    """Accepted (non-spike) log grad norms forming the baseline."""
    min_history: int = 16
    """Accepted grad norms needed before the spike rule can fire."""
    z: float = 8.0
    """A log grad norm more than this many robust sigma (MAD of differences) above the median fires."""
    min_ratio: float = 3.0
    """...and at least this many times the baseline median norm (noise on a flat norm is tiny in sigma)."""
    tail_ratio: float = 2.0
    """...and at least this many times the ``tail_quantile`` of all recent norms, spikes included: a
    run whose norms are bimodal (a fifth of the batches at 3-7x the median, multimodal data) has no
    spike inside its own tail, however many sigma of the main mode it is."""
    tail_quantile: float = 0.9
    """Quantile of the last ``window`` norms (spikes included) that the tail rule compares with."""
    warn_ratio: float = 10.0
    """An episode whose largest spike is this many times the median (an order of magnitude: with
    clipping off, an update that size) is a warning; smaller ones are a note (info) unless the loss
    followed or the norm stayed up. Magnitude alone never makes it critical: healthy runs spike
    3-17x (real logs 09, 15, 33, 39, 52) and even 2200x (57) with no loss consequence."""
    sustain_entries: int = 3
    """Consecutive spike entries that make it an explosion rather than one bad batch: with at least
    ``warn_ratio`` it is critical while it lasts and until its loss watch ends (BLOOM's first spike
    grew over five steps; the real logs' healthy spikes are back at the next entry)."""
    follow_entries: int = 5
    """Entries after a spike whose loss is watched: a rise there is the spike's consequence and
    escalates the episode (the loss peaks a few steps after the norm in BLOOM and OLMo 2)."""
    loss_rise: float = 0.1
    """A watched loss counts as following the spike when it is this fraction above the median loss
    before the spike ..."""
    loss_z: float = 5.0
    """... and this many robust sigma (MAD of entry-to-entry differences) above it: real log 57's
    per-step loss swings 0.4-2.3 around 1.16 without any spike."""
    quiet_entries: int = 200
    """In-band entries after the last spike that end an episode (the run's end also does). Healthy
    runs with heavy-tailed norms repeat their spikes every 10-400 entries (real logs 09, 57): a
    shorter stretch splits one behaviour into many near-identical findings (issue 14: 26 on 09).
    Kept below ``DetectorsConfig.replay_window`` so a restarted collector rebuilds an open episode."""
    degenerate_share: float = 0.5
    """Share of the last ``window`` losses that are exactly 0.0 or equal to the previous one above
    which the loss is degenerate (nothing learned, labels all masked, NaNs logged as 0): gradients
    are ~0 there and their spikes are not judged; one note says so."""
    max_listed: int = 20
    """Spikes an episode's evidence lists (the largest; the count covers all): bounded state."""
    clip_recent: int = 50
    """Steps in the recent clip-rate window."""
    clip_baseline: int = 200
    """Steps before the recent window that form the clip-rate baseline."""
    clip_rise: float = 0.4
    """The recent clip rate must exceed the baseline rate by this much ..."""
    clip_min_rate: float = 0.6
    """... and be at least this high, to report a rising clip rate."""
    shift_entries: int = 20
    """A norm that stays ``min_ratio`` x above its median before a spike episode for this many entries in a
    row (spikes or not: once the run's tail has caught up, the new level no longer reads as spikes) has
    shifted level: a warning naming its likely causes, never "back in band"."""


class _Screen(NamedTuple):
    """A batch's columns as :meth:`GradExplosion.observe_batch` reads them."""

    norms: list[Any]
    losses: list[Any]
    layers: list[Any] | None  # None: no step of the batch carries per-layer norms
    judged: np.ndarray  # a norm _norm judges (finite, above zero) ...
    x: np.ndarray  # ... and numpy's log of it; +inf elsewhere, so that a running floor passes over the others
    kept: np.ndarray  # a finite loss
    plain: np.ndarray  # a step without a clip coefficient

    def run(self, i: int, end: int, floor: float, bar: float) -> int:
        """The end of the run of plain steps from ``i`` (up to ``end``) whose norms are within ``bar`` of the floor,
        each against the floor before it: ``floor``, lowered by the run's norms before it."""
        xs = self.x[i:end]
        floors = np.minimum.accumulate(np.minimum(xs, floor))
        within = ~self.judged[i:end]
        within[0] |= xs[0] - floor <= bar
        within[1:] |= xs[1:] - floors[:-1] <= bar
        within &= self.plain[i:end]
        return end if within.all() else i + int(np.argmin(within))


def _screen(events: list[Event]) -> _Screen:
    n = len(events)
    _, others, (norms, losses, coefs, layers) = columns(events, "grad_norm", "loss", "clip_coef", "layer_grad_norms")
    # a validated event's loss, grad norm and clip coefficient are floats when present (trainmon.wire); absent reads as
    # NaN here (the batch's arrays, which other detectors read too)
    batch = read(events)
    norm = batch.floats("grad_norm")
    judged = np.isfinite(norm) & (norm > 0.0)
    x = np.full(n, np.inf)
    np.log(norm, out=x, where=judged)
    plain = np.ones(n, dtype=bool)
    plain[others] = False
    if coefs.count(None) != n:
        plain &= ~np.isfinite(np.array(coefs, dtype=float))
    kept = np.isfinite(batch.floats("loss"))
    return _Screen(norms, losses, layers if layers.count(None) != n else None, judged, x, kept, plain)


def _x(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


@dataclass(slots=True)
class _Spike:
    step: int
    norm: float
    ratio: float
    median: float


@dataclass(slots=True)
class _Episode:
    """One incident: spikes with less than ``quiet_entries`` between them, and what followed."""

    first: _Spike
    largest: _Spike
    record: tuple[float, int | None]  # the run's largest spike before this episode (ratio, step)
    last_step: int = 0
    count: int = 0
    listed: list[_Spike] = field(default_factory=list)  # the largest ``max_listed`` spikes
    run: int = 0  # consecutive spike entries up to the current one
    longest: int = 0  # the longest such run in the episode
    burst: int = 0  # the longest run since the current loss watch began
    burst_peak: float = 0.0  # the largest ratio since the current loss watch began
    burst_start: int = 0  # the step of the spike that began the current loss watch
    calm: int = 0  # in-band entries since the last spike
    watch: int = 0  # entries of the loss watch left
    watched: int = 0  # entries watched since the last spike
    loss_ref: tuple[float, float] | None = None  # loss median and robust sigma before the watch began
    blind: int = 0  # spikes with no loss history to watch against
    followed: dict[str, Any] | None = None  # the loss consequence, once seen
    followed_peak: float = 0.0  # the largest spike ratio before the loss followed
    cut: int | None = None  # the run ended this many entries into a loss watch
    ended: bool = False  # the run ended while the episode was open
    median: float = 0.0  # the norm baseline median now
    sigma: float = 0.0
    layer: dict[str, Any] | None = None  # the layer that grew most at the largest spike
    said: tuple[str, str] | None = None  # (severity, message) last reported
    # Opened at a step whose loss spiked too: one bad batch (or a scaled loss) drives both, the loss
    # first. Unless the norm stays up past that entry, it is loss_spike's incident (which names the
    # norm as evidence), and "the loss did not follow" beside it would contradict it: not reported.
    with_loss: bool = False
    # A level shift: the norm stays min_ratio x above the median it had before the episode (``first.median``)
    high: int = 0  # consecutive entries that far above it, spikes or not
    highs: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=32))
    shift: bool = False  # high for shift_entries in a row: a new level, not spikes that pass
    broke: bool = False  # the norm came back down before that: a spike episode, whatever follows in it
    down_step: int | None = None  # the step the norm came back down after a shift
    clip_before: float | None = None  # share of clipped steps before the episode
    clip_n: int = 0  # steps with a clip coefficient since the episode opened
    clip_hits: int = 0  # ... of which clipped


class GradExplosion(Detector):
    """Pre-clip grad-norm spike episodes (log-norm robust z, graded by consequence) and a rising clip rate."""

    kind = "grad_explosion"
    config_class = GradExplosionConfig
    order = 100
    priority = 140
    plots = ("grad",)
    localised = True
    consumes = frozenset(("run_start", "run_end", "step"))
    batch_from = 64  # per event, screened against observed: 2 events 18.8 us against 2.1, 32 1.7 against 1.0, 128 0.7
    # against 1.0

    def __init__(self, config: GradExplosionConfig) -> None:
        self.config = config
        self._min_bar = math.log(config.min_ratio)  # the first bar of a spike, asked of every norm
        # the accepted log norms, whose median is the baseline: asked only when the floor does not decide (see _norm)
        self._logs = LazyWindow(config.window)
        self._floor: float | None = None  # at most every median of _logs since its last one was taken
        # read only when a norm is min_ratio x the median (see _norm): every recent log norm, spikes included
        # (the tail), and the accepted differences (the sigma)
        self._all = LazyWindow(config.window)
        self._diffs = LazyWindow(config.window)
        self._prev: float | None = None
        self._layers: dict[str, float] | None = None
        self._ep: _Episode | None = None
        self._record: tuple[float, int | None] = (0.0, None)  # largest spike of this run's closed episodes
        # losses outside loss watches, the reference a spike's loss watch compares with (its median and
        # spread are computed only when a spike needs them: spikes are rare, steps are not)
        self._losses: collections.deque[float] = collections.deque(maxlen=config.window)
        # the last finite losses, one more than the degenerate test reads (it compares each with the one before):
        # that test is asked only of a spike
        self._recent_losses: collections.deque[float] = collections.deque(maxlen=config.window + 1)
        self._noted = False  # the degenerate-loss note was given
        self._clip_open = False
        self._clips: collections.deque[bool] = collections.deque(maxlen=config.clip_recent + config.clip_baseline)
        self._recent_clipped = 0  # clipped steps among the last clip_recent
        self._base_clipped = 0  # clipped steps among the clip_baseline before them

    # -- baselines -------------------------------------------------------------------------------

    def _sigma(self) -> float:
        if len(self._diffs) < 4:
            return 0.1
        return max(1.4826 * self._diffs.median() / math.sqrt(2.0), 0.01)

    def _accept(self, x: float) -> None:
        prev = self._prev
        if prev is not None:
            self._diffs.add(abs(x - prev))
        self._prev = x
        self._logs.add(x)
        floor = self._floor
        if floor is not None and x < floor:
            self._floor = x

    def _accept_all(self, xs: list[float]) -> None:
        """:meth:`_accept` of each of ``xs`` (at least one), each also added to ``_all``: the windows extended at once
        (a window's worth on every quiet run, one add at a time cost 0.03 s of a million-step log)."""
        seq = xs if self._prev is None else [self._prev, *xs]
        self._diffs.extend(map(abs, map(operator.sub, seq[1:], seq[:-1])))
        self._prev = xs[-1]
        self._logs.extend(xs)
        self._all.extend(xs)
        floor = self._floor
        if floor is not None:
            self._floor = min(floor, *xs)

    def _loss_ref(self) -> tuple[float, float] | None:
        """(median, robust sigma from the MAD of entry-to-entry differences) of the reference losses."""
        losses = list(self._losses)
        if len(losses) < max(2, self.config.min_history // 2):  # a difference needs two (min_history <= 3)
            return None
        diffs = [abs(b - a) for a, b in itertools.pairwise(losses)]
        return statistics.median(losses), 1.4826 * statistics.median(diffs) / math.sqrt(2.0)

    def _flats(self) -> tuple[int, int]:
        """(n, flat): of the last ``window`` finite losses (n), how many are exactly 0.0 or equal to the one
        before them."""
        losses = list(self._recent_losses)
        flags = [b == 0.0 or b == a for a, b in itertools.pairwise([None, *losses])][-self.config.window :]
        return len(flags), sum(flags)

    def _degenerate(self) -> bool:
        n, flat = self._flats()
        return n >= self.config.min_history and flat >= self.config.degenerate_share * n

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

    # -- events ----------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind != "step":  # steps first: nearly every event
            out: list[Finding] = []
            if kind == "run_start":
                if not event.fields.get("resumed", False):
                    if self._ep is not None:  # restarted from scratch: the old episode belongs to the old run
                        out = self._close(self._ep.last_step, "a new run started")
                    self.__init__(self.config)  # a fresh run: a new baseline
                self._prev = None
            elif kind == "run_end":
                out = self._end()
            return out
        f = event.fields
        step = f["step"]
        loss = f.get("loss")
        out = []
        ep = self._ep
        changed = False
        if ep is not None:
            changed = self._watch(ep, step, loss) if ep.watch > 0 else self._loss_back(ep, step, loss)
        norm = f.get("grad_norm")
        layers = f.get("layer_grad_norms")
        if finite(norm) and norm > 0:  # non-finite norms are nan_inf's business
            changed |= self._norm(step, norm, layers, out, loss)
        ep = self._ep
        if ep is not None:
            if changed:
                out.extend(self._report(ep))
            if ep.said is None and ep.with_loss and ep.watch == 0 and ep.run == 0 and not ep.high:
                self._ep = None  # the loss spike's incident is over: later spikes start their own episode
            elif ep.watch == 0 and ep.run == 0 and ep.calm >= self.config.quiet_entries:
                out.extend(self._close(step, f"in band since step {ep.last_step}"))
        if finite(loss):  # every finite loss (the degenerate test); outside loss watches, the reference ones
            self._recent_losses.append(loss)
            ep = self._ep
            if ep is None or ep.watch == 0:  # watched losses (and a spike's own) stay out
                self._losses.append(loss)
        if layers is not None and isinstance(layers, dict):  # most logs carry no per-layer norms
            self._take_layers(layers)
        coef = f.get("clip_coef")
        if coef is not None and finite(coef):  # most logs carry no clip coefficient
            if self._ep is not None:
                self._ep.clip_n += 1
                self._ep.clip_hits += coef < 1.0
            self._push_clip(coef < 1.0)
            if self._ep is None:
                out.extend(self._clip_rate(step))
        return out

    def _take_layers(self, layers: dict[str, Any]) -> None:
        """The per-layer norms of the latest step that carried them: what a spike's growth is measured from."""
        self._layers = {k: v for k, v in layers.items() if finite(v)}

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event, in fewer steps. With no episode open and the floor of the median known, a
        step without a clip coefficient whose grad norm is within ``min_ratio`` of the floor (or not judged: absent,
        non-finite, not above zero) finds nothing: its norm is accepted into the baselines and its loss kept. The
        batch's columns prove that of whole runs of steps at once (nearly all of a long log): numpy's logs of the
        norms against the floor as it falls along the run, with a slack for numpy's rounding (:data:`_SLACK`); a
        run moves the baselines in one go (:meth:`_quiet`). Every other event is :meth:`observe`'s
        (:func:`observe_runs`): a norm past the floor's bar (the median is taken), a clip coefficient, an open
        episode, another kind, and runs shorter than :data:`_MIN_RUN`."""
        n = len(events)
        screen: _Screen | None = None
        span = n  # steps screened at a time: the batch, then twice the run that ended a span, at least 256

        def take(i: int) -> int:
            nonlocal screen, span
            floor = self._floor
            if self._ep is not None or floor is None or "clip_coef" in events[i].fields:
                return i  # (a log with clip coefficients is followed step by step: its clip rate, at every step)
            if screen is None:
                screen = _screen(events)
            end = min(n, i + span)
            j = screen.run(i, end, floor, self._min_bar - _SLACK)
            span = 2 * span if j == end else max(256, 2 * (j - i))
            if j - i < _MIN_RUN and j < n:
                return i
            self._quiet(screen, i, j)
            return j

        observe_runs(self.observe, events, attempts, out, take)

    def _quiet(self, s: _Screen, i: int, j: int) -> None:
        """What :meth:`observe` leaves after the steps ``i:j`` with no episode open whose norms are within the floor's
        bar: the floor lowered to the least accepted log norm, and of each history only the last entries, through
        the same :meth:`_accept` as one step at a time."""
        at = np.flatnonzero(s.judged[i:j]) + i
        if len(at):
            # the least log norm, exactly: math.log of those numpy puts within its slack of the least
            x = s.x[at]
            low = at[x <= x.min() + _SLACK]
            self._floor = min(self._floor, *(_log(s.norms[k]) for k in low.tolist()))  # type: ignore[type-var]
            w = self.config.window
            tail = [_log(s.norms[k]) for k in at[-(w + 1) :].tolist()]
            if len(tail) > w:  # the one before the window's values: only its difference to the next one stays
                self._prev = tail.pop(0)
            self._accept_all(tail)
        at = np.flatnonzero(s.kept[i:j]) + i
        if len(at):
            self._recent_losses.extend(s.losses[k] for k in at[-(self._recent_losses.maxlen or 0) :].tolist())
            self._losses.extend(s.losses[k] for k in at[-(self._losses.maxlen or 0) :].tolist())
        if s.layers is not None:
            for k in range(j - 1, i - 1, -1):
                if isinstance(s.layers[k], dict):
                    self._take_layers(s.layers[k])
                    break

    def _above(self, loss: float, ref: tuple[float, float]) -> bool:
        """``loss`` far above the reference losses (median, sigma): the one test of a loss consequence."""
        med, sd = ref
        return loss - med > max(self.config.loss_z * sd, self.config.loss_rise * abs(med))

    def _loss_spiked(self, loss: Any) -> bool:
        """The loss of this very step is far above its reference, as ``_watch`` judges a consequence."""
        ref = self._loss_ref()
        return ref is not None and finite(loss) and self._above(loss, ref)

    def _norm(self, step: int, norm: float, layers: Any, out: list[Finding], loss: Any) -> bool:
        """Judge one norm (``loss``: this step's); True when the open episode changed.

        The median is taken only when the floor (a lower bound of it) does not decide: with no episode open, a norm
        within ``min_ratio`` of the floor is within it of the median, no spike, and nothing else reads the median
        (most steps of most runs). Why the floor bounds every later median: it starts as the lower middle value
        ``m`` of the window when a median is taken, ``r = (n - 1) // 2`` values at most below it; the window only
        grows, and every value it accepts since is at least the floor (which it lowers), so at most ``r`` values
        of a later window of ``n' >= n`` values are below the floor, and its lower middle value (``(n' - 1) // 2``
        values below it) is not: nor is its median, the upper middle or the mean of the two."""
        cfg = self.config
        x = _log(norm)
        spike = changed = False
        logs = self._logs
        ep, floor = self._ep, self._floor
        decided = ep is None and floor is not None and x - floor <= self._min_bar
        if not decided and len(logs) >= cfg.min_history:
            med = logs.median()
            self._floor = _lower_middle(logs)
            # Over max(z sigma, log min_ratio) and over the tail: sigma and the tail are asked only of a norm
            # past the first bar (x - med > max(a, b) is x - med > b and x - med > a): a few steps of most runs.
            if x - med > self._min_bar:
                sigma = self._sigma()
                spike = x - med > cfg.z * sigma and x - self._all.quantile(cfg.tail_quantile) > math.log(cfg.tail_ratio)
            if spike and ep is None and self._degenerate():
                out.extend(self._note(step, norm, math.exp(med)))
            elif spike:
                # Whether the loss spiked with it is asked only of a spike that opens an episode: judging
                # the reference losses every step was most of this detector's cost on a long log.
                with_loss = ep is None and self._loss_spiked(loss)
                self._spike(_Spike(step, norm, math.exp(x - med), math.exp(med)), sigma, layers, with_loss)
                changed = True
            elif ep is not None and not self._still_high(ep, x):
                ep.median = math.exp(med)
                changed = ep.run > 0  # back in band: the message says so
                ep.run = 0
                ep.calm += 1
            if self._ep is not None:
                changed |= self._level(self._ep, step, x)
        if not spike:
            self._accept(x)
        self._all.add(x)
        return changed

    def _still_high(self, ep: _Episode, x: float) -> bool:
        """Not a spike any more (the run's tail caught up with it), yet not back down either: above the
        square root of ``min_ratio`` x the median before the episode (hysteresis: noise around a new
        level dips below min_ratio now and then)."""
        if ep.broke and not ep.shift:
            return False  # it came down once: a spike episode, judged spike by spike
        return x - math.log(ep.first.median) >= 0.5 * math.log(self.config.min_ratio)

    def _level(self, ep: _Episode, step: int, x: float) -> bool:
        """Follow whether the norm stays far above its level before the episode; True when that is news."""
        cfg = self.config
        if ep.broke and not ep.shift:
            return False
        if self._still_high(ep, x):
            if x - math.log(ep.first.median) >= math.log(cfg.min_ratio):
                ep.high += 1
                ep.highs.append(math.exp(x))
            ep.calm = 0  # not back: the run's tail caught up with the new level, the norm did not come down
            ep.down_step = None
            if ep.shift:
                ep.last_step = step  # the extent of the condition
            level = statistics.median(ep.highs) / ep.first.median if ep.highs else 0.0
            # a new level the loss did not feel; one ``warn_ratio`` x up, or that the loss followed, is an explosion
            if (
                not ep.shift
                and not ep.broke
                and ep.high >= cfg.shift_entries
                and level < cfg.warn_ratio
                and ep.followed is None
            ):
                ep.shift = True
                ep.last_step = step
                return True
            return False
        ep.high = 0
        ep.broke = ep.broke or not ep.shift
        if ep.shift and ep.down_step is None:
            ep.down_step = step
            return True
        return False

    def _spike(self, s: _Spike, sigma: float, layers: Any, with_loss: bool = False) -> None:
        cfg = self.config
        ep = self._ep
        if ep is None:
            self._clip_open = False  # the episode takes over an anomaly the clip rate opened
            ep = self._ep = _Episode(first=s, largest=s, record=self._record, with_loss=with_loss)
            if self._clips:
                ep.clip_before = (self._recent_clipped + self._base_clipped) / len(self._clips)
        if ep.watch == 0:  # a new loss watch, against the loss before this spike
            ep.loss_ref = self._loss_ref()
            ep.burst, ep.burst_peak, ep.burst_start = 0, 0.0, s.step
        ep.count += 1
        ep.last_step = s.step
        ep.run += 1
        ep.longest = max(ep.longest, ep.run)
        ep.burst = max(ep.burst, ep.run)
        ep.burst_peak = max(ep.burst_peak, s.ratio)
        ep.calm = 0
        ep.watch, ep.watched = cfg.follow_entries, 0
        ep.blind += ep.loss_ref is None
        ep.median, ep.sigma = s.median, sigma
        if s.ratio > ep.largest.ratio or ep.count == 1:
            ep.largest = s
            ep.layer = self._layer(layers)
        ep.listed.append(s)
        if len(ep.listed) > cfg.max_listed:
            ep.listed.remove(min(ep.listed, key=lambda v: v.ratio))

    def _watch(self, ep: _Episode, step: int, loss: Any) -> bool:
        """One entry of the loss watch after a spike; True when what the episode says changed."""
        ep.watch -= 1
        ep.watched += 1
        changed = ep.watch == 0  # the verdict is in
        if ep.followed is not None and ep.followed.get("loss") is None:
            return changed  # already non-finite: nothing worse to say
        if loss is not None and not finite(loss):
            ref = ep.loss_ref[0] if ep.loss_ref else None
            ep.followed = {"step": step, "loss": None, "median": ref, "after_spike": ep.burst_start}
            ep.followed_peak = max(ep.followed_peak, ep.burst_peak)
            return True
        if not finite(loss) or ep.loss_ref is None:
            return changed
        med = ep.loss_ref[0]
        if not self._above(loss, ep.loss_ref):
            return changed
        ep.followed_peak = max(ep.followed_peak, ep.burst_peak)
        if ep.followed is None:
            ep.followed = {"step": step, "loss": loss, "median": med, "max_loss": loss, "max_step": step}
            ep.followed["after_spike"] = ep.burst_start
            return True
        ep.followed.pop("back_step", None)  # up again after a later spike: not back any more
        if loss > ep.followed["max_loss"]:
            ep.followed.update(max_loss=loss, max_step=step)
            return True
        return changed

    def _loss_back(self, ep: _Episode, step: int, loss: Any) -> bool:
        """After the watch: the loss that followed is back in its band before the spike; True when that is news."""
        fo = ep.followed
        if fo is None or fo.get("loss") is None or fo.get("back_step") is not None or ep.loss_ref is None:
            return False
        if not finite(loss) or self._above(loss, ep.loss_ref):
            return False
        fo["back_step"] = step
        return True

    def _end(self) -> list[Finding]:
        ep = self._ep
        if ep is None:
            return []
        ep.ended = True
        if ep.watch > 0:
            ep.cut, ep.watch = ep.watched, 0
        out = self._report(ep)
        if ep.run == 0 and (not ep.shift or ep.down_step is not None):  # the norm still up: it stays open
            out.extend(self._close(ep.last_step, "the run ended"))
        return out

    def _close(self, step: int, why: str) -> list[Finding]:
        ep = self._ep
        assert ep is not None
        self._ep = None
        if ep.largest.ratio > self._record[0]:
            self._record = (ep.largest.ratio, ep.largest.step)
        if ep.said is None:
            return []  # never reported (the loss spike's incident): nothing to resolve
        severity = self._severity(ep)
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=step,
                message=f"{self._message(ep)}; over ({why})",
                hint=self._hint(ep),
                evidence=self._evidence(ep),
                resolved=True,
            )
        ]

    # -- what the episode says -------------------------------------------------------------------

    def _severity(self, ep: _Episode) -> str:
        cfg = self.config
        if ep.followed is not None:
            passed = ep.followed.get("back_step") is not None and ep.run == 0 and ep.watch == 0
            return "critical" if ep.followed_peak >= cfg.warn_ratio and not passed else "warning"
        if ep.shift:
            return "warning"
        if (ep.run > 0 or ep.watch > 0) and ep.burst >= cfg.sustain_entries:
            return "critical" if ep.burst_peak >= cfg.warn_ratio else "warning"
        if ep.largest.ratio >= cfg.warn_ratio and ep.largest.ratio > ep.record[0]:
            return "warning"
        return "info"

    def _shift_message(self, ep: _Episode) -> str:
        before = ep.first.median
        level = statistics.median(ep.highs) if ep.highs else ep.largest.norm
        parts = [
            f"grad norm shifted up at step {ep.first.step} and stayed there: about {level:.3g} since, "
            f"{_x(level / before)} its median of {before:.3g} before"
        ]
        if ep.down_step is not None:
            parts.append(f"back down at step {ep.down_step}")
        elif ep.ended:
            parts.append("the run ended at that level")
        else:
            parts.append(f"{ep.high} entries in a row so far")
        if ep.clip_n:
            was = f" (was {ep.clip_before:.0%} before)" if ep.clip_before is not None else ""
            parts.append(f"clipping on {ep.clip_hits / ep.clip_n:.0%} of the steps since{was}")
        fo = ep.followed
        if fo is not None and fo["loss"] is not None:
            parts.append(f"the loss rose with it: {fo['loss']:.4g} at step {fo['step']} against {fo['median']:.4g}")
        return "; ".join(parts)

    def _message(self, ep: _Episode) -> str:
        cfg = self.config
        if ep.shift:
            return self._shift_message(ep)
        big = ep.largest
        if ep.count == 1:
            parts = [
                f"grad-norm spike at step {big.step}: {big.norm:.4g}, {_x(big.ratio)} its median of {big.median:.3g}"
            ]
        else:
            parts = [
                f"{ep.count} grad-norm spikes in steps {ep.first.step}-{ep.last_step}, the largest {big.norm:.4g} "
                f"at step {big.step} ({_x(big.ratio)} its median of {big.median:.3g})"
            ]
        if ep.run > 0 and ep.ended:
            parts.append(f"the run ended with the norm still above its band ({ep.run} entries in a row)")
        elif ep.run > 1:
            parts.append(f"above its band for {ep.run} entries in a row so far")
        elif ep.run == 0 and ep.longest == 1:
            parts.append(
                "each back to normal at the next entry" if ep.count > 1 else "back to normal at the next entry"
            )
        elif ep.run == 0:
            parts.append(f"back in band (the longest run of spikes lasted {ep.longest} entries)")
        fo = ep.followed
        if fo is not None and fo["loss"] is None:
            parts.append(f"the loss followed the spike at step {fo['after_spike']}: non-finite at step {fo['step']}")
        elif fo is not None:
            peak = f", up to {fo['max_loss']:.4g} at step {fo['max_step']}" if fo["max_step"] != fo["step"] else ""
            back = f", back in its band at step {fo['back_step']}" if fo.get("back_step") is not None else ""
            parts.append(
                f"the loss followed the spike at step {fo['after_spike']}: {fo['loss']:.4g} at step {fo['step']} "
                f"against a median of {fo['median']:.4g} before it{peak}{back}"
            )
        elif ep.blind == ep.count:
            parts.append("no loss history to tell whether the loss followed")
        elif ep.cut is not None:
            parts.append(f"the loss had not followed when the run ended {ep.cut} entries after the last spike")
        elif ep.watch > 0:
            parts.append(f"watching the loss for {cfg.follow_entries} entries")
        else:
            parts.append(
                f"the loss did not follow (within {cfg.follow_entries} entries of {'each' if ep.count > 1 else 'it'})"
            )
        if ep.record[1] is not None:
            parts.append(f"this run's largest so far: {_x(ep.record[0])} at step {ep.record[1]}")
        return "; ".join(parts)

    def _hint(self, ep: _Episode) -> str:
        cfg = self.config
        where = ""
        if ep.layer is not None:
            where = " " + ep.layer["text"]
        if ep.shift:
            clip = ""
            if ep.clip_n and ep.clip_hits >= 0.5 * ep.clip_n:
                clip = (
                    " With clipping on most steps, each update is now scaled down to max_norm: the run trains "
                    "with a different effective LR than the one set."
                )
            return (
                f"A step change of the gradient norm that persists is a change of scale at step {ep.first.step}, "
                "not an instability that passes. Likely causes: gradient accumulation that does not divide the "
                "loss by the number of micro-batches, a loss-reduction change (sum instead of mean, longer "
                "sequences or a bigger batch summed), or an LR or weight-decay change there." + clip + " Check what "
                "changed at that step; if it was meant, re-tune max_norm." + where
            )
        if ep.followed is not None and ep.followed.get("back_step") is not None:
            at, back = ep.followed["after_spike"], ep.followed["back_step"]
            return (
                f"The loss rose after the spike at step {at} and was back in its band by step {back}: the updates "
                "absorbed it, nothing to roll back. If such spikes keep coming, look at the batches at the listed "
                "steps and at the LR (a peak LR this run barely tolerates), or tighten clipping." + where
            )
        if ep.followed is not None:
            at = ep.followed["after_spike"]
            return (
                f"The loss rose after the spike at step {at}: that update (or the batch behind it) hurt the model. "
                "Check the LR of each group there, the batch and the fp16 loss scale; if the loss stays up, roll "
                f"back to a checkpoint from before step {at} and lower the LR or tighten clipping." + where
            )
        if (ep.run > 0 or ep.watch > 0) and ep.burst >= cfg.sustain_entries:
            return (
                f"The grad norm has been far above its median for {ep.burst} entries in a row: an instability "
                "building up rather than one bad batch, which often comes before a loss spike or divergence. "
                f"Keep a checkpoint from before step {ep.first.step}, lower the LR or tighten clipping now, and "
                "watch the loss." + where
            )
        if ep.run > 0 or ep.watch > 0:
            return (
                "A grad-norm spike can come before a loss spike: watch the loss over the next steps. Common causes: "
                "an unusual batch, an LR too high for this stage, fp16 overflow, attention-logit growth." + where
            )
        if ep.blind == ep.count or ep.cut is not None:
            return (
                "The spikes passed; whether the updates hurt is not known from the loss here: compare the eval "
                "metrics before and after them." + where
            )
        return (
            "The spikes passed and the loss did not react: the updates absorbed them (clipping, or Adam's "
            "per-parameter scaling). Nothing to do now; if they keep recurring, look at the batches at the "
            "listed steps (outliers, very long or corrupt samples)." + where
        )

    def _evidence(self, ep: _Episode) -> dict[str, Any]:
        listed = sorted(ep.listed, key=lambda v: v.step)
        evidence: dict[str, Any] = {
            "count": ep.count,
            "spike_steps": [s.step for s in listed],  # the same key as loss_spike's episodes
            "spikes": [{"step": s.step, "grad_norm": s.norm, "ratio": round(s.ratio, 2)} for s in listed],
            "largest": {
                "step": ep.largest.step,
                "grad_norm": ep.largest.norm,
                "ratio": round(ep.largest.ratio, 2),
                "median": round(ep.largest.median, 6),
            },
            "median": round(ep.median, 6),
            "log_sigma": round(ep.sigma, 4),
            "longest_run": ep.longest,
            "recovered": ep.run == 0,
            "loss_followed": None if ep.followed is None else dict(ep.followed),
        }
        if ep.layer is not None:
            evidence.update({k: v for k, v in ep.layer.items() if k != "text"})
        return evidence

    def _report(self, ep: _Episode) -> list[Finding]:
        """The episode's current state, if what it says changed (the step is its last spike: its extent)."""
        if ep.with_loss and ep.count == 1 and ep.burst < 2 and not ep.shift:
            return []  # the loss spike's incident, unless the norm stays up
        severity, message = self._severity(ep), self._message(ep)
        if ep.said == (severity, message):
            return []
        ep.said = (severity, message)
        return [Finding(self.kind, severity, ep.last_step, message, self._hint(ep), self._evidence(ep))]

    def _layer(self, layers: Any) -> dict[str, Any] | None:
        if isinstance(layers, dict) and self._layers:
            best = None
            for name, v in layers.items():
                was = self._layers.get(name)
                if finite(v) and was and was > 0:
                    r = v / was
                    if best is None or r > best[1]:
                        best = (name, r, was, v)
            if best is not None:
                return {
                    "layer": best[0],
                    "layer_ratio": round(best[1], 2),
                    "text": f"The largest growth is in {best[0]} ({best[2]:.3g} -> {best[3]:.3g}, {best[1]:.0f}x).",
                }
        elif isinstance(layers, dict) and layers:
            name, v = max(((k, v) for k, v in layers.items() if finite(v)), key=lambda kv: kv[1], default=("", 0))
            if name:
                return {"layer": name, "text": f"The largest per-parameter norm is {name} ({v:.3g})."}
        return None

    def _note(self, step: int, norm: float, med: float) -> list[Finding]:
        """One plain note per run: a spike not judged because the loss is degenerate."""
        if self._noted or self._clip_open:
            return []
        self._noted = True
        n, flat = self._flats()
        message = (
            f"grad-norm spike at step {step} ({norm:.3g}, {_x(norm / med)} its median of {med:.3g}) not judged: "
            f"the loss is 0.0 or repeats its previous value on {flat} of the last {n} entries, so the "
            "gradients carry no signal"
        )
        hint = (
            "A loss stuck at 0.0 (or at one value) means these batches teach nothing: check that the labels are not "
            "all masked (-100), that the loss is connected to the trainable parameters, and whether NaN losses are "
            "logged as 0.0 (HF Trainer's logging_nan_inf_filter)."
        )
        evidence = {"grad_norm": norm, "median": round(med, 6), "flat_losses": flat, "entries": n}
        return [
            Finding(self.kind, "info", step, message, hint, evidence),
            self.resolve(step, message, hint, evidence),
        ]

    def _clip_rate(self, step: int) -> list[Finding]:
        cfg = self.config
        if len(self._clips) < cfg.clip_recent + cfg.clip_baseline:
            return []
        recent = self._recent_clipped / cfg.clip_recent
        base = self._base_clipped / cfg.clip_baseline
        rising = recent >= cfg.clip_min_rate and recent - base >= cfg.clip_rise
        ev = {"clip_rate_recent": round(recent, 3), "clip_rate_baseline": round(base, 3)}
        if rising and not self._clip_open:
            self._clip_open = True
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
                        "The pre-clip grad norm is drifting up; that can lead to a loss spike or divergence. "
                        "Check the LR (too high for this stage?), the fp16 loss scale and per-layer grad norms; "
                        "consider lowering the LR before the loss moves."
                    ),
                    evidence=ev,
                )
            ]
        if self._clip_open and recent - base < cfg.clip_rise / 2:
            self._clip_open = False
            return [
                self.resolve(
                    step, f"clip rate back to {recent:.0%} at step {step}", "Clipping is back to its usual rate.", ev
                )
            ]
        return []
