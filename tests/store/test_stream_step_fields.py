"""``streams.step_fields``: the step fields each stream's stored steps hold, kept by the ingest as it stores them, so a
reader asks the record, not a pass over every step (the post-mortem's summary: whether the lowest rank's steps carry a
step time, tokens or a phase time). Grown by each batch with a field new to the stream, in one group or several
streams at once; a stream whose record is unknown (stored before it was kept) stays unknown as it goes on, since
its new steps alone would deny what its old ones hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, select

import trainmon.monitor.store.storage as storage_module
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage, streams
from trainmon.wire import Event, validate_event


def _event(stream: str, rank: int, seq: int, kind: str = "step", **fields: Any) -> Event:
    raw = {"kind": kind, "run": "r", "rank": rank, "host": "h", "stream": stream, "seq": seq, "time": 1e3 + seq}
    return validate_event({**raw, "fields": fields})


def _records(store: Storage) -> dict[str, list[str] | None]:
    with store.connect() as conn:
        return {row.stream: row.step_fields for row in conn.execute(select(streams.c.stream, streams.c.step_fields))}


def _ingestor(store: Storage) -> Ingestor:
    return Ingestor(store, Engine(store, DetectorsConfig(), process=False), None)


def test_the_record_grows_with_each_field_a_stream_stores(store: Storage) -> None:
    ingestor = _ingestor(store)
    ingestor.ingest([_event("s0", 0, 0, "run_start", config={}), _event("s1", 1, 0, "run_start", config={})])
    assert _records(store) == {"s0": [], "s1": []}  # known, and nothing held yet: not NULL
    ingestor.ingest([_event("s0", 0, i, step=i, loss=2.0) for i in range(1, 4)])
    assert _records(store) == {"s0": ["loss", "step"], "s1": []}
    # one group of two streams' segments, each with fields of its own; an eval is no step
    mixed = [
        _event("s0", 0, 4, step=4, loss=1.9, tokens=4096),
        _event("s1", 1, 1, step=1, loss=2.0, step_time=0.5, phases={"forward": 0.1}),
        _event("s0", 0, 5, "eval", step=5, loss=1.8),
        _event("s0", 0, 6, step=6, loss=1.7),
    ]
    ingestor.ingest(mixed)
    assert _records(store) == {"s0": ["loss", "step", "tokens"], "s1": ["loss", "phases", "step", "step_time"]}
    ingestor.ingest(mixed)  # the same batch again: duplicates, nothing stored, nothing new held
    ingestor.ingest([_event("s0", 0, 7, step=7, loss=1.6)])  # nothing new: the record stays
    assert _records(store)["s0"] == ["loss", "step", "tokens"]


def test_a_stream_stored_before_the_record_stays_unknown(store: Storage) -> None:
    """A stream an older collector stored (the schema at revision 0004, before the record), taken up after the upgrade
    by a collector started afresh: more steps, with a field of their own, leave its record unknown, so readers go on
    probing its steps; a stream started after the upgrade is recorded."""
    url = store.url
    store.close()
    with create_engine(url).begin() as conn:  # the database as revision 0004 left it, with one stream stored
        storage_module.metadata.drop_all(conn)
        conn.exec_driver_sql("DROP TABLE alembic_version")
        config = Config()
        config.set_main_option("script_location", str(Path(storage_module.__file__).parent / "migrations"))
        config.attributes["connection"] = conn
        command.upgrade(config, "0004")
        conn.exec_driver_sql(
            "INSERT INTO streams (stream, run, rank, attempt, host, started_at, last_seq, last_time, events, missing) "
            "VALUES ('s0', 'r', 0, 0, 'h', 1000.0, 2, 1002.0, 3, 0)"
        )
        conn.exec_driver_sql(
            "INSERT INTO runs (run, created_at, updated_at, status) VALUES ('r', 1000.0, 1002.0, 'running')"
        )
    upgraded = Storage(url)  # migrates to the head
    try:
        _ingestor(upgraded).ingest([_event("s0", 0, i, step=i, loss=1.0, step_time=0.3) for i in range(3, 6)])
        _ingestor(upgraded).ingest([_event("s1", 1, 0, step=0, loss=1.0)])
        assert _records(upgraded) == {"s0": None, "s1": ["loss", "step"]}
    finally:
        upgraded.close()
