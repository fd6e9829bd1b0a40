"""Read-side queries about runs, streams and anomalies, shared by the HTTP API, the CLI, the
collector and the post-mortem. Each returns what its name says; the step table's reads are in
:mod:`trainmon.monitor.store.step_reads`, the other per-step tables' in
:mod:`trainmon.monitor.store.event_reads`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, bindparam, func, select

from trainmon.monitor.store.step_reads import latest_step
from trainmon.monitor.store.storage import anomalies, runs, streams

_launch = streams.c.start["launch_id"].as_string()  # the job a stream belongs to (trainmon.hooks.launch)

__all__ = [
    "anomaly_rows",
    "clock_offsets",
    "launch_hosts",
    "launch_run",
    "name_runs",
    "newest_attempt",
    "open_anomaly_keys",
    "open_anomaly_rows",
    "open_findings_of_running_runs",
    "run_anomaly_states",
    "run_exists",
    "run_row",
    "run_rows",
    "run_updated_at",
    "step_base",
    "stream_count",
    "stream_ends",
    "stream_of",
    "stream_ranks",
    "stream_rows",
]


def run_row(conn: Connection, run: str) -> Row | None:
    """The run's row of ``runs`` (None if unknown)."""
    return conn.execute(select(runs).where(runs.c.run == run)).first()


def name_runs(conn: Connection, name: str, derived_prefix: str) -> Sequence[Row]:
    """``(run, status, updated_at)`` of the run ``name`` and of the runs derived from it (their ids start
    with ``derived_prefix``): every job stored under one run name."""
    cond = (runs.c.run == name) | runs.c.run.startswith(derived_prefix, autoescape=True)
    return conn.execute(select(runs.c.run, runs.c.status, runs.c.updated_at).where(cond)).all()


def launch_run(conn: Connection, candidates: Sequence[str], launch: str) -> str | None:
    """Which of ``candidates`` holds a stream of ``launch`` (its ``run_start``'s ``launch_id``), if any."""
    return conn.execute(select(streams.c.run).where(streams.c.run.in_(candidates), _launch == launch).limit(1)).scalar()


def launch_hosts(conn: Connection, run: str, limit: int = 64) -> tuple[str | None, list[str]]:
    """The launch id of ``run``'s newest stream and the hosts of that launch's newest ``limit`` streams."""
    rows = conn.execute(
        select(streams.c.host, _launch.label("launch"))
        .where(streams.c.run == run)
        .order_by(streams.c.started_at.desc())
        .limit(limit)
    ).all()
    if not rows:
        return None, []
    launch = rows[0].launch
    return launch, list(dict.fromkeys(r.host for r in rows if r.launch == launch))


def run_exists(conn: Connection, run: str) -> bool:
    """Whether the store holds ``run``."""
    return conn.execute(select(runs.c.run).where(runs.c.run == run)).first() is not None


_RUN_UPDATED_AT = select(runs.c.updated_at).where(runs.c.run == bindparam("run"))
"""Built once: asked by every ingest of a group, where building it cost 4x its execution (49 against 12 us)."""


def run_updated_at(conn: Connection, run: str) -> float | None:
    """When the run last changed (None if unknown): what an ingest merges its own times with."""
    row = conn.execute(_RUN_UPDATED_AT, {"run": run}).first()
    return None if row is None else row.updated_at


def anomaly_rows(conn: Connection, run: str) -> list[dict[str, Any]]:
    """A run's anomalies in the contract's shape, oldest first."""
    rows = conn.execute(select(anomalies).where(anomalies.c.run == run).order_by(anomalies.c.opened_at, anomalies.c.id))
    return [
        {
            "id": r.id,
            "kind": r.kind,
            "severity": r.severity,
            "status": r.status,
            "rank": r.rank,
            "first_step": r.first_step,
            "last_step": r.last_step,
            "message": r.message,
            "hint": r.hint,
            "evidence": r.evidence,
            "opened_at": r.opened_at,
            "resolved_at": r.resolved_at,
        }
        for r in rows
    ]


def open_anomaly_rows(conn: Connection) -> Sequence[Row]:
    """Every open anomaly's whole row, in the order they were stored (the notifier's starting point)."""
    return conn.execute(select(anomalies).where(anomalies.c.status == "open").order_by(anomalies.c.id)).all()


def open_anomaly_keys(conn: Connection, run: str | None = None) -> Sequence[Row]:
    """``(id, run, kind, rank, severity)`` of the open anomalies (of ``run``, or of every run): the
    detector engine's index of what a finding updates."""
    cond = anomalies.c.status == "open"
    if run is not None:
        cond = (anomalies.c.run == run) & cond
    cols = (anomalies.c.id, anomalies.c.run, anomalies.c.kind, anomalies.c.rank, anomalies.c.severity)
    return conn.execute(select(*cols).where(cond)).all()


def run_anomaly_states(conn: Connection) -> Sequence[Row]:
    """``(run, kind, severity, status)`` of every anomaly of the runs still running: the exported
    counters a collector restart must not reset."""
    return conn.execute(
        select(anomalies.c.run, anomalies.c.kind, anomalies.c.severity, anomalies.c.status)
        .join(runs, runs.c.run == anomalies.c.run)
        .where(runs.c.status == "running")
    ).all()


def open_findings_of_running_runs(conn: Connection) -> Sequence[Row]:
    """``(run, kind, rank, severity, first_step, last_step, message)`` of the open anomalies of the
    runs still running (what acknowledgements to trainers carry)."""
    cols = (
        anomalies.c.run,
        anomalies.c.kind,
        anomalies.c.rank,
        anomalies.c.severity,
        anomalies.c.first_step,
        anomalies.c.last_step,
        anomalies.c.message,
    )
    return conn.execute(
        select(*cols)
        .join(runs, runs.c.run == anomalies.c.run)
        .where(runs.c.status == "running", anomalies.c.status == "open")
    ).all()


def stream_rows(conn: Connection, run: str) -> list[dict[str, Any]]:
    """Every producer stream of ``run`` (one per process and rank), by attempt, then rank."""
    rows = conn.execute(select(streams).where(streams.c.run == run).order_by(streams.c.attempt, streams.c.rank))
    return [dict(r._mapping) for r in rows]


def clock_offsets(conn: Connection, run: str, rank: int) -> dict[int, float | None]:
    """``rank``'s estimated clock offset per attempt (collector minus producer; None: not live)."""
    rows = conn.execute(
        select(streams.c.attempt, streams.c.clock_offset).where(streams.c.run == run, streams.c.rank == rank)
    )
    return {r.attempt: r.clock_offset for r in rows}


def stream_ends(conn: Connection, run: str) -> list[dict[str, Any]]:
    """A run's streams (``attempt``, ``end_status``): what :func:`attempts.failed_attempts` counts."""
    rows = conn.execute(select(streams.c.attempt, streams.c.end_status).where(streams.c.run == run))
    return [dict(s._mapping) for s in rows]


def stream_of(conn: Connection, stream: str) -> Row | None:
    """One stream's row by its id (None if never stored)."""
    return conn.execute(select(streams).where(streams.c.stream == stream)).first()


def stream_count(conn: Connection, run: str, rank: int) -> int:
    """How many streams (attempts) ``rank`` of ``run`` has stored: the next stream's attempt."""
    return conn.execute(
        select(func.count()).select_from(streams).where(streams.c.run == run, streams.c.rank == rank)
    ).scalar_one()


def stream_ranks(conn: Connection, run: str) -> list[int]:
    """The ranks that have reported for ``run``."""
    return list(conn.execute(select(streams.c.rank).where(streams.c.run == run).distinct()).scalars().all())


def newest_attempt(conn: Connection, run: str, rank: int) -> int | None:
    """``rank``'s newest attempt of ``run`` (None if it never reported)."""
    return conn.execute(
        select(streams.c.attempt)
        .where(streams.c.run == run, streams.c.rank == rank)
        .order_by(streams.c.attempt.desc())
        .limit(1)
    ).scalar()


def step_base(config: Any) -> int:
    """The number of the run's first optimizer step: 1 when an importer recorded that the log counts
    steps done (HF's ``global_step``), else 0 (trainmon's hooks, llm.c, Lightning). Steps done at
    step ``s`` are ``s + 1 - step_base``; a user's own config is never read for it."""
    imported = isinstance(config, dict) and config.get("imported_from")
    return 1 if imported and config.get("step_base") == 1 else 0


def run_rows(conn: Connection) -> list[dict[str, Any]]:
    """One summary row per run, newest first; ``steps_done`` counts steps as the trainer does."""
    open_counts: dict[str, int] = dict(
        conn.execute(
            select(anomalies.c.run, func.count()).where(anomalies.c.status == "open").group_by(anomalies.c.run)
        ).all()
    )
    attempts = dict(conn.execute(select(streams.c.run, func.max(streams.c.attempt) + 1).group_by(streams.c.run)).all())
    out = []
    for r in conn.execute(select(runs).order_by(runs.c.created_at.desc())):
        last = latest_step(conn, r.run)
        out.append(
            {
                "run": r.run,
                "status": r.status,
                "created_at": r.created_at,
                "updated_at": r.updated_at,
                "world_size": r.world_size,
                "planned_steps": r.planned_steps,
                "attempts": attempts.get(r.run, 0),
                "step": None if last is None else last["step"],
                "steps_done": None if last is None else last["step"] + 1 - step_base(r.config),
                "loss": None if last is None else last["loss"],
                "open_anomalies": open_counts.get(r.run, 0),
            }
        )
    return out
