"""Read-side queries shared by the HTTP API, the CLI and the post-mortem."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, func, select

from trainmon.monitor.store.storage import anomalies, runs, steps, streams

__all__ = ["anomaly_rows", "latest_step", "run_rows", "step_base", "step_timeline"]


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


def latest_step(conn: Connection, run: str) -> dict[str, Any] | None:
    """Rank 0's newest step of the newest attempt (or the lowest rank that has steps)."""
    row = conn.execute(
        select(steps)
        .where(steps.c.run == run)
        .order_by(steps.c.attempt.desc(), steps.c.rank, steps.c.step.desc())
        .limit(1)
    ).first()
    return None if row is None else dict(row._mapping)


def step_base(config: Any) -> int:
    """The number of the run's first optimizer step: 1 when an importer recorded that the log counts
    steps done (HF's ``global_step``), else 0 (trainmon's hooks, llm.c, Lightning). Steps done at
    step ``s`` are ``s + 1 - step_base``; a user's own config is never read for it."""
    imported = isinstance(config, dict) and config.get("imported_from")
    return 1 if imported and config.get("step_base") == 1 else 0


def run_rows(conn: Connection) -> list[dict[str, Any]]:
    """One summary row per run, newest first; ``steps_done`` counts steps as the trainer does."""
    open_counts = dict(
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


def step_timeline(conn: Connection, run: str, rank: int, attempt: int) -> Iterator[list[tuple]]:
    """One rank's steps of one attempt in step order, in chunks of ``(step, time, step_time,
    phase_data, phase_checkpoint, phase_eval)`` tuples (the goodput ledger's input).

    Read through the DB-API cursor along the primary key: a million-step run is one index range,
    never sorted, never held whole in memory, and no SQLAlchemy row is built."""
    sql = (
        "SELECT step, time, step_time, phase_data, phase_checkpoint, phase_eval FROM steps "
        "WHERE run = ? AND rank = ? AND attempt = ? ORDER BY step"
    )
    if conn.dialect.paramstyle in ("format", "pyformat"):
        sql = sql.replace("?", "%s")
    cur = conn.connection.cursor()
    try:
        cur.execute(sql, (run, rank, attempt))
        while chunk := cur.fetchmany(10_000):
            yield chunk
    finally:
        cur.close()
