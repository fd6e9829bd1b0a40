"""What happened in a run, from the collector's store or from a log file.

A file is ingested into an in-memory store through the same :class:`~monitor.ingest.Ingestor`
the daemon uses, so imported runs go through the same detectors and the same queries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from hooks.wire import Event
from monitor.config import CollectorConfig
from monitor.engine import Engine
from monitor.importers import read_events
from monitor.ingest import Ingestor
from monitor.live import LiveState
from monitor.queries import anomaly_rows, latest_step
from monitor.storage import Storage, evals, runs, steps, streams

__all__ = ["import_file", "summarize"]

_BATCH = 5000


def import_file(path: str | Path, storage: Storage, config: CollectorConfig | None = None) -> list[str]:
    """Ingest a log file into ``storage`` (running the detectors); returns the run ids it held."""
    config = config or CollectorConfig()
    ingestor = Ingestor(storage, Engine(storage, config.detectors), LiveState())
    seen: dict[str, None] = {}
    batch: list[Event] = []

    def flush() -> None:
        ingestor.ingest(batch)
        ingestor.engine.tick(max(e.time for e in batch))  # the log's own clock, for silence checks
        batch.clear()

    for event in read_events(path):
        seen.setdefault(event.run)
        batch.append(event)
        if len(batch) >= _BATCH:
            flush()
    if batch:
        flush()
    if not seen:
        raise ValueError(f"{path}: no events found")
    return list(seen)


def summarize(storage: Storage, run: str) -> dict[str, Any]:
    """The post-mortem summary: the contract's keys first, then what helps a human."""
    with storage.connect() as conn:
        row = conn.execute(select(runs).where(runs.c.run == run)).first()
        if row is None:
            raise KeyError(f"no run {run!r} in {storage.url}")
        attempts = (
            conn.execute(select(func.max(streams.c.attempt) + 1).where(streams.c.run == run)).scalar_one_or_none() or 0
        )
        last = latest_step(conn, run)
        agg = conn.execute(
            select(
                func.count(),
                func.sum(steps.c.tokens),
                func.sum(steps.c.step_time),
                func.min(steps.c.time),
                func.max(steps.c.time),
            ).where(steps.c.run == run, steps.c.rank == (last["rank"] if last else 0))
        ).one()
        final_eval = conn.execute(
            select(evals.c.loss).where(evals.c.run == run).order_by(evals.c.attempt.desc(), evals.c.step.desc())
        ).first()
        anomaly_list = anomaly_rows(conn, run)
    n_logged, tokens, busy, t_first, t_last = agg
    final_loss = None if last is None else last["loss"]
    world = row.world_size or 1
    return {
        "run": run,
        "status": row.status,
        "steps": None if last is None else last["step"] + 1,
        "attempts": attempts,
        "final_loss": final_loss,
        "final_eval_loss": None if final_eval is None else final_eval.loss,
        "steps_logged": n_logged,
        "world_size": world,
        "planned_steps": row.planned_steps,
        "duration_seconds": (t_last - t_first) if t_first is not None else None,
        "tokens": None if tokens is None else tokens * world,
        "tokens_per_second": (tokens * world / busy) if tokens and busy else None,
        "anomalies": [
            {k: a[k] for k in ("kind", "severity", "rank", "first_step", "last_step", "message", "hint", "status")}
            for a in anomaly_list
        ],
    }
