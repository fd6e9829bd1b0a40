"""The detector instances of every (run, rank) and run, and the routing of events to them.

Pure computation: no storage, no threads. The engine (``trainmon.monitor.collector.engine``) owns the anomaly
lifecycle around it and decides where it runs: in the caller's thread (imports, tests) or in a
child process (``trainmon.monitor.collector.detection_process``, the collector), where it does not share the
ingest path's GIL.
"""

from __future__ import annotations

import logging
import operator

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, NOTHING, Detector, Finding
from trainmon.monitor.detectors.batch import Reading, read
from trainmon.wire import Event

__all__ = ["RUN_WIDE", "Detection", "Found", "Keyed"]

RUN_WIDE = -1

log = logging.getLogger("trainmon.collector")

# (run, rank the anomaly belongs to (RUN_WIDE: the run), finding)
Found = tuple[str, int, Finding]
Keyed = tuple[tuple[int, int, int, int], Found]
"""A finding with its place in the order detection reports them: ``(event, rank before run, detector, finding)``
for what events showed, ``(rank before run, group, detector, finding)`` for what a tick showed. Detections that
share the detectors out (:class:`Detection`'s ``only``) report in one order when their keyed findings are merged."""


class _Group:
    """The detectors of one (run, rank) or one run, in engine order, each with its position among its scope's
    detectors (the same in every :class:`Detection` given the same detector classes, whichever it runs)."""

    __slots__ = ("dets", "places")

    def __init__(self, dets: list[Detector], places: list[int]) -> None:
        self.dets = dets
        self.places = places

    def feed(self, events: list[Event], attempts: list[int]) -> list[tuple[int, list[list[Finding]], list[int] | None]]:
        """Each detector's outputs for the events it reads (:attr:`Detector.consumes`), detector by detector:
        ``(its position, outputs, where)``, the outputs in event order, one for each of the batch's events, or where
        the detector reads only some, one for each of ``where``'s indices. A detector that raises is dropped from the
        group (its run or rank), not the others, and keeps what it found before.

        Detector by detector, not event by event: one detector's ``observe`` called over the whole batch
        (``map``, in C) keeps its code and state hot and its call site of one callee; event by event, 17
        callees took turns at one call site. Same findings, reordered by the caller: detection cost 1.75x
        less CPU on a 200k-step log.

        The batch is read once for all of them (:func:`.batch.read`): its columns and quiet scans are shared, and so
        are its events of the kinds that the detectors which read only some read (:meth:`.batch.Reading.kept`)."""
        out: list[tuple[int, list[list[Finding]], list[int] | None]] = []
        failed: list[Detector] = []
        parts: dict[frozenset[str], tuple[Reading, list[int]] | None] = {}
        with read(events) as batch:
            present = batch.present
            for pos, det in zip(self.places, self.dets, strict=True):
                reads = det.consumes
                if reads is None or present <= reads:
                    evs, atts, at = events, attempts, None
                else:
                    kinds = present & reads
                    if kinds not in parts:
                        parts[kinds] = _part(batch, kinds, attempts)
                    part = parts[kinds]
                    if part is None:
                        continue
                    evs, atts, at = part[0].events, part[1], part[0].at
                outs: list[list[Finding]] = []
                try:  # both keep the outputs before a raise
                    if len(evs) < det.batch_from:
                        outs.extend(map(det.observe, evs, atts))
                    else:
                        det.observe_batch(evs, atts, outs)
                except Exception:
                    ev = evs[min(len(outs), len(evs) - 1)]  # an override may raise after its last output
                    log.exception(
                        "detector %s failed on a %s event of run %s; dropped for it", det.kind, ev.kind, ev.run
                    )
                    failed.append(det)
                out.append((pos, outs, at))
        for det in failed:
            del self.places[self.dets.index(det)]
            self.dets.remove(det)
        return out


def _part(batch: Reading, kinds: frozenset[str], attempts: list[int]) -> tuple[Reading, list[int]] | None:
    """The batch's events of ``kinds`` (:meth:`.batch.Reading.kept`) and their attempts, None where there are none."""
    kept = batch.kept(kinds) if kinds else None
    return None if kept is None else (kept, kept.cut(attempts))


class Detection:
    """Detectors per (run, rank) for ``rank`` scope, per run for ``run`` scope; created on first sight.

    ``only``: the kinds of ``detectors`` this one runs (all when None). Detections given the same ``detectors``
    and disjoint ``only`` can share the work out: merged by key, their keyed findings are in the order one
    Detection of them all reports (an import runs some in its own thread and the rest in a child process)."""

    def __init__(
        self,
        config: DetectorsConfig,
        detectors: tuple[type[Detector], ...] = ALL_DETECTORS,
        only: frozenset[str] | None = None,
    ) -> None:
        self._config = config
        self._only = only
        self._rank_classes = [c for c in detectors if c.scope == "rank"]
        self._run_classes = [c for c in detectors if c.scope == "run"]
        # Only a detector with a tick of its own needs the clock (the built-in ones: run scope, hangs);
        # 16,384 ranks x 14 detectors were 230k empty calls a second in the detection process.
        self._rank_ticks = any(c.tick is not Detector.tick for c in self._rank_classes)
        self.rank_dets: dict[tuple[str, int], _Group] = {}
        self.run_dets: dict[str, _Group] = {}

    def _make(self, classes: list[type[Detector]]) -> _Group:
        dets, places = [], []
        for place, cls in enumerate(classes):
            if self._only is not None and cls.kind not in self._only:
                continue
            try:
                dets.append(cls(getattr(self._config, cls.kind)))
                places.append(place)
            except Exception:  # one broken detector must not blind the others
                log.exception("detector %s could not be created; running without it", cls.kind)
        return _Group(dets, places)

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
        """Events (with their attempt) in commit order; what the detectors found, in the order of the events
        (for one event: its rank's detectors, then its run's, each in engine order)."""
        return [found for _, found in self.observe_keyed(items)]

    def observe_keyed(self, items: list[tuple[Event, int]]) -> list[Keyed]:
        """:meth:`observe`'s findings with their keys, in key order.

        An event goes to those detectors of its (run, rank), then of its run, that read its kind. Each group
        takes its events of the batch at once (``_Group.feed``), and the findings are put back in event order.
        A batch of one run and rank (an import's) is read once for both its groups (:func:`.batch.read`).
        """
        return self.observe_events(list(map(_EVENT, items)), list(map(_ATTEMPT, items)))

    def observe_events(
        self, events: list[Event], attempts: list[int], key: tuple[str, int] | None = None
    ) -> list[Keyed]:
        """:meth:`observe_keyed` of the events and their attempts as two lists. ``key``: the (run, rank) of every
        event, where the caller knows the batch is of one (the detection pipe's columns say so), else None."""
        runs: dict[str, list[int]] = {}
        keyed: list[Keyed] = []
        with read(events) as batch:
            by_key = _by_key(events) if key is None else {key: list(range(len(events)))}
            if len(by_key) == 1:  # the batch's detectors may read its rank rather than each event's
                batch.rank = next(iter(by_key))[1]
            for (run, rank), at in by_key.items():
                group = self.rank_dets.get((run, rank))
                if group is None:
                    group = self.rank_dets[(run, rank)] = self._make(self._rank_classes)
                if run not in runs:
                    runs[run] = []
                    if run not in self.run_dets:
                        self.run_dets[run] = self._make(self._run_classes)
                _collect(group, events, attempts, at, run, rank, 0, keyed)
                runs[run].extend(at)
            for run, at in runs.items():
                if self.run_dets[run].dets:
                    at.sort()
                    _collect(self.run_dets[run], events, attempts, at, run, RUN_WIDE, 1, keyed)
        keyed.sort(key=_KEY)
        return keyed

    def tick(self, now: float) -> list[Found]:
        """Silence checks (hangs): ``now`` is wall time live, or the log's clock on import."""
        return [found for _, found in self.tick_keyed(now)]

    def tick_keyed(self, now: float) -> list[Keyed]:
        """:meth:`tick`'s findings with their keys, in key order: ranks' detectors before runs', each group in the
        order it was first seen, each detector in engine order."""
        keyed: list[Keyed] = []
        if self._rank_ticks:
            for g, ((run, rank), group) in enumerate(self.rank_dets.items()):
                for pos, det in zip(group.places, group.dets, strict=True):
                    keyed.extend(((0, g, pos, k), (run, _rank(f, rank), f)) for k, f in enumerate(det.tick(now)))
        for g, (run, group) in enumerate(self.run_dets.items()):
            for pos, det in zip(group.places, group.dets, strict=True):
                keyed.extend(((1, g, pos, k), (run, _rank(f, RUN_WIDE), f)) for k, f in enumerate(det.tick(now)))
        return keyed

    def forget(self, run: str) -> None:
        for key in [k for k in self.rank_dets if k[0] == run]:
            del self.rank_dets[key]
        self.run_dets.pop(run, None)


def _by_key(events: list[Event]) -> dict[tuple[str, int], list[int]]:
    """The batch's indices by (run, rank), keys in the order first seen. A batch of one (run, rank), an import's
    always, is told so by two passes in C (the loop over every event: 0.02 s more per million events in each
    process that runs detectors, 15 % of the driver's own cost)."""
    if not events:
        return {}
    runs, ranks = set(map(_RUN, events)), set(map(_RANK, events))
    if len(runs) == 1 and len(ranks) == 1:
        return {(events[0].run, events[0].rank): list(range(len(events)))}
    by_key: dict[tuple[str, int], list[int]] = {}
    for i, event in enumerate(events):
        key = (event.run, event.rank)
        at = by_key.get(key)
        if at is None:
            at = by_key[key] = []
        at.append(i)
    return by_key


def _collect(
    group: _Group,
    events: list[Event],
    attempts: list[int],
    at: list[int],
    run: str,
    rank: int,
    scope: int,
    keyed: list[Keyed],
) -> None:
    """The findings of ``group`` on the events ``events[i] for i in at`` (with their attempts), each with its place
    in the batch's order: (event, rank before run, detector, finding)."""
    if not group.dets:
        return
    if len(at) < len(events):
        events = [events[i] for i in at]
        attempts = [attempts[i] for i in at]
    for pos, outs, where in group.feed(events, attempts):
        # Nearly every batch of every detector finds nothing: count() of the shared empty output says so in C, by
        # identity (an empty output that is not NOTHING is equal to it), where a loop over the outputs cost 0.3 s for
        # 18 detectors on a million events and any(), which asks each output its length, 0.12 s.
        if outs.count(NOTHING) < len(outs):
            for j, out in enumerate(outs):
                if out:
                    i = at[j if where is None else where[j]]
                    keyed.extend(((i, scope, pos, k), (run, _rank(f, rank), f)) for k, f in enumerate(out))


_KEY = operator.itemgetter(0)
_EVENT, _ATTEMPT = operator.itemgetter(0), operator.itemgetter(1)  # of an item
_RUN, _RANK = operator.attrgetter("run"), operator.attrgetter("rank")


def _rank(f: Finding, default: int) -> int:
    return default if f.rank is None else f.rank


def _feed(group: _Group, history: list[tuple[Event, int]]) -> None:
    group.feed(list(map(_EVENT, history)), list(map(_ATTEMPT, history)))
