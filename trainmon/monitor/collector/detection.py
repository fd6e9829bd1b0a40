"""The detector instances of every (run, rank) and run, and the routing of events to them.

Pure computation: no storage, no threads. The engine (``trainmon.monitor.collector.engine``) owns the anomaly
lifecycle around it and decides where it runs: in the caller's thread (imports, tests) or in a
child process (``trainmon.monitor.collector.detection_process``, the collector), where it does not share the
ingest path's GIL.
"""

from __future__ import annotations

import logging

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.wire import Event

__all__ = ["RUN_WIDE", "Detection", "Found"]

RUN_WIDE = -1

log = logging.getLogger("trainmon.collector")

# (run, rank the anomaly belongs to (RUN_WIDE: the run), finding)
Found = tuple[str, int, Finding]


class Detection:
    """Detectors per (run, rank) for ``rank`` scope, per run for ``run`` scope; created on first sight."""

    def __init__(self, config: DetectorsConfig, detectors: tuple[type[Detector], ...] = ALL_DETECTORS) -> None:
        self._config = config
        self._rank_classes = [c for c in detectors if c.scope == "rank"]
        self._run_classes = [c for c in detectors if c.scope == "run"]
        # Only a detector with a tick of its own needs the clock (the built-in ones: run scope, hangs);
        # 16,384 ranks x 14 detectors were 230k empty calls a second in the detection process.
        self._rank_ticks = any(c.tick is not Detector.tick for c in self._rank_classes)
        self.rank_dets: dict[tuple[str, int], list[Detector]] = {}
        self.run_dets: dict[str, list[Detector]] = {}

    def _make(self, classes: list[type[Detector]]) -> list[Detector]:
        dets = []
        for cls in classes:
            try:
                dets.append(cls(getattr(self._config, cls.kind)))
            except Exception:  # one broken detector must not blind the others
                log.exception("detector %s could not be created; running without it", cls.kind)
        return dets

    def feed_rank(self, run: str, rank: int, history: list[tuple[Event, int]]) -> None:
        """Fresh detectors for (run, rank), rebuilt from its stored history; their findings are dropped
        (what they would report is stored already)."""
        dets = self.rank_dets[(run, rank)] = self._make(self._rank_classes)
        _feed(dets, history)

    def feed_run(self, run: str, history: list[tuple[Event, int]]) -> None:
        """Fresh run-scope detectors for ``run``, rebuilt from every rank's history (time order)."""
        dets = self.run_dets[run] = self._make(self._run_classes)
        _feed(dets, history)

    def observe(self, items: list[tuple[Event, int]]) -> list[Found]:
        """Events (with their attempt) in commit order; what the detectors found."""
        found: list[Found] = []
        for event, attempt in items:
            rank_dets = self.rank_dets.get((event.run, event.rank))
            if rank_dets is None:
                rank_dets = self.rank_dets[(event.run, event.rank)] = self._make(self._rank_classes)
            _observe(rank_dets, event, attempt, event.rank, found)
            run_dets = self.run_dets.get(event.run)
            if run_dets is None:
                run_dets = self.run_dets[event.run] = self._make(self._run_classes)
            _observe(run_dets, event, attempt, RUN_WIDE, found)
        return found

    def tick(self, now: float) -> list[Found]:
        """Silence checks (hangs): ``now`` is wall time live, or the log's clock on import."""
        found: list[Found] = []
        if self._rank_ticks:
            for (run, rank), dets in self.rank_dets.items():
                for det in dets:
                    found.extend((run, _rank(f, rank), f) for f in det.tick(now))
        for run, dets in self.run_dets.items():
            for det in dets:
                found.extend((run, _rank(f, RUN_WIDE), f) for f in det.tick(now))
        return found

    def forget(self, run: str) -> None:
        for key in [k for k in self.rank_dets if k[0] == run]:
            del self.rank_dets[key]
        self.run_dets.pop(run, None)


def _observe(dets: list[Detector], event: Event, attempt: int, rank: int, found: list[Found]) -> None:
    """One event to each detector; a detector that raises is dropped (for this run or rank), not the others."""
    failed = None
    for det in dets:
        try:
            out = det.observe(event, attempt)
        except Exception:
            log.exception("detector %s failed on a %s event of run %s; dropped for it", det.kind, event.kind, event.run)
            failed = [*(failed or ()), det]
            continue
        if out:  # usually empty: no generator per call
            found.extend((event.run, _rank(f, rank), f) for f in out)
    for det in failed or ():
        dets.remove(det)


def _rank(f: Finding, default: int) -> int:
    return default if f.rank is None else f.rank


def _feed(dets: list[Detector], history: list[tuple[Event, int]]) -> None:
    for event, attempt in history:
        for det in dets:
            det.observe(event, attempt)
