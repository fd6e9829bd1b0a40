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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, select, update

from hooks.wire import Event
from monitor.config import DetectorsConfig
from monitor.detectors import ALL_DETECTORS, Detector, Finding
from monitor.replay import recent_events
from monitor.storage import Storage, anomalies, streams

__all__ = ["AnomalyChange", "Engine"]

RUN_WIDE = -1


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
    """Detector instances per (run, rank) and per run, plus the open-anomaly index."""

    def __init__(
        self, storage: Storage, config: DetectorsConfig, detectors: tuple[type[Detector], ...] = ALL_DETECTORS
    ) -> None:
        self._storage = storage
        self._config = config
        self._rank_classes = [c for c in detectors if c.scope == "rank"]
        self._run_classes = [c for c in detectors if c.scope == "run"]
        self._rank_dets: dict[tuple[str, int], list[Detector]] = {}
        self._run_dets: dict[str, list[Detector]] = {}
        self._lock = threading.Lock()
        with storage.connect() as conn:
            rows = conn.execute(
                select(anomalies.c.id, anomalies.c.run, anomalies.c.kind, anomalies.c.rank, anomalies.c.severity).where(
                    anomalies.c.status == "open"
                )
            )
            # (run, kind, rank) -> (id, stored severity) of each open anomaly
            self._open: dict[tuple[str, str, int], tuple[int, str]] = {
                (r.run, r.kind, r.rank): (r.id, r.severity) for r in rows
            }

    def _make(self, classes: list[type[Detector]]) -> list[Detector]:
        return [cls(getattr(self._config, cls.kind)) for cls in classes]

    def prime(self, keys: Iterable[tuple[str, int]]) -> None:
        """Create the detectors of (run, rank) pairs seen for the first time since start.

        Their stored history is replayed into them first; findings of the replay are dropped
        (they are stored already). Call before the new events are written.
        """
        with self._lock:
            new_ranks = [k for k in keys if k not in self._rank_dets]
            new_runs = sorted({run for run, _ in new_ranks if run not in self._run_dets})
            if not new_ranks:
                return
            with self._storage.connect() as conn:
                for run in new_runs:  # a run evicted earlier comes back with its open anomalies
                    rows = conn.execute(
                        select(anomalies.c.id, anomalies.c.kind, anomalies.c.rank, anomalies.c.severity).where(
                            anomalies.c.run == run, anomalies.c.status == "open"
                        )
                    )
                    self._open.update({(run, r.kind, r.rank): (r.id, r.severity) for r in rows})
                for run, rank in new_ranks:
                    dets = self._make(self._rank_classes)
                    _feed(dets, recent_events(conn, run, rank, self._config.replay_window))
                    self._rank_dets[(run, rank)] = dets
                for run in new_runs:
                    dets = self._make(self._run_classes)
                    if dets:
                        _feed(dets, self._run_history(conn, run))
                    self._run_dets[run] = dets

    def _run_history(self, conn: Connection, run: str) -> list[tuple[Event, int]]:
        ranks = conn.execute(select(streams.c.rank).where(streams.c.run == run).distinct()).scalars().all()
        window = max(16, self._config.replay_window // max(1, len(ranks)))
        history = [pair for rank in ranks for pair in recent_events(conn, run, rank, window)]
        history.sort(key=lambda pair: pair[0].time)
        return history

    def observe(self, items: list[tuple[Event, int]]) -> list[AnomalyChange]:
        """Feed events (with their attempt) to the detectors; store and return what changed."""
        with self._lock:
            found: list[tuple[str, int, Finding]] = []
            for event, attempt in items:
                rank_dets = self._rank_dets.get((event.run, event.rank))
                if rank_dets is None:
                    rank_dets = self._rank_dets[(event.run, event.rank)] = self._make(self._rank_classes)
                for det in rank_dets:
                    if out := det.observe(event, attempt):  # usually empty: no generator per call
                        found.extend((event.run, _rank(f, event.rank), f) for f in out)
                run_dets = self._run_dets.get(event.run)
                if run_dets is None:
                    run_dets = self._run_dets[event.run] = self._make(self._run_classes)
                for det in run_dets:
                    if out := det.observe(event, attempt):
                        found.extend((event.run, _rank(f, RUN_WIDE), f) for f in out)
            return self._store(found)

    def tick(self, now: float | None = None) -> list[AnomalyChange]:
        """Let detectors notice silence (hangs); the collector calls this every second."""
        now = time.time() if now is None else now
        with self._lock:
            found: list[tuple[str, int, Finding]] = []
            for (run, rank), dets in self._rank_dets.items():
                for det in dets:
                    found.extend((run, _rank(f, rank), f) for f in det.tick(now))
            for run, dets in self._run_dets.items():
                for det in dets:
                    found.extend((run, _rank(f, RUN_WIDE), f) for f in det.tick(now))
            return self._store(found)

    def _store(self, found: list[tuple[str, int, Finding]]) -> list[AnomalyChange]:
        if not found:
            return []
        with self._storage.begin() as conn:
            changes = [self._record(conn, run, rank, f) for run, rank, f in found]
        return [c for c in changes if c is not None]

    def _record(self, conn: Connection, run: str, rank: int, f: Finding) -> AnomalyChange | None:
        now = time.time()
        key = (run, f.kind, rank)
        current = self._open.get(key)
        if current is None and f.resolved:
            return None
        if current is None:
            result = conn.execute(
                anomalies.insert().values(
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
            )
            new_id = result.inserted_primary_key[0]
            self._open[key] = (new_id, f.severity)
            return AnomalyChange("opened", new_id, run, rank, f, f.severity)
        open_id, severity = current
        if f.resolved:
            conn.execute(
                update(anomalies)
                .where(anomalies.c.id == open_id)
                .values(status="resolved", resolved_at=now, updated_at=now)
            )
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
        conn.execute(update(anomalies).where(anomalies.c.id == open_id).values(**values))
        self._open[key] = (open_id, f.severity)
        return AnomalyChange("updated", open_id, run, rank, f, f.severity, severity)

    def forget(self, run: str) -> None:
        """Drop a finished run's detector state and open-anomaly index entries (bounded memory).

        If the run sends again, :meth:`prime` replays its stored tail and reloads its open
        anomalies, exactly as after a collector restart.
        """
        with self._lock:
            for key in [k for k in self._rank_dets if k[0] == run]:
                del self._rank_dets[key]
            self._run_dets.pop(run, None)
            for key in [k for k in self._open if k[0] == run]:
                del self._open[key]


def _rank(f: Finding, default: int) -> int:
    return default if f.rank is None else f.rank


def _feed(dets: list[Detector], history: list[tuple[Event, int]]) -> None:
    for event, attempt in history:
        for det in dets:
            det.observe(event, attempt)
