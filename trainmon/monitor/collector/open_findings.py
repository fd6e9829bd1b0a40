"""The open anomalies of each live run, in memory, for the acknowledgements of ``POST /v1/events``.

A producer that acts on findings (``TrainMonitor(on_critical=...)``) asks for them with each
batch (``?findings=SEVERITY&run=RUN&after=REV``). The answer is built on the event loop, so it
cannot read storage: this index follows every anomaly change (the same listener as the live
counters and the notifier), and it is loaded from storage at start. Each change gets a revision
number; a producer sends back the revision of its previous answer and gets only what was opened
or updated since, so an anomaly left open by an earlier attempt does not stop a resumed run
unless the new attempt makes it worse or renews it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from trainmon.monitor.collector.engine import AnomalyChange
from trainmon.monitor.detectors import SEVERITIES

__all__ = ["MAX_FINDINGS", "OpenFindings"]

MAX_FINDINGS = 10  # per acknowledgement, most severe first: one is enough to act on, a thousand ranks' NaNs are not


class OpenFindings:
    """(run, kind, rank) -> the anomaly as an acknowledgement carries it, with its revision."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[tuple[str, int], tuple[int, dict[str, Any]]]] = {}
        self.revision = 0  # of the latest change; read without the lock (an int)

    def load(self, rows: Iterable[Any]) -> None:
        """Open anomalies from storage (``run, kind, rank, severity, first_step, last_step, message``)."""
        with self._lock:
            for r in rows:
                self._put(r.run, r.kind, r.rank, r.severity, r.first_step, r.last_step, r.message)

    def apply(self, changes: list[AnomalyChange]) -> None:
        """Follow the anomaly table: opened and updated anomalies get a new revision, resolved ones go."""
        with self._lock:
            for ch in changes:
                if ch.action == "resolved":
                    self._runs.get(ch.run, {}).pop((ch.finding.kind, ch.rank), None)
                    continue
                f = ch.finding
                previous = self._runs.get(ch.run, {}).get((f.kind, ch.rank))
                first = previous[1]["first_step"] if previous is not None and ch.action == "updated" else f.step
                self._put(ch.run, f.kind, ch.rank, ch.severity, first, f.step, f.message)

    def _put(
        self, run: str, kind: str, rank: int, severity: str, first: int | None, last: int | None, message: str
    ) -> None:
        self.revision += 1
        entry = {
            "kind": kind,
            "severity": severity,
            "rank": rank,
            "first_step": first,
            "last_step": last,
            "message": message,
        }
        self._runs.setdefault(run, {})[(kind, rank)] = (self.revision, entry)

    def since(self, run: str, severity: str, after: int) -> tuple[list[dict[str, Any]], int]:
        """The run's open findings at or above ``severity`` changed after revision ``after``, and the
        revision they are current to (the producer's next ``after``)."""
        least = SEVERITIES.index(severity)
        with self._lock:
            current = self.revision
            found = [
                entry
                for rev, entry in self._runs.get(run, {}).values()
                if rev > after and entry["severity"] in SEVERITIES and SEVERITIES.index(entry["severity"]) >= least
            ]
        found.sort(key=lambda e: (-SEVERITIES.index(e["severity"]), e["first_step"] is None, e["first_step"] or 0))
        return found[:MAX_FINDINGS], current

    def forget(self, run: str) -> None:
        """Drop an evicted run (bounded memory)."""
        with self._lock:
            self._runs.pop(run, None)
