"""Removing runs and measuring the store: what ``trainmon delete`` and the collector's retention use.

A run is deleted a bounded batch of rows at a time, each batch its own short transaction, so a
collector ingesting other runs into the same store waits at most one batch (SQLite has one writer
at a time) instead of the whole delete. The ``runs`` row goes last: a delete cut short (a crash, a
full disk) leaves the run listed, and deleting it again finishes the job.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, Row, Table, select, text

from trainmon.monitor.store.storage import (
    Storage,
    anomalies,
    checkpoints,
    evals,
    health,
    layer_stats,
    metadata,
    resumes,
    runs,
    steps,
    streams,
)

__all__ = ["DELETE_BATCH_ROWS", "delete_run", "retention_candidates", "store_bytes"]

DELETE_BATCH_ROWS = 2000
"""Rows one delete transaction removes at most: a few milliseconds of the writer's time."""

# Per-run rows first, the run last (see the module docstring).
_RUN_TABLES: tuple[Table, ...] = (anomalies, health, layer_stats, evals, checkpoints, resumes, steps, streams, runs)


def delete_run(storage: Storage, run: str, batch_rows: int = DELETE_BATCH_ROWS) -> int:
    """Delete every row of ``run`` in every table, ``batch_rows`` rows per transaction; the rows deleted."""
    row_id = "ctid" if storage.dialect == "postgresql" else "rowid"  # each dialect's physical row address
    deleted = 0
    for table in _RUN_TABLES:
        sql = text(
            f"DELETE FROM {table.name} WHERE {row_id} IN (SELECT {row_id} FROM {table.name} WHERE run = :run LIMIT :n)"
        )
        while True:
            with storage.begin() as conn:
                count = conn.execute(sql, {"run": run, "n": batch_rows}).rowcount
            deleted += count
            if count < batch_rows:
                break
    return deleted


def retention_candidates(conn: Connection) -> Sequence[Row]:
    """``(run, status, updated_at)`` of every run, least recently updated first: the order retention
    deletes in."""
    return conn.execute(select(runs.c.run, runs.c.status, runs.c.updated_at).order_by(runs.c.updated_at)).all()


def store_bytes(storage: Storage) -> int:
    """The bytes the store's data takes.

    SQLite: the pages in use (``page_count - freelist_count`` times ``page_size``): deleted rows free
    pages that later inserts reuse, while the file keeps its size until a ``VACUUM``.
    PostgreSQL: the live rows' estimated size, tables and their indexes, from fresh ``ANALYZE``
    statistics (rows times average row width, scaled by each table's index-to-heap ratio):
    ``pg_database_size`` does not shrink when rows are deleted (only ``VACUUM FULL``, which locks the
    tables, returns the space), so a limit on it would delete every finished run, one pass after another.
    """
    with storage.begin() as conn:
        if storage.dialect == "postgresql":
            return _postgres_live_bytes(conn)
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one()
        free = conn.exec_driver_sql("PRAGMA freelist_count").scalar_one()
        size = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
        return int((pages - free) * size)


_TUPLE_OVERHEAD = 28  # bytes of a PostgreSQL row's header and line pointer


def _postgres_live_bytes(conn: Connection) -> int:
    names = [t.name for t in metadata.sorted_tables]
    for name in names:
        conn.exec_driver_sql(f"ANALYZE {name}")  # samples ~30,000 rows; takes no lock that blocks inserts
    widths = dict(
        conn.execute(
            text(
                "SELECT tablename, sum(avg_width) FROM pg_stats "
                "WHERE schemaname = current_schema() AND tablename = ANY(:names) GROUP BY tablename"
            ),
            {"names": names},
        ).all()
    )
    total = 0.0
    for name in names:
        tuples, heap, whole = conn.execute(
            text(
                "SELECT greatest(reltuples, 0), pg_relation_size(oid), pg_total_relation_size(oid) "
                "FROM pg_class WHERE oid = to_regclass(:name)"
            ),
            {"name": name},
        ).one()
        row = float(widths.get(name) or 0) + _TUPLE_OVERHEAD
        total += tuples * row * (whole / heap if heap else 1.0)
    return int(total)
