"""The latest values of every run and rank, held in memory for ``/metrics`` and live views."""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trainmon.clock import aligned
from trainmon.flops import declared_flops_per_token
from trainmon.monitor.core.budget import mfu_from_throughput
from trainmon.monitor.core.escape import visible_controls
from trainmon.monitor.core.goodput import Ledger, hang_open
from trainmon.monitor.store.storage import PRECURSOR_FIELDS
from trainmon.schedules import Schedule
from trainmon.wire import Event

__all__ = ["SCRAPE_EXTREMES", "LiveState", "RankState", "RunState"]

SCRAPE_EXTREMES = ("loss", "grad_norm", "step_time")
"""Step fields whose lowest and highest value since the previous scrape are exported (``_min``/``_max``):
the signals a human plots, where a one-step spike between two scrapes must not vanish (issue 26)."""

log = logging.getLogger("trainmon.collector")
_PRECURSORS = frozenset(PRECURSOR_FIELDS)


@dataclass
class RankState:
    host: str = ""
    attempt: int = 0
    step: int = -1
    last: dict[str, Any] = field(default_factory=dict)  # fields of the latest step event
    tokens_total: int = 0
    tokens_per_second: float | None = None
    last_step_time: float = 0.0  # wall time of the latest step, on the collector's clock (core.clock)
    last_seen: float = 0.0  # wall time of any event (heartbeats included), on the collector's clock
    start: dict[str, Any] = field(default_factory=dict)  # run_start fields of the current attempt
    schedule: Schedule | None = None  # the declared LR schedule, for the expected LR
    health: dict[str, Any] = field(default_factory=dict)  # fields of the latest health event
    seqs: dict[str, int] = field(default_factory=dict)  # highest seq seen per producer stream
    missing_events: int = 0  # sequence gaps: events the producer dropped
    # SCRAPE_EXTREMES field -> [lowest, highest] since the exporter's previous scrape (it resets them)
    extremes: dict[str, list[float]] = field(default_factory=dict)
    # the latest sampled step's instability precursors (PRECURSOR_FIELDS): they come every detail_every steps
    precursors: dict[str, Any] = field(default_factory=dict)

    def expected_lr(self) -> float | None:
        """The declared schedule's LR for the latest step (param group 0)."""
        if self.schedule is None or self.step < 0:
            return None
        return self.schedule.lr(self.step)

    def mfu(self) -> float | None:
        """Model FLOPs utilisation of this rank's device, when the run declared what it needs: the
        FLOPs per token (or the model's parameter count) and the device's peak FLOP/s."""
        fpt, peak = declared_flops_per_token(self.start), self.start.get("peak_flops")
        if not fpt or not peak or self.tokens_per_second is None:
            return None
        return mfu_from_throughput(self.tokens_per_second, fpt, peak)


@dataclass
class RunState:
    run: str
    status: str = "running"
    world_size: int | None = None
    planned_steps: int | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)
    eval_loss: float | None = None
    anomalies_total: collections.Counter = field(default_factory=collections.Counter)  # (kind, severity)
    anomalies_active: collections.Counter = field(default_factory=collections.Counter)
    received_at: float = field(default_factory=time.monotonic)  # collector clock of the latest event (eviction)
    goodput: Ledger = field(default_factory=Ledger)  # fed rank 0's events


def _widen(extremes: dict[str, list[float]], steps: list[dict[str, Any]]) -> None:
    """Fold steps' values, in order, into the interval's [lowest, highest]; a NaN is the highest and stays so."""
    for key in SCRAPE_EXTREMES:
        values = [v for f in steps if isinstance(v := f.get(key), (int, float)) and not isinstance(v, bool)]
        if not values:
            continue
        span = extremes.get(key)
        if span is None:
            span = extremes[key] = [values[0], values[0]]
            values = values[1:]
        low, high = span
        for v in values:
            if math.isnan(low) or v < low:
                low = v
            if math.isnan(v) or v > high:
                high = v
        span[0], span[1] = low, high


_Steps = dict[tuple[str, int], tuple[RankState, list[dict[str, Any]]]]
"""(run, rank) -> its state and the fields of its steps in a batch, in order."""


def _fold_steps(rank: RankState, steps: list[dict[str, Any]]) -> None:
    """What a batch's steps of the rank's current attempt add up to: the interval's extremes, the latest
    sampled step's precursors, tokens."""
    _widen(rank.extremes, steps)
    for f in reversed(steps):
        if not f.keys().isdisjoint(_PRECURSORS):
            rank.precursors = {k: f[k] for k in PRECURSOR_FIELDS if k in f}
            break
    for f in steps:
        tokens = f.get("tokens")
        if tokens is not None:
            rank.tokens_total += tokens
            if f.get("step_time"):
                rank.tokens_per_second = tokens / f["step_time"]


class LiveState:
    """Updated by ingest, read by the exporter; one lock keeps the two threads apart."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, RunState] = {}

    def apply(self, items: list[tuple[Event, int]]) -> None:
        """Fold stored events (with their attempt) into the live values, under one lock per batch.

        Every event is counted, in order: sequence gaps, the attempt, the latest step, the goodput ledger
        (rank 0's), and the rarer kinds (run_start, run_end, eval, health). What a rank's steps add up to (the
        interval's extremes, tokens, precursors) is folded once per batch from all of them, in order, giving
        the values that folding them one by one gives: an import sends 5,000 steps a batch. Nothing is kept
        per step but its fields in a list: objects that outlive the call cost the garbage collector's time.
        """
        with self.lock:
            steps: _Steps = {}
            try:
                self._count(items, steps)
            finally:  # the steps counted are folded even when a later event fails
                for rank, pending in steps.values():
                    if pending:
                        _fold_steps(rank, pending)

    def _count(self, items: list[tuple[Event, int]], steps: _Steps) -> None:
        """Each event in order, but a step's values go to ``steps``, per (run, rank), for :func:`_fold_steps`."""
        now = time.monotonic()
        key: tuple[str, int] | None = None
        for event, attempt in items:
            if key != (event.run, event.rank):
                key = (event.run, event.rank)
                run, rank = self._states(event.run, event.rank)
                run.received_at = now
                hung = hang_open(run.anomalies_active)  # anomalies change under self.lock only
                entry = steps.get(key)
                if entry is None:
                    entry = steps[key] = (rank, [])
                pending = entry[1]
            rank.host = event.host
            t = aligned(event.time, event.clock_offset)  # a skewed trainer must not look silent, or fresh
            if t > rank.last_seen:
                rank.last_seen = t
            last_seq = rank.seqs.get(event.stream, -1)
            if event.seq > last_seq + 1:
                rank.missing_events += event.seq - last_seq - 1
            elif event.seq < last_seq and rank.missing_events > 0:  # fresh, so a gap filled (a resent batch)
                rank.missing_events -= 1
            rank.seqs[event.stream] = max(last_seq, event.seq)
            if attempt < rank.attempt:
                continue  # a late replay of an earlier attempt must not roll the gauges back
            rank.attempt = attempt
            if event.rank == 0:
                run.goodput.observe(event.kind, event.fields, t, attempt, hung)
            if event.kind == "step":
                rank.last = event.fields
                rank.step = rank.last["step"]
                rank.last_step_time = t
                pending.append(rank.last)
            else:
                self._other(run, rank, event, attempt)

    def _states(self, run_id: str, rank_id: int) -> tuple[RunState, RankState]:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = RunState(run_id)
        rank = run.ranks.get(rank_id)
        if rank is None:
            rank = run.ranks[rank_id] = RankState()
        return run, rank

    @staticmethod
    def _other(run: RunState, rank: RankState, event: Event, attempt: int) -> None:
        """An event other than a step, of the rank's current attempt."""
        f = event.fields
        if event.kind == "health":
            rank.health = f
        elif event.kind == "run_start":
            rank.start = f
            try:
                rank.schedule = Schedule.from_dict(f["schedule"]) if f.get("schedule") else None
            except (TypeError, ValueError):
                rank.schedule = None  # a schedule we cannot rebuild is simply not compared
            if event.rank == 0:  # rank 0 speaks for the run, as for run_end
                run.status = "running"
            run.world_size = f.get("world_size", run.world_size)
            run.planned_steps = f.get("planned_steps", run.planned_steps)
            if event.rank == 0:
                log.info(
                    "run %s %s: attempt %d, %s rank(s), %s planned steps, host %s",
                    visible_controls(event.run),
                    "resumed" if f.get("resumed") else "started",
                    attempt + 1,
                    run.world_size or "?",
                    run.planned_steps or "?",
                    visible_controls(event.host),
                )
        elif event.kind == "eval":
            run.eval_loss = f["loss"]
        elif event.kind == "run_end" and event.rank == 0:
            run.status = f["status"]
            log.info("run %s %s at step %s", visible_controls(event.run), f["status"], f.get("step", "?"))

    def idle_runs(self, ended_after: float, idle_after: float, now: float | None = None) -> list[str]:
        """Runs to evict: ended ones quiet for ``ended_after`` seconds, any quiet for ``idle_after``."""
        now = time.monotonic() if now is None else now
        with self.lock:
            return [
                r.run
                for r in self.runs.values()
                if now - r.received_at > (ended_after if r.status != "running" else idle_after)
            ]

    def forget(self, run: str) -> None:
        """Drop a run's live values (bounded memory); its stored history is untouched."""
        with self.lock:
            self.runs.pop(run, None)

    def load_anomalies(self, rows: list[tuple[str, str, str, str]]) -> None:
        """Restore anomaly counters from storage: (run, kind, severity, status) per anomaly."""
        with self.lock:
            for run, kind, severity, status in rows:
                state = self.runs.setdefault(run, RunState(run))
                state.anomalies_total[(kind, severity)] += 1
                if status == "open":
                    state.anomalies_active[(kind, severity)] += 1

    def anomaly(self, run: str, kind: str, action: str, severity: str, previous: str | None = None) -> None:
        """Count an anomaly change; the active count moves with the anomaly's stored severity."""
        with self.lock:
            state = self.runs.setdefault(run, RunState(run))
            active = state.anomalies_active
            if action == "opened":
                state.anomalies_total[(kind, severity)] += 1
                active[(kind, severity)] += 1
            elif (
                previous is not None and active[(kind, previous)] > 0 and (action == "resolved" or previous != severity)
            ):
                active[(kind, previous)] -= 1
                if action == "updated":
                    active[(kind, severity)] += 1
