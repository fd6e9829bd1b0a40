"""Store an imported log in a collector database (``trainmon import FILE --db``).

The one import path (``trainmon.monitor.analysis.postmortem.import_file`` calls it too): the collector's
:class:`~trainmon.monitor.collector.ingest.Ingestor` and detector engine, so an imported run lands in the store with
its anomalies, exactly as if its trainer had reported live, with an optional run name and CSV
column mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.importers import read_events
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

__all__ = ["ImportResult", "import_log"]

_BATCH = 5000


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
    ingestor = Ingestor(storage, Engine(storage, config.detectors), LiveState())
    seen: dict[str, None] = {}
    batch: list[Event] = []
    total = stored = 0

    def flush() -> None:
        nonlocal stored
        stored += ingestor.ingest(batch).accepted
        ingestor.engine.tick(max(e.time for e in batch))  # the log's own clock, for silence checks
        batch.clear()
        if progress is not None:
            progress(total)

    for event in read_events(path, run=run, mapping=mapping):
        seen.setdefault(event.run)
        batch.append(event)
        total += 1
        if len(batch) >= _BATCH:
            flush()
    if batch:
        flush()
    if not seen:
        raise ValueError(f"{path}: no events found")
    return ImportResult(list(seen), total, stored)
