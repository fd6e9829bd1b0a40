"""Which runs the store lets go: the collector's ``[retention]`` limits, applied in one pass.

Prometheus bounds its storage the same two ways (``--storage.tsdb.retention.time`` and ``.size``).
Only finished runs go, whole and least recently updated first: a run that ended, or one whose
trainer has been silent longer than ``stale_after`` seconds (it crashed without ``run_end``; the
collector evicts it from memory after the same time). A run the caller names as live is never
deleted, whatever the store says of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container

from trainmon.monitor.store.lifecycle import delete_run, retention_candidates, store_bytes
from trainmon.monitor.store.queries import run_row
from trainmon.monitor.store.storage import Storage

__all__ = ["RunLiveError", "apply_retention", "delete_ended_run", "describe_retention", "receiving"]

log = logging.getLogger("trainmon.retention")

_DAY = 86400.0


def receiving(status: str, updated_at: float, now: float, stale_after: float) -> bool:
    """Whether the store says a run may still be receiving events: not ended, and heard from within
    ``stale_after`` seconds. Such a run is neither deleted nor expired."""
    return status == "running" and now - updated_at <= stale_after


class RunLiveError(RuntimeError):
    """A run still receiving events cannot be deleted (the collector answers 409)."""


def delete_ended_run(storage: Storage, run: str, stale_after: float, *, live: bool = False) -> int:
    """Delete ``run`` unless it may still be receiving events (``live``: its collector still holds it); the
    rows deleted. ``KeyError`` for an unknown run, :class:`RunLiveError` for one still receiving. The one
    check the collector's ``DELETE`` and ``trainmon delete --db`` both make."""
    with storage.connect() as conn:
        row = run_row(conn, run)
    if row is None:
        raise KeyError(f"no run {run!r}")
    now = time.time()
    if live or receiving(row.status, row.updated_at, now, stale_after):
        raise RunLiveError(
            f"run {run!r} may still be receiving events (running, last event {max(0.0, now - row.updated_at):.0f} s "
            f"ago): a run still receiving events can be deleted once it ends (run_end) or has been idle for more "
            f"than {stale_after:g} s"
        )
    return delete_run(storage, run)


def apply_retention(
    storage: Storage,
    *,
    max_age_days: float,
    max_bytes: int,
    now: float,
    stale_after: float,
    live: Container[str] = (),
    forget: Callable[[str], None] = lambda _run: None,
) -> list[str]:
    """Delete the finished runs past ``max_age_days``, then the oldest finished ones while the store
    holds more than ``max_bytes`` (0 turns a limit off); the runs deleted, in order. ``forget`` is
    called with each one after its rows are gone (the collector drops it from memory)."""
    with storage.connect() as conn:
        candidates = [
            (r.run, r.updated_at)
            for r in retention_candidates(conn)
            if r.run not in live and not receiving(r.status, r.updated_at, now, stale_after)
        ]
    deleted: list[str] = []

    def remove(run: str, why: str) -> None:
        delete_run(storage, run)
        forget(run)
        deleted.append(run)
        log.info("retention: deleted run %s (%s)", run, why)

    if max_age_days > 0:
        oldest = now - max_age_days * _DAY
        for run, updated_at in candidates:
            if updated_at < oldest:
                remove(run, f"last event {(now - updated_at) / _DAY:.1f} days ago, limit {max_age_days:g}")
    if max_bytes > 0:
        for run, _ in candidates:
            if run in deleted:
                continue
            size = store_bytes(storage)
            if size <= max_bytes:
                break
            remove(run, f"store holds {size:,} bytes, limit {max_bytes:,}")
    return deleted


def describe_retention(max_age_days: float, max_bytes: int) -> str:
    """The limits in words, for the collector's start-up line."""
    parts = []
    if max_age_days > 0:
        parts.append(f"finished runs older than {max_age_days:g} days")
    if max_bytes > 0:
        parts.append(f"the oldest finished runs while the store exceeds {max_bytes / 2**30:.3g} GiB")
    return "retention: deletes " + " and ".join(parts) if parts else "retention: off (runs are kept for ever)"
