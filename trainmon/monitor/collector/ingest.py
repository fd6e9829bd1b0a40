"""Validated events → storage (one transaction per group of batches) → live state and detectors.

Ingest is idempotent: each producer stream's events carry sequence numbers and the collector
remembers which ones it committed (``seqs.SeqSet``), so a batch that arrives again (a retry
after a lost response, a spool replay) is recognised and not stored twice, while events that
arrive after newer ones (a resent batch, a reversed one) are stored: a duplicate is only an
event already stored. A batch is
committed whole or not at all, and only a committed batch is acknowledged.

The collector assigns attempts: the first stream seen for a (run, rank) is attempt 0, the
next one (the process restarted, usually resuming from a checkpoint) attempt 1, and so on. A stream
of another job under the same run name while the first is live is no restart: it is stored under a
run of its own (``launches``), and its events carry that run's id from then on.

The producer's clock is not trusted for liveness: each batch that arrived live comes with the
collector's time of arrival, from which each stream's clock offset is estimated
(``trainmon.clock``). Fresh events carry it (``Event.clock_offset``) to the live values
and the detectors, and the times that say when a stream or run was active (``streams.started_at``,
``last_time``, ``runs.created_at``, ``updated_at``) are stored on the collector's clock; the
per-event rows keep the producer's own times (durations within a rank are differences of them).
"""

from __future__ import annotations

import itertools
import math
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection

from trainmon.clock import ClockOffset, aligned
from trainmon.monitor.collector.detection import Found
from trainmon.monitor.collector.detection_process import Part, Segment, pairs
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.launches import Launches, Pulse, stored_apart
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.collector.seqs import SeqSet
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.store.queries import run_updated_at, stream_count, stream_of
from trainmon.monitor.store.storage import (
    PHASE_COLUMNS,
    PRECURSOR_FIELDS,
    STEP_FIELDS,
    Repeated,
    Storage,
    checkpoints,
    evals,
    health,
    layer_stats,
    resumes,
    steps,
)
from trainmon.monitor.store.writes import insert_run, insert_stream, update_run, update_streams
from trainmon.wire import Event, json_safe

__all__ = ["BatchTooLarge", "IngestError", "IngestLimits", "IngestResult", "Ingestor", "LimitError"]


class IngestError(ValueError):
    """Events that are well-formed but contradict what the collector already knows."""


class LimitError(IngestError):
    """A batch that would take the collector past one of its limits (answered 429: retry later)."""


class BatchTooLarge(IngestError):
    """A batch holding more runs than one batch may (answered 413, as a body over the size limit is): the same
    events sent again can never be taken, their halves can. A node's forwarder, which posts the batches of every
    rank of the node as one, and the transport split on it; answered 429, they retried the whole forever."""


@dataclass(frozen=True, slots=True)
class IngestLimits:
    """What one collector holds in memory at most (see ``CollectorConfig`` for why each exists)."""

    max_live_runs: int
    max_ranks_per_run: int
    max_runs_per_batch: int


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicates: int
    stored_as: dict[str, str] = field(default_factory=dict)
    """Run names of the batch whose events were stored under another run id (a job that met another one
    under its name, ``launches``): the run whose findings an acknowledgement to that job must carry."""


@dataclass(slots=True)
class _Stream:
    run: str
    rank: int
    attempt: int
    seqs: SeqSet  # stored sequence numbers; a group works on a copy, kept only if it commits
    missing: int  # seqs below the highest that never arrived
    clock: ClockOffset  # shared by the group's copies: an estimate, not transactional state
    step_fields: frozenset[str] | None  # the step fields its stored steps hold; None: unknown (streams.step_fields)
    new: bool = False


class _Slot:
    """A batch of a group being committed, and what became of it."""

    __slots__ = ("accepted", "arrival", "error", "events", "fresh", "segments", "sent", "stored_as")

    def __init__(self, events: list[Event], arrival: float | None, sent: float | None = None) -> None:
        self.events = events
        self.segments = _segments(events)
        self.arrival = arrival  # collector wall time the batch was received; None: not live (tests, imports)
        self.sent = sent  # the producer's wall time when it sent the batch, if it said (wire.SENT_HEADER)
        self.fresh: list[Part] = []  # its events stored, by segment
        self.accepted = 0  # how many
        self.error: BaseException | None = None
        self.stored_as: dict[str, str] = {}  # IngestResult.stored_as


def _segments(events: list[Event]) -> list[Segment]:
    """The batch's segments: each run of its events of one stream, run and rank. A batch of one (a producer's, an
    import's) is told at C speed: a million events' 0.1 s sooner than ``groupby``'s key tuple per event, from 16
    events a batch on (below, the three scans cost more than the tuples: 2.25 us against 2.15 for 8 events)."""
    if len(events) >= 16 and _SEGMENT(events[0]) == _SEGMENT(events[-1]) and _one_segment(events):
        return [_segment(events)]
    return [_segment(list(same)) for _, same in itertools.groupby(events, _SEGMENT)]


def _one_segment(events: list[Event]) -> bool:
    """Whether the events are of one stream, run and rank, each asked of the whole batch (its first event's)."""
    first, n = events[0], len(events)
    return (
        [e.stream for e in events].count(first.stream) == n
        and [e.run for e in events].count(first.run) == n
        and [e.rank for e in events].count(first.rank) == n
    )


def _segment(events: list[Event]) -> Segment:
    """The segment of ``events``, its columns read in bytecode (a slot read there costs a third of an
    ``attrgetter`` call's: a million events' 0.04 s)."""
    return Segment(
        events,
        [e.seq for e in events],
        [e.time for e in events],
        [e.kind for e in events],
        [e.fields for e in events],
    )


def _hold(st: _Stream, su: dict[str, Any], fields: list[dict[str, Any]]) -> set[str]:
    """The names ``fields`` (steps of ``st`` being stored) hold, added to what the stream's steps hold and to its
    row's update (``su``) where that grew. A stream whose record is unknown (stored before it was kept) stays
    unknown: a record of its new steps alone would deny what its old ones hold."""
    names = set().union(*fields)
    if st.step_fields is not None and not names.issubset(st.step_fields):
        st.step_fields = st.step_fields.union(names)
        su["step_fields"] = sorted(st.step_fields)
    return names


def _key(ev: Event, attempt: int, step: int) -> dict[str, Any]:
    return {"run": ev.run, "rank": ev.rank, "attempt": attempt, "step": step, "time": ev.time}


_PHASE_KEYS = {p: f"phase_{p}" for p in PHASE_COLUMNS}
_STEP_FIELDS = frozenset(STEP_FIELDS)
_PRECURSORS = frozenset(PRECURSOR_FIELDS)
_STEP = operator.itemgetter("step")
_IS_STEP = "step".__eq__
_SEGMENT = operator.attrgetter("stream", "run", "rank")

Columns = dict[str, list[Any]]
"""Rows given column by column (:meth:`Storage.insert_ignore`)."""


def _columns(rows: list[dict[str, Any]]) -> Columns:
    """Rows as columns: each column some row has, None in the rows that lack it."""
    return {name: [row.get(name) for row in rows] for name in set().union(*rows)}


def _field(fields: list[dict[str, Any]], name: str) -> list[Any]:
    """Each of ``fields``' value of ``name`` (None where it has none), at C speed."""
    return list(map(dict.get, fields, itertools.repeat(name)))


class _StepKeys(NamedTuple):
    """The steps' key columns and times, gathered segment by segment: a segment's steps share its stream's run,
    rank and attempt (``_key_column``), and their times were read for the segment (``Segment``), so no step is
    asked them again."""

    run: list[str]
    rank: list[int]
    attempt: list[int]
    time: list[float]


def _key_column(parts: list[tuple[Any, int]]) -> list[Any]:
    """A key column of the steps of the parts (each part's value and number of steps): ``Repeated`` where the
    steps are one segment's (an import's batch), which ``insert_ignore`` then binds once a statement without
    asking each step whether its value is that one object."""
    if len(parts) == 1:
        return Repeated(*parts[0])
    return list(itertools.chain.from_iterable(itertools.starmap(itertools.repeat, parts)))


def _step_columns(
    events: list[Event], attempts: list[int], fields: list[dict[str, Any]], present: set[str], keys: _StepKeys
) -> Columns:
    """The steps' ``steps`` rows, column by column, with the columns some step has (``insert_ignore`` stores NULL
    in the others): an imported step has 4 of 30. Built from the keys (``keys``, ``attempts`` its attempts) and
    the fields (``fields``: each step's; ``present``: the names some step has) at C speed, not as a row per step
    read back column by column (a quarter of an import's store stage)."""
    columns = {
        "run": keys.run,
        "rank": keys.rank,
        "attempt": attempts,
        "step": list(map(_STEP, fields)),
        "time": keys.time,
    }
    for name in _STEP_FIELDS.intersection(present):
        columns[name] = _field(fields, name)
    lrs = _field(fields, "lr")
    lr = columns["lr"] = [x[0] if x else None for x in lrs]
    columns["lrs"] = _other_groups(lrs, lr)
    if "phases" in present:
        phases = [f.get("phases") or {} for f in fields]
        for phase in _PHASE_KEYS.keys() & set().union(*phases):
            columns[_PHASE_KEYS[phase]] = [p.get(phase) for p in phases]
    return columns


def _other_groups(lrs: list[Any], lr: list[Any]) -> list[Any]:
    """The ``lrs`` column: each step's learning rates where the ``lr`` column (the first group's) does not already
    say them all, NULL where the step has one group whose rate ``lr`` gives back as it is (a float, but -0.0:
    SQLite stores a REAL -0.0 as 0). ``replay.step_fields`` reads such a step's rates back as ``[lr]``. One group
    is most runs, and its JSON text was a fifth of an import's store stage (a float's shortest repr, a million
    times) for the value the ``lr`` column holds; a non-finite rate, which PostgreSQL's JSON cannot hold, is
    stored too. Asked of the whole column at C speed first: each step's first rate a float (so its rates are not
    None nor empty) and its only one, not -0.0 (whatever the rates' type: a list, as always, or any value of one
    item that the step-by-step rule gives NULL for too; not asked, as it was, in a pass of its own: 0.017 s of a
    million steps)."""
    if set(map(type, lr)) == _FLOAT and set(map(len, lrs)) == _ONE and (0.0 not in lr or all(map(_exact_in_lr, lr))):
        return Repeated(None, len(lrs))
    return [None if x is not None and len(x) == 1 and _exact_in_lr(x[0]) else x for x in lrs]


def _exact_in_lr(x: Any) -> bool:
    """The ``lr`` column (a REAL) gives ``x`` back as it is: a float, not -0.0."""
    return type(x) is float and (x != 0.0 or math.copysign(1.0, x) > 0.0)


_ONE = {1}
_FLOAT = {float}


def _layer_row(ev: Event, attempt: int) -> dict[str, Any] | None:
    """The sampled step's per-layer row: grad norms and precursors (non-finite as the wire's strings), or None."""
    f = ev.fields
    grad_norms = f.get("layer_grad_norms") or None
    if grad_norms is None and _PRECURSORS.isdisjoint(f):
        return None  # most steps: not sampled
    precursors = {k: f[k] for k in PRECURSOR_FIELDS if k in f}
    return {**_key(ev, attempt, f["step"]), "grad_norms": grad_norms, "precursors": json_safe(precursors) or None}


def _layer_rows(events: list[Event], attempts: list[int], present: set[str]) -> list[dict[str, Any]]:
    """The per-layer rows of the sampled steps among ``events``; asked of the field names the steps have
    (``present``) first: most batches hold no sampled step."""
    if "layer_grad_norms" not in present and _PRECURSORS.isdisjoint(present):
        return []
    return [row for ev, attempt in zip(events, attempts, strict=True) if (row := _layer_row(ev, attempt))]


def _extremes(segment: Segment) -> tuple[float, float]:
    """The latest and the earliest of the segment's times on the collector's clock (``aligned``). Under one offset
    ``aligned`` keeps the times' order, so each run of events of one offset (a segment's, stamped together) gives
    the aligned extremes of its times, without a call per event; a segment of one offset (an import's, a live
    batch's) those of all its times, its offsets compared at C speed (a million events' 0.03 s sooner)."""
    offsets = [e.clock_offset for e in segment.events]
    first = offsets[0]
    if offsets.count(first) == len(offsets):
        return aligned(max(segment.times), first), aligned(min(segment.times), first)
    extremes: list[tuple[float, float]] = []
    stop = 0
    for offset, same in itertools.groupby(offsets):
        start, stop = stop, stop + len(list(same))
        times = segment.times[start:stop]
        extremes.append((aligned(max(times), offset), aligned(min(times), offset)))
    latest, earliest = extremes[0]
    for hi, lo in extremes[1:]:
        latest, earliest = max(latest, hi), min(earliest, lo)
    return latest, earliest


class Ingestor:
    """The collector's write path. Thread-safe: groups are committed one at a time."""

    def __init__(
        self,
        storage: Storage,
        engine: Engine,
        live: LiveState | None,
        limits: IngestLimits | None = None,
        clash_window: float = CollectorConfig.clash_window_seconds,
    ) -> None:
        """``live``: the latest values the exporter, the API and the limits read; None where nothing reads them
        (an import, which reads its run back from the store: a third of its ingest cost went to them).
        ``clash_window``: the longest silence after which a run that did not end is still live (a new job
        under its name is then a second job, not its restart: ``launches``)."""
        self.storage = storage
        self.engine = engine
        self.live = live
        self.limits = limits  # None: unlimited (imports, tests)
        self._lock = threading.Lock()  # held while a group is committed
        self._streams: dict[str, _Stream] = {}
        self._launches = Launches(clash_window)

    def ingest(self, events: list[Event], arrival: float | None = None, sent: float | None = None) -> IngestResult:
        """Store one validated batch (received at ``arrival``, collector wall time, if it arrived live; sent at
        ``sent`` on the producer's clock, if it said) and wait for its detection. Raises ``IngestError`` on a
        conflict."""
        results: list[IngestResult | IngestError] = []
        ready = threading.Event()

        def done(out: list[IngestResult | IngestError]) -> None:
            results.extend(out)
            ready.set()

        self.ingest_group([events], done, None if arrival is None else [arrival], [sent])
        ready.wait()
        (result,) = results
        if isinstance(result, IngestError):
            raise result
        return result

    def ingest_group(
        self,
        batches: list[list[Event]],
        done: Callable[[list[IngestResult | IngestError]], None],
        arrivals: list[float] | None = None,
        sents: list[float | None] | None = None,
    ) -> None:
        """Store validated batches in one transaction (group commit); ``done`` gets one result per batch
        once the group is durable and the detectors have seen it (on another thread when detection
        runs in a child process: this returns as soon as the group is committed).

        Each batch is still all or nothing: one that contradicts stored data gets its
        ``IngestError`` and the others are stored. A thousand ranks cost a few fsyncs a second
        instead of one per batch (``synchronous=FULL`` makes the fsync the limit otherwise).
        Raises (and stores nothing, calls nothing) when the database fails. ``arrivals``: the collector
        wall time each batch was received (None: not live, the producer's clock is all there is); ``sents``: the
        producer's wall time when it sent each batch (``wire.SENT_HEADER``), None where it did not say.
        """
        group = [
            _Slot(events, arrivals[i] if arrivals is not None else None, sents[i] if sents is not None else None)
            for i, events in enumerate(batches)
        ]
        with self._lock:
            clashes = self._commit(group)
            results: list[IngestResult | IngestError] = []
            fresh: list[Part] = []
            for slot in group:
                if slot.error is not None:
                    assert isinstance(slot.error, IngestError)
                    results.append(slot.error)
                else:
                    results.append(IngestResult(slot.accepted, len(slot.events) - slot.accepted, slot.stored_as))
                    fresh.extend(slot.fresh)
            if fresh:
                if self.live is not None:
                    self.live.apply(pairs(fresh))
                # Under the lock: the detectors must see groups in commit order.
                self.engine.submit(fresh, lambda: done(results), clashes)
        if not fresh:
            done(results)

    def _commit(self, group: list[_Slot]) -> list[Found]:
        """One transaction for the group; a batch that conflicts is refused alone. Returns the ``run_clash``
        findings of the jobs it found sharing a run name."""
        if self.limits is not None:
            admitted: dict[str, set[int]] = {}
            for slot in group:
                try:
                    self._check_limits(slot.events, admitted)
                except (LimitError, BatchTooLarge) as exc:
                    slot.error = exc
        try:
            known: dict[str, _Stream] = {}
            parts: list[tuple[_Stream, Segment]] = []  # the fresh events, by segment, in the group's order
            with self.storage.begin() as conn:
                for slot in group:
                    if slot.error is not None:
                        continue
                    try:
                        self._load_streams(conn, slot, known)
                    except IngestError as exc:
                        slot.error = exc
                        continue
                    arrival = slot.arrival
                    if arrival is not None and slot.sent is not None:
                        # One sample per stream: when the request left against when it came. A batch replayed
                        # from a spool holds old events but was sent now, so it says nothing false about the clock.
                        for stream in {ev.stream for ev in slot.events}:
                            known[stream].clock.add(slot.sent, arrival)
                    elif arrival is not None:  # a producer that does not say when it sent: its events' times
                        for ev in slot.events:
                            known[ev.stream].clock.add(ev.time, arrival)
                    for segment in slot.segments:
                        st = known[segment.events[0].stream]
                        fresh = self._dedupe(st, segment)
                        if arrival is not None:  # the collector's own stamp on a validated event
                            for ev in fresh.events:
                                ev.clock_offset = st.clock.offset
                        if fresh.events:
                            parts.append((st, fresh))
                            slot.fresh.append((fresh, st.attempt))
                            slot.accepted += len(fresh.events)
                if parts:
                    # Priming a run is the costly part of a new one: only for the events stored, under the run
                    # they are stored under, before they are written (the history must not hold them).
                    self.engine.prime({(st.run, st.rank) for st, _ in parts}, conn)
                    self._write(conn, parts, known)
        except BaseException as exc:  # the transaction rolled back: no batch of the group was stored
            self._launches.rollback()
            for slot in group:
                if slot.error is None:
                    slot.error = exc
            raise
        for st in known.values():  # the group's own copies become the cache
            st.new = False
        self._streams.update(known)
        return self._launches.commit()

    @staticmethod
    def _dedupe(st: _Stream, segment: Segment) -> Segment:
        """The events of ``segment`` (one stream's, in order) not stored before, recorded in the stream's seqs;
        its count of missing seqs grows by each gap and shrinks by each one filled. Counted for the segment: each
        fresh seq above the stream's highest adds the gap below it, each one below fills one, which sums to the
        highest's rise less the fresh events."""
        highest = st.seqs.last
        stored = st.seqs.add_all(segment.seqs)  # False: stored before, a duplicate
        fresh = segment if all(stored) else Segment(*(list(itertools.compress(c, stored)) for c in segment))
        st.missing += st.seqs.last - highest - len(fresh.events)
        return fresh

    def _check_limits(self, events: list[Event], admitted: dict[str, set[int]]) -> None:
        """Refuse a batch that would take memory past the limits, or that holds more runs than one batch may;
        ``admitted`` holds the group's earlier batches."""
        limits = self.limits
        assert limits is not None
        ranks: dict[str, set[int]] = {}
        for ev in events:
            ranks.setdefault(ev.run, set()).add(ev.rank)
        if len(ranks) > limits.max_runs_per_batch:
            raise BatchTooLarge(
                f"{len(ranks)} runs in one batch, at most {limits.max_runs_per_batch} (max_runs_per_batch): "
                "send them in smaller batches"
            )
        live = self.live.runs if self.live is not None else {}
        new = {run for run in (*ranks, *admitted) if run not in live}
        if new and len(live) + len(new) > limits.max_live_runs:
            raise LimitError(
                f"the collector holds {len(live)} live runs, at most {limits.max_live_runs} (max_live_runs); "
                "finished runs leave memory after evict_after_seconds: retry later"
            )
        # Counted from the batch's own ranks, not by a union with the run's: a 16,384-rank job sends
        # 16,384 batches a second, and a union per batch made the check grow with the square of the ranks.
        joining: dict[str, set[int]] = {}
        for run, rs in ranks.items():
            state = live.get(run)
            known = state.ranks if state is not None else {}
            earlier = admitted.get(run, set())  # joined in this group before this batch (none of them known)
            joining[run] = {r for r in rs if r not in known and r not in earlier}
            total = len(known) + len(earlier) + len(joining[run])
            if total > limits.max_ranks_per_run:
                raise LimitError(f"run {run} would have {total} ranks, at most {limits.max_ranks_per_run}")
        for run, rs in joining.items():
            admitted.setdefault(run, set()).update(rs)

    def evict(self, ended_after: float, idle_after: float) -> list[str]:
        """Forget runs that ended (or went silent) long enough ago: detectors, live values, stream cache.

        Held under the ingest lock, so a batch of the run cannot interleave; if the run sends
        again, it is primed from storage like after a restart.
        """
        if self.live is None:
            return []
        with self._lock:
            gone = self.live.idle_runs(ended_after, idle_after)
            if not gone:
                return []
            self._forget(set(gone))
            return gone

    def forget(self, run: str) -> None:
        """Drop a deleted run from memory (its stream cache, detectors, live values), under the ingest lock
        so that no batch of it is half-applied; a batch that comes later starts it afresh."""
        with self._lock:
            self._forget({run})

    def _forget(self, runs: set[str]) -> None:
        for key in [k for k, st in self._streams.items() if st.run in runs]:
            del self._streams[key]
        self._launches.forget(runs)
        for run in runs:
            self.engine.forget(run)
            if self.live is not None:
                self.live.forget(run)

    def _load_streams(self, conn: Connection, slot: _Slot, known: dict[str, _Stream]) -> None:
        """Add the batch's streams to ``known`` (the group's); on a conflict, take them out again."""
        added: list[str] = []
        mark = self._launches.mark()
        try:
            self._add_streams(conn, slot, known, added)
        except IngestError:
            for stream in added:
                del known[stream]
            self._launches.undo(mark)
            raise

    def _add_streams(self, conn: Connection, slot: _Slot, known: dict[str, _Stream], added: list[str]) -> None:
        """Find or create each segment's stream; the events of a job stored apart from others of its run name
        (``launches``) get that run's id."""
        events, arrival = slot.events, slot.arrival
        launches: dict[str, str | None] | None = None  # stream -> launch id, of the batch's run_start events
        pulses = self._launches.pulses  # when each run was last heard from: whether a new job meets a live one
        for segment in slot.segments:
            ev = segment.events[0]
            st = known.get(ev.stream)
            if st is None:
                cached = self._streams.get(ev.stream)
                # A copy the group can change and drop on a rollback (built directly: ``replace`` costs more).
                st = (
                    _Stream(
                        cached.run,
                        cached.rank,
                        cached.attempt,
                        cached.seqs.copy(),
                        cached.missing,
                        cached.clock,
                        cached.step_fields,
                    )
                    if cached
                    else self._fetch(conn, ev.stream)
                )
                if st is None:  # a stream never seen
                    if launches is None:
                        launches = {e.stream: e.fields.get("launch_id") for e in events if e.kind == "run_start"}
                    run = self._launches.run_of(
                        conn, ev.run, launches.get(ev.stream), ev.host, ev.time if arrival is None else arrival
                    )
                    attempt = stream_count(conn, run, ev.rank)
                    attempt += sum(1 for s in known.values() if s.new and s.run == run and s.rank == ev.rank)
                    st = _Stream(run, ev.rank, attempt, SeqSet(), 0, ClockOffset(), frozenset(), new=True)
                known[ev.stream] = st
                added.append(ev.stream)
            if st.run != ev.run or st.rank != ev.rank:
                if st.rank != ev.rank or not stored_apart(st.run, ev.run):
                    raise IngestError(
                        f"stream {ev.stream} belongs to run {st.run!r} rank {st.rank}, "
                        f"not run {ev.run!r} rank {ev.rank}"
                    )
                slot.stored_as[ev.run] = st.run
                for e in segment.events:
                    e.run = st.run  # the collector's own stamp, as ``clock_offset``
            pulse = pulses.get(st.run)
            if pulse is None:
                pulse = pulses[st.run] = Pulse()
            pulse.beats(segment.times if arrival is None else [arrival], segment.kinds, ev.rank)

    @staticmethod
    def _fetch(conn: Connection, stream: str) -> _Stream | None:
        row = stream_of(conn, stream)
        if row is None:
            return None
        seqs = SeqSet(row.received) if row.received is not None else SeqSet.up_to(row.last_seq)
        known = None if row.step_fields is None else frozenset(row.step_fields)
        return _Stream(row.run, row.rank, row.attempt, seqs, row.missing, ClockOffset(row.clock_offset), known)

    def _write(self, conn: Connection, parts: list[tuple[_Stream, Segment]], known: dict[str, _Stream]) -> None:
        """Store the fresh events, given by segment (one stream's, in order): their rows, and what they tell of
        their streams and runs (when each was active, on the collector's clock, how many events, a start, an end)."""
        step_events: list[Event] = []
        step_fields: list[dict[str, Any]] = []
        counts: list[tuple[_Stream, int]] = []  # each part with steps: its stream and number of steps
        held: list[set[str]] = []  # each part with steps: the field names its steps hold
        times: list[float] = []
        rows: dict[Any, list[dict]] = {t: [] for t in (evals, checkpoints, resumes, health)}
        stream_updates: dict[str, dict[str, Any]] = {}
        run_updates: dict[str, dict[str, Any]] = {}
        for st, segment in parts:
            events, kinds = segment.events, segment.kinds
            first_event, attempt = events[0], st.attempt
            latest, earliest = _extremes(segment)
            su = stream_updates.get(first_event.stream)  # not setdefault: its default dict would be built every time
            if su is None:
                su = stream_updates[first_event.stream] = {"host": first_event.host, "last_time": latest, "events": 0}
            elif latest > su["last_time"]:
                su["last_time"] = latest
            su["events"] += len(events)
            ru = run_updates.get(st.run)
            if ru is None:
                ru = run_updates[st.run] = {"updated_at": latest, "first": earliest}
            else:
                ru["updated_at"] = max(ru["updated_at"], latest)
                ru["first"] = min(ru["first"], earliest)
            count = kinds.count("step")
            stepping = None if count == len(kinds) else list(map(_IS_STEP, kinds))  # None: steps alone, as mostly
            if count:
                counts.append((st, count))
            if stepping is None:
                step_events += events
                step_fields += segment.fields
                times += segment.times
                held.append(_hold(st, su, segment.fields))
                continue
            step_events += itertools.compress(events, stepping)
            step_fields += itertools.compress(segment.fields, stepping)
            times += itertools.compress(segment.times, stepping)
            if count:
                held.append(_hold(st, su, step_fields[-count:]))
            for ev in itertools.compress(events, map(operator.not_, stepping)):
                f = ev.fields
                if ev.kind == "eval":
                    rows[evals].append(
                        {
                            **_key(ev, attempt, f["step"]),
                            "loss": f["loss"],
                            "metrics": f.get("metrics"),
                            "duration": f.get("duration"),
                        }
                    )
                elif ev.kind == "checkpoint":
                    rows[checkpoints].append(
                        {
                            **_key(ev, attempt, f["step"]),
                            "path": f.get("path"),
                            "duration": f.get("duration"),
                            "bytes": f.get("bytes"),
                            "fingerprint": f.get("fingerprint"),
                        }
                    )
                elif ev.kind == "resume":
                    rows[resumes].append(
                        {
                            **_key(ev, attempt, f["step"]),
                            "path": f.get("path"),
                            "duration": f.get("duration"),
                            "fingerprint": f.get("fingerprint"),
                        }
                    )
                elif ev.kind == "health":
                    rows[health].append(
                        {
                            "run": ev.run,
                            "rank": ev.rank,
                            "attempt": attempt,
                            "host": ev.host,
                            "time": ev.time,
                            "data": f,
                        }
                    )
                elif ev.kind == "run_start":
                    su["start"] = f
                    su["started_at"] = aligned(ev.time, ev.clock_offset)
                    if ev.rank == 0:
                        ru["start"] = f
                        ru["status"] = "running"
                elif ev.kind == "run_end":
                    su.update(
                        end_status=f["status"],
                        end_step=f.get("step"),
                        end_error=f.get("error"),
                        dropped_events=f.get("dropped_events"),
                    )
                    if ev.rank == 0:
                        ru["status"] = f["status"]
        if step_events:
            present = set().union(*held)
            keys = _StepKeys(
                _key_column([(st.run, n) for st, n in counts]),  # every event's run now (``_add_streams``)
                _key_column([(st.rank, n) for st, n in counts]),
                _key_column([(st.attempt, n) for st, n in counts]),
                times,
            )
            columns = _step_columns(step_events, keys.attempt, step_fields, present, keys)
            self.storage.insert_ignore(conn, steps, columns)
            layers = _layer_rows(step_events, keys.attempt, present)
            if layers:
                self.storage.insert_ignore(conn, layer_stats, _columns(layers))
        for table, batch in rows.items():
            if batch:
                self.storage.insert_ignore(conn, table, _columns(batch))
        self._write_streams(conn, stream_updates, known)
        self._write_runs(conn, run_updates)

    @staticmethod
    def _write_streams(conn: Connection, updates: dict[str, dict[str, Any]], known: dict[str, _Stream]) -> None:
        # Existing streams are updated with one executemany per set of changed columns (usually one
        # set: host, last_time, seq counters), not one statement per stream: a group holds hundreds.
        changed: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for stream, su in updates.items():
            st = known[stream]
            values = {
                k: su[k]
                for k in (
                    "host",
                    "last_time",
                    "start",
                    "end_status",
                    "end_step",
                    "end_error",
                    "dropped_events",
                    "step_fields",
                )
                if k in su
            }
            values.update(
                last_seq=st.seqs.last, missing=st.missing, received=st.seqs.ranges(), clock_offset=st.clock.offset
            )
            if st.new:
                values["step_fields"] = sorted(st.step_fields) if st.step_fields is not None else None
                insert_stream(
                    conn,
                    stream=stream,
                    run=st.run,
                    rank=st.rank,
                    attempt=st.attempt,
                    started_at=su.get("started_at", su["last_time"]),
                    events=su["events"],
                    **values,
                )
            else:
                values.update(b_stream=stream, b_events=su["events"])
                changed.setdefault(tuple(sorted(values)), []).append(values)
        for columns, rows in changed.items():
            update_streams(conn, columns, rows)

    @staticmethod
    def _write_runs(conn: Connection, updates: dict[str, dict[str, Any]]) -> None:
        for run, ru in updates.items():
            values: dict[str, Any] = {}
            start = ru.get("start")
            if start is not None:
                values.update(
                    world_size=start.get("world_size"),
                    planned_steps=start.get("planned_steps"),
                    vocab_size=start.get("vocab_size"),
                    config=start.get("config"),
                    schedule=start.get("schedule"),
                    meta={k: v for k, v in start.items() if k not in ("config", "schedule")},
                )
            if "status" in ru:
                values["status"] = ru["status"]
            updated_at = run_updated_at(conn, run)
            if updated_at is None:
                values = {"status": "running", **values}
                insert_run(conn, run=run, created_at=ru["first"], updated_at=ru["updated_at"], **values)
            else:
                values["updated_at"] = max(updated_at, ru["updated_at"])
                update_run(conn, run, **values)
