"""Store an imported log in a collector database (``trainmon import FILE --db``).

The one import path (``trainmon.monitor.analysis.postmortem.import_file`` calls it too): the collector's
:class:`~trainmon.monitor.collector.ingest.Ingestor` and detector engine, so an imported run lands in the store with
its anomalies, exactly as if its trainer had reported live, with an optional run name and CSV
column mapping.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import IngestError, Ingestor, IngestResult
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.importers import log_files, read_events
from trainmon.monitor.store.storage import Storage

__all__ = ["ImportResult", "import_log"]

_BATCH = 10_000
"""Events an import stores and sends to detection at a time. Each batch costs its fixed part on both sides (a
statement, a reading, each detector's screen set up); a million-row CSV on a quiet machine, interleaved: 5.24-5.40 s
at 10,000, 5.43-5.66 at 5,000, 5.32-5.68 at 20,000 (the child starts its first batch later, and the last one's
detection is waited for); a 300k-entry trainer_state.json and a 200k-row CSV take the same time at 5,000 and 10,000.
The findings do not depend on it: every detector's are the same at every cut of a stream into batches."""
_PROCESS_FROM = 8 << 20
"""Bytes of log from which an import's detection runs in a child process. Known before the parse, so the child
starts (0.25 s of CPU, 0.45 s to its first answer) on another core while this one parses: counted in events (from
50,000), it started after a million-row CSV's first 1.2 s of parsing, and the import waited 0.3-0.4 s more on it.
8 MiB is about 50,000 entries of an HF trainer_state.json (whose 30,000 entries, 4.9 MB, took 0.2 s longer with
the child: their parse is too short to hide its start), 125,000 rows of a four-column CSV (a 100,000-row one, 6.5
MB, took as long either way)."""
_IN_THREAD = frozenset(("divergence",))
"""The detectors that still run in the importing thread beside the child. Since the detectors decide most steps of a
batch at once (``Detector.observe_batch``), detection is the smaller half of a long import. A million-row CSV on a
quiet machine (session 14, the child started during the parse), interleaved: 5.35-5.46 s with divergence alone here
(one run of five 5.90), 5.63-5.93 s with lr_schedule_drift as well; session 13 (the child started after the first
50,000 events): 7.2-7.3 s with both, 7.5-7.6 s with grad_explosion and degenerate as well, 8.0-8.6 s with none.
Where each runs changes no finding (``SplitDetection``)."""


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
    # A long log's detection runs in the collector's detection process, on another core, while this thread
    # parses and stores the next batches (a million-row log: 11 of 23 CPU seconds were detection). Its findings
    # are stored here, between batches (``deferred``), in the order the events were stored. A short log is
    # done before the process would have started.
    process = _size(Path(path)) >= _PROCESS_FROM
    engine = Engine(storage, config.detectors, process=process, in_thread=_IN_THREAD, deferred=True)
    ingestor = Ingestor(storage, engine, None)  # nothing reads live values of a log
    runs: dict[str, None] = {}
    results: list[IngestResult | IngestError] = []
    total = 0
    # The parsed log lives until its last event is ingested: kept out of the garbage collector's scans,
    # which it would otherwise lengthen all through the ingest (see importers.common.gc_paused). The ingest
    # makes no cyclic garbage worth a collection (rows, events, the detectors' empty outputs: reference
    # counting frees them), so the collector is paused too: its collections cost a 200k-step log's detection
    # 7% of its CPU for nothing. Paused from before the parse: re-enabled after it, the collector's next pass
    # went over every point the parse had made (0.18 s of a million-row CSV).
    enabled = gc.isenabled()
    gc.disable()
    try:
        events = read_events(path, run=run, mapping=mapping)
        gc.freeze()
        while batch := list(itertools.islice(events, _BATCH)):
            # comprehensions, not map(attrgetter): Python 3.11 reads a slot in bytecode faster (0.017 s of 1M events)
            runs.update(dict.fromkeys([ev.run for ev in batch]))
            total += len(batch)
            ingestor.ingest_group([batch], results.extend)
            engine.tick(max([ev.time for ev in batch]))  # the log's own clock, for silence checks
            engine.settle()
            _raise_refused(results)
            if progress is not None:
                progress(total)
        engine.settle(wait=True)
        _raise_refused(results)
        if engine.detection.lost:
            # A detection process that died (killed, out of memory) answered what it held with nothing: the
            # events are stored, their findings are not. Live, that is logged and the collector goes on; a
            # post-mortem that kept quiet would report those steps clean.
            raise RuntimeError(
                f"{path}: the detection process stopped during the import, so some steps were never checked "
                "by the detectors (see the log above); import the log again"
            )
    finally:
        engine.close()
        gc.unfreeze()
        if enabled:
            gc.enable()
    if not runs:
        raise ValueError(f"{path}: no events found")
    return ImportResult(list(runs), total, sum(r.accepted for r in results if isinstance(r, IngestResult)))


def _size(path: Path) -> int:
    """The bytes of the log a path holds: the file, or the log files of a folder (its JSONL streams or TensorBoard
    event files; a run folder's checkpoints beside them would start a detection process for a short log)."""
    try:
        return sum(f.stat().st_size for f in log_files(path))
    except OSError:  # read_events says what is wrong with it
        return 0


def _raise_refused(results: list[IngestResult | IngestError]) -> None:
    """A batch the store refused (it contradicts what is stored) fails the import, as a live batch gets a 409."""
    for result in results:
        if isinstance(result, IngestError):
            raise result
