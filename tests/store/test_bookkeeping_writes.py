"""The streams' and runs' updates (``store.writes``) run statements made once per set of columns: a later update of
another set, or of the same set in another run or stream, changes what its own values say and nothing else."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from trainmon.monitor.store.storage import Storage, runs, streams
from trainmon.monitor.store.writes import insert_run, insert_stream, update_run, update_streams


def _run(store: Storage, run: str) -> dict[str, Any]:
    with store.connect() as conn:
        return dict(conn.execute(select(runs).where(runs.c.run == run)).one()._mapping)


def _stream(store: Storage, stream: str) -> dict[str, Any]:
    with store.connect() as conn:
        return dict(conn.execute(select(streams).where(streams.c.stream == stream)).one()._mapping)


def test_runs_updated_by_sets_of_columns_in_turn(store: Storage) -> None:
    with store.begin() as conn:
        for run in ("a", "b"):
            insert_run(conn, run=run, created_at=1.0, updated_at=2.0, status="running")
    updates = [
        ("a", {"updated_at": 3.0}),
        ("b", {"updated_at": 4.0}),
        ("a", {"status": "finished", "updated_at": 5.0}),
        ("b", {"world_size": 8, "config": {"lr": 1e-4}, "meta": {"k": [1, None]}, "updated_at": 6.0}),
        ("a", {"updated_at": 7.0, "status": "failed"}),
    ]
    expected = {run: _run(store, run) for run in ("a", "b")}
    for run, values in updates:
        with store.begin() as conn:
            update_run(conn, run, **values)
        expected[run].update(values)
        assert {r: _run(store, r) for r in ("a", "b")} == expected


def test_streams_updated_by_sets_of_columns_in_turn(store: Storage) -> None:
    base = {"run": "r", "rank": 0, "attempt": 0, "host": "h", "started_at": 1.0, "last_time": 1.0, "missing": 0}
    with store.begin() as conn:
        for stream in ("s0", "s1"):
            insert_stream(conn, stream=stream, last_seq=0, events=1, **base)
    expected = {s: _stream(store, s) for s in ("s0", "s1")}
    updates = [
        [{"b_stream": "s0", "b_events": 2, "last_seq": 2, "received": [[0, 2]]}],
        [{"b_stream": "s1", "b_events": 3, "last_seq": 3, "received": None}],
        [
            {"b_stream": "s0", "b_events": 1, "last_seq": 3, "received": [[0, 3]], "end_status": "finished"},
            {"b_stream": "s1", "b_events": 1, "last_seq": 4, "received": [[0, 4]], "end_status": "failed"},
        ],
    ]
    for rows in updates:
        columns = tuple(sorted(rows[0]))
        with store.begin() as conn:
            update_streams(conn, columns, rows)
        for row in rows:
            want = expected[row["b_stream"]]
            want["events"] += row["b_events"]
            want.update({k: v for k, v in row.items() if not k.startswith("b_")})
        assert {s: _stream(store, s) for s in ("s0", "s1")} == expected
