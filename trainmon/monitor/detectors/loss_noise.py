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

import bisect
import collections
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainmon.monitor.detectors.base import NOTHING, Detector, Finding, finite
from trainmon.monitor.detectors.batch import columns, read
from trainmon.monitor.detectors.rolling import (
    LazyWindow,
    RollingWindow,
    mad_floors,
    sorted_mad,
    sorted_mads,
    window_bounds,
)
from trainmon.wire import Event

__all__ = ["LossNoise", "LossNoiseConfig", "shuffling_hint"]

_isfinite, _log = math.isfinite, math.log
_FLOAT: frozenset[type] = frozenset((float,))
_RETRY_ADDS = 16
"""Admissions after which the absolute baseline's ties are counted again where they proved nothing (a quantised log)."""
_STRETCH = 16
"""Entries ``observe`` takes between two screens where one stopped or the state is not quiet (such entries come in
clusters), doubled while screens decide nothing."""
_RUN_MIN = 64
"""Runs of steps shorter than this go through ``observe`` one by one: planning one costs as much."""
_BLOCK = 8
"""Baseline windows that share one floor under their MADs (``mad_floors``): a union of ``baseline + 7`` values sorted
for eight windows of ``baseline``, the floors loose enough to leave a few in a hundred quiet entries to the exact
MADs."""
_EXACT = 8
"""Entries the floors leave undecided whose exact MADs a screen computes at a time: it stops at the first one high."""
_CARRY = 12
"""Quiet entries in a row after which ``_screen`` leaves judging one at a time past a rise (``_carry``, ~3 us an entry)
for a new scan (~100 us and up); 6 and 24 measured the same on D_w1m."""
_AHEAD = 256
"""Entries a screen's floors judge at once, doubled each time: a rise stops the screen every 400 entries or so, and
judging the run's rest at each start judged six times the entries there are (D_w1m: 6.4M for 1M)."""


def _lr(f: dict[str, Any]) -> Any:
    """A step's LR: the first group's, where it is a finite number."""
    lrs = f.get("lr")
    lr = lrs[0] if isinstance(lrs, list) and lrs else None
    if lr is not None and not (_isfinite(lr) if type(lr) is float else finite(lr)):
        return None
    return lr


def _lrs(fields: list[dict[str, Any]]) -> list[Any]:
    """``_lr`` of each step's fields: at once where every step logs a list of finite floats."""
    col = [f.get("lr") for f in fields]
    if set(map(type, col)) == {list} and all(col):
        first = [x[0] for x in col]
        if set(map(type, first)) == {float} and np.isfinite(np.array(first)).all():
            return first
    return list(map(_lr, fields))


def _indices(entries: range | np.ndarray) -> Sequence[int]:
    """``entries`` as ints: an array's as a list."""
    return entries.tolist() if isinstance(entries, np.ndarray) else entries


def _log_change(loss: float, prev: float) -> float:
    """The change of the log loss: the log of the ratio, or where the two losses are hundreds of decades apart (the
    ratio 0 or infinite), the difference of the logs."""
    ratio = loss / prev
    return _log(ratio) if 0.0 < ratio < math.inf else _log(loss) - _log(prev)


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


class _Run:
    """A run of steps with positive finite float losses, each with a previous loss (``LossNoise.observe_batch``): what
    the detector's state does not change about them, computed once. Each entry's log and absolute change; the recent
    window it leaves (only ever its last ``window`` changes, whatever the state): that window's values sorted, median,
    bounds on its MAD and whether it descends (``_descending``: from the bounds where they decide, else the exact MAD);
    the entry it pushes out of the window (``recent`` at the run's start, then the run's own: ``e_*`` lists, the log and
    absolute changes as arrays, ``ed`` and ``ea``, read as floats only where the windows take them, and each recent
    window of the absolute ones, unsorted, ``awin``; the LRs read when asked, ``lrs``) and whether that one may join the
    baseline (past the warmup, the window not descending), which it does from the quiet state; and the baseline's
    windows were every one that may join to join (``joined``, from the baseline at the run's start, then the entries
    ``jidx``, and floors under their MADs: ``floors``), which hold from the quiet state unless an earlier stretch kept
    some out, until ``baseline`` more have joined. ``pad``: the entries before the recent window is full, which no
    screen takes."""

    __slots__ = (
        "awin",
        "b0",
        "cc",
        "e_loss",
        "e_step",
        "ea",
        "ed",
        "fields",
        "floors",
        "jidx",
        "joined",
        "joins",
        "off",
        "old_lrs",
        "pad",
        "r0",
        "rhi",
        "rlo",
        "rs",
    )

    def __init__(
        self, det: LossNoise, fields: list[Any], losses: list[float], steps: list[int], array: np.ndarray
    ) -> None:
        """``array``: ``losses`` as an array (``observe_batch``'s where it made one: not made twice)."""
        c = det.config
        w = c.window
        old = list(det._recent)
        r0 = self.r0 = len(old)  # as many as the recent window holds: each entry adds one to both
        self.fields = fields
        n = len(losses)
        both: np.ndarray = np.concatenate((np.array([det._prev], dtype=float), array))
        with np.errstate(over="ignore", under="ignore"):  # the ratio 0 or inf: the logs' difference below
            ratio = both[1:] / both[:-1]
        if ((ratio > 0.0) & (ratio < math.inf)).all():
            d = np.fromiter(map(_log, ratio.tolist()), float, n)  # _log_change's, where the ratio is positive finite
        else:
            d = np.fromiter(map(_log_change, losses, both[:-1].tolist()), float, n)
        self.e_loss = [x[0] for x in old] + losses
        self.ed = ed = np.concatenate((np.array([x[1] for x in old], dtype=float), d))
        self.ea = np.concatenate((np.array([x[2] for x in old], dtype=float), both[1:] - both[:-1]))
        self.e_step = [x[4] for x in old] + steps
        self.old_lrs = [x[3] for x in old]
        self.pad = pad = max(0, w - r0)
        self.joins = joins = np.zeros(n, dtype=bool)
        self.off = -pad  # entry k's recent window is row k + off (r0 + pad is the window)
        self.cc = self.rs = self.rlo = self.rhi = self.floors = self.joined = self.jidx = self.awin = np.empty(0)
        self.b0 = 0
        if n <= pad:
            return
        rs, med, rlo, rhi = window_bounds(ed[1:], w)
        self.rs, self.rlo, self.rhi = rs, rlo, rhi  # bounds that meet on most rows: the MAD
        self.awin = sliding_window_view(self.ea[1:], w)  # entry k's absolute window: row k + off, unsorted
        trend, t = np.abs(med), c.trend_max
        desc = trend > t * rhi
        q = np.flatnonzero((trend > t * rlo) & ~desc)  # the bounds straddle: the exact MADs, at once
        desc[q] = trend[q] > t * sorted_mads(rs[q])
        leaving = self.e_step[: r0 + n - w]
        joins[pad:] = ~desc
        if min(leaving) < det._warmup_end:
            joins[pad:] &= np.array([s >= det._warmup_end for s in leaving])
        self.cc = np.cumsum(joins)  # the entries that may join through each entry
        bd = det._bd.values()
        self.b0, b = len(bd), c.baseline
        self.jidx = np.flatnonzero(joins) + (r0 - w)  # joined[b0:]'s entries (e_* indices)
        self.joined = np.concatenate((np.array(bd, dtype=float), ed[self.jidx]))
        if len(self.joined) >= b:  # window r: joined[r : r + b], the baseline once b0 + cc - b = r
            self.floors = mad_floors(self.joined, b, _BLOCK)

    def lrs(self, entries: Sequence[int]) -> list[Any]:
        """``_lr`` of each of ``entries`` (``e_*`` indices, ascending): the recent window's as it kept them, the run's
        read when asked (a screen hands the windows only the last few)."""
        cut = bisect.bisect_left(entries, self.r0)
        fields, r0 = self.fields, self.r0
        return [self.old_lrs[e] for e in entries[:cut]] + _lrs([fields[e - r0] for e in entries[cut:]])

    def last_lrs(self, entries: range | np.ndarray, size: int) -> list[Any]:
        """The last ``size`` LRs logged by ``entries`` (``e_*`` indices, ascending), in order: as ints read only as far
        back as a step without an LR makes it look."""
        found = self.lrs(_indices(entries[-size:]))
        if None not in found:
            return found
        return [lr for lr in self.lrs(_indices(entries)) if lr is not None][-size:]


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
        # the settings _screen's proof takes: a quiet entry ends in _add's ``hits < sustain`` return, _descending's
        # bounds decide, the windows have bounding blocks (window_bounds)
        c = config
        self._screens = c.sustain >= 1 and c.trend_max >= 0 and all(n & 1 or n >= 4 for n in (c.window, c.baseline))

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
            d = _log_change(loss, prev)
            return self._add(f["step"], loss, d, loss - prev, _lr(f), f.get("batch_fingerprint"))
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

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """``observe`` of each event, but a run of steps with positive finite float losses is planned at once
        (``_Run``) and, where the detector judges against a baseline at a quiet noise (a long log's usual state),
        screened many entries at a time (``_screen``); what the screen cannot show quiet, and every other event, goes
        through ``observe``."""
        observe, n = self.observe, len(events)
        if n < _RUN_MIN or not self._screens:  # no run to plan (a live call's few steps of a rank): not a look at it
            out.extend(map(observe, events, attempts))
            return
        fields, others, (losses, steps) = columns(events, "loss", "step")
        batch = read(events)
        loss = None
        if not others and batch.only("loss", _FLOAT):
            loss = batch.floats("loss")  # the batch's, which other detectors read too: made once
            simple = np.isfinite(loss) & (loss > 0.0)
        else:
            simple = np.array([type(x) is float and 0.0 < x < math.inf for x in losses], dtype=bool)
            simple[others] = False
        i = 0
        for stop in [*np.flatnonzero(~simple).tolist(), n]:
            if stop - i >= _RUN_MIN:
                self._run(events, attempts, i, stop, fields, losses, steps, loss, out)
            else:
                out.extend(map(observe, events[i:stop], attempts[i:stop]))
            if stop < n:
                out.append(observe(events[stop], attempts[stop]))
            i = stop + 1

    def _run(
        self,
        events: list[Event],
        attempts: list[int],
        lo: int,
        hi: int,
        fields: list[Any],
        losses: list[Any],
        steps: list[Any],
        array: np.ndarray | None,
        out: list[list[Finding]],
    ) -> None:
        """``observe`` of the steps ``events[lo:hi]``, all with positive finite float losses: from the quiet state
        (``_quiet``) screened to the run's end or as far as ``_screen`` shows them quiet, the others through
        ``observe``, ``_STRETCH`` at a time (more while screens decide nothing) between two looks at the state.
        ``array``: the batch's losses as an array, where ``observe_batch`` made one."""
        observe = self.observe
        if self._prev is None:  # the first has no difference: observe keeps its loss
            out.append(observe(events[lo], attempts[lo]))
            lo += 1
        cut = losses[lo:hi]
        run = _Run(self, fields[lo:hi], cut, steps[lo:hi], np.array(cut) if array is None else array[lo:hi])
        k, n, back = 0, hi - lo, _STRETCH
        while k < n:
            stretch = _STRETCH
            if k >= run.pad and self._quiet():
                j, whole = self._screen(run, k, out)
                if whole:
                    k, back = j, _STRETCH
                    continue
                back = _STRETCH if j > k else min(2 * back, n)  # it decided nothing: screen less often
                k, stretch = j, back
            stop = min(n, k + stretch)
            out.extend(map(observe, events[lo + k : lo + stop], attempts[lo + k : lo + stop]))
            k = stop

    def _quiet(self) -> bool:
        """Judging, nothing open, the last entry's noise under ``admit_ratio`` x its baseline's and no streak: the state
        every entry ``_screen`` shows quiet leaves as it found it."""
        return self._judged and not (self._open or self._high or self._hits) and self._settled and self._since is None

    def _screen(self, run: _Run, k: int, out: list[list[Finding]]) -> tuple[int, bool]:
        """``observe`` of the run's entries from ``k`` in the quiet state (``_quiet``), as far as it can follow them:
        returns where it stopped and whether it took the run's rest; else it stopped at the first entry of a rise it
        cannot follow (``observe`` judges that one).

        From the quiet state an entry changes nothing but the windows, and leaves the state quiet, while the
        baseline's MAD is zero or the recent one is under ``admit_ratio`` x it (``_add`` returns nothing then, by
        whichever of its paths), and the entry it pushes out of the recent window joins the baseline where the run
        says it may (``_Run.joins``: nothing rising or open blocks it then); so it does where the relative noise is
        that high but the absolute one under the bar, or the absolute baseline's MAD zero (``_judge``'s second
        ``_under``, ``_measured``). The baseline's windows through those admissions are the current baseline followed
        by the entries that join: the run's windows, or after a rise kept some out, new ones until ``baseline``
        entries have joined and the run's hold again. The ratio is at most the recent MAD's upper bound over the floor
        under the baseline's (``mad_floors``; float division is monotone), and where that does not show it under the
        bar, the exact MADs do (``sorted_mads``), ``_EXACT`` entries at a time.

        Where both noises are high (a rise, ``_rise``), it follows the rise while it would not start a streak (the
        relative noise under ``ratio``: ``_judge`` then neither counts nor asks the LR and the level): nothing joins
        the baseline after its first entry, so each entry is judged against that one baseline, until the first entry
        back under the bar, which leaves the state quiet again, its own one kept out too (``_follow``); past it, the
        entries are judged one at a time, the next rises of a cluster followed alike, until ``_CARRY`` in a row are
        quiet and a new scan takes over (``_carry``). A rise that would start a streak, or still runs at the run's
        end, is left to ``observe``. The windows then take the entries at once."""
        c = self.config
        w, b = c.window, c.baseline
        end, b0 = len(run.joins), run.b0
        t = b0 + (int(run.cc[k - 1]) if k else 0)  # joined[:t]: the baseline at the run's start and the joins before
        base, base_a = np.array(self._bd.values()), self._ba.values()  # the baseline's two windows
        # floors under the first b windows: the run's where the baseline is its, new where a rise kept some out
        head = run.floors[t - b : t] if t >= b and base.tolist() == run.joined[t - b : t].tolist() else None
        out_of = np.zeros(end, dtype=bool)  # entries whose leaving entry a rise kept out of the baseline
        i = stop = k
        while i < end:
            if head is None:
                head = mad_floors(np.concatenate((base, run.joined[t : t + b - 1])), b, _BLOCK)
            for e, bdm, r in self._relative_highs(run, i, base, t, head):
                a_win = (base_a + run.ea[run.jidx[t - b0 + max(0, r - b) : t - b0 + r]].tolist())[-b:]
                n = self._follow(run, e, bdm, sorted_mad(sorted(a_win)))
                if n != 0:  # a rise, or one observe must follow
                    break
            else:
                stop = end
                break
            stop = e
            if n is None:
                break
            out_of[e + 1 : e + n + 1] = True
            base = np.concatenate((base[r:], run.joined[t + max(0, r - b) : t + r]))  # window r: e's baseline
            i, t, base, base_a, rise = self._carry(run, e + n + 1, base, a_win, b0 + int(run.cc[e + n]), out_of)
            stop, head = i, None
            if rise:  # one observe must follow
                break
        m = stop - k
        if not m:
            return k, False
        # the state as m entries of observe leave it
        out.extend([NOTHING] * m)
        self._prev = run.e_loss[run.r0 + stop - 1]
        # those joined, as an array: the windows keep the last b, read as ints (not all of a run's thousands)
        joined = np.flatnonzero(run.joins[k:stop] & ~out_of[k:stop]) + (k + run.r0 - w)
        if len(joined):
            self._admitted += len(joined)
            self._blr.extend(run.last_lrs(joined, b))
            at = joined[-b:].tolist()
            self._levels.extend([run.e_loss[e] for e in at])
            self._bd.extend(run.ed[at].tolist())
            self._ba.extend(run.ea[at].tolist())
        first, last = run.r0 + k, run.r0 + stop
        kept = range(max(first, last - w), last)  # the entries the recent window keeps
        recent, kept_d, kept_a = self._recent, run.ed[kept.start : last].tolist(), run.ea[kept.start : last].tolist()
        if m >= w:
            recent.clear()
        else:
            for _ in kept:
                recent.popleft()
        recent.extend(
            zip(
                run.e_loss[kept.start : last],
                kept_d,
                kept_a,
                run.lrs(kept),
                run.e_step[kept.start : last],
                strict=True,
            )
        )
        self._rd.extend(kept_d)  # all finite: the last window's worth is what it keeps
        self._ra.extend(kept_a)
        self._rlr.extend(run.last_lrs(range(first, last), w))
        self._prints.extend([run.fields[e - run.r0].get("batch_fingerprint") for e in kept])
        return stop, stop == end

    def _relative_highs(
        self, run: _Run, i: int, base: np.ndarray, t: int, head: np.ndarray
    ) -> Iterator[tuple[int, float, int]]:
        """The run's entries from ``i`` whose relative noise is high from the quiet state, every entry joining where
        the run says it may, in order, as the caller asks for them (it stops at a rise): each entry, its baseline's MAD
        (positive) and its baseline's row: entry ``i + q``'s baseline is window ``row`` of ``base`` followed by
        ``joined[t:]``, ``row`` the entries that join from ``i`` through it; ``head``: floors under the first
        ``baseline`` windows, the run's (``_Run.floors``) after. Each look ahead reads only its own rows, floors and
        values (a rise stops most before their first 256 entries, and the run's thousands copied and counted at each
        start took 3% of LossNoise's samples on D_w1m)."""
        c = self.config
        b, bar, off = c.baseline, c.admit_ratio, run.off
        window, lo, ahead, n = np.arange(b), 0, _AHEAD, len(run.joins) - i
        c0 = int(run.cc[i - 1]) if i else 0
        while lo < n:
            hi = min(n, lo + ahead)
            rows = run.cc[i + lo : i + hi] - c0
            p = int(np.searchsorted(rows, b))  # rows under b: the head's windows
            below = np.concatenate((head[rows[:p]], run.floors[rows[p:] + (t - b)]))
            rhi = run.rhi[lo + i + off : hi + i + off]
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero floor or MAD decides nothing
                undecided = np.flatnonzero(~((below > 0.0) & (rhi / below < bar)))
            if len(undecided):
                seq = np.concatenate((base, run.joined[t : t + int(rows[-1])]))
            for at in range(0, len(undecided), _EXACT):  # the exact MADs, as _judge's _under judges them
                q = undecided[at : at + _EXACT]
                bdm = sorted_mads(np.sort(seq[rows[q][:, None] + window], axis=1))
                with np.errstate(divide="ignore", invalid="ignore"):  # the recent MAD's upper bound shows most quiet
                    maybe = np.flatnonzero((bdm > 0.0) & ~(rhi[q] / bdm < bar)).tolist()
                for k in maybe:
                    e = i + lo + int(q[k])
                    if run.rlo[e + off] == rhi[q[k]] or sorted_mad(run.rs[e + off].tolist()) / bdm[k] >= bar:
                        yield e, float(bdm[k]), int(rows[q[k]])
            lo, ahead = hi, 2 * ahead

    def _carry(
        self, run: _Run, i: int, base: np.ndarray, base_a: list[float], t: int, out_of: np.ndarray
    ) -> tuple[int, int, np.ndarray, list[float], bool]:
        """``_screen`` past a rise it followed: the entries from ``i`` (``base`` and ``base_a`` their baselines before
        ``i``'s admission, ``joined[t]`` the next to join) judged one at a time as ``_relative_highs`` and ``_follow``
        judge them, rises among them followed, until ``_CARRY`` in a row are quiet: returns the entry where it
        stopped, the next to join and the baselines there, and whether a rise it cannot follow starts at that entry.
        Rises come in clusters (D_w1m: of 2,080 that followed another in its batch, 844 started within 3 entries of
        its end, 1,178 within 16), and a new scan after each cost its floors (``mad_floors``) and its first look
        ahead: new scans 2,187 -> 964."""
        c = self.config
        bar, b, off, b0 = c.admit_ratio, c.baseline, run.off, run.b0
        bd = RollingWindow(b)
        bd.extend(base.tolist())
        ba = collections.deque(base_a, maxlen=b)
        joins, rlo, rhi, joined, ea, jidx = run.joins, run.rlo, run.rhi, run.joined, run.ea, run.jidx
        end, quiet, j = len(joins), 0, i
        while j < end and quiet < _CARRY:
            if joins[j]:
                bd.add(float(joined[t]))
                ba.append(float(ea[jidx[t - b0]]))
                t += 1
            lo = bd.mad_bounds()[0]
            if lo > 0.0 and rhi[j + off] / lo < bar:  # the recent MAD's upper bound shows most quiet
                quiet, j = quiet + 1, j + 1
                continue
            bdm, r = bd.mad(), rhi[j + off]
            if not bdm > 0.0 or (r if rlo[j + off] == r else sorted_mad(run.rs[j + off].tolist())) / bdm < bar:
                quiet, j = quiet + 1, j + 1
                continue
            n = self._follow(run, j, bdm, sorted_mad(sorted(ba)))
            if n is None:
                return j, t, base, base_a, True
            if n:
                out_of[j + 1 : j + n + 1] = True
                t, quiet = b0 + int(run.cc[j + n]), 0
            j += n + 1
        return j, t, np.array(bd.values()), list(ba), False

    def _follow(self, run: _Run, e: int, bdm: float, bam: float) -> int | None:
        """Where the noise from ``e`` (the relative noise high, its baselines' MADs ``bdm``, positive, and ``bam``) is
        back under the bar: the first entry from ``e`` whose noise is not high, as its distance from ``e``, every entry
        judged against those baselines (nothing joins them after a high ``e``; ``_judge``'s ``_under`` on the exact
        MADs); 0 where ``e`` is not high after all (the absolute noise under the bar), or not measured (``bam`` zero:
        ``_measured``). None where a high one has the relative noise at ``ratio`` (it would start a streak) or the rise
        runs to the run's end. One entry at a time, its absolute window sorted only where the relative noise is high: a
        rise lasts about five entries (D_w1m: 2,179 rises, 11,607 entries), and numpy on eight rows at a time made
        four times the calls (the follows' CPU 0.20 -> 0.14 s)."""
        c = self.config
        bar, ratio, off = c.admit_ratio, c.ratio, run.off
        if not bam > 0.0:
            return 0
        rs, awin = run.rs, run.awin
        for j in range(e, len(run.joins)):
            rel = sorted_mad(rs[j + off].tolist()) / bdm
            if rel < bar or sorted_mad(sorted(awin[j + off].tolist())) / bam < bar:
                return j - e
            if not rel < ratio:
                return None
        return None

    # -- the rule --------------------------------------------------------------------------------

    def _ratios(self) -> tuple[float, float] | None:
        """(relative, absolute) noise of the recent window over the baseline's, once both are judged."""
        if len(self._recent) < self.config.window or not self._bd.full:
            return None
        if self._bd.mad() <= 0 or self._ba.mad() <= 0:
            return None  # a baseline with no measurable noise (a quantised or constant log)
        return self._noise()

    def _noise(self) -> tuple[float, float]:
        """``_ratios`` where both baselines' MADs are known positive."""
        return self._rd.mad() / self._bd.mad(), self._ra.mad() / self._ba.mad()

    @staticmethod
    def _under(recent: RollingWindow | LazyWindow, base: RollingWindow | LazyWindow, bar: float) -> bool:
        """``recent.mad() / base.mad() < bar``, ``base``'s MAD positive, from the MADs' O(1) bounds where they decide
        it, else from the MADs. Exact: with ``lo <= mad <= hi``, the ratio is at most ``recent_hi / base_lo`` where
        ``base_lo`` is positive, and at least ``recent_lo / base_hi`` (float division is monotone in both, rounding
        included), and neither bound shows a NaN ratio (two infinite MADs: the absolute ones of losses near the
        float's limit) under the bar."""
        base_lo, base_hi = base.mad_bounds()
        lo, hi = recent.mad_bounds()
        if base_lo > 0 and hi / base_lo < bar:
            return True
        if lo / base_hi >= bar:
            return False
        return recent.mad() / base.mad() < bar

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
        if not self._open:
            if (self._judged or self._judging()) and self._measured():
                return self._judge(step)
            self._high = False  # too few entries yet, or a baseline with no measurable noise (a quantised log)
            return []
        ratios = self._ratios()
        if ratios is None:
            self._high = False
            return []
        rel, ab = ratios
        noise = min(rel, ab)
        self._rise(step, noise >= c.admit_ratio)
        self._calm = self._calm + 1 if noise < c.release_ratio else 0
        if self._calm >= c.sustain:
            self._open = False
            msg = f"loss noise back to {noise:.1f}x its baseline (relative {rel:.1f}x, absolute {ab:.1f}x)"
            return [self._finding(step, msg, {"relative_ratio": rel, "absolute_ratio": ab}, resolved=True)]
        if step - self._reported >= c.window:
            self._reported = step
            return [self._report(step, rel, ab)]
        return []

    def _measured(self) -> bool:
        """Both baselines' MADs positive (a quantised or constant log's may be zero: no ratio then): the relative one's
        from its lower bound where that shows it, the absolute one's from its ties (``_ba_positive``)."""
        bd = self._bd
        return (bd.mad_bounds()[0] > 0 or bd.mad() > 0) and (self._admitted <= self._ba_proven or self._ba_positive())

    def _judge(self, step: int) -> list[Finding]:
        """The rule, nothing open, on a judged entry whose ratios exist (``_measured``). Noise, the lesser ratio, at
        least ``admit_ratio`` makes the entry high and dates the rise; a streak starts at ``ratio`` and holds while
        the noise stays ``admit_ratio`` up (hysteresis), and opens the finding after ``sustain`` entries. Each ratio is
        only compared with a bar (``_under``: on most entries from the MADs' O(1) bounds, quiet ones and those
        between ``admit_ratio`` and ``ratio`` alike) and computed for a report; the relative one first, which decides
        most quiet entries alone (the absolute window is sorted only when read), and the LR and the level, dearest,
        last: only of an entry that starts or holds a streak."""
        c = self.config
        rd, bd, bar = self._rd, self._bd, c.admit_ratio
        if self._under(rd, bd, bar) or self._under(self._ra, self._ba, bar):
            self._rise(step, False)
            self._hits = 0
            return []
        self._rise(step, True)  # the lesser ratio at least the bar (the relative one, of log changes, is never NaN)
        held = self._settled and (self._hits or not self._under(rd, bd, c.ratio))
        self._hits = self._hits + 1 if held and self._lr_steady() and self._level_steady() else 0
        if self._hits < c.sustain or self._under(rd, bd, c.ratio):
            return []
        rel, ab = self._noise()
        self._open, self._calm, self._reported = True, 0, step
        return [self._report(step, rel, ab)]

    def _rise(self, step: int, high: bool) -> None:
        """The entry's noise, the lesser ratio, at least ``admit_ratio`` (``high``) or not: a high one after a settled
        one dates the rise; one under it settles the noise."""
        self._high = high
        if not high:
            self._since, self._settled = None, True
        elif self._since is None and self._settled:
            self._since = step

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
