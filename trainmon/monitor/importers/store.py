"""Store an imported log in a collector database (``trainmon import FILE --db``).

The one import path (``trainmon.monitor.analysis.postmortem.import_file`` calls it too): the collector's
:class:`~trainmon.monitor.collector.ingest.Ingestor` and detector engine, so an imported run lands in the store with
its anomalies, exactly as if its trainer had reported live, with an optional run name and CSV
column mapping.
"""

from __future__ import annotations

import gc
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.importers import read_events
from trainmon.monitor.store.storage import Storage

__all__ = ["ImportResult", "import_log"]

_BATCH = 5000
_RUN = operator.attrgetter("run")
_TIME = operator.attrgetter("time")


@dataclass(frozen=True, slots=True)
class ImportResult:
    runs: list[str]
    events: int
    stored: int
    """Events newly stored; fewer than ``events`` when the same log was imported before."""


def import_log(
    path: str | Path,
    storage: Storage,
    config: CollectorConfig | None = None,
    *,
    run: str | None = None,
    mapping: str | dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ImportResult:
    """Ingest a log file or folder into ``storage``, running the detectors on it.

    ``progress`` is called with the number of events read so far after each batch.
    """
    config = config or CollectorConfig()
    ingestor = Ingestor(storage, Engine(storage, config.detectors), None)  # nothing reads live values of a log
    runs: dict[str, None] = {}
    total = stored = 0
    events = read_events(path, run=run, mapping=mapping)
    # The parsed log lives until its last event is ingested: kept out of the garbage collector's scans,
    # which it would otherwise lengthen all through the ingest (see importers.common.gc_paused). The ingest
    # makes no cyclic garbage worth a collection (rows, events, the detectors' empty outputs: reference
    # counting frees them), so the collector is paused too: its collections cost a 200k-step log's detection
    # 7% of its CPU for nothing.
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        while batch := list(itertools.islice(events, _BATCH)):
            runs.update(dict.fromkeys(map(_RUN, batch)))
            total += len(batch)
            stored += ingestor.ingest(batch).accepted
            ingestor.engine.tick(max(map(_TIME, batch)))  # the log's own clock, for silence checks
            if progress is not None:
                progress(total)
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
    if not runs:
        raise ValueError(f"{path}: no events found")
    return ImportResult(list(runs), total, stored)
