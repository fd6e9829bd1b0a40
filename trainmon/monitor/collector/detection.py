"""The detector instances of every (run, rank) and run, and the routing of events to them.

Pure computation: no storage, no threads. The engine (``trainmon.monitor.collector.engine``) owns the anomaly
lifecycle around it and decides where it runs: in the caller's thread (imports, tests) or in a
child process (``trainmon.monitor.collector.detection_process``, the collector), where it does not share the
ingest path's GIL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.wire import Event

__all__ = ["RUN_WIDE", "Detection", "Found"]

RUN_WIDE = -1

log = logging.getLogger("trainmon.collector")

# (run, rank the anomaly belongs to (RUN_WIDE: the run), finding)
Found = tuple[str, int, Finding]


_Observe = Callable[[Event, int], list[Finding]]


class _Group:
    """The detectors of one (run, rank) or one run, in engine order, and which of them each event kind
    goes to (:attr:`Detector.consumes`), learnt at the kind's first event: their bound ``observe``
    (17 detectors' method lookups on every event were a tenth of the driver's time)."""

    __slots__ = ("dets", "routes")

    def __init__(self, dets: list[Detector]) -> None:
        self.dets = dets
        self.routes: dict[str, list[_Observe]] = {}

    def route(self, kind: str) -> list[_Observe]:
        route = self.routes.get(kind)
        if route is None:
            route = self.routes[kind] = [d.observe for d in self.dets if d.consumes is None or kind in d.consumes]
        return route

    def drop(self, failed: list[Detector]) -> None:
        for det in failed:
            self.dets.remove(det)
        self.routes.clear()


class Detection:
    """Detectors per (run, rank) for ``rank`` scope, per run for ``run`` scope; created on first sight."""

    def __init__(self, config: DetectorsConfig, detectors: tuple[type[Detector], ...] = ALL_DETECTORS) -> None:
        self._config = config
        self._rank_classes = [c for c in detectors if c.scope == "rank"]
        self._run_classes = [c for c in detectors if c.scope == "run"]
        # Only a detector with a tick of its own needs the clock (the built-in ones: run scope, hangs);
        # 16,384 ranks x 14 detectors were 230k empty calls a second in the detection process.
        self._rank_ticks = any(c.tick is not Detector.tick for c in self._rank_classes)
        self.rank_dets: dict[tuple[str, int], _Group] = {}
        self.run_dets: dict[str, _Group] = {}

    def _make(self, classes: list[type[Detector]]) -> _Group:
        dets = []
        for cls in classes:
            try:
                dets.append(cls(getattr(self._config, cls.kind)))
            except Exception:  # one broken detector must not blind the others
                log.exception("detector %s could not be created; running without it", cls.kind)
        return _Group(dets)

    def feed_rank(self, run: str, rank: int, history: list[tuple[Event, int]]) -> None:
        """Fresh detectors for (run, rank), rebuilt from its stored history; their findings are dropped
        (what they would report is stored already)."""
        group = self.rank_dets[(run, rank)] = self._make(self._rank_classes)
        _feed(group, history)

    def feed_run(self, run: str, history: list[tuple[Event, int]]) -> None:
        """Fresh run-scope detectors for ``run``, rebuilt from every rank's history (time order)."""
        group = self.run_dets[run] = self._make(self._run_classes)
        _feed(group, history)

    def observe(self, items: list[tuple[Event, int]]) -> list[Found]:
        """Events (with their attempt) in commit order; what the detectors found.

        An event goes to those detectors of its (run, rank), then of its run, that read its kind. A
        batch is mostly one rank's events of one kind in a row: who gets an event is looked up again
        only when its run, rank or kind differs from the previous one's (or a detector was dropped).
        """
        found: list[Found] = []
        run: str | None = None
        rank: int | None = None
        kind: str | None = None
        rank_group = run_group = _Group([])
        rank_route = run_route = rank_group.dets
        for event, attempt in items:
            if event.kind != kind or event.rank != rank or event.run != run:
                if event.rank != rank or event.run != run:
                    rank = event.rank
                    group = self.rank_dets.get((event.run, rank))
                    if group is None:
                        group = self.rank_dets[(event.run, rank)] = self._make(self._rank_classes)
                    rank_group = group
                    if event.run != run:
                        run = event.run
                        group = self.run_dets.get(run)
                        if group is None:
                            group = self.run_dets[run] = self._make(self._run_classes)
                        run_group = group
                kind = event.kind
                rank_route, run_route = rank_group.route(kind), run_group.route(kind)
            if rank_route and _observe(rank_group, rank_route, event, attempt, event.rank, found):
                kind = None  # a detector was dropped: the next event looks its detectors up again
            if run_route and _observe(run_group, run_route, event, attempt, RUN_WIDE, found):
                kind = None
        return found

    def tick(self, now: float) -> list[Found]:
        """Silence checks (hangs): ``now`` is wall time live, or the log's clock on import."""
        found: list[Found] = []
        if self._rank_ticks:
            for (run, rank), group in self.rank_dets.items():
                for det in group.dets:
                    found.extend((run, _rank(f, rank), f) for f in det.tick(now))
        for run, group in self.run_dets.items():
            for det in group.dets:
                found.extend((run, _rank(f, RUN_WIDE), f) for f in det.tick(now))
        return found

    def forget(self, run: str) -> None:
        for key in [k for k in self.rank_dets if k[0] == run]:
            del self.rank_dets[key]
        self.run_dets.pop(run, None)


def _observe(group: _Group, route: list[_Observe], event: Event, attempt: int, rank: int, found: list[Found]) -> bool:
    """One event to ``route`` (the detectors of ``group`` that read its kind); a detector that raises is
    dropped from the group (its run or rank), not the others. Whether one was."""
    failed = None
    for observe in route:
        try:
            out = observe(event, attempt)
        except Exception:
            det: Detector = observe.__self__  # type: ignore[attr-defined]
            log.exception("detector %s failed on a %s event of run %s; dropped for it", det.kind, event.kind, event.run)
            failed = [*(failed or ()), det]
            continue
        if out:  # usually empty: no generator per call
            found.extend((event.run, _rank(f, rank), f) for f in out)
    if failed:
        group.drop(failed)
        return True
    return False


def _rank(f: Finding, default: int) -> int:
    return default if f.rank is None else f.rank


def _feed(group: _Group, history: list[tuple[Event, int]]) -> None:
    for event, attempt in history:
        for observe in group.route(event.kind):
            observe(event, attempt)
