"""Stored rows back into wire-format events.

Detectors keep streaming state (baselines, windows). When the collector restarts, that state is
rebuilt by replaying the tail of each stream from storage, so a restart does not blind a
detector for a window; the same functions let stored runs be re-analysed offline.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Select, and_, select

from trainmon.clock import producer_time
from trainmon.monitor.store.storage import (
    PHASE_COLUMNS,
    STEP_FIELDS,
    checkpoints,
    evals,
    layer_stats,
    resumes,
    steps,
    streams,
)
from trainmon.wire import Event, decode_float

__all__ = ["recent_events", "step_fields", "steps_with_precursors"]


def step_fields(row: Any) -> dict[str, Any]:
    """The ``step`` event fields of a stored step row, with its sampled precursors when the row was
    joined with ``layer_stats.precursors`` (:func:`steps_with_precursors`)."""
    m = row._mapping
    fields = {k: m[k] for k in STEP_FIELDS if m[k] is not None}
    fields["step"] = m["step"]
    if m["lrs"] is not None:
        fields["lr"] = m["lrs"]
    elif m["lr"] is not None:  # one group, its rate stored once (``ingest._other_groups``)
        fields["lr"] = [m["lr"]]
    phases = {p: m[f"phase_{p}"] for p in PHASE_COLUMNS if m[f"phase_{p}"] is not None}
    if phases:
        fields["phases"] = phases
    precursors = m.get("precursors")
    if precursors:
        # As the live detectors got them: a scalar decoded (validation does), a map as sent (markers kept).
        fields.update({k: decode_float(v) if isinstance(v, str) else v for k, v in precursors.items()})
    return fields


def steps_with_precursors(*columns: Any) -> Select:
    """``steps`` (and ``columns``) outer-joined with each row's sampled precursors, for :func:`step_fields`."""
    on = and_(*(steps.c[k] == layer_stats.c[k] for k in ("run", "rank", "attempt", "step")))
    return select(steps, layer_stats.c.precursors, *columns).outerjoin(layer_stats, on)


def recent_events(conn: Connection, run: str, rank: int, window: int = 512) -> list[tuple[Event, int]]:
    """The tail of a rank's history, oldest first, as (event, attempt) pairs.

    Holds every attempt's ``run_start``, the resumes, checkpoints and evaluations, and the
    last ``window`` steps: what the detectors need to rebuild their state. Each event carries its
    stream's stored clock offset, as it did when it arrived live.
    """
    hosts: dict[int, tuple[str, str, float | None]] = {}
    out: list[tuple[Event, int]] = []

    def add(kind: str, attempt: int, t: float, fields: dict[str, Any]) -> None:
        host, stream, offset = hosts.get(attempt, ("", "replay", None))
        out.append((Event(kind, run, rank, host, stream, 0, t, fields, offset), attempt))

    for s in conn.execute(select(streams).where(streams.c.run == run, streams.c.rank == rank)):
        hosts[s.attempt] = (s.host, s.stream, s.clock_offset)
        if s.start is not None:
            add("run_start", s.attempt, producer_time(s.started_at, s.clock_offset), s.start)  # stored on ours
    key = (steps.c.run == run) & (steps.c.rank == rank)
    rows = conn.execute(steps_with_precursors().where(key).order_by(steps.c.time.desc()).limit(window)).all()
    first_time = rows[-1].time if rows else float("-inf")
    for r in rows:
        add("step", r.attempt, r.time, step_fields(r))
    for table, kind in ((resumes, "resume"), (checkpoints, "checkpoint"), (evals, "eval")):
        cond = (table.c.run == run) & (table.c.rank == rank) & (table.c.time >= first_time)
        for r in conn.execute(select(table).where(cond)):
            m = dict(r._mapping)
            fields = {k: v for k, v in m.items() if k not in ("run", "rank", "attempt", "time") and v is not None}
            add(kind, r.attempt, r.time, fields)
    out.sort(key=lambda pair: (pair[0].time, pair[0].kind != "run_start"))
    return out
