"""The writes the collector makes besides bulk event rows (:meth:`Storage.insert_ignore`): the
anomaly lifecycle, and the streams' and runs' bookkeeping. The callers decide what the values are;
here is only how they reach the tables, inside the caller's transaction."""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import Connection, Update, bindparam, update

from trainmon.monitor.store.storage import anomalies, runs, streams

__all__ = ["insert_anomaly", "insert_run", "insert_stream", "update_anomaly", "update_run", "update_streams"]


def insert_anomaly(conn: Connection, **values: Any) -> int:
    """Store a new anomaly; its id."""
    return conn.execute(anomalies.insert().values(**values)).inserted_primary_key[0]


def update_anomaly(conn: Connection, anomaly_id: int, **values: Any) -> None:
    """Change columns of one stored anomaly."""
    conn.execute(update(anomalies).where(anomalies.c.id == anomaly_id).values(**values))


def insert_stream(conn: Connection, **values: Any) -> None:
    """Store a stream seen for the first time."""
    conn.execute(streams.insert().values(**values))


def update_streams(conn: Connection, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    """Update stored streams in one executemany: each row names its stream (``b_stream``), the
    events it adds to the stream's count (``b_events``) and the new values of ``columns`` (those
    not starting with ``b_``). One statement for all, not one per stream: a group holds hundreds."""
    conn.execute(_update_streams(columns), rows)


@functools.lru_cache(maxsize=64)
def _update_streams(columns: tuple[str, ...]) -> Update:
    """The statement of :func:`update_streams`, made once per set of columns (a few: a stream's start and end
    come once each): built anew, it cost SQLAlchemy six times what running it does, once per group committed."""
    return (
        update(streams)
        .where(streams.c.stream == bindparam("b_stream"))
        .values(
            events=streams.c.events + bindparam("b_events"),
            **{c: bindparam(c) for c in columns if not c.startswith("b_")},
        )
    )


def insert_run(conn: Connection, **values: Any) -> None:
    """Store a run seen for the first time."""
    conn.execute(runs.insert().values(**values))


def update_run(conn: Connection, run: str, **values: Any) -> None:
    """Change columns of a stored run."""
    conn.execute(_update_run(tuple(values)), {"b_run": run, **values})


@functools.lru_cache(maxsize=64)
def _update_run(columns: tuple[str, ...]) -> Update:
    """The statement of :func:`update_run`, made once per set of columns (as :func:`_update_streams`)."""
    return update(runs).where(runs.c.run == bindparam("b_run")).values({c: bindparam(c) for c in columns})
