"""``hang``: a rank stops finishing steps.

Why the rule is what it is (``failure-modes.md`` P6, P3): a hung job does not fail, it goes
quiet. NCCL hangs and deadlocks leave the process alive (the heartbeat thread keeps beating, GPUs
may even spin at 100%) while the step counter stops; a dead process or node stops both. The
detector learns each rank's step interval and fires when no step arrived within
``max(timeout_factor x median interval, pause_factor x longest recent interval or
checkpoint/eval pause, min_timeout)``, plus, at the steps where a long pause recurs every K
steps (a save or an eval not wrapped in ``phase()``), ``pause_factor`` times that pause; until
an interval is known (before the first step, and
between the first and the second) the timeout is ``first_step_timeout``. Every interval shorter
than the timeout in force is learnt, and the first one however long: a stall must not teach the
timeout (hence the gate), but a gate before anything is learnt would mean a log whose steps are
naturally more than ``first_step_timeout`` apart (a real-time TensorBoard or W&B import, an RL
iteration of 13 minutes) never learns its interval and reads as a stall at every entry (255 of
them on a W&B history). Seen after the fact, the first interval is judged in units of the log's
own intervals: once the next ``_EARLY`` are known (or the rank ends) it is a stall only beyond
``first_step_timeout`` and ``timeout_factor`` times their median, and a stall is then unlearnt.
It says "alive but stuck" when the rank's events still arrive, "dead" when nothing has arrived
for ``dead_factor`` heartbeat intervals too.

A hang opens as a warning and becomes critical only once it has lasted ``critical_after`` seconds
beyond its timeout: a pause of a few seconds is not something to page anyone for. The open
finding follows the condition: it is sent again whenever the silence has grown by a quarter (or
the severity, the state or the stacks changed), so the message and evidence say how long it has
been, not how long it was when it opened.

Where the ranks wait: the hooks send the training thread's stack (``stack`` events) when a rank
stops stepping. The stacks of the run's ranks that are current (taken after their latest step)
are grouped by signature (``trainmon.monitor.core.stacks``) and go into the evidence and the
message of every open hang of the run, naming the odd ones out.

Silence is checked two ways, both deterministic: :meth:`tick` with the caller's clock (the live
collector, every second; ``import_file``, at each imported batch), and on each event of a rank
with that event's own time (a heartbeat at ``t`` while the last step is older than the timeout
is proof of a stuck rank, whatever the arrival order of the other ranks). The live collector's
clock is not the trainer's: a rank whose events carry the collector's estimate of its clock offset
(``Event.clock_offset``) is ticked at the collector's ``now`` read on the rank's clock, so a trainer
an hour behind is not an hour silent and one an hour ahead cannot hide a hang (step intervals stay
differences of the rank's own times). A rank that ended
(``run_end``), or that has done its planned steps, or that stops together with a finished run,
is not hung. Resolved when the rank's steps resume.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from trainmon.clock import aligned
from trainmon.monitor.core.stacks import group_stacks, rank_ranges
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import Reading, columns, observe_runs, read
from trainmon.monitor.detectors.rolling import LazyWindow, RollingWindow
from trainmon.wire import Event

__all__ = ["Hang", "HangConfig"]


@dataclass
class HangConfig:
    """``hang``: no step (or no heartbeat) from a rank within a learnt timeout."""

    timeout_factor: float = 20.0
    """Timeout as a multiple of the rank's median step interval (P6 uses 5x, P3 10x; a margin for jitter)."""
    pause_factor: float = 2.0
    """...or this multiple of the longest recent step interval or checkpoint/eval pause, so routine
    saves and periodic pauses (GC) do not fire."""
    min_timeout: float = 60.0
    """Floor of the timeout in seconds: a pause shorter than this is not a hang however fast the steps
    are (a busy host, a GC, an unwrapped save); P6 uses 120 s on large jobs. Tests lower it."""
    recurring_factor: float = 5.0
    """A step interval at least this multiple of the median is a long pause; long pauses that recur
    every K steps (saves or evals not wrapped in ``phase()``) are allowed ``pause_factor`` times their
    length at the steps where they recur."""
    critical_after: float = 120.0
    """Seconds an open hang must last beyond its timeout before it is critical (someone must act
    now); until then it is a warning. A stall seen only after it ended stays a warning."""
    first_step_timeout: float = 300.0
    """Seconds allowed until a step interval is known: before the first step (imports, compilation,
    data loading) and between the first and the second (whose interval is then learnt, however long)."""
    dead_factor: float = 3.0
    """No event at all for this multiple of the rank's heartbeat interval (and the timeout) means dead."""
    history: int = 64
    """Step intervals kept per rank to learn the timeout."""


_GROWTH = 1.25  # an open finding is sent again when its silence has grown by this factor
_RANK, _TIME = attrgetter("rank"), attrgetter("time")
_INT: frozenset[type] = frozenset((int,))
_AT_ONCE = 16  # steps in a row worth learning at once: the screens cost a few microseconds a piece
_PIECE = 1024  # steps screened at once: an outlier (a save, an eval) sends only its piece one by one
_EARLY = 4  # intervals after a log's first one that say what a normal interval is, to judge the first


@dataclass
class _Rank:
    host: str = "?"
    started: float = 0.0
    last_step: int | None = None
    last_step_time: float | None = None
    last_event_time: float = 0.0
    # read on rare steps only (a long one, a stall): kept in arrival order, sorted when read (see _on_step)
    intervals: LazyWindow = field(default_factory=lambda: LazyWindow(64))
    # at most the median of ``intervals`` (every interval is >= 0): a gap under recurring_factor x this is no long
    # pause, which decides most steps without the median (see _on_step)
    median_floor: float = 0.0
    # steps between two logged steps: a log that skips steps (sampled W&B history) has longer gaps where it skips more
    strides: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=64))
    beats: RollingWindow = field(default_factory=lambda: RollingWindow(16))
    last_beat: float | None = None
    longest_pause: float = 0.0
    # (step that ended it, seconds) of intervals at least recurring_factor x the median
    long_gaps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    ended: bool = False
    open: str | None = None  # "stuck" or "dead" while an anomaly is open
    reported: tuple[str, float, int] = ("", 0.0, -1)  # severity, silence, stacks version last sent
    stack: tuple[int | None, list, dict | None] | None = None  # (step, frames, nccl) of the latest capture
    # the first step interval, seen after the fact (an import): (unexplained seconds, step before, step after),
    # judged once the intervals after it say what a normal one is; and those intervals
    first_gap: tuple[float, int | None, int] | None = None
    early: list = field(default_factory=list)
    offset: float | None = None  # the collector's clock minus this rank's, when its events arrived live


def _strides(last: int | None, steps: list[int], keep: int | None) -> list[int]:
    """The last ``keep`` (all with None) steps between two logged steps, of ``steps`` logged after ``last``, in
    order: what appending each rise to a window of ``keep`` leaves of them (read from the end)."""
    befores = [last, *steps[:-1]]
    rises = (s - b for b, s in zip(reversed(befores), reversed(steps), strict=True) if b is not None and s > b)
    found = list(itertools.islice(rises, keep))
    found.reverse()
    return found


class Hang(Detector):
    """No step from a rank within its learnt timeout; stuck (heartbeats) or dead (silence)."""

    kind = "hang"
    batch_from = _AT_ONCE  # shorter than a piece worth learning: 2 steps cost 4.1 us each looked at, 1.8 observed
    config_class = HangConfig
    order = 60
    priority = 80
    plots = ("throughput",)
    localised = False
    scope = "run"

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self._ranks: dict[int, _Rank] = {}
        self._planned: int | None = None
        self._finished_step: int | None = None  # last step of a rank that finished normally
        # timeout() is never below this: most steps are judged without computing it
        self._least_timeout = min(config.min_timeout, config.first_step_timeout)
        self._stacks_version = 0  # counts stack events: an open finding is re-sent with new stacks
        self._steps_seen = 0  # counts step events: a rank that stepped makes its capture stale
        self._grouped: tuple[tuple[int, int], Any] = ((-1, -1), (None, {}))

    # -- state ---------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        st = self._ranks.get(event.rank)
        kind = event.kind
        if kind == "run_start":
            st = self._ranks[event.rank] = _Rank(
                host=event.host,
                started=event.time,
                last_event_time=event.time,
                intervals=LazyWindow(self.config.history),
                offset=event.clock_offset,
            )
            self._planned = event.fields.get("planned_steps") or self._planned
            self._finished_step = None
            return []
        if st is None:  # events of a rank whose run_start we did not see
            st = self._ranks[event.rank] = _Rank(
                host=event.host,
                started=event.time,
                last_event_time=event.time,
                intervals=LazyWindow(self.config.history),
            )
        if event.clock_offset is not None:
            st.offset = event.clock_offset
        t = event.time
        if kind == "step":
            out = self._on_step(event.rank, st, event.fields, t)
            if t > st.last_event_time:
                st.last_event_time = t
            return out
        out = []
        if kind == "run_end":
            if st.first_gap is not None:
                out += self._judge_first_gap(event.rank, st)
            st.ended = True
            if event.fields.get("status") == "finished":
                last = event.fields.get("step", st.last_step)
                if last is not None:
                    self._finished_step = max(self._finished_step or 0, last)
            if st.open:
                out.append(self._resolved(event.rank, st, st.last_step, "the rank ended"))
            st.last_event_time = max(st.last_event_time, t)
            return out
        if kind in ("checkpoint", "eval") and (duration := event.fields.get("duration")):
            st.longest_pause = max(st.longest_pause, float(duration))
        if kind == "stack":
            frames = (event.fields.get("stack") or {}).get("frames")
            if isinstance(frames, list):
                st.stack = (event.fields.get("step"), frames, event.fields.get("nccl"))
                self._stacks_version += 1
        if kind == "heartbeat":
            if st.last_beat is not None and t > st.last_beat:
                st.beats.add(t - st.last_beat)
            st.last_beat = t
        st.last_event_time = max(st.last_event_time, t)
        # The rank's own clock: an event at t while its last step is older than the timeout.
        out += self._check(event.rank, st, t, own_event=True)
        return out

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event; steps in a row of one rank, in pieces of ``_PIECE``, that :meth:`_learn`
        proves ordinary (each learnt, none a pause, a stall or the end of one) are learnt at once. On a long log that
        is almost every step. Every other event is :meth:`observe`'s (:func:`observe_runs`): the steps after the
        rank's start, a piece with an outlier, other kinds.

        The step numbers and phases are the batch's shared columns (other detectors read the steps too; a log without
        phases has a column of None without a look): D_w1m's hang CPU 0.24 -> 0.18 s."""
        batch = read(events)
        with batch:  # one reading for the columns and the screens (the engine's is of another list where it leaves
            # kinds out)
            _, others, (numbers, phases) = columns(events, "step", "phases")
        ends = [*others, len(events)]  # where each run of steps ends
        unread = 0  # the pieces before this one are observe's: the screen refused them

        def take(i: int) -> int:
            nonlocal unread
            if i < unread:
                return i
            j = min(ends[bisect.bisect_left(ends, i)], i + _PIECE)
            if j - i >= _AT_ONCE and self._learn(batch, i, j, numbers[i:j], phases[i:j]):
                return j
            unread = j
            return i

        observe_runs(self.observe, events, attempts, out, take)

    def _learn(self, batch: Reading, i: int, j: int, numbers: list[Any], phases: list[Any]) -> bool:
        """The steps ``i`` to ``j`` of ``batch``, of one rank (``numbers``, ``phases``: their columns), learnt as
        :meth:`_on_step` learns them one by one, when the batch's columns prove that :meth:`_on_step` would take its
        plain path at each: the rank has a learnt interval and nothing open or pending (no hang, no first interval to
        judge), no step has phases, the step numbers are ints, every interval is positive and under the least timeout
        (so learnt, and no stall) and under ``recurring_factor`` times the least of the median's floor and the intervals
        (the floor only falls to them along the way, so no interval is a long pause). Then each interval is added (the
        window keeps the last ``history``), the floor falls to the least, the strides are the last ones, the last step
        and times are the last step's. False, with nothing learnt, otherwise.

        What other detectors read too is the batch's, read once: its rank where it is of one (straggler's question),
        its step numbers' types (loss_spike's, divergence's, bad_resume's), where its clock offsets are (node_health's):
        D_w1m's hang CPU 0.155 -> 0.09 s."""
        steps = batch.events[i:j]
        rank = steps[0].rank
        st = self._ranks.get(rank)
        if st is None or st.open or st.first_gap is not None or st.last_step_time is None or not len(st.intervals):
            return False
        m = len(steps)
        if batch.rank is None and list(map(_RANK, steps)).count(rank) != m:
            return False
        if not batch.only("step", _INT, i, j) or any(phases):  # (a step without a number reads None)
            return False
        times = np.fromiter(map(_TIME, steps), float, m)
        gaps = np.empty(m)
        gaps[0] = times[0] - st.last_step_time
        np.subtract(times[1:], times[:-1], out=gaps[1:])
        least, most = float(gaps.min()), float(gaps.max())
        floor = min(st.median_floor, least)
        # a bar above the positive intervals needs a positive factor: a negative or NaN one fails here
        if not (least > 0.0 and most < self._least_timeout and most < self.config.recurring_factor * floor):
            return False
        self._steps_seen += m
        st.intervals.extend(gaps[-self.config.history :].tolist())
        st.median_floor = floor
        clocked = batch.clocked
        last = clocked[bisect.bisect_left(clocked, j) - 1]  # the last step with an offset, if any is one of these
        if i <= last < j:
            st.offset = batch.events[last].clock_offset
        st.strides.extend(_strides(st.last_step, numbers, st.strides.maxlen))
        st.last_step, st.last_step_time = numbers[-1], steps[-1].time
        if st.last_step_time > st.last_event_time:
            st.last_event_time = st.last_step_time
        st.ended = False
        return True

    def _on_step(self, rank: int, st: _Rank, fields: dict[str, Any], t: float) -> list[Finding]:
        """A step of ``rank``: its interval is learnt, or judged as a stall seen after the fact.

        Why a long pause is told on most steps without the intervals' median (sorting them, once a step, was half
        of the detector's time on a long log): ``st.median_floor`` is set to the window's nearest-rank lower
        quartile when it is read and lowered to every interval learnt since, and it stays at most the median. At
        most ``(n - 1) // 2`` of the ``n`` values lie below the quartile (index ``round((n - 1) / 4)``); a value now
        in the window and below the floor is one of them (every value added since is at least the floor), and the
        window only grows or replaces values, so the ``(n' - 1) // 2``-th smallest value of any later window of
        ``n' >= n`` values, and so its median (that value, or its mean with the next: rounding keeps it above), is
        at least the floor. Every interval is >= 0, so ``gap < factor * floor`` implies ``gap < factor * median``
        for a factor >= 0; a negative factor puts the bar at or below 0 (read each time), and an infinite or NaN
        one fails both tests. ``tests/detectors/test_hang_speed.py`` checks it against the median itself.
        """
        out: list[Finding] = []
        self._steps_seen += 1
        step = fields["step"]
        phases = fields.get("phases")  # most logs carry none: read once
        last_time = st.last_step_time
        intervals = st.intervals
        least = self._least_timeout
        if last_time is None:
            first_interval = False
            gap = t - st.started
        else:
            known = len(intervals)
            first_interval = not known
            gap = t - last_time
            if t >= last_time:
                if phases and phases.get("checkpoint", 0.0) + phases.get("eval", 0.0) > 0:
                    st.longest_pause = max(st.longest_pause, gap)
                else:
                    factor = self.config.recurring_factor
                    if known and gap >= factor * st.median_floor:
                        st.median_floor = intervals.quantile(0.25)  # the floor, raised again (see below)
                        if gap >= factor * intervals.median():
                            st.long_gaps.append((step, gap))
                    if not known or (not st.open and (gap < least or gap < self.timeout(st, step))):
                        intervals.add(gap)  # the first interval is learnt however long (see the docstring)
                        if gap < st.median_floor:
                            st.median_floor = gap
                    if st.first_gap is not None and len(st.early) < _EARLY:
                        st.early.append(gap)
        if st.open:
            out.append(self._resolved(rank, st, step, f"steps resumed after {gap:.1f} s"))
        else:
            # Seen only now (an import, or the collector was down): report the stall after the fact.
            unexplained = gap - phases.get("checkpoint", 0.0) - phases.get("eval", 0.0) if phases else gap
            if unexplained < least or self._done(st):
                pass
            elif first_interval and len(intervals):
                # the first interval, just learnt: judged against the intervals that follow it
                st.first_gap = (unexplained, st.last_step, step)
            else:
                limit = self.timeout(st, step)
                if st.last_step is not None and step > st.last_step and st.strides:
                    # a gap over more steps (the strides' median, taken only here)
                    strides = RollingWindow(len(st.strides))
                    for k in st.strides:
                        strides.add(k)
                    limit *= max(1.0, (step - st.last_step) / strides.median())
                if unexplained >= limit:
                    st.open = "stuck"
                    out.append(self._finding(rank, st, gap, limit, 0.0, "stalled", ended_by=step))
                    out.append(self._resolved(rank, st, step, f"steps resumed after {gap:.1f} s"))
        if st.last_step is not None and step > st.last_step:
            st.strides.append(step - st.last_step)
        st.last_step, st.last_step_time = step, t
        st.ended = False
        if st.first_gap is not None and len(st.early) >= _EARLY:
            out += self._judge_first_gap(rank, st)
        return out

    def _judge_first_gap(self, rank: int, st: _Rank) -> list[Finding]:
        """The first step interval of a log read after the fact: a stall when it exceeds the start-up
        allowance and ``timeout_factor`` times the typical interval after it. A log whose every entry is
        13 minutes apart (a W&B history of an RL run) has a first interval of 13 minutes too: not a stall
        (it read as one at all 255 entries). A stall is unlearnt: the timeout comes from the others."""
        gap, before, after = st.first_gap  # type: ignore[misc]
        early, st.first_gap = st.early, None
        cfg = self.config
        limit = max(cfg.first_step_timeout, cfg.min_timeout)
        if early:
            limit = max(limit, cfg.timeout_factor * sorted(early)[len(early) // 2])
        if gap < limit:
            return []
        st.intervals, st.median_floor = LazyWindow(cfg.history), 0.0
        for g in early:
            st.intervals.add(g)
        last, last_time, opened = st.last_step, st.last_step_time, st.open
        st.last_step = before
        try:
            found = self._finding(rank, st, gap, limit, 0.0, "stalled", ended_by=after)
        finally:
            st.last_step, st.last_step_time, st.open = last, last_time, opened
        return [found, self._resolved(rank, st, after, f"steps resumed after {gap:.1f} s")]

    def tick(self, now: float) -> list[Finding]:
        out: list[Finding] = []
        for rank, st in self._ranks.items():
            # ``now`` on the rank's own clock, which its step and event times are on
            out += self._check(rank, st, now - aligned(0.0, st.offset), own_event=False)
        return out

    # -- the rule ------------------------------------------------------------------------------

    def timeout(self, st: _Rank, step: int | None = None) -> float:
        """Seconds without a step after which the rank counts as hung, waiting for ``step`` (default:
        the step after its last one)."""
        cfg = self.config
        if not len(st.intervals):  # no step interval known yet: the generous start-up timeout
            return max(cfg.first_step_timeout, cfg.pause_factor * st.longest_pause)
        median = st.intervals.median()
        longest = max(st.longest_pause, st.intervals.quantile(1.0), self._recurring(st, step))
        return max(cfg.timeout_factor * median, cfg.pause_factor * longest, cfg.min_timeout)

    @staticmethod
    def _recurring(st: _Rank, step: int | None) -> float:
        """The longest of the long pauses that recur every K steps, if ``step`` is one where they recur.
        K is the commonest spacing of the recent long pauses (a one-off stall does not break the rhythm)."""
        if step is None:
            step = (st.last_step if st.last_step is not None else -1) + 1
        at = [a for a, _ in st.long_gaps]
        spacings = [b - a for a, b in itertools.pairwise(at) if b > a]
        if not spacings:
            return 0.0
        counts = collections.Counter(spacings)
        period = max(reversed(spacings), key=counts.__getitem__)  # ties: the latest spacing
        anchor = max(b for a, b in itertools.pairwise(at) if b - a == period)
        if (step - anchor) % period:
            return 0.0
        return max(gap for a, gap in st.long_gaps if (a - anchor) % period == 0)

    def _severity(self, silent: float, limit: float) -> str:
        return "critical" if silent >= limit + self.config.critical_after else "warning"

    def _current_stacks(self) -> tuple[dict[str, Any] | None, dict[int, Any]]:
        """The grouping (and NCCL traces) of the stacks of ranks whose latest capture came after their
        latest step; computed once per change, not once per rank's finding (a hang of 1,000 ranks)."""
        key = (self._stacks_version, self._steps_seen)
        if self._grouped[0] != key:
            frames, nccl = {}, {}
            for rank, st in self._ranks.items():
                if st.stack is not None and not st.ended and st.stack[0] == st.last_step:
                    frames[rank] = st.stack[1]
                    if st.stack[2]:
                        nccl[rank] = st.stack[2]
            self._grouped = (key, (group_stacks(frames) if frames else None, nccl))
        return self._grouped[1]

    def _done(self, st: _Rank) -> bool:
        if st.ended:
            return True
        if st.last_step is not None and self._planned is not None and st.last_step >= self._planned - 1:
            return True  # trained its planned steps: final eval/save, then exit
        return self._finished_step is not None and st.last_step is not None and st.last_step >= self._finished_step

    def _check(self, rank: int, st: _Rank, now: float, own_event: bool) -> list[Finding]:
        if self._done(st):
            return []
        since = st.last_step_time if st.last_step_time is not None else st.started
        silent = now - since
        if silent < self._least_timeout:
            return []  # within any timeout: the usual case, decided without computing it
        limit = self.timeout(st)
        if silent < limit:
            return []
        beat = st.beats.median() if len(st.beats) else self.config.min_timeout
        quiet = now - st.last_event_time
        dead = not own_event and quiet >= max(self.config.dead_factor * beat, limit)
        state = "dead" if dead else "stuck"
        if st.open == "dead" and state == "stuck" and quiet > 0:
            state = "dead"  # nothing new arrived from it since it was declared dead
        severity, version = self._severity(silent, limit), self._stacks_version
        if st.open == state:
            last_severity, last_silent, last_version = st.reported
            if severity == last_severity and silent < _GROWTH * last_silent and version == last_version:
                return []  # nothing new to say
        st.open = state
        st.reported = (severity, silent, version)
        return [self._finding(rank, st, silent, limit, quiet, state, severity=severity)]

    def _others(self, rank: int) -> str:
        parts = [
            f"rank {r}: step {o.last_step}" + (" (ended)" if o.ended else "")
            for r, o in sorted(self._ranks.items())
            if r != rank
        ][:8]
        return "; ".join(parts)

    def _finding(
        self,
        rank: int,
        st: _Rank,
        silent: float,
        limit: float,
        quiet: float,
        state: str,
        ended_by: int | None = None,
        severity: str = "warning",
    ) -> Finding:
        stuck_at = (st.last_step + 1) if st.last_step is not None else 0
        others = self._others(rank)
        stacks, nccl = self._current_stacks()
        if state == "stalled":
            # Seen after the fact: the stall lies between the last step seen and the one that ended it
            # (in a log written every N steps, that is N steps, not "the next step").
            stuck_at = ended_by if ended_by is not None else stuck_at
            where = (
                f"between step {st.last_step} and step {stuck_at}"
                if st.last_step is not None and stuck_at != st.last_step + 1
                else f"before step {stuck_at}"
            )
            msg = (
                f"rank {rank} on {st.host} finished no step for {silent:.1f} s (timeout {limit:.1f} s) {where}, "
                "then resumed"
            )
            hint = (
                "A stall seen after the fact (imported log, or the collector was away): a collective that "
                "waited for another rank, a deadlock that cleared, a hung dataloader or storage. Compare the "
                "phases of the step that ended it across ranks (the rank that waited shows it in comm)"
                + (f"; the other ranks: {others}" if others else "")
                + "."
            )
        elif state == "stuck":
            msg = (
                f"rank {rank} on {st.host} finished no step for {silent:.1f} s (timeout {limit:.1f} s) "
                f"but is alive (last event {quiet:.1f} s ago); stuck in step {stuck_at}"
            )
            if stacks:
                look = f"Where the ranks wait: {stacks['summary']} (their stacks are in the evidence). " + (
                    f"Look at {rank_ranges(stacks['odd_ranks'])} first: the others wait for it. "
                    if stacks["odd_ranks"]
                    else ""
                )
            else:
                look = (
                    f"Dump the stacks with `py-spy dump --pid <pid>` on {st.host} (and the NCCL flight "
                    "recorder, TORCH_NCCL_TRACE_BUFFER_SIZE); "
                )
            hint = (
                "Alive but stuck: a collective that never completes (NCCL hang, a rank that skipped or "
                "reordered a collective), a deadlock, or a hung dataloader. "
                + look
                + "compare the other ranks' last step"
                + (f" ({others})" if others else "")
                + "; set NCCL_ASYNC_ERROR_HANDLING=1 / a process-group timeout so a hang fails fast."
            )
        else:
            msg = (
                f"rank {rank} on {st.host} sent nothing for {quiet:.1f} s, no step for {silent:.1f} s "
                f"(timeout {limit:.1f} s): the process or its node looks dead"
            )
            hint = (
                f"No heartbeat either: the process or node {st.host} died (OOM kill, segfault, Xid "
                "error, node failure) or lost the network. Check the job scheduler, `dmesg` / the kernel "
                "log for the OOM killer and Xid errors on that node, and node_health"
                + (f"; the other ranks: {others}" if others else "")
                + ". Restart from the last checkpoint without that node."
            )
        evidence: dict[str, Any] = {
            "state": state,
            "rank": rank,
            "host": st.host,
            "last_step": st.last_step,
            "seconds_without_step": round(silent, 2),
            "seconds_without_event": round(quiet, 2),
            "timeout_s": round(limit, 2) if math.isfinite(limit) else str(limit),
        }
        if stacks:
            msg += f"; {stacks['summary']}"
            evidence["stacks"] = stacks
            if nccl:
                evidence["nccl"] = {str(r): v for r, v in sorted(nccl.items())}
        return Finding(
            kind=self.kind,
            severity=severity,
            step=stuck_at,
            message=msg,
            hint=hint,
            evidence=evidence,
            rank=rank,
        )

    def _resolved(self, rank: int, st: _Rank, step: int | None, why: str) -> Finding:
        st.open = None
        return self.resolve(
            step,
            f"rank {rank} no longer hung: {why}",
            "If it recurs, compare the stacks of the ranks during the stall (py-spy dump).",
            {"rank": rank, "last_step": step},
            rank=rank,
        )
