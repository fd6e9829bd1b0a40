"""The same storage behaviour on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import math

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from tests.events import batch, event, step_events
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage, anomalies, metadata, steps, streams
from trainmon.wire import validate_batch


def _ingest(storage: Storage, events: list[dict]) -> tuple[int, int]:
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    result = ingestor.ingest(validate_batch(batch(events)))
    return result.accepted, result.duplicates


def test_migrations_build_exactly_the_declared_schema(store: Storage) -> None:
    with store.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_reopening_a_store_keeps_its_data(store: Storage) -> None:
    _ingest(store, step_events(3))
    again = Storage(store.url)  # runs the migrations again: a no-op at head
    with again.connect() as conn:
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 3
    again.close()


def test_non_finite_values_round_trip(store: Storage) -> None:
    values = {0: math.nan, 1: math.inf, 2: -math.inf, 3: 1.5}
    enc = {math.inf: "Infinity", -math.inf: "-Infinity"}
    evs = step_events(4, loss=lambda i: "NaN" if math.isnan(values[i]) else enc.get(values[i], values[i]))
    _ingest(store, evs)
    with store.connect() as conn:
        got = dict(conn.execute(select(steps.c.step, steps.c.loss)).all())
    assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf and got[3] == 1.5


def test_ingest_is_idempotent_and_counts_attempts(store: Storage) -> None:
    first = [event("run_start", {"world_size": 1}, seq=0), *step_events(10)]
    assert _ingest(store, first) == (11, 0)
    assert _ingest(store, first) == (0, 11)
    second = [event("run_start", {"world_size": 1}, stream="s1", seq=0), *step_events(4, stream="s1")]
    assert _ingest(store, second) == (5, 0)
    with store.connect() as conn:
        assert dict(conn.execute(select(streams.c.stream, streams.c.attempt)).all()) == {"s0": 0, "s1": 1}
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 14


def test_anomalies_persist_with_their_evidence(store: Storage) -> None:
    _ingest(store, step_events(10, loss=lambda i: "NaN" if i == 7 else 4.0))
    with store.connect() as conn:
        (row,) = conn.execute(select(anomalies)).all()
    assert (row.kind, row.first_step, row.status) == ("nan_inf", 7, "open")
    assert row.evidence["loss"] == "nan"


def test_collectors_opening_a_fresh_postgres_database_at_once_all_start(request: pytest.FixtureRequest) -> None:
    """Collectors of one job's node groups share one PostgreSQL database and may start together: the
    migration is serialised (an advisory lock), so neither fails creating the schema the other creates."""
    import threading

    url = request.getfixturevalue("postgres_url")
    errors: list[BaseException] = []
    opened: list[Storage] = []
    start = threading.Barrier(4)

    def open_store() -> None:
        start.wait()
        try:
            opened.append(Storage(url))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for store in opened:
        store.close()
    assert errors == [] and len(opened) == 4


def test_a_streams_clock_offset_is_kept_for_the_next_collector(store: Storage) -> None:
    """Migration 0003: the offset estimated from arrivals is stored, and a restarted collector's
    events carry it (a late retried batch does not replace the minimum)."""
    evs = validate_batch(batch([event("step", {"step": 0}, seq=1, t=1000.0)]))
    Ingestor(store, Engine(store, DetectorsConfig()), LiveState()).ingest(evs, arrival=4600.25)
    late = validate_batch(batch([event("step", {"step": 1}, seq=2, t=1001.0)]))
    Ingestor(store, Engine(store, DetectorsConfig()), LiveState()).ingest(late, arrival=4700.0)
    assert late[0].clock_offset == 3600.25
    with store.connect() as conn:
        row = conn.execute(select(streams.c.clock_offset, streams.c.started_at, streams.c.last_time)).one()
    assert tuple(row) == (3600.25, 4600.25, 4601.25)
