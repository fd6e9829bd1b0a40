"""Runs the detectors over the event streams and keeps the anomaly lifecycle.

Detectors come in two scopes. A ``rank`` detector gets one instance per (run, rank) and sees
only that rank's events (NaNs, spikes, LR drift, resumes). A ``run`` detector gets one
instance per run and sees every rank's events, for comparisons across ranks (stragglers) and
for silence (hangs, through :meth:`Detector.tick`).

An anomaly is identified by (run, kind, rank), rank -1 meaning the run as a whole. The first
finding opens it, later findings update its step range and evidence, a ``resolved`` finding
closes it; a new finding after that opens a new anomaly. Open anomalies are loaded from
storage at start, and each detector's state is rebuilt from the stored tail of its streams the
first time the stream is seen again, so a collector restart neither loses nor re-raises an
anomaly, and does not blind a detector for a window.

The detectors themselves (``trainmon.monitor.collector.detection``) run either in the caller's thread or, in the
collector, in a child process (``trainmon.monitor.collector.detection_process``) that works on one group while
the writer commits the next. Every change to the anomaly table goes to one listener
(``on_changes``: the collector's live state and notifier).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from trainmon.monitor.collector.detection import RUN_WIDE, Found
from trainmon.monitor.collector.detection_process import (
    Answer,
    DetectionProcess,
    LocalDetection,
    Part,
    SplitDetection,
)
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.monitor.store.queries import open_anomaly_keys, stream_ranks
from trainmon.monitor.store.replay import recent_events
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.store.writes import insert_anomaly, update_anomaly
from trainmon.wire import Event

__all__ = ["RUN_WIDE", "AnomalyChange", "Engine"]

log = logging.getLogger("trainmon.collector")

_MAX_UNSAVED = 10_000  # findings held through a storage outage (the newest are kept)


@dataclass(frozen=True, slots=True)
class AnomalyChange:
    """What a finding did to the anomaly table: ``opened``, ``updated`` or ``resolved``."""

    action: str
    id: int
    run: str
    rank: int
    finding: Finding
    severity: str  # the anomaly's severity after the change
    previous: str | None = None  # its severity before (updated, resolved)


class Engine:
    """The anomaly lifecycle around the detectors: open-anomaly index, storage, priming from history.

    ``process=True`` runs the detectors in a child process (the collector), except those of ``in_thread``, which
    run in the calling thread beside it (an import, whose thread has parsing and storing to do too: the kinds
    that balance the two); otherwise they all run in the calling thread and every callback has run when a
    call returns.

    ``deferred=True`` stores findings on the caller's thread, when it calls :meth:`settle`, instead of on the
    thread that delivers them: an import, whose in-memory SQLite store is one database per thread, sends
    detection its batches in a child process and settles between them. :meth:`tick` then does not wait either.
    """

    def __init__(
        self,
        storage: Storage,
        config: DetectorsConfig,
        detectors: tuple[type[Detector], ...] = ALL_DETECTORS,
        *,
        process: bool = False,
        in_thread: frozenset[str] = frozenset(),
        deferred: bool = False,
        on_changes: Callable[[list[AnomalyChange]], None] | None = None,
    ) -> None:
        self._storage = storage
        self._config = config
        self._on_changes = on_changes
        self._lock = threading.Lock()  # the open-anomaly index and the primed sets
        self._unsaved: list[Found] = []  # findings a failed commit did not store; stored first next time
        self._unsaved_lock = threading.Lock()
        self._primed_ranks: set[tuple[str, int]] = set()
        self._primed_runs: set[str] = set()
        self._generation = 0  # of the detection process the primed sets were fed to
        # deferred: the answers delivered and not settled yet, and how many calls are still owed one
        self._inbox: queue.SimpleQueue[tuple[Callable[[list[Found]], None], list[Found]]] | None = (
            queue.SimpleQueue() if deferred else None
        )
        self._owed = 0
        with storage.connect() as conn:
            # (run, kind, rank) -> (id, stored severity) of each open anomaly
            self._open: dict[tuple[str, str, int], tuple[int, str]] = {
                (r.run, r.kind, r.rank): (r.id, r.severity) for r in open_anomaly_keys(conn)
            }
        if process:
            if detectors is not ALL_DETECTORS:
                raise ValueError("a detection process runs the built-in detectors; pass process=False for others")
            self._detection: LocalDetection | DetectionProcess | SplitDetection = (
                SplitDetection(config, in_thread) if in_thread else DetectionProcess(config)
            )
        else:
            self._detection = LocalDetection(config, detectors)

    @property
    def detection(self) -> LocalDetection | DetectionProcess | SplitDetection:
        return self._detection

    def prime(self, keys: Iterable[tuple[str, int]], conn: Connection | None = None) -> None:
        """Rebuild the detectors of (run, rank) pairs seen for the first time since start (or eviction)
        from their stored history. Call before the new events are written: the history must not
        hold them. ``conn``: the caller's transaction to read it in (else a connection of its own)."""
        with self._lock:
            if self._generation != self._detection.generation:  # a new detection process: nothing is fed
                self._generation = self._detection.generation
                self._primed_ranks.clear()
                self._primed_runs.clear()
            new_ranks = [k for k in keys if k not in self._primed_ranks]
            if not new_ranks:
                return
            new_runs = sorted({run for run, _ in new_ranks if run not in self._primed_runs})
            if conn is None:
                with self._storage.connect() as own:
                    self._feed(own, new_ranks, new_runs)
            else:
                self._feed(conn, new_ranks, new_runs)
            self._primed_ranks.update(new_ranks)
            self._primed_runs.update(new_runs)

    def _feed(self, conn: Connection, new_ranks: list[tuple[str, int]], new_runs: list[str]) -> None:
        for run in new_runs:  # a run evicted earlier comes back with its open anomalies
            rows = open_anomaly_keys(conn, run)
            self._open.update({(run, r.kind, r.rank): (r.id, r.severity) for r in rows})
        for run, rank in new_ranks:
            self._detection.feed_rank(run, rank, recent_events(conn, run, rank, self._config.replay_window))
        for run in new_runs:
            self._detection.feed_run(run, self._run_history(conn, run))

    def _run_history(self, conn: Connection, run: str) -> list[tuple[Event, int]]:
        ranks = stream_ranks(conn, run)
        window = max(16, self._config.replay_window // max(1, len(ranks)))
        history = [pair for rank in ranks for pair in recent_events(conn, run, rank, window)]
        history.sort(key=lambda pair: pair[0].time)
        return history

    def submit(self, stored: list[Part], done: Callable[[], None], ingested: Sequence[Found] = ()) -> None:
        """Detect on committed events (by part: each run of one stream's events under one attempt, with the columns
        the ingest read of them), in commit order; ``done()`` once what they changed is stored and published. In a
        detection process, this returns at once (blocking only when the child is several groups behind) and ``done``
        runs on another thread. ``ingested``: the findings ingest itself made of the same group (two jobs under one
        run name), stored first."""

        def detected(found: list[Found]) -> None:
            try:
                self._apply([*ingested, *found])
            except Exception:  # the events are stored and get answered; what they showed is logged as lost
                log.exception("storing or publishing %d findings failed", len(found))
            finally:
                done()

        self._detection.observe(stored, self._deliver(detected))

    def tick(self, now: float | None = None) -> list[AnomalyChange]:
        """Let detectors notice silence (hangs); the collector calls this every second. Waits for the
        detection process to get to it (after the groups sent before), except when ``deferred``: then it
        returns at once, with no changes, and :meth:`settle` stores what the silence showed."""
        now = time.time() if now is None else now
        if self._inbox is not None:
            self._detection.tick(now, self._deliver(self._store_later))
            return []
        result: list[list[AnomalyChange]] = []
        ready = threading.Event()

        def detected(found: list[Found]) -> None:
            try:
                result.append(self._apply(found))
            finally:
                ready.set()

        self._detection.tick(now, self._deliver(detected))
        ready.wait()
        return result[0] if result else []

    def _deliver(self, answer: Callable[[list[Found]], None]) -> Answer:
        """``answer`` as the detection's callback, given the findings without their keys: at once, or when
        ``deferred`` by :meth:`settle`."""
        inbox = self._inbox
        if inbox is None:
            return lambda keyed: answer([found for _, found in keyed])
        self._owed += 1
        return lambda keyed: inbox.put((answer, [found for _, found in keyed]))

    def _store_later(self, found: list[Found]) -> None:
        self._apply(found)

    def settle(self, wait: bool = False) -> None:
        """``deferred``: store, on this thread, the findings detection has delivered, in the order it was asked;
        with ``wait``, every call made so far (a stuck detection process is replaced within its ``stuck_after`` and
        its calls answered with nothing, so this returns)."""
        inbox = self._inbox
        if inbox is None:
            return
        while self._owed and (wait or not inbox.empty()):
            answer, found = inbox.get()
            self._owed -= 1
            answer(found)

    def _apply(self, found: list[Found]) -> list[AnomalyChange]:
        """Findings into the anomaly table, and what changed to the listener.

        Findings that could not be stored (the database is down) are kept, in order, and stored with
        the next ones, at the latest on the next tick: an outage delays an anomaly, it does not lose it."""
        with self._unsaved_lock:
            pending, self._unsaved = [*self._unsaved, *found], []
        try:
            changes = self._store(pending)
        except Exception:
            with self._unsaved_lock:
                self._unsaved = [*pending, *self._unsaved][-_MAX_UNSAVED:]
                lost = len(pending) - len(self._unsaved)
            if lost > 0:
                log.error("storage down: %d findings beyond the %d kept were dropped", lost, _MAX_UNSAVED)
            raise
        if changes and self._on_changes is not None:
            self._on_changes(changes)
        return changes

    def forget(self, run: str) -> None:
        """Drop a finished run's detector state and open-anomaly index entries (bounded memory).

        If the run sends again, :meth:`prime` replays its stored tail and reloads its open
        anomalies, exactly as after a collector restart.
        """
        with self._lock:
            self._detection.forget(run)
            self._primed_ranks = {k for k in self._primed_ranks if k[0] != run}
            self._primed_runs.discard(run)
            for key in [k for k in self._open if k[0] == run]:
                del self._open[key]

    def close(self, timeout: float = 10.0) -> None:
        """Answer what is in flight within ``timeout`` seconds (a stuck detection is cut off)."""
        self._detection.close(timeout)

    def _store(self, found: list[tuple[str, int, Finding]]) -> list[AnomalyChange]:
        if not found:
            return []
        with self._lock:
            before = dict(self._open)
            try:
                with self._storage.begin() as conn:
                    changes = [self._record(conn, run, rank, f) for run, rank, f in found]
            except BaseException:
                self._open = before  # rolled back: the index must not point at rows that were never written
                raise
        return [c for c in changes if c is not None]

    def _record(self, conn: Connection, run: str, rank: int, f: Finding) -> AnomalyChange | None:
        now = time.time()
        key = (run, f.kind, rank)
        current = self._open.get(key)
        if current is None and f.resolved:
            return None
        if current is None:
            new_id = insert_anomaly(
                conn,
                run=run,
                kind=f.kind,
                rank=rank,
                severity=f.severity,
                status="open",
                first_step=f.step,
                last_step=f.step,
                opened_at=now,
                updated_at=now,
                message=f.message,
                hint=f.hint,
                evidence=f.evidence,
            )
            self._open[key] = (new_id, f.severity)
            return AnomalyChange("opened", new_id, run, rank, f, f.severity)
        open_id, severity = current
        if f.resolved:
            update_anomaly(conn, open_id, status="resolved", resolved_at=now, updated_at=now)
            del self._open[key]
            return AnomalyChange("resolved", open_id, run, rank, f, severity, severity)
        values = {
            "updated_at": now,
            "evidence": f.evidence,
            "severity": f.severity,
            "message": f.message,
            "hint": f.hint,
        }
        if f.step is not None:
            values["last_step"] = f.step
        update_anomaly(conn, open_id, **values)
        self._open[key] = (open_id, f.severity)
        return AnomalyChange("updated", open_id, run, rank, f, f.severity, severity)
