"""Reads of the per-step tables other than ``steps``: checkpoints, resumes, evaluations, node-health
samples, per-layer gradient norms and the sampled instability precursors. They are small (one row per
save, eval or sample) or read only near a step (per-layer norms), so each is one plain query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, func, select

from trainmon.monitor.store.storage import checkpoints, evals, health, layer_stats, resumes

__all__ = [
    "CHECKPOINT_COLUMNS",
    "EVAL_COLUMNS",
    "checkpoint_rows",
    "eval_losses",
    "eval_rows",
    "health_count",
    "health_samples",
    "latest_eval",
    "layer_norms_at",
    "layer_norms_before",
    "precursor_samples",
    "resume_rows",
]

CHECKPOINT_COLUMNS = ("attempt", "step", "time", "duration", "bytes")
EVAL_COLUMNS = ("attempt", "step", "time", "loss")


def checkpoint_rows(conn: Connection, run: str, rank: int) -> Sequence[Row]:
    """``CHECKPOINT_COLUMNS`` of ``rank``'s checkpoint saves, by attempt then step."""
    return conn.execute(
        select(*[checkpoints.c[c] for c in CHECKPOINT_COLUMNS])
        .where(checkpoints.c.run == run, checkpoints.c.rank == rank)
        .order_by(checkpoints.c.attempt, checkpoints.c.step)
    ).all()


def resume_rows(conn: Connection, run: str, rank: int) -> list[dict[str, Any]]:
    """``rank``'s resumes (``attempt, step, time, path, duration``), by attempt."""
    rows = conn.execute(
        select(resumes.c.attempt, resumes.c.step, resumes.c.time, resumes.c.path, resumes.c.duration)
        .where(resumes.c.run == run, resumes.c.rank == rank)
        .order_by(resumes.c.attempt)
    ).all()
    return [dict(r._mapping) for r in rows]


def eval_rows(conn: Connection, run: str) -> Sequence[Row]:
    """``EVAL_COLUMNS`` of the lowest evaluating rank's evaluations, by attempt then step."""
    rank = conn.execute(select(func.min(evals.c.rank)).where(evals.c.run == run)).scalar()
    if rank is None:
        return []
    return conn.execute(
        select(*[evals.c[c] for c in EVAL_COLUMNS])
        .where(evals.c.run == run, evals.c.rank == rank)
        .order_by(evals.c.attempt, evals.c.step)
    ).all()


def eval_losses(conn: Connection, run: str) -> Sequence[Row]:
    """``(step, loss)`` of every evaluation of any rank, by step then attempt (the latest attempt last)."""
    return conn.execute(
        select(evals.c.step, evals.c.loss).where(evals.c.run == run).order_by(evals.c.step, evals.c.attempt)
    ).all()


def latest_eval(conn: Connection, run: str) -> Row | None:
    """``(step, loss)`` of the newest attempt's last evaluation (None if none)."""
    return conn.execute(
        select(evals.c.step, evals.c.loss)
        .where(evals.c.run == run)
        .order_by(evals.c.attempt.desc(), evals.c.step.desc())
        .limit(1)
    ).first()


def health_count(conn: Connection, run: str) -> int:
    """How many node-health samples ``run`` stored."""
    return conn.execute(select(func.count()).select_from(health).where(health.c.run == run)).scalar_one()


def health_samples(conn: Connection, run: str, every: int = 1) -> Sequence[Row]:
    """``(time, rank, host, data)`` of ``run``'s node-health samples in time order; with ``every > 1``
    only those whose id is a multiple of it (thinning a long run's samples)."""
    stmt = select(health.c.time, health.c.rank, health.c.host, health.c.data).where(health.c.run == run)
    if every > 1:
        stmt = stmt.where(health.c.id % every == 0)
    return conn.execute(stmt.order_by(health.c.time)).all()


def layer_norms_at(conn: Connection, run: str, rank: int, step: int, within: int = 2) -> Row | None:
    """``(attempt, step, grad_norms)`` of the first per-layer sample of ``rank`` in steps
    ``step .. step + within`` (lowest attempt first), None if there is none."""
    return conn.execute(
        select(layer_stats.c.attempt, layer_stats.c.step, layer_stats.c.grad_norms)
        .where(
            layer_stats.c.run == run,
            layer_stats.c.rank == rank,
            layer_stats.c.grad_norms.is_not(None),  # a row may hold only precursors
            layer_stats.c.step >= step,
            layer_stats.c.step <= step + within,
        )
        .order_by(layer_stats.c.attempt, layer_stats.c.step)
        .limit(1)
    ).first()


def layer_norms_before(conn: Connection, run: str, rank: int, attempt: int, step: int, limit: int = 50) -> list[Any]:
    """The per-layer norm dicts of the last ``limit`` samples of (rank, attempt) before ``step``, newest first."""
    rows = conn.execute(
        select(layer_stats.c.grad_norms)
        .where(
            layer_stats.c.run == run,
            layer_stats.c.rank == rank,
            layer_stats.c.attempt == attempt,
            layer_stats.c.grad_norms.is_not(None),
            layer_stats.c.step < step,
        )
        .order_by(layer_stats.c.step.desc())
        .limit(limit)
    ).all()
    return [norms for (norms,) in rows]


def precursor_samples(conn: Connection, run: str, rank: int) -> Sequence[Row]:
    """``(attempt, step, precursors)`` of ``rank``'s sampled steps that carried instability precursors, in
    attempt and step order (one row per ``detail_every`` steps: a long run's few thousand)."""
    return conn.execute(
        select(layer_stats.c.attempt, layer_stats.c.step, layer_stats.c.precursors)
        .where(layer_stats.c.run == run, layer_stats.c.rank == rank, layer_stats.c.precursors.is_not(None))
        .order_by(layer_stats.c.attempt, layer_stats.c.step)
    ).all()
