"""A stored run back as its wire-format events, oldest first: ``trainmon export RUN FILE``.

The file is trainmon's own JSONL (one event per line), which ``trainmon postmortem FILE`` and
``trainmon import FILE`` read like a trainer's spool, so a run archived before retention removes it
can be explained again. What the store keeps is what comes back: every step (with its per-layer
norms), evaluation, checkpoint, resume and health sample, each stream's ``run_start`` and
``run_end``. Heartbeats and stack dumps are not stored, nor the step fields only detectors read
(attention logits, weight checksums, per-group update ratios), so findings that rest on them are in
the stored run's post-mortem but not in the exported file's.

Each stream keeps its id and host; sequence numbers are renumbered from 0 in time order (the store
keeps which ones arrived, not each event's), which a reader needs only to be unique per stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import orjson
from sqlalchemy import Connection, Select, select

from trainmon.clock import producer_time
from trainmon.monitor.store.replay import step_fields, steps_with_precursors
from trainmon.monitor.store.storage import checkpoints, evals, health, layer_stats, resumes, steps, streams
from trainmon.wire import json_safe

__all__ = ["export_lines", "run_events"]

_STREAM_ROWS = 2000  # rows a query hands over at a time: a million-step run is never held in memory
_FIRST, _MIDDLE, _LAST = 0, 1, 2  # run_start before, run_end after the events of the same time


def run_events(conn: Connection, run: str) -> Iterator[dict[str, Any]]:
    """``run``'s stored events as wire-format dicts (JSON-safe), oldest first; none for an unknown run."""
    ids: dict[tuple[int, int], tuple[str, str]] = {}
    edges: list[tuple[float, int, int, int, str, dict[str, Any]]] = []
    for s in conn.execute(select(streams).where(streams.c.run == run).order_by(streams.c.attempt, streams.c.rank)):
        ids[(s.rank, s.attempt)] = (s.stream, s.host)
        if s.start is not None:
            # the stream's start and end are kept on the collector's clock; its events are on its own
            edges.append((producer_time(s.started_at, s.clock_offset), _FIRST, s.rank, s.attempt, "run_start", s.start))
        if s.end_status is not None:
            end = {"status": s.end_status, "step": s.end_step, "error": s.end_error, "dropped_events": s.dropped_events}
            edges.append(
                (
                    producer_time(s.last_time, s.clock_offset),
                    _LAST,
                    s.rank,
                    s.attempt,
                    "run_end",
                    {k: v for k, v in end.items() if v is not None},
                )
            )
    edges.sort(key=lambda e: e[:2])
    merged = heapq.merge(
        iter(edges),
        _steps(conn, run),
        _rows(conn, run, evals, "eval"),
        _rows(conn, run, checkpoints, "checkpoint"),
        _rows(conn, run, resumes, "resume"),
        _health(conn, run),
        key=lambda e: e[:2],
    )
    seqs: dict[str, int] = {}
    for t, _order, rank, attempt, kind, fields in merged:
        stream, host = ids.get((rank, attempt), (f"exported-{rank}-{attempt}", ""))
        seq = seqs[stream] = seqs.get(stream, -1) + 1
        yield {
            "kind": kind,
            "run": run,
            "rank": rank,
            "host": host,
            "stream": stream,
            "seq": seq,
            "time": t,
            "fields": json_safe(fields),
        }


def export_lines(conn: Connection, run: str) -> Iterator[bytes]:
    """:func:`run_events` as JSONL lines, newline-terminated."""
    for ev in run_events(conn, run):
        yield orjson.dumps(ev) + b"\n"


def _streamed(conn: Connection, query: Select) -> Iterator[Any]:
    return conn.execution_options(stream_results=True, yield_per=_STREAM_ROWS).execute(query)


def _steps(conn: Connection, run: str) -> Iterator[tuple]:
    query = steps_with_precursors(layer_stats.c.grad_norms).where(steps.c.run == run).order_by(steps.c.time)
    for r in _streamed(conn, query):
        fields = step_fields(r)
        if r.grad_norms:
            fields["layer_grad_norms"] = r.grad_norms
        yield r.time, _MIDDLE, r.rank, r.attempt, "step", fields


def _rows(conn: Connection, run: str, table: Any, kind: str) -> Iterator[tuple]:
    skip = ("run", "rank", "attempt", "time")
    for r in _streamed(conn, select(table).where(table.c.run == run).order_by(table.c.time)):
        fields = {str(k): v for k, v in r._mapping.items() if k not in skip and v is not None}  # str: not quoted_name
        yield r.time, _MIDDLE, r.rank, r.attempt, kind, fields


def _health(conn: Connection, run: str) -> Iterator[tuple]:
    for r in _streamed(conn, select(health).where(health.c.run == run).order_by(health.c.time)):
        yield r.time, _MIDDLE, r.rank, r.attempt, "health", r.data
