"""One run to analyse: a run id in a store (``--db PATH_OR_URL``), or a foreign log file or folder
imported into an in-memory store first, so both go through the same queries and detectors.

``postmortem FILE`` and ``compare A B`` read runs this way; ``status`` and ``runs`` read a store as
it is (:class:`~trainmon.monitor.analysis.live_view.DbSource`: ``Storage(db, create=False)``, the
store layer's own "open an existing store"), and the web view reads the collector's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.store.storage import Storage

__all__ = ["OpenRunError", "OpenedRun", "import_file", "open_run"]


class OpenRunError(ValueError):
    """The target is neither a run in the store nor a log holding the run asked for; the message says which."""


@dataclass
class OpenedRun:
    """A store and the run in it to read; close it (or use it as a context manager) when done."""

    storage: Storage
    run: str

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> OpenedRun:
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


def open_run(
    target: str | Path,
    db: str | None = None,
    run: str | None = None,
    *,
    config: CollectorConfig | None = None,
    progress: Callable[[int], None] | None = None,
    choose: str = "--run",
) -> OpenedRun:
    """``target`` as a run id in ``db`` when ``db`` holds it, else as a log file or folder imported
    into memory (running the detectors with ``config``; ``progress`` gets the events read so far).

    ``run`` picks one run of a file that holds several; without it such a file is an error naming
    ``choose`` (the option that picks one). Raises :class:`OpenRunError`, and ``FileNotFoundError``
    when ``db`` is a SQLite path with no store (reading never creates one)."""
    if db is not None:
        storage = Storage(db, create=False)
        if str(target) in storage.run_ids():
            return OpenedRun(storage, str(target))
        storage.close()
    path = Path(target)
    if not path.exists():
        where = f"a run in {db} nor " if db else ""
        raise OpenRunError(f"{target}: not {where}a log file or folder" + ("" if db else " (give --db for run ids)"))
    storage = Storage("sqlite://")
    try:
        found = import_file(path, storage, config, progress)
        if run is None and len(found) > 1:
            raise OpenRunError(f"{target} holds runs {found}; choose one with {choose}")
        chosen = run or found[0]
        if chosen not in found:
            raise OpenRunError(f"{target} holds runs {found}, not {chosen!r}")
    except ValueError as exc:
        storage.close()
        raise OpenRunError(str(exc)) from None
    return OpenedRun(storage, chosen)


def import_file(
    path: str | Path,
    storage: Storage,
    config: CollectorConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Ingest a log file or folder into ``storage`` (running the detectors); the run ids it held.

    ``progress`` is called with the number of events read so far after each batch. Here, not beside
    the analysis: a post-mortem of a file imports the analysis (pandas, the queries) only once the
    log is in."""
    from trainmon.monitor.importers.store import import_log  # the detectors: only files need them

    return import_log(path, storage, config, progress=progress).runs
