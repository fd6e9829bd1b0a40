"""Reads of the ``steps`` table, each through its ``(run, rank, attempt, step)`` primary key.

A million-step run on eight ranks holds eight million rows, so no read here sorts them or holds
them whole: extents are two index probes, aggregates are range queries, and the big reads (the
post-mortem's sample, the goodput timeline) go through the DB-API cursor, where SQLAlchemy rows
and their float processors would cost more than SQLite's own work.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, or_, select

from trainmon.monitor.store.storage import PHASE_COLUMNS, steps

__all__ = [
    "RECENT_COLUMNS",
    "SAMPLE_COLUMNS",
    "SAMPLE_KEY",
    "SERIES_COLUMNS",
    "SUMMED_COLUMNS",
    "SUMMED_FIELDS",
    "latest_step",
    "lowest_step_rank",
    "recent_steps",
    "sampled_steps",
    "step_bins",
    "step_carries",
    "step_count",
    "step_ends",
    "step_extent",
    "step_row",
    "step_series",
    "step_timeline",
    "steps_after",
]

RECENT_COLUMNS = ("step", "time", "loss", "grad_norm", "lr", "step_time", "tokens")  # and every phase
SAMPLE_KEY = ("rank", "attempt", "step")
SAMPLE_COLUMNS = (  # what the post-mortem reads of the sample: the per-rank table, the heatmap, the LR
    *SAMPLE_KEY,
    "lr",
    "step_time",
    *[f"phase_{p}" for p in ("data", "forward", "backward", "comm", "optimizer")],
)
SUMMED_COLUMNS = ("step_time", "tokens", *[f"phase_{p}" for p in PHASE_COLUMNS])  # what the bins sum
SUMMED_FIELDS = frozenset(
    ("step_time", "tokens", "phases")
)  # the step fields those columns store (streams.step_fields)
SERIES_COLUMNS = ("step", "attempt", "loss", "lr", "tokens", "step_time", *[f"phase_{p}" for p in PHASE_COLUMNS])
_PHASES = [steps.c[f"phase_{p}"] for p in PHASE_COLUMNS]


def latest_step(conn: Connection, run: str) -> dict[str, Any] | None:
    """Rank 0's newest step of the newest attempt (or the lowest rank that has steps)."""
    row = conn.execute(
        select(steps)
        .where(steps.c.run == run)
        .order_by(steps.c.attempt.desc(), steps.c.rank, steps.c.step.desc())
        .limit(1)
    ).first()
    return None if row is None else dict(row._mapping)


def step_row(conn: Connection, run: str, rank: int, attempt: int, step: int) -> dict[str, Any] | None:
    """One stored step, every column (None if absent)."""
    row = conn.execute(
        select(steps).where(steps.c.run == run, steps.c.rank == rank, steps.c.attempt == attempt, steps.c.step == step)
    ).first()
    return None if row is None else dict(row._mapping)


def step_extent(conn: Connection, run: str, rank: int, attempt: int) -> tuple[int, int] | None:
    """First and last step of one (rank, attempt), None without steps: two index probes (a min and
    a max in one SQLite query would scan the range)."""
    where = (steps.c.run == run) & (steps.c.rank == rank) & (steps.c.attempt == attempt)
    first = conn.execute(select(func.min(steps.c.step)).where(where)).scalar()
    if first is None:
        return None
    last = conn.execute(select(func.max(steps.c.step)).where(where)).scalar()
    return int(first), int(last)


def step_count(conn: Connection, run: str, rank: int, attempt: int) -> int:
    """How many steps one (rank, attempt) logged, counted in the primary key's index without a visit to
    any row (a million steps: 0.05 s)."""
    where = (steps.c.run == run) & (steps.c.rank == rank) & (steps.c.attempt == attempt)
    return int(conn.execute(select(func.count()).where(where)).scalar_one())


def lowest_step_rank(conn: Connection, run: str) -> int | None:
    """The lowest rank that logged a step (None without steps)."""
    return conn.execute(select(steps.c.rank).where(steps.c.run == run).order_by(steps.c.rank).limit(1)).scalar()


def _finite(col: Any) -> Any:
    """The value when finite, else NULL: NaN is the text 'NaN' on SQLite, a float on PostgreSQL;
    both fail the BETWEEN, as do infinities."""
    return case((col.between(-1e308, 1e308), col), else_=None)


def step_bins(
    conn: Connection,
    run: str,
    rank: int,
    ranges: Iterable[tuple[int, int, int]],
    *,
    curves: bool,
    sums: bool,
    whole: Container[int] = (),
) -> list[dict[str, Any]]:
    """Exact aggregates of one rank's steps over each ``(attempt, lo, hi)`` range (``lo <= step <
    hi``), one range query each; ranges without steps are left out. Each record holds ``attempt``,
    ``lo``, ``hi``, ``count``, sums of ``SUMMED_COLUMNS`` (with ``timed`` and ``tokens_n``, how many
    steps carry a step time and tokens); with ``curves``, also what the plots draw: the finite
    loss and grad-norm mean / min / max, ``nonfinite`` (NaN or infinite losses) and mean ``lr``
    (half of SQLite's work on a log of a million steps, and no figure of the summary needs them).

    ``sums=False`` says no step of the ranges carries any of ``SUMMED_COLUMNS`` (:func:`step_carries`):
    the sums are then NULL and the counts 0 without reading them, and without ``curves`` a range is
    counted in the primary key's index alone (a million steps: 0.05 s against 0.43 s with the sums), and
    one of an attempt in ``whole`` (that holds every step from its first to its last, :func:`step_count`)
    holds ``hi - lo`` steps without a read."""
    cols = [func.count().label("count")]
    if sums:
        cols += [
            func.sum(steps.c.step_time).label("step_time"),
            func.count(steps.c.step_time).label("timed"),
            func.sum(steps.c.tokens).label("tokens"),
            func.count(steps.c.tokens).label("tokens_n"),
            *[func.sum(steps.c[f"phase_{p}"]).label(f"phase_{p}") for p in PHASE_COLUMNS],
        ]
    absent: dict[str, Any] = {"step_time": None, "timed": 0, "tokens": None, "tokens_n": 0}  # what sums=False gives
    absent = {} if sums else {**absent, **dict.fromkeys(f"phase_{p}" for p in PHASE_COLUMNS)}
    if curves:
        loss, gn = _finite(steps.c.loss), _finite(steps.c.grad_norm)
        cols += [
            func.avg(loss).label("loss"),
            func.min(loss).label("loss_min"),
            func.max(loss).label("loss_max"),
            func.sum(case((loss.is_(None) & steps.c.loss.is_not(None), 1), else_=0)).label("nonfinite"),
            func.avg(gn).label("grad_norm"),
            func.max(gn).label("grad_norm_max"),
            func.avg(_finite(steps.c.grad_norm_clipped)).label("grad_norm_clipped"),
            func.avg(steps.c.lr).label("lr"),
        ]
    lo_p, hi_p, att_p = bindparam("lo"), bindparam("hi"), bindparam("att")
    stmt = select(*cols).where(
        steps.c.run == run, steps.c.rank == rank, steps.c.attempt == att_p, steps.c.step >= lo_p, steps.c.step < hi_p
    )
    records = []
    for attempt, lo, hi in ranges:
        if not (sums or curves) and attempt in whole:
            records.append({"attempt": attempt, "lo": lo, "hi": hi, "count": hi - lo, **absent})
            continue
        r = conn.execute(stmt, {"lo": lo, "hi": hi, "att": attempt}).one()
        if r.count:
            records.append({"attempt": attempt, "lo": lo, "hi": hi, "count": r.count, **absent, **r._mapping})
    return records


def step_carries(conn: Connection, run: str, rank: int, attempt: int, *columns: str, finite: bool = False) -> bool:
    """Whether some step of one (rank, attempt) holds a value of one of ``columns`` (a finite one with
    ``finite``): the first step that does ends the read, so a column the steps carry costs a probe or
    two; columns they never carry, one pass over the attempt's steps."""
    values = [_finite(steps.c[c]) if finite else steps.c[c] for c in columns]
    where = (steps.c.run == run) & (steps.c.rank == rank) & (steps.c.attempt == attempt)
    where &= or_(*(v.is_not(None) for v in values))
    return conn.execute(select(steps.c.step).where(where).limit(1)).first() is not None


def sampled_steps(
    conn: Connection, run: str, rank: int, attempt: int, wanted: list[int] | None, read: Container[str] = SAMPLE_COLUMNS
) -> list[tuple[Any, ...]]:
    """``SAMPLE_COLUMNS`` of one (rank, attempt)'s steps numbered ``wanted`` (every step if None),
    as plain tuples, through the primary key (IN lists of at most 900). A column other than the key
    and those in ``read`` is NULL without being read: the key alone is read from the primary key's
    index, without a visit to each row (a million steps' 58,824-row sample: 0.08 s against 0.16 s)."""
    columns = ", ".join(c if c in read or c in SAMPLE_KEY else "NULL" for c in SAMPLE_COLUMNS)
    base = f"SELECT {columns} FROM steps WHERE run = ? AND rank = ? AND attempt = ?"
    params = (run, rank, attempt)
    if wanted is None:
        return _fetchall(conn, base, params)
    rows: list[tuple[Any, ...]] = []
    for i in range(0, len(wanted), 900):
        chunk = wanted[i : i + 900]
        rows.extend(_fetchall(conn, base + f" AND step IN ({', '.join('?' * len(chunk))})", (*params, *chunk)))
    return rows


_TIMELINE = (
    "SELECT step, time, step_time, phase_data, phase_checkpoint, phase_eval FROM steps "
    "WHERE run = ? AND rank = ? AND attempt = ?"
)


def step_timeline(conn: Connection, run: str, rank: int, attempt: int) -> Iterator[list[tuple[Any, ...]]]:
    """One rank's steps of one attempt in step order, in chunks of ``(step, time, step_time,
    phase_data, phase_checkpoint, phase_eval)`` tuples (the goodput ledger's input).

    Read through the DB-API cursor along the primary key: a million-step run is one index range,
    never sorted, never held whole in memory, and no SQLAlchemy row is built."""
    cur = _cursor(conn, _TIMELINE + " ORDER BY step", (run, rank, attempt))
    try:
        while chunk := cur.fetchmany(10_000):
            yield chunk
    finally:
        cur.close()


def step_ends(conn: Connection, run: str, rank: int, attempt: int) -> list[tuple[Any, ...]]:
    """The first and the last of :func:`step_timeline`'s rows (one row when the attempt logged one step,
    none without steps): two index probes, for a reader that needs where an attempt's steps begin and
    end but none of the steps between (the goodput ledger's step counts under a synthetic clock)."""
    first = _fetchall(conn, _TIMELINE + " ORDER BY step LIMIT 1", (run, rank, attempt))
    last = _fetchall(conn, _TIMELINE + " ORDER BY step DESC LIMIT 1", (run, rank, attempt))
    return first + last if first and last[0][0] != first[0][0] else first


def _fetchall(conn: Connection, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    cur = _cursor(conn, sql, params)
    try:
        return cur.fetchall()
    finally:
        cur.close()


def _cursor(conn: Connection, sql: str, params: tuple[Any, ...]) -> Any:
    """A DB-API cursor under ``conn`` that ran ``sql`` (written with qmark placeholders)."""
    if conn.dialect.paramstyle in ("format", "pyformat"):
        sql = sql.replace("?", "%s")
    cur = conn.connection.cursor()
    try:
        cur.execute(sql, params)
    except BaseException:
        cur.close()
        raise
    return cur


def recent_steps(conn: Connection, run: str, rank: int, attempt: int, window: int) -> list[dict[str, Any]]:
    """The last ``window`` steps of one (rank, attempt), oldest first: ``RECENT_COLUMNS`` and the phases."""
    cols = [steps.c[c] for c in RECENT_COLUMNS] + _PHASES
    rows = conn.execute(
        select(*cols)
        .where(steps.c.run == run, steps.c.rank == rank, steps.c.attempt == attempt)
        .order_by(steps.c.step.desc())
        .limit(window)
    ).all()
    return [dict(r._mapping) for r in reversed(rows)]


def steps_after(conn: Connection, run: str, rank: int, attempt: int, since: int, limit: int) -> list[dict[str, Any]]:
    """One (rank, attempt)'s steps after ``since``, oldest first (at most ``limit``):
    ``RECENT_COLUMNS``, ``grad_norm_clipped``, ``attempt`` and the phases."""
    cols = [steps.c[c] for c in RECENT_COLUMNS] + [steps.c.grad_norm_clipped, steps.c.attempt] + _PHASES
    rows = conn.execute(
        select(*cols)
        .where(steps.c.run == run, steps.c.rank == rank, steps.c.attempt == attempt, steps.c.step > since)
        .order_by(steps.c.step)
        .limit(limit)
    ).all()
    return [dict(r._mapping) for r in rows]


def step_series(conn: Connection, run: str, rank: int) -> list[Any]:
    """``SERIES_COLUMNS`` of every step of one rank, all attempts, by step then attempt (a resumed
    run's later attempt last)."""
    rows = conn.execute(
        select(*[steps.c[c] for c in SERIES_COLUMNS])
        .where(steps.c.run == run, steps.c.rank == rank)
        .order_by(steps.c.step, steps.c.attempt)
    ).all()
    return list(rows)
