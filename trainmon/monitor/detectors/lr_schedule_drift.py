"""``lr_schedule_drift``: the LR each param group actually used, against the schedule it should follow.

Why the rule is what it is (``/work/shared/research/failure-modes.md``, rows R1, L1, L2, L3):
scheduler bugs barely move the loss of a small model (the resume simulation saw +0.014 for a
restarted warmup), but they are exact in the LR trace. So the check is on the LR itself:

* With a schedule declared in ``run_start`` (``trainmon.schedules``), every step's LR of group 0
  must equal ``schedule.lr(step)`` and every other group must keep the ratio to group 0 it
  started with; more than 1% off for 2 consecutive steps fires (the R1/L3 rule). When it
  fires, a few hypotheses are tried against the recent trace to name the bug: the scheduler
  stepped ``accum`` (or ``world_size``) times per step (L1), restarted at the resume step (R1),
  frozen (R1, and the ``lr_frozen`` fault), sized for a different total (L2, with an estimate
  of the total it was built for), shifted by a few steps (L3, pytorch#60265), a constant
  factor (an LR override), or one param group diverging from the others (L3).
* The hooks also count ``scheduler.step()`` calls per optimizer step: more than one for 2
  steps is L1 directly, even where the LR curve is flat and the bug does not show yet.
* With no declared schedule, the schedule is inferred from the first logged steps, and only
  what every standard schedule (constant, warmup then constant/cosine/linear/wsd/inverse-sqrt)
  obeys is checked. After the peak the LR does not rise again: a jump back up from the middle of
  the decay (``reset_min_level`` of the peak or more) is a scheduler reset, a warning; a rise from
  the decay's floor is what warm restarts and cyclic schedules do, a note. A level held and then
  raised before any decay is more warmup (``ConstantLR``, stepped warmups). When the planned
  length is known, an LR that stops changing in the middle of a smooth decay for
  ``frozen_steps`` steps is frozen (a stepwise decay holds its levels at will). Inferred checks
  say so in their evidence. Real logs (``/work/shared/real-logs``) show no LR rise after the peak
  in any clean run.
* A scheduler the hooks watch but cannot read (``run_start``'s ``scheduler`` with no ``schedule``:
  ``CyclicLR``, warm restarts, ``ReduceLROnPlateau``, a ``LambdaLR`` of the user's) owns the LR's
  shape: rises and long plateaus are what it does, so only the per-step scheduler count is checked.
  So does a schedule read off a scheduler (``schedule_source: "scheduler"``) that is stepped once
  per epoch: it counts epochs, not steps. Its cadence shows in ``scheduler_steps``: stepped at the
  attempt's first step, it is per step; first stepped later, per epoch. Until it steps, nothing is
  compared. ``scheduler_steps`` counts the steps between two logged steps, so a loop that logs
  every k-th step is not L1.

* Format semantics belong to the importer: a logged step N is optimizer step ``N - step_base``,
  and a trainer whose warmup counts the step being taken (llm.c: ``max_lr * (step + 1) / warmup``)
  says so in ``config.lr_warmup_offset``; the expected LR follows both, so an llm.c run that
  never resumed is not "1% off, an off-by-one in the scheduler position".
* Printed LRs are rounded (llm.c: ``lr 5.97e-04``): the printing quantum is learnt from the
  values' digits and half of it is tolerated; a flat LR is frozen only when it lasts
  ``frozen_level_ratio`` times the previous level too. A frozen LR that is the floor of a complete
  cosine (or linear, to a round floor) decay is a schedule running too fast, with the ratio.
* Every attempt after the first is a resume (with or without a resume event): an LR going wrong
  within its first logged steps is checked against the schedule restarting there.
* An open anomaly starts at its first off step and is restated as it grows (``update_every``,
  ``update_ratio``), and once more at its last off step before it resolves or the attempt ends.

Deliberate LR changes that are part of the declared schedule (warmup, WSD decay, floors) are
the schedule, so they never fire. Skipped fp16 steps that also skip the scheduler (the HF
behaviour) are tolerated: the LR may lag the schedule by the number of skipped steps.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np

from trainmon.monitor.core.fmt import fmt
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import carries, columns, observe_runs, read
from trainmon.schedules import Schedule
from trainmon.wire import Event

__all__ = ["LrScheduleDrift", "LrScheduleDriftConfig"]


@dataclass
class LrScheduleDriftConfig:
    """``lr_schedule_drift``: actual LR per group against the declared (or inferred) schedule."""

    rel_tol: float = 0.01
    """Relative LR difference from the expected value that counts as off schedule (failure-modes L1-L3: 1%)."""
    min_steps: int = 2
    """Consecutive off-schedule steps before firing (one odd step is a logging glitch, two are a trend)."""
    resolve_after: int = 3
    """Consecutive on-schedule steps after which the anomaly is resolved."""
    history: int = 8
    """Recent (step, LR) observations kept to diagnose the drift (accumulation, restart, frozen, length)."""
    infer_points: int = 5
    """Logged steps needed before a schedule is inferred when none is declared."""
    frozen_steps: int = 50
    """Inferred schedules only: steps of an exactly flat LR after a decay before calling it frozen (R1)."""
    scheduler_steps_min: int = 2
    """Consecutive steps reporting ``scheduler_steps`` > 1 before firing (L1: the ratio must be 1)."""
    frozen_level_ratio: float = 4.0
    """Inferred schedules only: a flat LR is frozen only when it lasts this many times the previous LR
    level too (a rounded LR, e.g. llm.c's ``lr 5.97e-04``, moves in levels lasting tens of steps)."""
    reset_min_level: float = 0.3
    """Inferred schedules only: an LR that jumps back up from at least this fraction of its peak (or
    falls by half from there and climbs again) restarted mid-decay: a scheduler reset, a warning.
    Warm-restart and cyclic schedules rise from the floor of their decay: a note (info)."""
    frozen_max_drop: float = 0.3
    """Inferred schedules only: an LR held for 3+ logged points and then cut by more than this fraction
    is a step schedule (StepLR, MultiStepLR, ReduceLROnPlateau: x0.1, x0.5), which holds each level
    as long as it likes, so no flat stretch after it is frozen. A smooth decay moves every point, or
    by a printed quantum (~1%) after a held level; only its last points into a floor of 0 drop more."""
    quantum_min_values: int = 8
    """Distinct logged LRs needed before their printed resolution is trusted (half a quantum is tolerated)."""
    restart_points: int = 3
    """Logged steps into a resumed attempt within which an LR going wrong is the schedule restarting there."""
    update_every: int = 25
    """While a drift lasts, its finding is restated at least every this many steps (magnitude, extent)..."""
    update_ratio: float = 1.25
    """...and as soon as how far off the LR is moved by this factor either way."""


_INF = math.inf
_SAME = 1e-9  # relative difference below which two logged LRs are the same value
_REPR_DIGITS = 17  # the most significant digits a float's repr has
_DECAY_KEPT = 256  # change points kept of an inferred decay at most (halved beyond)
_BULK = 32  # events from which a batch is looked at as a whole (numpy's fixed cost is a few us)
_RUN_MIN = 8  # steps in a run from which it is taken at once (below, observe costs less than the look)
_FALL, _HOLD, _BARE, _RISE = 1, 2, 3, 4  # the runs of steps taken at once: a decay, a held LR, no LR, a warmup
_NONE: frozenset[type] = frozenset((type(None),))
_LIST: frozenset[type] = frozenset((list,))
_TINY = 1e-30  # the least LR a relative difference is taken of (every LR checked here is non-negative)
_ROUND_FLOORS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)  # floors as a fraction of the peak that configs use
_SHAPES: tuple[tuple[str, Callable[[float], float]], ...] = (
    ("cosine", lambda u: 0.5 * (1.0 + math.cos(math.pi * u))),
    ("linear", lambda u: 1.0 - u),
)


def _rel(actual: float, expected: float, floor: float, slack: float = 0.0) -> float:
    """Relative difference, after ``slack`` (half the printing quantum) is allowed for."""
    return max(0.0, abs(actual - expected) - slack) / max(abs(expected), floor)


def _same(lr: float, prev: float) -> bool:
    """Two logged LRs that are the same value (printing and float noise): within ``_SAME`` of the previous one."""
    return abs(lr - prev) <= _SAME * (prev if prev >= _TINY else _TINY)


def _moving(lrs: np.ndarray, fall: bool) -> np.ndarray:
    """For each LR after the first, whether it is below (``fall``; else above) the one before and not :func:`_same` as
    it: the same comparisons, over a column."""
    prev, lr = lrs[:-1], lrs[1:]
    moving: np.ndarray = ((lr < prev) if fall else (lr > prev)) & ~(
        np.abs(lr - prev) <= _SAME * np.where(prev >= _TINY, prev, _TINY)
    )
    return moving


def _plain(f: dict[str, Any]) -> bool:
    """A step whose LRs may be read with the others of its batch: one per group, every one a float in [0, inf),
    no scheduler count and no skip (either makes the step one to read on its own)."""
    lrs = f.get("lr")
    return (
        type(lrs) is list
        and bool(lrs)
        and all(type(x) is float and 0 <= x < _INF for x in lrs)
        and f.get("scheduler_steps") is None
        and not f.get("skipped")
    )


def _bare(f: dict[str, Any]) -> bool:
    """A step with no LR and no scheduler count: all it changes is the count of steps and the last one."""
    return not f.get("lr") and f.get("scheduler_steps") is None


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class _Resolution:
    """How finely the LR values were printed, learnt from the values themselves.

    Text logs print the LR rounded: llm.c's stdout to 3 significant digits (``lr 5.97e-04``), its
    ``main.log`` to 6 decimals (``lr:0.000597``). A smooth schedule then moves in steps of one
    quantum and looks flat for tens of steps, and a value can sit half a quantum away from the
    schedule. The digits each distinct value needs (its shortest repr) bound the printing: at most
    ``sig`` significant digits and ``decimals`` decimals, so a value's quantum is the coarser of
    the two grids. Full-precision floats need 15-17 digits: their quantum is negligible. A few
    distinct values are required first (a constant 1e-3 needs one digit, but says nothing).

    Exact shortcut (every logged LR of a full-precision log was a ``Decimal`` parse): a repr has at most
    17 digits, so once ``sig`` is 17 a value changes ``decimals`` only if its repr's own (``digits - 1 -
    exponent``) exceeds it, impossible at or above ``10 ** (16 - decimals)``: such values are not parsed
    (``tests/detectors/test_detector_speed.py`` checks it against parsing every value). Once ``min_values``
    distinct values are kept as well, adding such a value changes nothing: ``inert_from`` says where that
    starts, and the detector, which adds every logged LR, skips the call there
    (``tests/detectors/test_lr_schedule_drift_speed2.py``).
    """

    def __init__(self, min_values: int) -> None:
        self.min_values = min_values
        self.sig = 0
        self.decimals = 0
        self._values: set[float] = set()
        self._settled_from = math.inf  # values at or above it cannot change sig or decimals
        self.inert_from = math.inf  # values at or above it change nothing at all: add() need not be called

    def add(self, x: float) -> None:
        values = self._values
        if x <= 0 or x in values:
            return
        if len(values) < self.min_values:
            values.add(x)
        if x < self._settled_from:
            t = Decimal(repr(x)).normalize().as_tuple()
            assert isinstance(t.exponent, int)
            self.sig = max(self.sig, len(t.digits))
            self.decimals = max(self.decimals, -t.exponent)
            if self.sig >= _REPR_DIGITS:
                bound = Decimal(10) ** (_REPR_DIGITS - 1 - self.decimals)
                low = float(bound)  # the least float at or above the bound
                self._settled_from = low if Decimal(low) >= bound else math.nextafter(low, math.inf)
        if len(values) >= self.min_values:
            self.inert_from = self._settled_from

    def quantum(self, x: float) -> float:
        """The printing step around ``x`` (0 while too few distinct values were seen)."""
        if len(self._values) < self.min_values or x <= 0:
            return 0.0
        return max(10.0 ** (math.floor(math.log10(x)) - self.sig + 1), 10.0**-self.decimals)


@dataclass(slots=True)
class _Columns:
    """A batch's events as :meth:`LrScheduleDrift.observe_batch` reads them: which are steps that may be taken with
    others (``plain``: an LR per group, every one a float in [0, inf), no scheduler count and no skip; ``bare``: no
    LR and no scheduler count), and where each kind of run ends (``ends[kind]``: the events that do not continue
    one, then the batch's length): a decay (each plain step below the one before and not the same value), a held LR
    (equal to the one before), steps with no LR, a warmup (each plain step above the one before and not the same
    value)."""

    fields: list[dict[str, Any]]
    lrs: list[Any]
    lr0: np.ndarray  # group 0's LR (NaN where not plain)
    groups: np.ndarray  # LRs per step (0 where not plain)
    plain: np.ndarray
    bare: np.ndarray
    _ends: dict[int, list[int]] = field(default_factory=dict)

    def ends(self, kind: int) -> list[int]:
        """Where the runs of ``kind`` end: the events that do not continue one (read once a run of it is found)."""
        ends = self._ends.get(kind)
        if ends is None:
            plain, lr0, groups = self.plain, self.lr0, self.groups
            if kind == _BARE:
                continues = self.bare[1:] & self.bare[:-1]
            else:
                both = plain[1:] & plain[:-1] & (groups[1:] == groups[:-1])
                continues = both & (lr0[1:] == lr0[:-1] if kind == _HOLD else _moving(lr0, kind == _FALL))
            ends = self._ends[kind] = [*(np.flatnonzero(~continues) + 1).tolist(), len(plain)]
        return ends

    @classmethod
    def read(cls, events: list[Event]) -> _Columns | None:
        """The columns, or None for a batch too short to be worth a look."""
        n = len(events)
        if n < _BULK:
            return None
        with read(events) as batch:  # one reading for both (the engine's is of another list where it leaves kinds out)
            fields, others, (lrs,) = columns(events, "lr")
            usual = not others and not carries(events, "scheduler_steps", "skipped")  # every event a step, nothing else
        # (the LR column's types: the batch's, which bad_resume asks too)
        lists = usual and batch.only("lr", _LIST)
        unprinted = usual and not lists and batch.only("lr", _NONE)
        widths = set(map(len, lrs)) if lists else set()
        width = widths.pop() if len(widths) == 1 else 0  # LRs a step, the same at every step (0: not so)
        # the LRs in a row, group by group: one group's (nearly every log's) the batch's (bad_resume reads them too),
        # several chained
        table = None
        if width == 1:
            first = batch.firsts("lr")
            table = None if first is None else first.reshape(n, 1)
        elif width:
            flat = list(itertools.chain.from_iterable(lrs))
            if set(map(type, flat)) == {float}:  # floats: np.array's look at each is not needed
                table = np.fromiter(flat, float, len(flat)).reshape(n, -1)
        if unprinted:  # a log that does not print its LR
            plain, bare = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
            lr0 = np.full(n, math.nan)
            groups = np.zeros(n, dtype=int)
        elif table is not None:  # one LR a group, all floats
            plain = np.asarray(((table >= 0) & (table < _INF)).all(axis=1))
            bare = np.zeros(n, dtype=bool)
            lr0 = table[:, 0]
            groups = np.full(n, table.shape[1])
        else:
            plain = np.array([e.kind == "step" and _plain(f) for e, f in zip(events, fields, strict=True)])
            bare = np.array([e.kind == "step" and _bare(f) for e, f in zip(events, fields, strict=True)])
            lr0 = np.array([lr[0] if ok else math.nan for lr, ok in zip(lrs, plain, strict=True)])
            groups = np.array([len(lr) if ok else 0 for lr, ok in zip(lrs, plain, strict=True)])
        return cls(fields, lrs, lr0, groups, plain, bare)


class LrScheduleDrift(Detector):
    """Compares each step's LR per param group with the declared (or inferred) schedule."""

    kind = "lr_schedule_drift"
    config_class = LrScheduleDriftConfig
    order = 20
    priority = 110
    plots = ("lr",)
    localised = False
    consumes = frozenset(("run_start", "resume", "run_end", "step"))

    def __init__(self, config: LrScheduleDriftConfig) -> None:
        self.config = config
        self._schedule: Schedule | None = None
        self._opaque = False  # a scheduler whose schedule was not declared: its shape is its own business
        # A schedule read off the watched scheduler counts scheduler steps; it is in optimizer steps only
        # when the scheduler steps with the optimizer ("step"), not once per epoch ("sparse"; None: not known yet).
        self._cadence: str | None = "step"
        self._last_logged: int | None = None
        self._counted = False  # a step of this attempt reported its scheduler steps
        self._accum = 1
        self._step_base = 0
        self._warmup_offset = 0
        self._world = 1
        self._planned: int | None = None
        self._ratios: list[float] | None = None
        self._recent: collections.deque[tuple[int, tuple[float, ...]]] = collections.deque(maxlen=config.history)
        self._res = _Resolution(config.quantum_min_values)
        self._bad = 0
        self._bad_since: int | None = None  # first step of the current off-schedule run
        self._good = 0
        self._open = False
        self._open_diag: str | None = None
        self._open_extra: dict[str, Any] = {}
        self._ep_first = 0  # the open anomaly: first off step, off steps, last off step and what it was
        self._ep_bad = 0
        self._ep_last: tuple[int, dict[str, Any]] | None = None
        self._reported: tuple[int, float | None] = (0, None)  # step and magnitude last reported
        self._run_first: int | None = None  # first step of the run (a new attempt at or before it is a fresh start)
        self._skipped = 0
        self._attempt_first: int | None = None  # first step of the latest resumed attempt
        self._attempt_points = 0  # steps logged in the current attempt
        self._awaiting_first = False
        self._resume_next: int | None = None  # checkpoint step + 1 of the latest resume
        self._first_seen: int | None = None  # the first step logged after it
        self._resumed = False
        self._multi = 0  # consecutive steps with scheduler_steps > 1
        self._sched_steps: int | None = None
        # inferred mode
        self._n = 0
        self._prev: float | None = None
        self._peak_done = False
        self._fell = False  # the LR went down since the peak (a rise before that is more warmup)
        self._stepwise = False  # the last decrease was a step down after a held level (StepLR, plateau)
        self._changed_at = 0  # the logged point at which the LR last changed
        self._fall_from: float | None = None  # the LR before the last decrease, when that cut it by half or more
        self._rise_from = 0.0  # where the current rise above the floor started from (the fall's top, if any)
        self._equal_run = 0
        self._floor: float | None = None  # lowest LR since the peak
        self._decreases = 0  # consecutive decreasing points, counted up to 3 (whether 2 or more is what is read)
        self._decaying = False  # a decay was under way when the LR last changed
        self._flat_since: int | None = None
        self._flat_next: int | None = None  # the first step of the flat run after flat_since
        self._level = 1  # steps the previous LR level lasted (a rounded LR moves in levels)
        self._peak = 0.0
        self._peak_step = 0
        self._decay: list[tuple[int, float]] = []  # change points since the peak (decimated, bounded)

    # -- events ------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            return self._on_step(event.fields)
        if kind == "run_start":
            self._start(event.fields)
        elif kind == "resume":
            self._attempt_first = self._resume_next = int(event.fields["step"]) + 1
            self._resumed = True
        elif kind == "run_end" and self._open and self._ep_last is not None and self._ep_last[0] > self._reported[0]:
            return [self._report(*self._ep_last)]  # the extent it reached when the attempt ended
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event, runs of steps with nothing to find taken at once (:meth:`_take`).

        Most steps of a long log are one of three kinds, each with nothing to find where an inferred schedule is
        past its peak with nothing open, and each leaving little to keep: a step of the LR's decay (below the one
        before and not the same value; what :meth:`_check_inferred` keeps is the count, the last steps and the
        decay's change points), a step at the same LR as the one before (a constant LR, a printed one held at its
        rounding, where no frozen LR can be called), and a step with no LR at all (the logs that do not print it).
        Before the peak, a warmup's steps (each above the one before and not the same value) find nothing either,
        and leave the count, the last steps and the peak (D_w1m's 20,000 went through :meth:`observe` one by one).
        One look at the batch's LR column finds the runs of each (:class:`_Columns`); a run that starts where its
        kind has nothing to find updates the state in one go, every other event goes through :meth:`observe`."""
        cols = _Columns.read(events)
        if cols is None:
            out.extend(map(self.observe, events, attempts))
            return

        def take(i: int) -> int:
            kind = self._quiet(cols, i)
            if not kind:
                return i
            ends = cols.ends(kind)
            j = ends[bisect.bisect_right(ends, i)]
            if j - i < _RUN_MIN:
                return i
            self._take(kind, cols, i, j)
            return j

        observe_runs(self.observe, events, attempts, out, take)

    def _quiet(self, cols: _Columns, i: int) -> int:
        """The kind of run (``_FALL``, ``_HOLD``, ``_BARE``, ``_RISE``) event ``i`` starts with nothing to find from
        the state here, 0 when it must go through :meth:`observe`."""
        if cols.bare[i]:
            return _BARE if not self._awaiting_first and self._run_first is not None else 0
        if not cols.plain[i]:
            return 0
        lr, prev, floor, ratios = cols.lr0[i].item(), self._prev, self._floor, self._ratios
        if not (
            self._schedule is None
            and not self._opaque
            and not self._awaiting_first
            and not self._open
            and self._n + 1 >= self.config.infer_points
            and self._run_first is not None
            and ratios is not None
            and len(ratios) == cols.groups[i]
            and prev is not None
        ):
            return 0
        if not self._peak_done:  # a rise to a new peak is more warmup (but where one point makes the peak)
            rise = lr >= self._peak and lr > prev and not _same(lr, prev) and self.config.infer_points > 1
            return _RISE if rise else 0
        if floor is None or lr > floor:
            return 0
        if lr == prev:  # held: no frozen LR can be called (never decayed, a stepwise decay, or no planned length)
            return _HOLD if not (self._decaying and not self._stepwise and self._planned) else 0
        if self._fell and self._decreases >= 3 and self._changed_at == self._n and lr < prev and not _same(lr, prev):
            return _FALL  # one more point of a decay under way
        return 0

    def _take(self, kind: int, cols: _Columns, i: int, j: int) -> None:
        """The state after the steps ``i`` to ``j - 1``, a run of ``kind`` that :meth:`_quiet` found quiet from its
        first: what :meth:`_on_step` and :meth:`_check_inferred` leave, nothing found at any of them. Only the steps
        kept are read: the last ones, and the decay's change points that survive its halvings."""
        fields, lr0 = cols.fields, cols.lr0
        k = j - i
        self._attempt_points += k
        self._sched_steps = None
        self._multi = 0
        last = self._last_logged = fields[j - 1]["step"]
        if kind == _BARE:
            return
        res = self._res
        if lr0[i:j].min() < res.inert_from:
            for lr in dict.fromkeys(lr0[i:j].tolist()):  # adding a value again changes nothing
                if lr < res.inert_from:
                    res.add(lr)
        lrs = cols.lrs
        self._recent.extend((fields[x]["step"], tuple(lrs[x])) for x in range(max(i, j - self.config.history), j))
        self._bad = 0
        if kind == _HOLD:
            if self._equal_run == 0:
                self._flat_next = fields[i]["step"]
            self._equal_run += k
            self._n += k
            return
        if kind == _RISE:  # each step a change, and the peak
            self._equal_run = self._decreases = 0
            self._decaying = False
            self._prev = self._peak = lr0[j - 1].item()
            self._peak_step = last
            self._n += k
            if k > 1:
                self._flat_since = fields[j - 2]["step"]
            self._changed(self._n, last)
            return
        if k > 1:  # the steps before the last one: each a change at the point after the one before
            self._prev = lr0[j - 2].item()
            self._n += k - 1
            self._changed_at = self._n
            self._flat_since = fields[j - 2]["step"]
        prev = self._prev
        assert prev is not None
        lr = self._prev = self._floor = lr0[j - 1].item()
        n = self._n = self._n + 1
        self._lowered(n, lr, prev)
        self._changed(n, last)
        self._extend_decay(range(i, j))  # each point as its index here, the ones kept then read
        kept: list[Any] = self._decay
        self._decay = [(fields[x]["step"], lr0[x].item()) if type(x) is int else x for x in kept]

    def _on_step(self, f: dict[str, Any]) -> list[Finding]:
        step = f["step"]
        if self._awaiting_first:
            self._awaiting_first = False
            self._first_seen = step
            if self._run_first is not None and step <= self._run_first and self._resume_next is None:
                self._fresh_start()  # the run started over from its beginning: so does its schedule
            else:
                self._resumed = True
                if self._attempt_first is None:
                    self._attempt_first = step
                self._rewind(step)
        if self._run_first is None:
            self._run_first = step
        self._attempt_points += 1
        out: list[Finding] = []
        sched_steps = f.get("scheduler_steps")
        self._sched_steps = sched_steps
        last, self._last_logged = self._last_logged, step
        skipped = f.get("skipped")
        if sched_steps is None:
            multi_run = self._multi = 0
        else:
            # a loop that logs every k-th step steps its scheduler k times between two logged steps
            gap = step - last if last is not None and step > last else 1
            multi_run = self._multi = self._multi + 1 if sched_steps > gap else 0
            if self._cadence is None and not skipped:
                if sched_steps and not self._counted:
                    self._cadence = "step"  # stepped with the first counted step: the schedule is in steps
                elif sched_steps:
                    # First stepped after optimizer steps without: once per epoch (or every N steps). The
                    # schedule read off it counts epochs, so the scheduler owns the LR's shape from here.
                    self._cadence, self._schedule, self._opaque = "sparse", None, True
                self._counted = True
        lrs = f.get("lr")
        if not lrs:
            return out
        lrs_t = tuple(lrs)  # floats already: an Event's float lists are decoded (wire.Event)
        for x in lrs_t:
            if not 0 <= x < _INF:  # (NaN too)
                return out
        lr = lrs_t[0]
        res = self._res
        if lr < res.inert_from:
            res.add(lr)
        self._recent.append((step, lrs_t))
        # what is off at this step (None: nothing)
        worst: dict[str, Any] | None
        if self._schedule is not None:
            # not stepped yet (per epoch, or never): nothing to compare until it is
            worst = None if self._cadence is None else self._check_declared(step, lrs_t)
        elif self._opaque:
            worst = None
        else:
            worst = self._check_inferred(step, lr)
            ratios = self._ratios
            if ratios is None or len(ratios) != len(lrs_t):
                self._learn_ratios(lrs_t)
        if skipped:
            self._skipped += 1  # from the next step on, the LR may lag by one more step
        cfg = self.config
        multi = multi_run >= cfg.scheduler_steps_min
        if multi and worst is None:
            worst = {"group": 0, "actual": lr}
        if worst is not None:
            bad = self._bad = self._bad + 1
            self._good = 0
            if bad == 1:
                self._bad_since = step
            if self._open:
                self._ep_bad += 1
                self._ep_last = (step, worst)
                if self._update_due(step, worst):
                    out.append(self._report(step, worst))
            elif bad >= cfg.min_steps or multi:
                out.append(self._fire(step, worst))
        else:
            self._bad = 0
            if self._open:
                self._good += 1
                if self._good >= cfg.resolve_after:
                    out += self._resolve(step, lrs_t)
        return out

    def _start(self, f: dict[str, Any]) -> None:
        raw = f.get("schedule")
        if raw is None and isinstance(f.get("config"), dict):
            raw = f["config"].get("declared_schedule")  # what an imported log's own header declares
        if isinstance(raw, dict):
            try:
                self._schedule = Schedule.from_dict(raw)
            except (TypeError, ValueError):
                self._schedule = None
        # CyclicLR, warm restarts, ReduceLROnPlateau, a LambdaLR of the user's: rises and plateaus are
        # what they do, so the shape rules of an inferred schedule would only cry wolf.
        self._opaque = self._schedule is None and bool(f.get("scheduler"))
        read_off = self._schedule is not None and f.get("schedule_source") == "scheduler"
        self._cadence = None if read_off else "step"
        self._counted = False
        self._last_logged = None
        config = f.get("config") if isinstance(f.get("config"), dict) else {}
        # a log that counts its steps from 1 (llm.c's stdout prints step + 1) logs lr(N - 1) at step N
        self._step_base = int(config.get("step_base") or 0)
        # how a printed LR relates to its step in warmup (the importer says: llm.c's warmup counts the step
        # being taken, max_lr * (step + 1) / warmup); without it every llm.c run was "1.0% off, an off-by-one"
        self._warmup_offset = int(config.get("lr_warmup_offset") or 0)
        self._accum = int(f.get("accum_steps") or self._accum or 1)
        self._world = int(f.get("world_size") or self._world or 1)
        self._planned = f.get("planned_steps") or self._planned
        if f.get("resumed") or self._run_first is not None:
            # Every attempt after the first is a resume, whether or not the trainer says so (a trainer
            # using only what the Quick start shows sends no resume event): its first step is where a
            # scheduler that was not restored starts its warmup again. Decided at that first step.
            self._attempt_first = self._resume_next = self._first_seen = None
            self._awaiting_first = True
            self._attempt_points = 0
        self._bad = 0

    def _fresh_start(self) -> None:
        """A new attempt from the run's first step: the inferred schedule is learnt again."""
        self._resumed = False
        self._attempt_first = None
        self._n = self._equal_run = self._decreases = 0
        self._prev = self._floor = self._flat_since = self._flat_next = None
        self._peak_done = self._decaying = self._fell = False
        self._stepwise = False
        self._changed_at = 0
        self._fall_from = None
        self._rise_from = 0.0
        self._peak, self._peak_step, self._level = 0.0, 0, 1
        self._decay = []

    def _rewind(self, step: int) -> None:
        """A resume from a checkpoint older than the last logged step logs those steps again, and a restored
        scheduler gives them the LRs they had the first time: above the floor the decay reached since. The
        inferred decay goes back to where it stood at that step (an unrestored scheduler's warmup still climbs
        past it)."""
        if not self._recent or step > self._recent[-1][0] or not self._peak_done:
            return
        self._decay = [(s, v) for s, v in self._decay if s <= step]
        level = self._decay[-1][1] if self._decay else self._peak
        self._floor = self._prev = level

    # -- declared schedule ---------------------------------------------------------------------

    def _learn_ratios(self, lrs: tuple[float, ...]) -> None:
        if lrs[0] > 0:
            self._ratios = [x / lrs[0] for x in lrs]

    def _expected(self, step: int) -> float:
        assert self._schedule is not None
        return _lr_at(self._schedule, step - self._step_base, self._warmup_offset)

    def _check_declared(self, step: int, lrs: tuple[float, ...]) -> dict[str, Any] | None:
        """The group furthest off the schedule, when one is more than ``rel_tol`` off (None: on schedule)."""
        sched = self._schedule
        assert sched is not None
        if self._ratios is None or len(self._ratios) != len(lrs):
            self._learn_ratios(lrs)
        ratios = self._ratios or [1.0] * len(lrs)
        floor = sched.peak_lr * 1e-3
        tol = self.config.rel_tol
        want = self._expected(step)
        lagged = self._expected(max(0, step - self._skipped)) if self._skipped else None
        worst: dict[str, Any] = {}
        worst_err = 0.0
        for g, (actual, ratio) in enumerate(zip(lrs, ratios, strict=False)):
            half = self._res.quantum(actual) / 2  # a printed LR may sit half a quantum off
            err = _rel(actual, want * ratio, floor * ratio, half)
            if lagged is not None:
                err = min(err, _rel(actual, lagged * ratio, floor * ratio, half))
            if err > worst_err:
                worst_err = err
                worst = {"group": g, "actual": actual, "expected": want * ratio, "rel_err": round(err, 6)}
        return worst if worst_err > tol else None

    # -- inferred schedule ---------------------------------------------------------------------

    def _check_inferred(self, step: int, lr: float) -> dict[str, Any] | None:
        """Warmup (rising), then never rising again; frozen mid-decay when the length is known. What is off
        (None: nothing). Runs on every logged step of a log without a declared schedule, so each piece of
        state is read once."""
        cfg = self.config
        prev = self._prev
        self._prev = lr
        n = self._n = self._n + 1
        if prev is None:
            self._flat_since = step
            self._peak, self._peak_step = lr, step
            return None
        same = _same(lr, prev)  # every LR here was checked non-negative (-0.0 is below 1e-30 either way)
        lower = lr < prev
        peak_done = self._peak_done
        if same:
            equal_run = self._equal_run = self._equal_run + 1
            if equal_run == 1:
                self._flat_next = step
        else:
            equal_run = self._equal_run = 0
            if lower:  # held for 3+ logged points, then down by a large fraction: a step schedule
                decreases = self._decreases
                if decreases < 3:  # counted no further: from 3 on (only a rise resets it) _decaying stays True
                    self._decaying = decreases >= 2
                    self._decreases = decreases + 1
                self._lowered(n, lr, prev)
            else:
                self._decaying = False
                self._decreases = 0
            self._changed(n, step)
        done_here = not peak_done and ((lower and not same) or equal_run >= cfg.infer_points - 1)
        if lower and (done_here or (peak_done and not same)):
            # down after the peak (or at it): the decay's change points, for the shape check, halved when too many
            self._fell = True
            self._extend_decay(((step, lr),))
        if not peak_done:
            if lr >= self._peak:
                self._peak, self._peak_step = lr, step
            if done_here:
                self._peak_done = True
                self._floor = lr
            return None
        if lr > prev and not self._fell:  # a level held, then higher (ConstantLR, a stepped warmup): still warmup
            self._peak_done = False
            self._peak, self._peak_step = lr, step
            return None
        floor = self._floor
        if n < cfg.infer_points:
            self._floor = lr if floor is None or lr < floor else floor
            return None
        if floor is None:
            floor = lr
        # The quantum (>= 0) only raises the bar: below the bar without it, the LR is below it with it.
        above = floor * (1 + cfg.rel_tol)
        if lr > above and lr > self._peak * 1e-6 and lr > (above := above + self._res.quantum(lr)):
            if prev <= above:  # the rise starts here: from the floor of a decay, or from the middle of one
                jump = self._fall_from is not None or lr >= 1.3 * prev
                self._rise_from = max(prev, self._fall_from or 0.0) if jump else 0.0
            return {
                "group": 0,
                "actual": lr,
                "expected_max": floor,
                "rule": "rise_after_peak",
                "rise_from": self._rise_from,
            }
        self._floor = lr if lr < floor else floor
        if (
            same
            and self._decaying
            and not self._stepwise  # a smooth decay, not a stepwise one
            and self._planned
            and self._flat_since is not None
            and step - self._flat_since >= cfg.frozen_steps
            and step - self._flat_since >= cfg.frozen_level_ratio * self._level  # longer than rounding explains
            and step < 0.95 * self._planned
        ):
            return {"group": 0, "actual": lr, "flat_since": self._flat_since, "rule": "frozen"}
        return None

    def _lowered(self, n: int, lr: float, prev: float) -> None:
        """The LR went down to ``lr`` from ``prev`` at logged point ``n``: held for 3+ points, then down by a large
        fraction, it is a step schedule; down by half or more, a rise after it is measured from ``prev``."""
        self._stepwise = n - self._changed_at >= 3 and 1.0 - lr / prev > self.config.frozen_max_drop
        self._fall_from = prev if lr <= 0.5 * prev else None

    def _changed(self, n: int, step: int) -> None:
        """The LR changed at logged point ``n`` (``step``): the level it leaves lasted since the last change."""
        self._changed_at = n
        flat_since = self._flat_since
        if flat_since is not None:
            self._level = step - flat_since
        self._flat_since = step

    def _extend_decay(self, points: Sequence[Any]) -> None:
        """The decay's change points ``points`` appended in order, halved (every other one kept) each time there are
        more than ``_DECAY_KEPT``: its shape at a bounded cost."""
        decay, at = self._decay, 0
        while at < len(points):
            room = _DECAY_KEPT + 1 - len(decay)
            decay.extend(points[at : at + room])
            at += room
            if len(decay) > _DECAY_KEPT:
                decay = decay[::2]
        self._decay = decay

    def _ended_early(self, end: int, lr: float) -> dict[str, Any] | None:
        """The flat LR is the floor of a complete standard decay that ended at ``end``, not a freeze.

        A frozen scheduler stops the LR wherever it was, mid-slope; a schedule sized for fewer
        steps (or stepped several times per step) reaches its floor along the whole decay shape:
        a cosine flattens into it. A linear decay ends abruptly either way, so it counts only
        when the floor is a round fraction of the peak, as configured floors are.
        """
        p0, peak = self._peak_step, self._peak
        pts = [(s, v) for s, v in self._decay if s < end]
        if end - p0 < 3 or len(pts) < 3 or not peak > lr or not self._planned:
            return None
        lo = lr / peak
        tol = self.config.rel_tol
        for shape, g in _SHAPES:
            if shape == "linear" and not any(abs(lo - r) <= 1e-3 for r in _ROUND_FLOORS):
                continue
            fits = True
            for s, v in pts:
                model = lr + (peak - lr) * g((s - p0) / (end - p0))
                if abs(v - model) > tol * max(model, 0.1 * peak) + self._res.quantum(v):
                    fits = False
                    break
            if fits:
                return {"shape": shape, "floor_step": end, "speedup": round(self._planned / end, 1)}
        return None

    # -- findings ------------------------------------------------------------------------------

    def _fire(self, step: int, worst: dict[str, Any]) -> Finding:
        # The diagnosis is made once, when the anomaly opens, from the first off-schedule steps
        # (later, a compressed or shifted schedule sits on its floor and looks like anything);
        # it costs a few thousand schedule evaluations, so a drift lasting the whole run stays cheap.
        diag, extra = self._diagnose(step, worst)
        self._open = True
        self._open_diag, self._open_extra = diag, extra
        self._good = 0
        # the anomaly starts at the first step that was off, not at the step that confirmed it
        if self._multi >= self.config.scheduler_steps_min and diag == "per_microbatch" and "expected" not in worst:
            self._ep_first = step - self._multi + 1
        elif worst.get("rule") == "frozen":
            self._ep_first = self._flat_next if self._flat_next is not None else step
        else:
            self._ep_first = self._bad_since if self._bad_since is not None else step
        self._ep_bad = self._bad if worst.get("rule") != "frozen" else 0
        self._ep_last = (step, worst)
        self._reported = (step, self._magnitude(worst))
        return self._finding(self._ep_first, step, diag, worst, extra)

    @staticmethod
    def _magnitude(worst: dict[str, Any]) -> float | None:
        """How far off the LR is, as a ratio (None for a frozen LR: its extent is what grows)."""
        if "rel_err" in worst:
            return 1.0 + float(worst["rel_err"])
        if worst.get("expected_max"):
            return float(worst["actual"]) / float(worst["expected_max"])
        return None

    def _update_due(self, step: int, worst: dict[str, Any]) -> bool:
        cfg = self.config
        last_step, last_mag = self._reported
        mag = self._magnitude(worst)
        moved = mag is not None and last_mag is not None and abs(math.log(mag / last_mag)) >= math.log(cfg.update_ratio)
        return moved or step - last_step >= cfg.update_every

    def _report(self, step: int, worst: dict[str, Any]) -> Finding:
        """The open anomaly restated as it stands now: magnitude, extent, last off step."""
        assert self._open_diag is not None
        self._reported = (step, self._magnitude(worst))
        return self._finding(step, step, self._open_diag, worst, self._open_extra)

    def _resolve(self, step: int, lrs: tuple[float, ...]) -> list[Finding]:
        out = []
        if self._ep_last is not None and self._ep_last[0] > self._reported[0]:
            out.append(self._report(*self._ep_last))  # the extent it reached, before it closes
        self._open = False
        diag = self._open_diag
        self._open_diag = None
        if self._schedule is None:
            self._floor = lrs[0]  # the rise is over: the LR decays again from here
        out.append(
            self.resolve(
                step,
                f"LR back on schedule at step {step} (group 0: {_fmt(lrs[0])})",
                "The LR follows the schedule again; the steps in between trained at the wrong LR.",
                {"step": step, "lr": list(lrs), "diagnosis": diag},
            )
        )
        return out

    def _bad_obs(self, group: int) -> list[tuple[int, float]]:
        n = max(self.config.min_steps, min(self._bad, len(self._recent)))
        pts = list(self._recent)[-n:]
        return [(s, lrs[group]) for s, lrs in pts if group < len(lrs)]

    def _fits(self, obs: list[tuple[int, float]], fn: Callable[[int], float | None]) -> float | None:
        """Worst relative error of ``fn`` over ``obs``, or None when it does not fit within tolerance."""
        sched = self._schedule
        floor = (sched.peak_lr if sched else max(a for _, a in obs) or 1.0) * 1e-3
        worst = 0.0
        for s, a in obs:
            want = fn(s)
            if want is None:
                return None
            err = _rel(a, want, floor)
            if err > self.config.rel_tol:
                return None
            worst = max(worst, err)
        return worst

    def _diagnose(self, step: int, worst: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if self._multi >= self.config.scheduler_steps_min:
            return "per_microbatch", {"scheduler_steps": self._sched_steps, "accum_steps": self._accum}
        if self._schedule is None:
            if worst.get("rule") == "frozen":
                ended = self._ended_early(int(worst["flat_since"]), float(worst["actual"]))
                if ended is not None:
                    return "too_fast", {"inferred": True, **ended}
                return "frozen", {"inferred": True}
            if self._restarted_here():
                return "restarted", {"inferred": True, "restart_step": self._attempt_first}
            if worst.get("rise_from", 0.0) >= self.config.reset_min_level * self._peak:
                return "reset", {"inferred": True, "peak": self._peak}
            return "rise", {"inferred": True}
        group = int(worst.get("group", 0))
        ratios = self._ratios or [1.0]
        ratio = ratios[group] if group < len(ratios) else 1.0
        if group != 0 and self._fits(self._bad_obs(0), self._expected) is not None:
            return "group", {"group": group}
        obs = [(s, a / ratio) for s, a in self._bad_obs(group)]
        sched = self._schedule
        if self._sched_steps == 0:
            return "frozen", {"scheduler_steps": 0}
        values = [a for _, a in obs]
        wants = [self._expected(s) for s, _ in obs]
        if len(obs) >= 2 and max(values) - min(values) <= _SAME * max(values) and max(wants) - min(wants) > 0:
            if abs(values[-1] - sched.peak_lr * sched.min_ratio) <= self.config.rel_tol * sched.peak_lr:
                total = self._estimate_total(obs)
                return "wrong_length", {"estimated_total_steps": total, "floor_reached": True}
            return "frozen", {"frozen_lr": values[-1]}
        first_bad = obs[0][0]
        lo = max(self._attempt_first or 0, first_bad - 64)
        for m in sorted({self._accum, self._world} - {0, 1}):
            for k in range(first_bad, lo - 1, -1):
                for off in (m - 1, 0):
                    fn = lambda s, k=k, m=m, off=off: self._expected(k + (s - k) * m + off)  # noqa: E731
                    if self._fits(obs, fn) is not None:
                        return ("per_microbatch" if m == self._accum else "per_process"), {"factor": m, "since": k}
        if self._resume_next is not None and self._first_seen is not None and self._first_seen != self._resume_next:
            d = self._resume_next - self._first_seen
            if self._fits(obs, lambda s, d=d: self._expected(max(0, s + d))) is not None:
                return "step_offset", {"shift_steps": d, "first_step": self._first_seen}
        if self._restarted_here():
            r0 = self._attempt_first
            for r in (r0, r0 - 1, r0 + 1):
                fn = lambda s, r=r: sched.lr(s - r) if s >= r else None  # noqa: E731
                if self._fits(obs, fn) is not None:
                    return "restarted", {"restart_step": r}
        total = self._estimate_total(obs)
        if total is not None:
            return "wrong_length", {"estimated_total_steps": total}
        for d in (1, -1, 2, -2, 3, -3, 4, -4, 8, -8):
            if self._fits(obs, lambda s, d=d: self._expected(max(0, s + d))) is not None:
                return "shifted", {"shift_steps": d}
        factors = [a / w for (_, a), w in zip(obs, wants, strict=True) if w > 0]
        if factors and max(factors) - min(factors) <= self.config.rel_tol * max(factors):
            return "scaled", {"factor": round(factors[-1], 4)}
        return "unknown", {}

    def _restarted_here(self) -> bool:
        """The LR went wrong within the first logged steps of a resumed attempt."""
        return (
            self._resumed
            and self._attempt_first is not None
            and self._bad_since is not None
            and self._attempt_points - self._bad <= self.config.restart_points
        )

    def _estimate_total(self, obs: list[tuple[int, float]]) -> int | None:
        """The ``total_steps`` the scheduler seems built for (same shape, warmup and floor)."""
        sched = self._schedule
        if sched is None or sched.name == "constant":
            return None
        n = sched.total_steps
        cands = {round(n * 2 ** (k / 16)) for k in range(-64, 65)}
        cands |= {n // d for d in range(2, 17)} | {n * d for d in range(2, 17)}
        if self._planned:
            cands.add(int(self._planned))
        cands = {c for c in cands if c >= 1 and c != n}

        def build(t: int) -> Callable[[int], float]:
            built = Schedule(
                sched.name, sched.peak_lr, t, min(sched.warmup_steps, t), sched.min_ratio, sched.decay_fraction
            )
            return lambda s: _lr_at(built, s - self._step_base, self._warmup_offset)

        scored = []
        for t in cands:
            err = self._fits(obs, build(t))
            if err is not None:
                scored.append((err, abs(t - n), t))
        if not scored:
            return None
        best = min(scored)[2]
        # refine around the best candidate (the grid is ~4% apart)
        span = max(1, best // 20)
        fine = []
        for t in range(max(1, best - span), best + span + 1):
            if t == n:
                continue
            err = self._fits(obs, build(t))
            if err is not None:
                fine.append((err, t))
        return min(fine)[1] if fine else best

    def _finding(self, at: int, step: int, diag: str, worst: dict[str, Any], extra: dict[str, Any]) -> Finding:
        """The anomaly as it stands at ``step`` (``at`` is the finding's step: the first off step when it opens)."""
        sched = self._schedule
        group = int(worst.get("group", 0))
        actual = worst.get("actual")
        source = "declared" if sched is not None else "inferred"
        frozen = worst.get("rule") == "frozen"
        off = step - int(worst["flat_since"]) if frozen else self._ep_bad
        evidence: dict[str, Any] = {
            "step": step,
            "first_step": self._ep_first,
            "schedule": source,
            "diagnosis": diag,
            "off_schedule_steps": off,
            **{k: v for k, v in worst.items() if k != "rule"},
            **extra,
        }
        if sched is not None:
            evidence["schedule_name"] = sched.name
            evidence["total_steps"] = sched.total_steps
        since = f"since step {self._ep_first}"
        inferred = "schedule inferred from the first steps: none was declared"
        if diag == "per_microbatch" and "expected" not in worst and "expected_max" not in worst:
            what = (
                f"scheduler.step() ran {self._sched_steps} times in optimizer step {step} (1 expected), "
                f"for {self._multi} steps"
            )
        elif sched is not None:
            what = (
                f"LR of param group {group} is {_fmt(actual)} at step {step}, the declared {sched.name} schedule "
                f"expects {_fmt(worst.get('expected', float('nan')))} ({_off(actual, worst.get('expected'))}); "
                f"off schedule for {off} steps {since}"
            )
        elif diag == "too_fast":
            what = (
                f"LR reached its floor {_fmt(actual)} at step {extra['floor_step']} of {self._planned} planned and "
                f"has stayed there for {off} steps (step {step}): a complete {extra['shape']} decay, ~"
                f"{extra['speedup']}x faster than the run ({inferred})"
            )
        elif diag == "reset":
            what = (
                f"LR jumped back up from {_fmt(worst['rise_from'])} ({worst['rise_from'] / extra['peak']:.0%} of its "
                f"peak {_fmt(extra['peak'])}, mid-decay) at step {self._ep_first}: the schedule restarted; "
                f"{_fmt(actual)} at step {step}, above the decay for {off} steps ({inferred})"
            )
        elif frozen:
            what = (
                f"LR has stayed at {_fmt(actual)} since step {worst.get('flat_since')} after decaying, {off} steps "
                f"at step {step} ({inferred})"
            )
        else:
            what = (
                f"LR rose to {_fmt(actual)} at step {step} after decaying to {_fmt(worst.get('expected_max', 0.0))}, "
                f"above it for {off} steps {since} ({inferred})"
            )
        hint = _HINTS[diag](self, extra, group)
        if source == "inferred":
            hint += " (No schedule was declared; declare it in run_start for exact checks.)"
        # An LR rising after a decay, with nothing declared and no resume there, is what warm restarts and
        # cyclic schedules do by design: a note, unless the user tells trainmon the schedule.
        severity = "info" if diag == "rise" else "warning"
        return Finding(kind=self.kind, severity=severity, step=at, message=what, hint=hint, evidence=evidence)


def _lr_at(schedule: Schedule, s: int, warmup_offset: int) -> float:
    """The LR optimizer step ``s`` (0-based) ran at, in the trainer's own warmup convention: the
    warmup of a trainer that counts the step being taken is ``warmup_offset`` steps ahead of the
    torch convention (``step / warmup``); its decay is not."""
    if warmup_offset and 0 <= s < schedule.warmup_steps:
        return schedule.lr(min(s + warmup_offset, schedule.warmup_steps))
    return schedule.lr(s)


def _off(actual: float | None, expected: float | None) -> str:
    """How far ``actual`` is from ``expected``, recomputed from the two numbers the message prints
    (as printed, 3 significant digits): a percentage while they are within 2x of each other, a
    ratio beyond ("8,935x the expected", not "30192.6% off", which came from an error floored for
    the tolerance and matched neither number)."""
    if actual is None or expected is None or not (math.isfinite(actual) and math.isfinite(expected)):
        return "? off"
    a, e = float(_fmt(actual)), float(_fmt(expected))
    if e == 0:
        return "expected 0" if a == 0 else "where 0 is expected"
    ratio = a / e
    if ratio <= 0:
        return "the opposite sign"
    if ratio >= 2:
        return f"{fmt(ratio, 3)}x the expected"
    if ratio <= 0.5:
        return f"1/{fmt(1 / ratio, 3)} of the expected"
    return f"{100 * (ratio - 1):+.1f}% off"


def _hint_group(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"Param group {group} diverges from the others (group 0 still follows the schedule): its LR "
        "is set or scheduled separately. Check that the scheduler was built on this optimizer after "
        "all groups were added (scheduler.optimizer.param_groups is optimizer.param_groups), and "
        "any per-group LR override or an optimizer state loaded with a different initial_lr."
    )


def _hint_microbatch(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    m = extra.get("factor") or extra.get("scheduler_steps") or det._accum
    since = f" since step {extra['since']}" if "since" in extra else ""
    return (
        f"The LR follows the schedule {m}x too fast{since}: the scheduler is stepped once per "
        f"micro-batch (accum_steps = {det._accum}), so warmup and decay are compressed by the "
        "accumulation factor. Move scheduler.step() out of the micro-batch loop, next to optimizer.step()."
    )


def _hint_process(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"The LR follows the schedule {extra.get('factor')}x too fast, once per process "
        f"(world_size = {det._world}): the scheduler is stepped on every rank for the same optimizer "
        "step (accelerate#2926), or sized without the data-parallel factor. Step it once per optimizer step."
    )


def _hint_restarted(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    where = extra.get("restart_step", det._attempt_first)
    return (
        f"The schedule restarted from its beginning at step {where}, where the run resumed: the "
        "scheduler state was not restored (a new scheduler, no scheduler.load_state_dict, or it was "
        "loaded before the optimizer). Check the resume code and the bad_resume anomaly."
    )


def _hint_reset(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"The LR went back up in the middle of its decay, not from its floor as warm-restart and cyclic schedules "
        f"do: the scheduler was re-created or reset, most often at a resume that did not restore its state (a "
        f"new scheduler, no scheduler.load_state_dict). Check the resume code around step {det._ep_first}; the "
        f"steps since ran at a higher LR than planned."
    )


def _hint_rise(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        "The LR went up again after decaying: warm restarts (CosineAnnealingWarmRestarts, HF "
        "cosine_with_restarts) and cyclic schedules do this by design; otherwise a scheduler rebuilt or reset "
        "mid-run, or a manual LR override. Pass the scheduler to watch() or declare the schedule for an exact "
        "check."
    )


def _hint_frozen(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        "The LR stopped changing while the schedule still moves: scheduler.step() is no longer called "
        "(skipped in a branch, or the scheduler drives a detached copy of the optimizer's param groups), "
        "or the scheduler was not restored on resume (DeepSpeed#4344). Check that scheduler.step() runs every step."
    )


def _hint_length(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    total = extra.get("estimated_total_steps")
    declared = det._schedule.total_steps if det._schedule else None
    est = f"~{total} steps" if total else "a shorter length"
    return (
        f"The LR matches the same schedule sized for {est} instead of the declared {declared}: the "
        "scheduler was built with the wrong total (len(loader) without accumulation or world size, a "
        "stale max_steps, or stepped num_processes times). The LR will hit its floor early. Check num_training_steps."
    )


def _hint_shifted(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    d = extra.get("shift_steps")
    return (
        f"The LR is the schedule's value {d:+d} steps away: an off-by-one in the scheduler position "
        "(resume using lr(step+1) as the base, pytorch#60265, or stepping the scheduler before the optimizer)."
    )


def _hint_step_offset(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"The LR is the schedule's value {extra.get('shift_steps')} steps ahead of the logged step: after the "
        f"resume the step counter restarted at {extra.get('first_step')} instead of {det._resume_next} while the "
        "scheduler kept its position. The global step was not restored (see the bad_resume anomaly)."
    )


def _hint_scaled(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"The LR is {extra.get('factor')}x the declared schedule at every step checked: a manual LR "
        "override or multiplier, or the optimizer built with a different base LR than declared. "
        "Check param_group['lr'] assignments and the declared peak_lr."
    )


def _hint_unknown(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        "The LR does not match the declared schedule and no single cause (accumulation, restart, "
        "frozen, length, shift) explains it. Compare the LR curve with the schedule around this step "
        "and check every place that sets param_group['lr'] or steps the scheduler."
    )


def _hint_too_fast(det: LrScheduleDrift, extra: dict[str, Any], group: int) -> str:
    return (
        f"The LR went through its whole {extra.get('shape')} decay by step {extra.get('floor_step')} although the "
        f"run plans {det._planned} steps: the schedule runs ~{extra.get('speedup')}x too fast. Either the "
        f"scheduler was built for ~{extra.get('floor_step')} steps (num_training_steps from len(loader) without "
        "accumulation or world size, a stale max_steps) or it is stepped several times per optimizer step (inside "
        "the micro-batch loop, or on every process). Check num_training_steps and where scheduler.step() is called."
    )


_HINTS: dict[str, Callable[[LrScheduleDrift, dict[str, Any], int], str]] = {
    "too_fast": _hint_too_fast,
    "group": _hint_group,
    "per_microbatch": _hint_microbatch,
    "per_process": _hint_process,
    "restarted": _hint_restarted,
    "reset": _hint_reset,
    "rise": _hint_rise,
    "frozen": _hint_frozen,
    "wrong_length": _hint_length,
    "shifted": _hint_shifted,
    "step_offset": _hint_step_offset,
    "scaled": _hint_scaled,
    "unknown": _hint_unknown,
}
