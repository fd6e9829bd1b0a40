"""Goodput: how much of a run's wall-clock time trained the model, and where the rest went.

Every second from the first attempt's ``run_start`` to the end of the last attempt goes to exactly
one place, read from the lowest rank (in data-parallel training every rank waits for the slowest,
so one rank's clock is the run's):

* ``startup``: from each attempt's ``run_start`` to the start of its first step (imports,
  process groups, model build, checkpoint load).
* ``checkpoint``: the steps' ``checkpoint`` phase, or the checkpoint events' durations when the
  steps carry no phases (and the save after the last step, which no step holds).
* ``eval``: the steps' ``eval`` phase.
* ``data_stall``: the part of a step's excess over the median that its ``data`` phase explains
  (its data time beyond the median data time).
* ``slow_steps``: the rest of the excess: a step's time, net of checkpoint and eval, beyond
  the median step. The median is the run's own, over the last :data:`WINDOW` step intervals
  before the step (a log entry covering n steps is compared with n medians).
* ``hang``: the excess of the steps a ``hang`` anomaly covers, and an attempt's time after its
  last step when it ended (or is) hung.
* ``recomputation``: the work a failure threw away: the time of the steps a later attempt ran
  again (after the checkpoint it resumed from), and a failed attempt's time from its last step to
  the crash. ``recomputed_steps`` counts those steps.
* ``restart``: the gap between a failed attempt's end and the next attempt's ``run_start``.
* ``other``: what none of those explains (shutdown after the last step of a finished attempt,
  the gap before an attempt that followed a finished one).

Productive time is the rest of the steps' time; ``fraction`` is productive over wall time.

One :class:`Ledger` does the accounting for the collector's live exporter (fed each event as it
arrives) and for the post-mortem (fed the stored rows in the same order), so the two report the
same numbers; steps are accounted in batches, so a post-mortem of a million steps costs seconds.
The ledger learns what a failure cost only when the next attempt's first step arrives (it tells
where the resume began): the seconds of the steps after that point move to ``recomputation`` then,
measured from the snapshot the ledger took at the checkpoint the attempt resumed from
(interpolated by step between the nearest snapshots when that checkpoint event is missing).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Connection

from trainmon.clock import aligned
from trainmon.monitor.core.attempts import attempt_failed
from trainmon.monitor.store.event_reads import checkpoint_rows
from trainmon.monitor.store.queries import clock_offsets
from trainmon.monitor.store.step_reads import step_ends, step_timeline

__all__ = ["BATCH", "CAUSES", "CLOCK_KEYS", "MARKS", "WINDOW", "Ledger", "from_store", "hang_open", "headline"]

CAUSES = (
    "startup",
    "checkpoint",
    "eval",
    "data_stall",
    "slow_steps",
    "hang",
    "recomputation",
    "restart",
    "other",
)
"""Badput causes, the keys of ``badput_seconds`` and the ``cause`` label of ``trainmon_badput_seconds``."""

WINDOW = 1001
"""Step intervals the median is taken over: long enough that a sustained slowdown of a few hundred
steps still counts as slow, short enough that a run whose step time changes for good (sequence
length warm-up, a larger batch) stops counting it after a while."""

MIN_BASELINE = 5
"""Step intervals seen before a median is trusted; until then no step counts as slow."""

BATCH = 512
"""Steps buffered before they are accounted (the ledger also accounts them when read): ~50 KB per live
run at most (the collector holds up to 256), large enough that the per-batch numpy work stays cheap."""

OFFLINE_BATCH = 65_536
"""The post-mortem's batch: a few MB of tuples for one run, and the window re-read once per 64k steps
instead of once per 512 (a 1M-step run's ledger went from ~3.4 s to ~1 s)."""

MARKS = 64
"""Checkpoints remembered per attempt as resume points (a resume goes to one of the newest): the
live ledger of a long run stays small."""

# The step-time parts a later resume may reclassify as recomputation (checkpoint and eval time was
# spent on work that was kept or on a save that was resumed from: it stays where it is).
_MOVABLE = ("productive", "data_stall", "slow_steps", "hang")


@dataclass
class _Attempt:
    attempt: int
    start: float
    last_time: float  # its newest event of any kind
    status: str | None = None  # how it ended; None while running
    hung_at_end: bool = False
    first_step: int | None = None
    last_step: int | None = None
    first_row_start: float | None = None
    last_row_time: float | None = None
    pending_checkpoint: float = 0.0  # checkpoint seconds of events after the newest step
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*_MOVABLE, "checkpoint", "eval"), 0.0))
    # (step, seconds of the movable parts up to and including that step): the attempt's start and
    # each checkpoint, where a later attempt may resume
    marks: list[tuple[int, tuple[float, ...]]] = field(default_factory=list)
    recomputation: float = 0.0
    recomputed_steps: int = 0

    def movable(self) -> tuple[float, ...]:
        return tuple(self.seconds[k] for k in _MOVABLE)


def _number(v: Any) -> float:
    """A finite, non-negative float, else NaN (the wire and imported logs may send anything)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return math.nan
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else math.nan


def _columns(rows: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(step, time, step_time, data, checkpoint, eval)`` rows as columns: steps as integers, times as floats,
    durations as :func:`_seconds` makes them.

    One conversion of the whole table where every cell is a number, None (NaN) or SQLite's 'NaN' text, which
    is every stored row (a million steps: 0.3 s against 1.0 s column by column); column by column otherwise."""
    try:
        table = np.array(rows, dtype=float)
    except (TypeError, ValueError, OverflowError):
        cols = list(zip(*rows, strict=True))
        step, t = np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=float)
        step_time, data, ckpt, ev = (_seconds(c) for c in cols[2:6])
        return step, t, step_time, data, ckpt, ev
    durations = table[:, 2:6]
    durations[~np.isfinite(durations) | (durations < 0)] = np.nan
    return table[:, 0].astype(np.int64), table[:, 1], table[:, 2], table[:, 3], table[:, 4], table[:, 5]


def _seconds(values: tuple) -> np.ndarray:
    """Durations as floats: NaN where a value is missing, not a number, negative or infinite."""
    try:
        out = np.array(values, dtype=float)  # floats and None (NaN), and SQLite's 'NaN' text
    except (TypeError, ValueError, OverflowError):
        out = pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(dtype=float, copy=True)
    out[~np.isfinite(out) | (out < 0)] = np.nan
    return out


def _medians_before(history: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of ``values``: the median of the :data:`WINDOW` values before it (``history`` holds
    those that came before the first), NaN until :data:`MIN_BASELINE` non-NaN values were seen."""
    both = pd.Series(np.concatenate((history, values)))
    med = both.rolling(WINDOW, min_periods=MIN_BASELINE).median().to_numpy()
    return np.concatenate(([math.nan], med))[len(history) : len(history) + len(values)]


def hang_open(active: Mapping[tuple[str, str], int]) -> bool:
    """Whether a ``hang`` anomaly is open, from the live counts of open anomalies by (kind, severity)."""
    return any(n > 0 for (kind, _severity), n in active.items() if kind == "hang")


class Ledger:
    """The goodput accounting of one run, fed the lowest rank's events in order.

    Steps are buffered and accounted in batches (numpy, pandas' rolling median) when another kind
    of event comes, when :data:`BATCH` are waiting, or when the result is read: per event the
    collector only appends a tuple, and a post-mortem of a million steps costs a few seconds."""

    def __init__(self, batch: int = BATCH) -> None:
        """``batch``: steps buffered before they are accounted; a post-mortem, which holds no live
        runs, passes a larger one (a window's worth of history is re-read per batch)."""
        self._batch = batch
        self._attempts: list[_Attempt] = []
        self._step_history = np.empty(0)  # net seconds per step of the last WINDOW steps
        self._data_history = np.empty(0)  # data seconds per step of the same steps (NaN: not timed)
        self._rows: list[tuple] = []  # waiting steps: (step, time, step_time, data, checkpoint, eval)
        self._hung: list[bool] = []  # whether each was in a hang
        self._saves: list[tuple[int, int | None, float]] = []  # (steps waiting before it, step, seconds)

    # -- feeding --------------------------------------------------------------------------------

    def observe(self, kind: str, fields: Mapping[str, Any], time: float, attempt: int, hung: bool) -> None:
        """Fold one wire event (the collector's live path); ``hung``: a hang anomaly is open."""
        if kind == "step":
            ph = fields.get("phases")
            ph = ph if isinstance(ph, Mapping) else {}
            self.step(
                attempt,
                fields["step"],
                time,
                fields.get("step_time"),
                ph.get("data"),
                ph.get("checkpoint"),
                ph.get("eval"),
                hung,
            )
        elif kind == "run_start":
            self.start(attempt, time)
        elif kind == "checkpoint":
            self.checkpoint(attempt, fields.get("step"), fields.get("duration"), time)
        elif kind == "run_end":
            self.end(attempt, time, fields.get("status"), hung)
        else:
            self.seen(attempt, time)

    def start(self, attempt: int, time: float) -> None:
        """An attempt's ``run_start``; an attempt still open before it ended silently (lost)."""
        self._flush()
        if self._attempts and attempt <= self._attempts[-1].attempt:
            return  # a replay of an attempt already under way
        if self._attempts and self._attempts[-1].status is None:
            self._attempts[-1].status = "lost"
        self._attempts.append(_Attempt(attempt, time, time))

    def _current(self, attempt: int, time: float) -> _Attempt | None:
        """The attempt an event belongs to: the newest one (created when its ``run_start`` was missed)."""
        if not self._attempts or attempt > self._attempts[-1].attempt:
            self.start(attempt, time)
        a = self._attempts[-1]
        if a.attempt != attempt:
            return None  # an older attempt's late event: its accounting is closed
        a.last_time = max(a.last_time, time)
        return a

    def seen(self, attempt: int, time: float) -> None:
        """Any other event: the attempt was alive then (a silent end is dated by it)."""
        self._current(attempt, time)

    def checkpoint(self, attempt: int, step: Any, duration: Any, time: float) -> None:
        """A checkpoint save: its duration, and a snapshot a later attempt may resume from."""
        if self._current(attempt, time) is not None:
            d = _number(duration)
            self._saves.append((len(self._rows), step if isinstance(step, int) else None, 0.0 if d != d else d))

    def step(
        self,
        attempt: int,
        step: int,
        time: float,
        step_time: Any,
        data: Any = None,
        checkpoint: Any = None,
        eval: Any = None,
        hung: bool = False,
    ) -> None:
        """One step (or one log entry covering the steps since the previous one) of the lowest rank,
        with its phases' seconds (``data``, ``checkpoint``, ``eval``); ``hung``: in a hang."""
        if self._current(attempt, time) is not None:
            self._rows.append((step, time, step_time, data, checkpoint, eval))
            self._hung.append(hung)
            if len(self._rows) >= self._batch:
                self._flush()

    def steps(self, attempt: int, rows: list[tuple], hung: list[bool]) -> None:
        """Many steps at once: ``(step, time, step_time, data, checkpoint, eval)`` tuples and their
        ``hung`` flags, as :meth:`step` takes them (the post-mortem's path: no Python work per step)."""
        if rows and self._current(attempt, rows[-1][1]) is not None:
            self._rows.extend(rows)
            self._hung.extend(hung)
            if len(self._rows) >= self._batch:
                self._flush()

    def end(self, attempt: int, time: float, status: Any, hung: bool = False) -> None:
        """An attempt's end (``run_end``, or the last event the store holds): how, and whether hung."""
        a = self._current(attempt, time)
        if a is None:
            return
        self._flush()
        a.status = status if isinstance(status, str) else "unknown"
        a.hung_at_end = hung

    def _flush(self) -> None:
        """Account the waiting steps (all of the newest attempt) and the saves among them."""
        rows, saves, hung_flags = self._rows, self._saves, self._hung
        self._rows, self._saves, self._hung = [], [], []
        if not self._attempts:
            return
        a = self._attempts[-1]
        if not rows:
            for _, step, secs in saves:
                self._save(a, step, secs)
            return
        step, t, step_time, data, ckpt, ev = _columns(rows)
        hung = np.array(hung_flags, dtype=bool)
        # steps seen already (a replay) are dropped, and the saves after them move with them
        seen = np.maximum.accumulate(np.concatenate(([-1 if a.last_step is None else a.last_step], step)))[:-1]
        if not (keep := step > seen).all():
            index = np.cumsum(np.concatenate(([0], keep)))
            saves = [(int(index[i]), st, secs) for i, st, secs in saves]
            step, t, step_time, data, ckpt, ev, hung = (c[keep] for c in (step, t, step_time, data, ckpt, ev, hung))
            if not len(step):
                for _, st, secs in saves:
                    self._save(a, st, secs)
                return
        rows_n = len(step)
        dt = np.empty(rows_n)
        n = np.empty(rows_n)
        dt[1:], n[1:] = np.maximum(0.0, np.diff(t)), np.diff(step)
        if a.last_row_time is None:  # the attempt's first step: its step time, at most since run_start
            dt[0] = min(0.0 if step_time[0] != step_time[0] else step_time[0], max(0.0, t[0] - a.start))
            n[0] = 1
            a.first_step, a.first_row_start = int(step[0]), float(t[0] - dt[0])
            a.marks.append((int(step[0]) - 1, a.movable()))
            self._resumed(a)
        else:
            dt[0], n[0] = max(0.0, t[0] - a.last_row_time), step[0] - (a.last_step or 0)
        # checkpoint seconds: the step's phase, else the saves reported before it
        reported = np.zeros(rows_n + 1)
        reported[0] = a.pending_checkpoint
        for i, _, secs in saves:
            reported[i] += secs
        a.pending_checkpoint = float(reported[-1])
        ckpt = np.minimum(dt, np.where(np.isnan(ckpt), reported[:-1], ckpt))
        ev = np.minimum(dt - ckpt, np.nan_to_num(ev))
        net = dt - ckpt - ev
        med = _medians_before(self._step_history, net / n)
        excess = np.where(np.isnan(med), 0.0, np.maximum(0.0, net - n * med))
        data_med = _medians_before(self._data_history, data / n)
        stall = np.minimum(excess, np.maximum(0.0, data - n * data_med))
        stall = np.where(np.isnan(stall) | hung, 0.0, stall)
        self._step_history = np.concatenate((self._step_history, net / n))[-WINDOW:]
        self._data_history = np.concatenate((self._data_history, data / n))[-WINDOW:]
        parts = {
            "productive": net - excess,
            "data_stall": stall,
            "slow_steps": np.where(hung, 0.0, excess - stall),
            "hang": np.where(hung, excess, 0.0),
        }
        before = a.movable()
        upto = np.cumsum(np.column_stack([parts[k] for k in _MOVABLE]), axis=0)
        for i, save_step, _ in saves:  # a snapshot at the step each save followed
            if i == 0:
                self._save(a, save_step, 0.0)
            else:
                movable = tuple(b + float(u) for b, u in zip(before, upto[i - 1], strict=True))
                self._mark(a, int(step[i - 1]), save_step, movable)
        for key in _MOVABLE:
            a.seconds[key] += float(parts[key].sum())
        a.seconds["checkpoint"] += float(ckpt.sum())
        a.seconds["eval"] += float(ev.sum())
        a.last_step, a.last_row_time = int(step[-1]), float(t[-1])

    def _save(self, a: _Attempt, step: int | None, secs: float) -> None:
        """A save reported after the attempt's newest accounted step."""
        a.pending_checkpoint += secs
        if a.last_step is not None:
            self._mark(a, a.last_step, step, a.movable())

    @staticmethod
    def _mark(a: _Attempt, after: int, step: int | None, movable: tuple[float, ...]) -> None:
        if step is not None and step >= after:
            a.marks.append((after, movable))
            if len(a.marks) > MARKS:
                del a.marks[1]  # the attempt's start stays: a resume from further back is interpolated

    def _resumed(self, a: _Attempt) -> None:
        """The first step of attempt ``a``: the previous attempt's steps from here on are lost work."""
        i = len(self._attempts) - 1
        prev = next((p for p in reversed(self._attempts[:i]) if p.last_step is not None), None)
        if prev is None or prev.last_step is None or a.first_step is None:
            return
        # the checkpoint's step (the new attempt starts after it), or where prev began if earlier
        kept = max(a.first_step - 1, prev.marks[0][0])
        if prev.last_step <= kept:
            return
        steps = [m[0] for m in prev.marks]
        j = max(0, bisect.bisect_right(steps, kept) - 1)
        mark_step, mark = prev.marks[j]
        share = (prev.last_step - kept) / (prev.last_step - mark_step)  # 1 when the snapshot is at the checkpoint
        for key, before in zip(_MOVABLE, mark, strict=True):
            lost = (prev.seconds[key] - before) * share
            prev.seconds[key] -= lost
            prev.recomputation += lost
        prev.recomputed_steps += prev.last_step - kept

    # -- reading --------------------------------------------------------------------------------

    def result(self, now: float | None = None, hung: bool = False) -> dict[str, Any]:
        """The accounting so far: ``fraction``, ``recomputed_steps``, ``badput_seconds`` by cause,
        ``productive_seconds``, ``wall_seconds`` and ``failures``.

        A running attempt counts up to its newest step; past it, up to ``now`` when ``hung`` (a
        hang anomaly is open), since what the step in progress is doing is not known yet."""
        self._flush()
        bad = dict.fromkeys(CAUSES, 0.0)
        productive = 0.0
        recomputed = failures = 0
        for i, a in enumerate(self._attempts):
            # a failure costs the work since the last checkpoint and a restart; the last attempt's interruption
            # (Ctrl-C, a time limit) is how the run ended (attempts.attempt_failed)
            failed = a.status is not None and attempt_failed(a.status, i + 1 == len(self._attempts))
            failures += failed
            end = a.last_time
            if a.status is None:
                end = now if hung and now is not None else (a.last_row_time or a.start)
            if a.first_row_start is None:
                bad["startup"] += max(0.0, end - a.start)
            else:
                bad["startup"] += max(0.0, a.first_row_start - a.start)
                s = a.seconds
                productive += s["productive"]
                for key in ("checkpoint", "eval", "data_stall", "slow_steps", "hang"):
                    bad[key] += s[key]
                bad["recomputation"] += a.recomputation
                recomputed += a.recomputed_steps
                tail = max(0.0, end - (a.last_row_time or end))
                saving = min(tail, a.pending_checkpoint)
                bad["checkpoint"] += saving
                rest = tail - saving
                if a.hung_at_end or (a.status is None and hung):
                    bad["hang"] += rest
                elif failed:
                    bad["recomputation"] += rest
                else:
                    bad["other"] += rest
            if i + 1 < len(self._attempts):
                gap = max(0.0, self._attempts[i + 1].start - end)
                bad["restart" if failed else "other"] += gap
        wall = productive + sum(bad.values())
        return {
            "fraction": productive / wall if wall > 0 else None,
            "recomputed_steps": recomputed,
            "failures": failures,
            "wall_seconds": wall,
            "productive_seconds": productive,
            "badput_seconds": bad,
        }


CLOCK_KEYS = ("fraction", "wall_seconds", "productive_seconds", "badput_seconds")
"""What a synthetic clock leaves unknown (``recomputed_steps`` and ``failures`` count steps and attempts)."""


def from_store(
    conn: Connection,
    run: str,
    rank: int | None,
    attempts: list[dict[str, Any]],
    anomalies: list[dict[str, Any]],
    clock: str | None = None,
) -> dict[str, Any]:
    """The post-mortem's goodput: the stored steps and checkpoints of ``rank`` (the lowest) through a
    :class:`Ledger`, attempt by attempt, with the post-mortem's ``attempts`` (when and how each
    ended) and the ``hang`` anomalies' step ranges.

    ``clock`` is why the run's times are not real (a synthetic clock): the figures in seconds and
    the fraction are then None, and only the step counts stand; they depend on where each attempt's
    steps begin and end and on nothing between, so the ledger is fed each attempt's first and last
    step only (a million-step log: two index probes instead of a 1.4 s read and accounting of every
    step whose seconds would be thrown away). The attempts' times are on the collector's clock; the
    rank's own times are put on it by its stream's clock offset."""
    hangs = [
        (a["first_step"], max(a["first_step"], a["last_step"] if a["last_step"] is not None else a["first_step"]))
        for a in anomalies
        if a["kind"] == "hang" and a["first_step"] is not None
    ]

    def hung_at(step: np.ndarray) -> np.ndarray:
        out = np.zeros(len(step), dtype=bool)
        for lo, hi in hangs:
            out |= (step >= lo) & (step <= hi)
        return out

    saves: dict[int, list[tuple[int, float | None, float]]] = {}
    offsets = clock_offsets(conn, run, rank) if rank is not None else {}
    if rank is not None:
        for r in checkpoint_rows(conn, run, rank):
            saves.setdefault(r.attempt, []).append((r.step, r.duration, aligned(r.time, offsets.get(r.attempt))))
    ledger = Ledger(batch=OFFLINE_BATCH)
    for a in attempts:
        att = a["attempt"]
        ledger.start(att, a["started_at"])
        pending = saves.get(att, [])
        i = 0
        last = None
        shift = aligned(0.0, offsets.get(att))  # the rank's clock to the collector's (0: no skew)
        for chunk in _timeline(conn, run, rank, att, clock):
            if shift:
                chunk = [(r[0], r[1] + shift, *r[2:]) for r in chunk]
            steps = [r[0] for r in chunk]
            hung = hung_at(np.array(steps)).tolist()
            done = 0
            while i < len(pending) and pending[i][0] < steps[-1]:  # a save follows the step it saved
                at = bisect.bisect_right(steps, pending[i][0])
                ledger.steps(att, chunk[done:at], hung[done:at])
                ledger.checkpoint(att, *pending[i])
                done, i = at, i + 1
            ledger.steps(att, chunk[done:], hung[done:])
            last = steps[-1]
        for save in pending[i:]:
            ledger.checkpoint(att, *save)
        if a["status"] == "running":
            ledger.seen(att, a["ended_at"])
        else:
            ledger.end(att, a["ended_at"], a["status"], last is not None and bool(hung_at(np.array([last + 1]))[0]))
    out = ledger.result()
    if clock:
        out.update(dict.fromkeys(CLOCK_KEYS))
    return out


def _timeline(conn: Connection, run: str, rank: int | None, attempt: int, clock: str | None) -> Iterable[list[tuple]]:
    """The steps :func:`from_store` feeds the ledger, in chunks: every step of ``rank``'s ``attempt``, or
    under a synthetic ``clock`` its first and last (the step counts are all that stands)."""
    if rank is None:
        return ()
    if clock is None:
        return step_timeline(conn, run, rank, attempt)
    ends = step_ends(conn, run, rank, attempt)
    return [ends] if ends else ()


_LABELS = {
    "startup": "startup",
    "checkpoint": "checkpointing",
    "eval": "evaluation",
    "data_stall": "data stalls",
    "slow_steps": "slow steps",
    "hang": "hangs",
    "recomputation": "recomputation",
    "restart": "restarts",
    "other": "other",
}


def headline(summary: Mapping[str, Any]) -> str | None:
    """The goodput and its largest losses, largest first, for the top of the report (labelled
    ``goodput``): ``81%: 9% recomputation after 2 failures (31 steps), 6% checkpointing, 3% startup``.

    None when the summary has no goodput (no steps); ``unknown (why)`` when the clock is unknown."""
    g = summary.get("goodput")
    if not g:
        return None
    if g.get("fraction") is None:
        why = (summary.get("unknown") or {}).get("goodput.fraction") or "no wall time"
        steps = f"; {g['recomputed_steps']} steps recomputed" if g.get("recomputed_steps") else ""
        return f"unknown ({why}){steps}"
    wall = g["wall_seconds"]
    parts = []
    for cause, secs in sorted(g["badput_seconds"].items(), key=lambda kv: -kv[1]):
        share = secs / wall
        if share < 0.005:
            continue
        text = f"{100 * share:.0f}% {_LABELS[cause]}"
        if cause == "recomputation" and g.get("failures"):
            n = g["failures"]
            text += f" after {n} failure{'s' if n != 1 else ''} ({g['recomputed_steps']} steps)"
        parts.append(text)
    return f"{100 * g['fraction']:.0f}%" + (": " + ", ".join(parts) if parts else "")
