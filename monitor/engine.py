"""Runs the detectors over each rank's stream and keeps the anomaly lifecycle.

An anomaly is identified by (run, kind, rank). The first finding opens it, later findings
update its step range and evidence, a ``resolved`` finding closes it; a new finding after that
opens a new anomaly. Open anomalies are loaded from storage at start, so a collector restart
neither loses nor re-raises them.
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
from monitor.storage import Storage, anomalies

__all__ = ["AnomalyChange", "Engine"]


@dataclass(frozen=True, slots=True)
class AnomalyChange:
    """What a finding did to the anomaly table: ``opened``, ``updated`` or ``resolved``."""

    action: str
    id: int
    run: str
    rank: int
    finding: Finding


class Engine:
    """Per-(run, rank) detector instances plus the open-anomaly index."""

    def __init__(
        self, storage: Storage, config: DetectorsConfig, detectors: tuple[type[Detector], ...] = ALL_DETECTORS
    ) -> None:
        self._storage = storage
        self._config = config
        self._classes = detectors
        self._detectors: dict[tuple[str, int], list[Detector]] = {}
        self._lock = threading.Lock()
        with storage.connect() as conn:
            rows = conn.execute(
                select(anomalies.c.id, anomalies.c.run, anomalies.c.kind, anomalies.c.rank).where(
                    anomalies.c.status == "open"
                )
            )
            self._open: dict[tuple[str, str, int], int] = {(r.run, r.kind, r.rank): r.id for r in rows}

    def _new(self) -> list[Detector]:
        return [cls(getattr(self._config, cls.kind)) for cls in self._classes]

    def prime(self, keys: Iterable[tuple[str, int]]) -> None:
        """Give (run, rank) pairs seen for the first time since start their detectors.

        Their stored history is replayed first, so a collector restart does not blind a
        detector for a window. Findings of the replay are dropped: they are already stored.
        Call before the new events are written.
        """
        with self._lock:
            missing = [k for k in keys if k not in self._detectors]
            if not missing:
                return
            with self._storage.connect() as conn:
                for run, rank in missing:
                    dets = self._new()
                    for event, attempt in recent_events(conn, run, rank, self._config.replay_window):
                        for det in dets:
                            det.observe(event, attempt)
                    self._detectors[(run, rank)] = dets

    def _for(self, run: str, rank: int) -> list[Detector]:
        dets = self._detectors.get((run, rank))
        if dets is None:
            dets = self._detectors[(run, rank)] = self._new()
        return dets

    def observe(self, items: list[tuple[Event, int]]) -> list[AnomalyChange]:
        """Feed events (with their attempt) to the detectors; store and return what changed."""
        with self._lock:
            found: list[tuple[str, int, Finding]] = []
            for event, attempt in items:
                for det in self._for(event.run, event.rank):
                    found.extend((event.run, event.rank, f) for f in det.observe(event, attempt))
            if not found:
                return []
            with self._storage.begin() as conn:
                return [self._record(conn, run, rank, f) for run, rank, f in found]

    def _record(self, conn: Connection, run: str, rank: int, f: Finding) -> AnomalyChange:
        now = time.time()
        key = (run, f.kind, rank)
        open_id = self._open.get(key)
        if open_id is None and f.resolved:
            return AnomalyChange("resolved", -1, run, rank, f)
        if open_id is None:
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
            self._open[key] = new_id
            return AnomalyChange("opened", new_id, run, rank, f)
        if f.resolved:
            conn.execute(
                update(anomalies)
                .where(anomalies.c.id == open_id)
                .values(status="resolved", resolved_at=now, updated_at=now)
            )
            del self._open[key]
            return AnomalyChange("resolved", open_id, run, rank, f)
        conn.execute(
            update(anomalies)
            .where(anomalies.c.id == open_id)
            .values(last_step=f.step, updated_at=now, evidence=f.evidence, severity=f.severity)
        )
        return AnomalyChange("updated", open_id, run, rank, f)

    def forget(self, run: str) -> None:
        """Drop a finished run's detector state (bounded memory)."""
        with self._lock:
            for key in [k for k in self._detectors if k[0] == run]:
                del self._detectors[key]
