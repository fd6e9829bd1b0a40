"""What happened in a run, from the collector's store or from a log file.

A file is ingested into an in-memory store through the same :class:`~trainmon.monitor.collector.ingest.Ingestor`
the daemon uses, so imported runs go through the same detectors and the same queries.

The analysis has to stay fast on a run of a million steps on eight ranks (``bench/postmortem.py``:
10 s, 2 GiB), where the steps table holds eight million rows. SQLite spends a few hundred
nanoseconds per row and aggregate, so reading every row of every rank, or a ``GROUP BY`` that
sorts them, is out of budget. The analysis therefore reads three things, each through the
``(run, rank, attempt, step)`` primary key:

* **bins** - exact aggregates of the lowest rank's steps over ~200 step ranges (one range query
  each: no sort). Totals, the phase breakdown, and the loss / grad-norm / throughput curves
  (mean with min-max band, so a one-step spike stays visible) come from them. In data-parallel
  training every rank sees the same step; rank 0 stands for the run, tokens are scaled by the
  world size. The curves are the plots' alone: :func:`summarize` (``--json``) leaves them out,
  half of SQLite's work on a log of a million steps, and asks the steps only whether they carry
  a loss, a grad norm and an LR (a probe that ends at the first step that does). It asks too
  whether they carry a step time, tokens or a phase: when none does (W&B and HF logs), the bins
  only count the steps, in the primary key's index, and an attempt that logged every step is
  counted and sampled without a read (a million steps: 0.7-0.8 -> 0.35-0.4 s CPU).
* **sample** - every rank's steps at ``step % k == c`` for a prime stride ``k`` chosen to read
  about 60k rows (``k = 1``, everything, on small runs). The per-rank table, the rank heatmap
  and the LR comparison use it. A prime stride is not aligned with periodic events
  (checkpoints every 1,000 steps), so their share is not over- or under-counted.
* small tables in full - anomalies, checkpoints, resumes, evals, streams; per-layer norms only
  around the anomalies they may localise; health samples (thinned past 50k rows).

What the input cannot tell is said, not computed. A figure the run's data cannot give is null in
the summary and its key is in ``summary["unknown"]`` with the reason, as the path to it
(``"duration_seconds"``, ``"checkpoint.mtbf_seconds"``, ``"attempts_detail.started_at"``); a null
whose key is not there is merely absent (no checkpoints, no tokens logged). The main case: a log
imported without a clock carries a synthetic one (one second per logged entry, flagged
``synthetic_time`` by the importer), so wall time, attempt start/end times, checkpoint overhead
and interval in seconds, failure rate, MTBF, the Young/Daly interval, and tokens/s (and MFU) when
the log records no step durations are unknown. Step durations a log does record are the
trainer's own measurements: busy time and tokens/s from them are kept, the synthetic clock never
enters them.

Steps: ``steps`` is the number of optimizer steps the input covers. From a run's start that is the
steps done by the end of the log, counted as the trainer counts them: ``last_step + 1 - step_base``
(``step_base`` 0 for trainmon's own runs, 1 for logs numbering the first step 1, as HF's
``global_step`` does), or the trainer's own count when the imported file states one
(``steps_done``); ``run_steps`` is that count in every case. A log that starts at a resume the
importer saw (``resumed_after_step``) covers the steps after it, and one whose first step lies well
past its first logging window starts mid-run (``starts_mid_run``) and covers the steps from that
window on; a note says which. ``first_step`` and ``last_step`` are the steps the log holds;
``steps_logged`` the number of logged entries.

Status: ``status`` is the run's end as stored; ``status_detail`` says more when the input does,
e.g. an HF ``checkpoint-N/trainer_state.json`` (``ends_at_checkpoint``): the log ends at a
checkpoint before the planned end and how the run ended is unknown. An attempt whose end is
unknown is not a failed attempt.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Row

from trainmon.flops import declared_flops_per_token
from trainmon.monitor.analysis import coverage
from trainmon.monitor.analysis.open_run import import_file  # re-exported: importing a log is where analyses start
from trainmon.monitor.analysis.verdict import clusters
from trainmon.monitor.core import budget, goodput
from trainmon.monitor.core.attempts import attempt_failed, attempt_status
from trainmon.monitor.core.fmt import fmt
from trainmon.monitor.detectors import localised_kinds
from trainmon.monitor.store.event_reads import (
    CHECKPOINT_COLUMNS,
    EVAL_COLUMNS,
    checkpoint_rows,
    eval_rows,
    health_count,
    health_samples,
    layer_norms_at,
    layer_norms_before,
    precursor_samples,
    resume_rows,
)
from trainmon.monitor.store.queries import anomaly_rows, run_row, step_base, stream_rows
from trainmon.monitor.store.step_reads import (
    SAMPLE_COLUMNS,
    SAMPLE_KEY,
    SUMMED_COLUMNS,
    SUMMED_FIELDS,
    sampled_steps,
    step_bins,
    step_carries,
    step_count,
    step_extent,
    step_row,
)
from trainmon.monitor.store.storage import PHASE_COLUMNS, Storage
from trainmon.schedules import Schedule

__all__ = ["Analysis", "analyse", "import_file", "optimal_checkpoint_interval", "summarize"]

BINS = 200  # step ranges of the lowest rank: plot resolution and the unit of the phase breakdown
SAMPLE_ROWS = 60_000  # rows of the all-rank sample
HEALTH_ROWS = 20_000  # health samples read before thinning
LOCALISED = localised_kinds()  # kinds per-layer norms can localise (Detector.localised)
CONTRACT_KEYS = ("kind", "severity", "rank", "first_step", "last_step", "message", "hint")
COMPUTE_PHASES = ("forward", "backward", "optimizer")

Progress = Callable[[str], None]


@dataclass
class Analysis:
    """The summary (JSON-safe after ``trainmon.wire.json_safe``) and the series the plots draw."""

    summary: dict[str, Any]
    bins: pd.DataFrame  # lowest rank, exact aggregates per step range (see the module docstring)
    sample: pd.DataFrame  # every rank at step % stride == offset
    evals: pd.DataFrame  # attempt, step, time, loss
    health: pd.DataFrame  # one row per GPU (or host) sample: time, rank, host, temperature_c, ...
    schedule: Schedule | None = None
    notes: list[str] = field(default_factory=list)
    precursors: Sequence[Row] = ()  # (attempt, step, precursors) of the lowest rank's sampled steps (issue 28)
    carried: frozenset[str] = frozenset()  # the signals the lowest rank's steps carry (coverage.not_checked)


def summarize(storage: Storage, run: str, progress: Progress | None = None) -> dict[str, Any]:
    """The post-mortem summary: the contract's keys first, then what helps a human. The same as
    ``analyse(...).summary``, without reading what only the plots draw (the loss, grad-norm and LR
    curves, the precursors): ``postmortem --json`` without ``--out``."""
    return _analyse(storage, run, progress, series=False).summary


def analyse(storage: Storage, run: str, progress: Progress | None = None) -> Analysis:
    """Everything ``trainmon postmortem`` reports about ``run``, the plots' series too; raises
    ``KeyError`` if unknown.

    ``progress`` is called with the name of each stage as it starts (for a progress bar).
    """
    return _analyse(storage, run, progress, series=True)


def _analyse(storage: Storage, run: str, progress: Progress | None, series: bool) -> Analysis:
    """:func:`analyse`; without ``series``, the bins hold no curve and no precursor is read."""
    say = progress or (lambda _stage: None)
    notes: list[str] = []
    with storage.connect() as conn:
        say("run and attempts")
        row = run_row(conn, run)
        if row is None:
            raise KeyError(f"no run {run!r} in {storage.url}")
        meta = dict(row.meta or {})
        world = row.world_size or 1
        schedule = _schedule(row.schedule)
        streams = stream_rows(conn, run)
        extents = _extents(conn, run, streams)
        rank0 = min((e["rank"] for e in extents), default=None)
        lead = [e for e in extents if e["rank"] == rank0]
        say("step aggregates and per-rank sample")
        stride, offset = _stride(sum(e["last"] - e["first"] + 1 for e in extents))
        summed = _sums_carried(conn, run, lead, streams)
        # Without the plots' series, and with no step time, tokens or phase on the lowest rank, the summary
        # reads of its steps only their LR against a schedule; an attempt of it that logged every step
        # from its first to its last is counted and sampled without a read.
        lean = not (series or summed)
        whole = _whole_attempts(conn, run, lead) if lean else frozenset()
        lead_read = ("lr",) if lean and schedule is not None else () if lean else SAMPLE_COLUMNS
        # The two big reads run side by side on their own connections (the DB driver releases the
        # GIL while SQLite works); an in-memory store has one connection per thread, so not there.
        with ThreadPoolExecutor(1) if storage.url != "sqlite://" else nullcontext() as pool:
            pending = pool.submit(_bins_on, storage, run, lead, series, summed, whole) if pool is not None else None
            sample = _sample(conn, run, extents, stride, offset, (rank0, lead_read, whole))
            bins = pending.result() if pending is not None else _bins(conn, run, lead, series, summed, whole)
        carried = _carried(conn, run, lead)
        say("checkpoints, resumes and evaluations")
        ckpts = _checkpoints(conn, run, rank0)
        resumed = resume_rows(conn, run, rank0 or 0)
        eval_df = _evals(conn, run)
        last = _last_step(conn, run, extents)
        say("anomalies")
        found = anomaly_rows(conn, run)
        local = {a["id"]: _localise(conn, run, a, rank0) for a in found if a["kind"] in LOCALISED}
        say("goodput")
        synthetic = _import_facts(row.config)["clock_unknown"]
        good = goodput.from_store(conn, run, rank0, _attempts(streams, extents), found, synthetic)
        say("instability precursors")
        precursors = precursor_samples(conn, run, rank0) if series and rank0 is not None else ()
        say("node health")
        health_df, health_note = _health(conn, run)
    notes.extend(_import_notes(row.config))
    if health_note:
        notes.append(health_note)
    if stride > 1:
        notes.append(
            f"per-rank table, rank heatmap and LR plot use every {stride}th step (step % {stride} == {offset}); "
            "totals, phases and the loss curve are exact (rank "
            f"{rank0})"
        )

    facts = _import_facts(row.config)
    clock = facts["clock_unknown"]  # why times are unknown (a synthetic clock), or None
    unknown: dict[str, str] = {}
    wall = None if clock else _wall(streams)
    attempts = _attempts(streams, extents)
    if clock:
        for a in attempts:
            a["started_at"] = a["ended_at"] = None
        unknown["duration_seconds"] = clock
        unknown.update({f"goodput.{k}": clock for k in goodput.CLOCK_KEYS})
        unknown["attempts_detail.started_at"] = unknown["attempts_detail.ended_at"] = clock
    n_attempts = len(attempts)
    busy = _per_step_total(bins, "step_time", "timed")
    tokens_rank = round(_per_step_total(bins, "tokens", "tokens_n"))
    tokens = tokens_rank * world if tokens_rank else None
    tps = tokens / busy if tokens and busy else None
    if clock and not busy:
        unknown["tokens_per_second"] = "the log has no step durations and " + clock.removeprefix("the log has ")
    elif clock and tps is not None:
        notes.append(
            "busy time and tokens/s come from the step durations the log records, not from its synthetic clock"
        )
    final_eval = None if eval_df.empty else float(eval_df.iloc[-1]["loss"])
    span = _step_span(lead, bins, last, facts, attempts)
    if span["resumed_after_step"] is not None:
        notes.append(
            f"the log starts at a resume from step {span['resumed_after_step']}: the run's earlier steps are not in "
            f"it; steps counts the {span['steps']} steps the log covers, run_steps the run's steps to its end"
        )
    elif span["starts_mid_run"]:
        notes.append(
            f"the log starts at step {span['first_step']}, mid-run (it logs about every {span['interval']:g} steps): "
            "the run's earlier steps are not in it (a resumed job writing a new log, or a log cut at its start); "
            "steps counts the steps the log covers (from its first logging window), run_steps the run's steps to "
            "the end of the log, steps_logged the entries the log holds"
        )
    anomalies_out, timeline = _timeline(found, local)
    phases = _phase_breakdown(bins)
    if phases is None and len(bins):
        notes.append("no phase times in this input: the phase breakdown is not available")
    if not any(local.values()) and any(a["kind"] in LOCALISED for a in found):
        notes.append("no per-layer grad norms near the anomalies: they are not localised to a layer")
    failures = sum(1 for a in attempts if a["failed"])
    ckpt_summary = _checkpoint_summary(ckpts, bins, wall, failures, last, clock)
    if clock:
        unknown.update({f"checkpoint.{k}": clock for k in _CLOCK_CHECKPOINT_KEYS})
        if not len(ckpts):
            del unknown["checkpoint.overhead_fraction"], unknown["checkpoint.interval_seconds"]  # no checkpoints
    mfu = _mfu(meta, tps, world)
    if mfu is None and "tokens_per_second" in unknown and _mfu(meta, 1.0, world) is not None:
        unknown["mfu"] = "tokens/s is unknown: " + unknown["tokens_per_second"]
    summary: dict[str, Any] = {
        "run": run,
        "status": row.status,
        "steps": span["steps"],
        "run_steps": span["run_steps"],
        "attempts": n_attempts,
        "final_loss": None if last is None else last["loss"],
        "final_eval_loss": final_eval,
        "anomalies": anomalies_out,
        "goodput": good,
        "status_detail": _status_detail(row.status, facts, row.planned_steps),
        "ends_at_checkpoint": facts["ends_at_checkpoint"],
        "first_step": span["first_step"],
        "last_step": span["last_step"],
        "step_base": facts["step_base"],
        "starts_mid_run": span["starts_mid_run"],
        "steps_logged": int(bins["count"].sum()) if len(bins) else 0,
        "world_size": world,
        "planned_steps": row.planned_steps,
        "unknown": unknown,
        "duration_seconds": wall,
        "busy_seconds": busy or None,
        "tokens": None if tokens is None else int(tokens),
        "tokens_per_second": tps,
        "mfu": mfu,
        "n_params": meta.get("n_params"),
        "resumes": resumed,
        "attempts_detail": attempts,
        "failures": failures,
        "checkpoint": ckpt_summary,
        "timeline": timeline,
        "phases": phases,
        "ranks": _rank_table(sample, streams, found),
        "health": _health_table(health_df, streams, found),
        "lr": _lr_summary(sample, schedule, rank0),
        "sample": {"stride": stride, "offset": offset, "rows": len(sample)},
        "notes": notes,
    }
    summary["not_checked"] = coverage.not_checked(summary, carried, eval_df, row.config)
    return Analysis(summary, bins, sample, eval_df, health_df, schedule, notes, precursors, carried)


# -- reading -------------------------------------------------------------------------------


def _import_notes(config: Any) -> list[str]:
    """What a run imported from a foreign log cannot hold, as its importer recorded it: said, not faked."""
    if not isinstance(config, dict) or not config.get("imported_from"):
        return []
    missing = _texts(config.get("missing_signals"))
    out = [
        f"imported from {config['imported_from']} ({config.get('format', '?')})"
        + (f"; the log has no {', '.join(missing)}" if missing else "")
    ]
    if config.get("synthetic_time"):
        out.append("times are synthetic (" + str(config.get("time_source") or "one second per logged entry") + ")")
    out.extend(_texts(config.get("notes")))
    return out


_CLOCK_CHECKPOINT_KEYS = (
    "overhead_fraction",
    "interval_seconds",
    "failure_rate_per_hour",
    "mtbf_seconds",
    "optimal_interval_seconds",
    "optimal_interval_young_seconds",
    "optimal_interval_steps",
)
SYNTHETIC_CLOCK = "the log has no clock: its times are synthetic, one second per logged entry"


def _import_facts(config: Any) -> dict[str, Any]:
    """What an importer recorded about the log's clock and step numbering (``importers.common``);
    a run from trainmon's own hooks has none of it (its config is the user's, not read here)."""
    cfg = config if isinstance(config, dict) and config.get("imported_from") else {}

    def count(key: str) -> int | None:
        v = cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    logging_steps = cfg.get("logging_steps")
    return {
        "imported": bool(cfg),
        "clock_unknown": SYNTHETIC_CLOCK if cfg.get("synthetic_time") else None,
        "step_base": step_base(cfg),
        "steps_done": count("steps_done"),
        "ends_at_checkpoint": count("ends_at_checkpoint"),
        "logging_steps": float(logging_steps)
        if isinstance(logging_steps, int | float) and not isinstance(logging_steps, bool) and logging_steps >= 1
        else None,
    }


def _step_span(
    lead: list[dict[str, Any]],
    bins: pd.DataFrame,
    last: dict[str, Any] | None,
    facts: dict[str, Any],
    attempts: list[dict[str, Any]],
) -> dict[str, Any]:
    """Steps the input covers, the run's steps to its end (as the trainer counts them), and whether it starts
    mid-run.

    ``steps`` counts what the input covers: from the run's first step (``step_base``) when it starts
    there, from the step after the resume when it starts at a resume the importer saw ("Loaded
    checkpoint ... step 5000": a log of steps 5001-10000 covers 5,000 steps, not 10,000), and from its
    first logging window when it starts mid-run for a reason the input does not say. ``run_steps`` is
    the trainer's count to the end of the input, the same number when the input starts at the run's
    start. A log starts mid-run when its first step is past where a log from the run's start would
    begin, its first logging window: at least twice the logging interval (and 10 steps) in. The
    interval is the one the log declares, else the mean gap of the first attempt's steps."""
    base = facts["step_base"]
    last_step = None if last is None else int(last["step"])
    steps = None if last_step is None else max(0, last_step + 1 - base)
    if steps is not None and facts["steps_done"] is not None and facts["steps_done"] >= steps:
        steps = facts["steps_done"]  # the trainer's own count: past the last logged step
    out: dict[str, Any] = {
        "steps": steps,
        "run_steps": steps,
        "first_step": None,
        "last_step": last_step,
        "interval": None,
        "starts_mid_run": False,
        "resumed_after_step": None,
    }
    if not lead:
        return out
    first = min(lead, key=lambda e: e["attempt"])
    out["first_step"] = first["first"]
    interval = facts["logging_steps"]
    if interval is None and len(bins):
        n = int(bins.loc[bins["attempt"] == first["attempt"], "count"].sum())
        if n >= 2 and first["last"] > first["first"]:
            interval = (first["last"] - first["first"]) / (n - 1)
    if interval is not None:
        out["interval"] = float(interval)
        out["starts_mid_run"] = first["first"] - base >= max(2 * interval, interval + 10)
    opening = next((a for a in attempts if a["attempt"] == first["attempt"]), None)
    resumed_after = opening["resumed_after_step"] if opening is not None else None
    if steps is None or last_step is None:
        return out
    if resumed_after is not None and resumed_after < first["first"]:
        out["resumed_after_step"] = resumed_after
        out["steps"] = max(0, last_step - resumed_after)
    elif out["starts_mid_run"] and interval is not None:
        out["steps"] = max(0, last_step - first["first"] + round(interval))
    return out


def _status_detail(status: str, facts: dict[str, Any], planned: int | None) -> str | None:
    """What the status means when the input says more than the status word."""
    ck = facts["ends_at_checkpoint"]
    if ck is not None:
        where = f"the log ends at the checkpoint of step {ck}"
        if planned and ck < planned:
            where += f", {planned - ck} steps before the planned {planned}"
        return (
            where + ": a snapshot saved with that checkpoint, not a failure; why the log ends there "
            "(training went on, stopped or failed) is unknown"
        )
    if facts["imported"] and status == "unknown":
        return "the log does not say how the run ended"
    return None


def _texts(value: Any) -> list[str]:
    """A config entry meant to be a list of strings, as strings whatever a producer sent: the run's
    config is free-form JSON (``[1, {"a": 2}]``, a bare string, an object)."""
    if not value:
        return []
    items = value if isinstance(value, list) else [value]
    return [v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in items]


def _schedule(raw: Any) -> Schedule | None:
    if not raw:
        return None
    try:
        return Schedule.from_dict(raw)
    except (TypeError, ValueError):
        return None  # a schedule we cannot rebuild is simply not compared


def _extents(conn: Connection, run: str, streams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """First and last step of each (rank, attempt) that has steps."""
    out = []
    for s in streams:
        extent = step_extent(conn, run, s["rank"], s["attempt"])
        if extent is not None:
            out.append({"rank": s["rank"], "attempt": s["attempt"], "first": extent[0], "last": extent[1]})
    return out


def _bins_on(
    storage: Storage, run: str, extents: list[dict[str, Any]], curves: bool, sums: bool, whole: frozenset[int]
) -> pd.DataFrame:
    with storage.connect() as conn:
        return _bins(conn, run, extents, curves, sums, whole)


def _bins(
    conn: Connection, run: str, extents: list[dict[str, Any]], curves: bool, sums: bool, whole: frozenset[int]
) -> pd.DataFrame:
    """Exact aggregates over ~BINS step ranges of one rank (all its attempts), one range query each;
    ``curves``: with the loss, grad-norm and LR the plots draw; ``sums``: whether some step carries
    what the bins sum; ``whole``: the attempts that logged every step (:func:`step_bins`)."""
    span = sum(e["last"] - e["first"] + 1 for e in extents)
    if not span:
        return pd.DataFrame(columns=["attempt", "lo", "hi", "count"])
    width = max(1, math.ceil(span / BINS))
    ranges = [
        (e["attempt"], lo, min(lo + width, e["last"] + 1))
        for e in sorted(extents, key=lambda e: e["attempt"])
        for lo in range(e["first"], e["last"] + 1, width)
    ]
    records = step_bins(conn, run, extents[0]["rank"], ranges, curves=curves, sums=sums, whole=whole)
    df = pd.DataFrame.from_records(records)
    for c in df.columns:
        if c not in ("attempt", "lo", "hi", "count"):
            df[c] = pd.to_numeric(df[c], errors="coerce")
    df["step"] = (df["lo"] + df["hi"] - 1) / 2
    return df


_CARRIED = (("loss", False), ("grad_norm", True), ("lr", False))  # (column, finite values only)


def _carried(conn: Connection, run: str, lead: list[dict[str, Any]]) -> frozenset[str]:
    """The signals some step of the lowest rank carries, for :func:`coverage.not_checked`: a loss (a
    NaN one too: the log has a loss), a finite grad norm, an LR. Probes, not the bins: the summary
    reads no curve, and a column the steps carry answers at their first step."""
    return frozenset(
        column
        for column, finite in _CARRIED
        if any(step_carries(conn, run, e["rank"], e["attempt"], column, finite=finite) for e in lead)
    )


def _sums_carried(conn: Connection, run: str, lead: list[dict[str, Any]], streams: list[dict[str, Any]]) -> bool:
    """Whether some step of the lowest rank carries a step time, tokens or a phase time (what the bins
    sum). A W&B or HF log carries none, which spares the bins their sums (0.43 -> 0.05 s a million steps)
    and the sample a visit to each of its rows. Read from what each stream's stored steps hold
    (``streams.step_fields``); a stream stored before that was kept is probed, which takes a pass over its
    steps to say no (0.26 s a million)."""
    held = {(s["rank"], s["attempt"]): s["step_fields"] for s in streams}
    for e in lead:
        fields = held.get((e["rank"], e["attempt"]))
        if fields is None:
            if step_carries(conn, run, e["rank"], e["attempt"], *SUMMED_COLUMNS):
                return True
        elif not SUMMED_FIELDS.isdisjoint(fields):
            return True
    return False


def _whole_attempts(conn: Connection, run: str, lead: list[dict[str, Any]]) -> frozenset[int]:
    """The attempts of the lowest rank that logged every step from their first to their last (a count
    in the primary key's index each: a million steps, 0.05 s)."""
    return frozenset(
        e["attempt"] for e in lead if step_count(conn, run, e["rank"], e["attempt"]) == e["last"] - e["first"] + 1
    )


def _per_step_total(bins: pd.DataFrame, col: str, n_col: str) -> float:
    """A per-step figure (tokens, step time) summed over every step the run did, logged or not.

    A log written every N steps holds one entry per window, carrying that window's per-step figure
    (HF's ``logging_steps``; importers turn cumulative counters into per-step values): summing the
    entries counts 1/N of the steps. Each attempt's sum is scaled to the steps it spans, by the
    mean gap between its entries and by its entries over those that carry the figure (a cumulative
    counter's first window has none). A run logged at every step keeps its exact sum."""
    total = 0.0
    if not len(bins):
        return total
    for _, g in bins.groupby("attempt"):
        logged, carried, n = float(g[col].sum()), int(g[n_col].sum()), int(g["count"].sum())
        if not carried or not logged:
            continue
        span = int(g["hi"].max()) - int(g["lo"].min())  # steps from the first entry to the last, inclusive
        if carried == n == span:
            total += logged
            continue
        gap = (span - 1) / (n - 1) if n > 1 else 1.0
        total += logged / carried * n * gap
    return total


def _stride(rows: int) -> tuple[int, int]:
    """A prime stride reading about SAMPLE_ROWS rows, and the residue every rank is read at."""
    if rows <= SAMPLE_ROWS:
        return 1, 0
    k = max(7, math.ceil(rows / SAMPLE_ROWS))  # 2, 3 and 5 divide the usual periods (every 100, 250 steps)
    while any(k % d == 0 for d in range(2, int(k**0.5) + 1)):
        k += 1
    return k, k // 2


def _sample(
    conn: Connection,
    run: str,
    extents: list[dict[str, Any]],
    stride: int,
    offset: int,
    lean: tuple[int | None, tuple[str, ...], frozenset[int]],
) -> pd.DataFrame:
    """Every rank's steps at ``step % stride == offset`` (plain tuples from the DB-API cursor:
    SQLAlchemy rows would cost more than SQLite's own work here, 60k rows of ``SAMPLE_COLUMNS``);
    ``lean`` is a rank, the columns read of its steps (the others NaN, :func:`sampled_steps`) and
    its attempts that logged every step from their first to their last.

    Of such an attempt read for its key alone, the sampled steps are known without a read: a million
    steps' sample 0.19 -> 0.01 s, the rows and their frame included. The frame's rows are then in
    another order; nothing of the summary depends on it (per-rank medians and counts; no LR read)."""
    rows: list[tuple] = []
    known: list[pd.DataFrame] = []
    for e in extents:
        rank, attempt, first, last = e["rank"], e["attempt"], e["first"], e["last"]
        wanted = range(first + (offset - first) % stride, last + 1, stride)
        read = lean[1] if rank == lean[0] else SAMPLE_COLUMNS
        if not read and attempt in lean[2]:
            known.append(_key_frame(rank, attempt, wanted))
        else:
            rows.extend(sampled_steps(conn, run, rank, attempt, list(wanted) if stride > 1 else None, read))
    df = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
    for c in SAMPLE_COLUMNS:
        if c not in SAMPLE_KEY:
            df[c] = pd.to_numeric(df[c], errors="coerce")  # 'NaN' text on SQLite -> NaN
    frames = [f for f in (df, *known) if len(f)]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0] if frames else df


def _key_frame(rank: int, attempt: int, sampled: range) -> pd.DataFrame:
    """The sample's rows of one (rank, attempt) at the steps ``sampled``, every column but the key NaN."""
    n = len(sampled)
    key = {"rank": np.full(n, rank, dtype=np.int64), "attempt": np.full(n, attempt, dtype=np.int64)}
    key["step"] = np.arange(sampled.start, sampled.stop, sampled.step, dtype=np.int64)
    return pd.DataFrame({**key, **{c: np.full(n, np.nan) for c in SAMPLE_COLUMNS if c not in SAMPLE_KEY}})


def _last_step(conn: Connection, run: str, extents: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest step of the newest attempt of the lowest rank that has one."""
    if not extents:
        return None
    newest = max(e["attempt"] for e in extents)
    e = min((e for e in extents if e["attempt"] == newest), key=lambda e: e["rank"])
    return step_row(conn, run, e["rank"], e["attempt"], e["last"])


def _checkpoints(conn: Connection, run: str, rank: int | None) -> pd.DataFrame:
    rows = checkpoint_rows(conn, run, 0 if rank is None else rank)
    return pd.DataFrame.from_records(rows, columns=list(CHECKPOINT_COLUMNS))


def _evals(conn: Connection, run: str) -> pd.DataFrame:
    rows = eval_rows(conn, run)
    if not rows:
        return pd.DataFrame(columns=list(EVAL_COLUMNS))
    return pd.DataFrame.from_records(rows, columns=list(EVAL_COLUMNS))


def _health(conn: Connection, run: str) -> tuple[pd.DataFrame, str | None]:
    """One row per GPU per sample (or per host sample when there is no GPU), thinned past HEALTH_ROWS."""
    total = health_count(conn, run)
    cols = ["time", "rank", "host", "gpu", "temperature_c", "utilization_ratio", "sm_clock_hz", "power_w"]
    cols += ["ecc_corrected", "ecc_uncorrected", "host_mem_ratio"]
    if not total:
        return pd.DataFrame(columns=cols), None  # said once, by coverage.not_checked ("GPU health")
    note = None
    k = 1
    if total > HEALTH_ROWS:
        k = math.ceil(total / HEALTH_ROWS)
        note = f"node-health plots and table use every {k}th of {total:,} samples; node_health anomalies saw them all"
    records = []
    for t, rank, host, data in health_samples(conn, run, k):
        used, total_mem = data.get("host_mem_used_bytes"), data.get("host_mem_total_bytes")
        mem = used / total_mem if used is not None and total_mem else None
        gpus = data.get("gpus") or [{}]
        for g in gpus:
            records.append(
                (
                    t,
                    rank,
                    host,
                    g.get("index"),
                    g.get("temperature_c"),
                    g.get("utilization_ratio"),
                    g.get("sm_clock_hz"),
                    g.get("power_w"),
                    g.get("ecc_corrected"),
                    g.get("ecc_uncorrected"),
                    mem,
                )
            )
    df = pd.DataFrame.from_records(records, columns=cols)
    for c in cols[3:]:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df, note


# -- second level: which layer -------------------------------------------------------------


def _localise(conn: Connection, run: str, anomaly: dict[str, Any], rank0: int | None) -> list[dict[str, Any]]:
    """Layers whose grad norm rose the most at the anomaly's first step, against their median over
    the per-layer samples before it (layer_stats is second-level: sampled every N steps and on a
    trigger, so only rows near the anomaly are read)."""
    step = anomaly["first_step"]
    if step is None:
        return []
    rank = anomaly["rank"] if anomaly["rank"] >= 0 else (rank0 or 0)
    at = layer_norms_at(conn, run, rank, step)
    if at is None or not at.grad_norms:
        return []
    history: dict[str, list[float]] = {}
    for norms in layer_norms_before(conn, run, rank, at.attempt, step):
        for name, v in (norms or {}).items():
            if isinstance(v, int | float) and math.isfinite(v):
                history.setdefault(name, []).append(float(v))
    out = []
    for name, raw in at.grad_norms.items():
        v = _float(raw)
        base = statistics.median(history[name]) if history.get(name) else None
        if v is None:
            continue
        if not math.isfinite(v):
            ratio = math.inf
        elif base:
            ratio = v / base
        else:
            continue
        out.append({"layer": name, "step": at.step, "grad_norm": v, "baseline": base, "ratio": ratio})
    out.sort(key=lambda d: -d["ratio"])
    top = [d for d in out[:3] if d["ratio"] >= 3]
    return top


def _float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
        return float(v.replace("Infinity", "inf"))
    return None


# -- the timeline --------------------------------------------------------------------------


def _timeline(
    found: list[dict[str, Any]], local: dict[int, list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Anomalies in step order, each first-level symptom followed by what localises it.

    Returns the contract's anomaly list (in that order) and the timeline: level-1 entries with,
    under them, the related detections at the same steps and the layers whose grad norm rose.
    """
    anomalies_out: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    for cluster in clusters(found):  # the incidents and their first-level symptoms: verdict's one rule
        head = len(timeline)
        for level, a in enumerate(cluster):
            idx = len(anomalies_out)
            anomalies_out.append(
                {
                    **{k: a[k] for k in CONTRACT_KEYS},
                    "status": a["status"],
                    "id": a["id"],
                    "evidence": a["evidence"],
                    "level": 1 if level == 0 else 2,
                }
            )
            timeline.append(
                {
                    "level": 1 if level == 0 else 2,
                    "explains": None if level == 0 else head,
                    "anomaly": idx,
                    **{k: a[k] for k in CONTRACT_KEYS},
                    "status": a["status"],
                    "evidence": a["evidence"],
                }
            )
        layers: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # layer -> (its rise, the anomaly)
        for a in cluster:
            for loc in local.get(a["id"], []):
                layers.setdefault(loc["layer"], (loc, a))
        if layers:
            timeline.append(
                _layer_entry(cluster[0]["kind"], head, sorted(layers.values(), key=lambda la: -la[0]["ratio"]))
            )
    return anomalies_out, timeline


def _layer_entry(kind: str, head: int, rises: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """One entry for the layers whose grad norm rose at an incident, largest rise first. Localised
    means one layer stands out: no other rose 10x or more (a bad batch lifts every layer at once,
    and naming each as "the" place sent the reader to three layers for one cause)."""
    top, a = rises[0]

    def ratio(loc: dict[str, Any]) -> str:
        return "non-finite" if not math.isfinite(loc["ratio"]) else f"{fmt(loc['ratio'], 3)}x"

    others = [loc for loc, _ in rises[1:3]]
    localised = all(loc["ratio"] < 10 for loc in others)
    if localised:
        message = (
            f"grad norm of {top['layer']} at step {top['step']}: {top['grad_norm']:.4g} ({ratio(top)} its median "
            f"of {_g(top['baseline'])} before)"
        )
        hint = (
            f"the {kind} is localised to {top['layer']}: inspect that layer's inputs and weights at this step "
            "(attention logits, norm scales, the batch)."
        )
    else:
        listed = ", ".join(f"{loc['layer']} {ratio(loc)}" for loc, _ in rises[:3])
        message = (
            f"grad norm rose in {len(rises)} layers at step {top['step']} (against their medians before): {listed}"
        )
        hint = (
            f"not localised: several layers rose together, so look at the step as a whole (the batch, the LR) "
            f"before any one layer; the largest rise is in {top['layer']}."
        )
    return {
        "level": 2,
        "explains": head,
        "anomaly": None,
        "kind": "layer_grad_norm",
        "severity": "info",
        "rank": a["rank"],
        "first_step": top["step"],
        "last_step": top["step"],
        "message": message,
        "hint": hint,
        "status": None,
        "evidence": {**top, "localised": localised, "layers": [loc for loc, _ in rises[:3]]},
    }


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


# -- tables --------------------------------------------------------------------------------


def _wall(streams: list[dict[str, Any]]) -> float | None:
    if not streams:
        return None
    return max(s["last_time"] for s in streams) - min(s["started_at"] for s in streams)


def _attempts(streams: list[dict[str, Any]], extents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per attempt: when, how far, how it ended. An attempt failed when any rank ended it
    failed or interrupted, or when it ended silently (no run_end) and a later attempt followed;
    an end the producer reported as ``unknown`` is not a failure."""
    by: dict[int, list[dict[str, Any]]] = {}
    for s in streams:
        by.setdefault(s["attempt"], []).append(s)
    spans: dict[int, list[dict[str, Any]]] = {}
    for e in extents:
        spans.setdefault(e["attempt"], []).append(e)
    newest = max(by, default=-1)
    out = []
    for attempt in sorted(by):
        ss = by[attempt]
        ends = {s["end_status"] for s in ss}
        ext = spans.get(attempt, [])
        status = attempt_status(ends, attempt == newest)  # the one rule the live views use too
        errors = [s["end_error"] for s in ss if s.get("end_error")]
        out.append(
            {
                "attempt": attempt,
                "ranks": len(ss),
                "started_at": min(s["started_at"] for s in ss),
                "ended_at": max(s["last_time"] for s in ss),
                "first_step": min((e["first"] for e in ext), default=None),
                "last_step": max((e["last"] for e in ext), default=None),
                "status": status,
                "failed": attempt_failed(status, attempt == newest),
                "error": errors[0] if errors else None,
                "resumed": bool((ss[0].get("start") or {}).get("resumed")),
                "resumed_after_step": _resumed_after(ss[0].get("start")),
            }
        )
    return out


def _resumed_after(start: Any) -> int | None:
    """The step a resumed attempt goes on from, when its ``run_start`` says (an importer that saw the resume)."""
    if not isinstance(start, dict) or not start.get("resumed"):
        return None
    config = start.get("config")
    step = config.get("resumed_after_step") if isinstance(config, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _phase_breakdown(bins: pd.DataFrame, parts: int = 10) -> dict[str, Any] | None:
    """Share of each phase of the step time per tenth of the steps (the lowest rank, exact).

    Time not attributed to any phase counts as ``other``."""
    if bins.empty:
        return None
    cols = [f"phase_{p}" for p in PHASE_COLUMNS]
    if not bins[cols].notna().any().any():
        return None
    b = bins.copy()
    b[cols] = b[cols].fillna(0.0)
    b["unattributed"] = (b["step_time"].fillna(0.0) - b[cols].sum(axis=1)).clip(lower=0.0)
    b["phase_other"] += b["unattributed"]
    steps_done = b["count"].cumsum()
    total = steps_done.iloc[-1]
    b["part"] = np.minimum(parts - 1, ((steps_done - b["count"]) * parts // total).astype(int))
    out = []
    for part, g in b.groupby("part", sort=True):
        secs = g[cols].sum()
        tot = float(secs.sum())
        out.append(
            {
                "part": int(part),
                "first_step": int(g["lo"].iloc[0]),
                "last_step": int(g["hi"].iloc[-1] - 1),
                "attempts": sorted({int(x) for x in g["attempt"]}),
                "steps": int(g["count"].sum()),
                "seconds": tot,
                "shares": {p: (float(secs[f"phase_{p}"]) / tot if tot else None) for p in PHASE_COLUMNS},
            }
        )
    secs = b[cols].sum()
    tot = float(secs.sum())
    overall = {p: (float(secs[f"phase_{p}"]) / tot if tot else None) for p in PHASE_COLUMNS}
    return {"overall": overall, "by_part": out}


def _rank_table(
    sample: pd.DataFrame, streams: list[dict[str, Any]], found: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Median step, compute, comm-wait and data time per rank, and each relative to the median
    rank: a slow rank computes longer while the others wait for it in comm."""
    if sample.empty:
        return []
    s = sample.copy()
    have_phases = s[[f"phase_{p}" for p in COMPUTE_PHASES]].notna().any(axis=1)
    s["compute"] = s[[f"phase_{p}" for p in COMPUTE_PHASES]].sum(axis=1, min_count=1).where(have_phases)
    med = s.groupby("rank")[["step_time", "compute", "phase_comm", "phase_data"]].median()
    counts = s.groupby("rank").size()
    ref = med.median()
    hosts: dict[int, str] = {}
    for st in streams:
        hosts[st["rank"]] = st["host"]  # newest attempt wins (rows come in attempt order)
    kinds: dict[int, list[str]] = {}
    for a in found:
        if a["rank"] >= 0:
            kinds.setdefault(a["rank"], []).append(a["kind"])
    out = []
    for rank, r in med.iterrows():

        def rel(col: str, r: pd.Series = r) -> float | None:
            return float(r[col] / ref[col]) if pd.notna(r[col]) and pd.notna(ref[col]) and ref[col] > 0 else None

        row = {
            "rank": int(rank),
            "host": hosts.get(int(rank)),
            "samples": int(counts[rank]),
            "step_time": _num(r["step_time"]),
            "compute": _num(r["compute"]),
            "comm": _num(r["phase_comm"]),
            "data": _num(r["phase_data"]),
            "step_time_rel": rel("step_time"),
            "compute_rel": rel("compute"),
            "comm_rel": rel("phase_comm"),
            "anomalies": sorted(set(kinds.get(int(rank), []))),
        }
        slow = [v for v in (row["compute_rel"], row["step_time_rel"]) if v is not None]
        row["slow"] = bool(slow and max(slow) > 1.1)
        out.append(row)
    return out


def _num(v: Any) -> float | None:
    return float(v) if v is not None and pd.notna(v) else None


def _health_table(df: pd.DataFrame, streams: list[dict[str, Any]], found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (host, rank): the worst readings of its GPU and host, and the node_health anomalies on it."""
    events: dict[int, list[dict[str, Any]]] = {}
    for a in found:
        if a["kind"] == "node_health":
            events.setdefault(a["rank"], []).append(
                {k: a[k] for k in ("severity", "first_step", "last_step", "message", "hint", "status")}
            )
    hosts = {s["rank"]: s["host"] for s in streams}
    out = []
    keys = set(events)
    if not df.empty:
        keys |= {int(r) for r in df["rank"].unique()}
    for rank in sorted(keys):
        g = df[df["rank"] == rank] if not df.empty else df

        def agg(col: str, how: str, g: pd.DataFrame = g) -> float | None:
            if g.empty or g[col].isna().all():
                return None
            return float(getattr(g[col], how)())

        out.append(
            {
                "rank": rank,
                "host": (g["host"].iloc[-1] if not g.empty else hosts.get(rank)),
                "samples": len(g),
                "max_temperature_c": agg("temperature_c", "max"),
                "min_sm_clock_hz": agg("sm_clock_hz", "min"),
                "mean_utilization": agg("utilization_ratio", "mean"),
                "max_ecc_corrected": agg("ecc_corrected", "max"),
                "max_ecc_uncorrected": agg("ecc_uncorrected", "max"),
                "max_host_mem_ratio": agg("host_mem_ratio", "max"),
                "events": events.get(rank, []),
            }
        )
    return out


def _lr_summary(sample: pd.DataFrame, schedule: Schedule | None, rank0: int | None) -> dict[str, Any] | None:
    """Largest relative gap between the actual LR and the declared schedule (the sampled steps)."""
    if schedule is None or sample.empty:
        return None
    s = sample[(sample["rank"] == rank0) & sample["lr"].notna()]
    if s.empty:
        return None
    expected = expected_lr(schedule, s["step"].to_numpy())
    gap = np.abs(s["lr"].to_numpy() - expected) / np.maximum(expected, 1e-300)
    i = int(np.argmax(gap))
    return {
        "schedule": schedule.to_dict(),
        "max_rel_gap": float(gap[i]),
        "at_step": int(s["step"].iloc[i]),
        "actual": float(s["lr"].iloc[i]),
        "expected": float(expected[i]),
        "steps_compared": len(s),
    }


def expected_lr(schedule: Schedule, step_values: Iterable[int]) -> np.ndarray:
    """The declared schedule's LR at each step (``Schedule.lr`` is the one definition)."""
    return np.fromiter((schedule.lr(int(s)) for s in step_values), dtype=float)


# -- budget: checkpoint interval and MFU ----------------------------------------------------


def optimal_checkpoint_interval(checkpoint_seconds: float, mtbf_seconds: float) -> dict[str, float]:
    """Young's and Daly's optimal compute time between checkpoints, from :mod:`trainmon.monitor.core.budget`
    (one definition of the arithmetic for the CLI, the live view and the post-mortem)."""
    return {
        "young_seconds": budget.young_interval_seconds(checkpoint_seconds, mtbf_seconds),
        "daly_seconds": budget.daly_interval_seconds(checkpoint_seconds, mtbf_seconds),
    }


def _checkpoint_summary(
    ckpts: pd.DataFrame,
    bins: pd.DataFrame,
    wall: float | None,
    failures: int,
    last: dict[str, Any] | None,
    clock: str | None = None,
) -> dict[str, Any]:
    """Checkpoint cost as a share of wall time, and the interval Young/Daly would choose given the
    failure rate this run saw (attempts that did not finish per wall-clock second).

    ``clock`` is why the run's times are not real (a synthetic clock): then every figure in
    seconds of wall time (overhead share, interval, failure rate, MTBF, Young/Daly) is None."""
    n = len(ckpts)
    durations = ckpts["duration"].dropna() if n else pd.Series(dtype=float)
    if len(durations):
        seconds, source = float(durations.sum()), "checkpoint events"
        mean = float(durations.mean())
    elif len(bins) and bins["phase_checkpoint"].notna().any():
        seconds, source = float(bins["phase_checkpoint"].sum()), "checkpoint phase of the steps"
        mean = seconds / n if n else None
    else:
        seconds, source, mean = None, None, None
    interval_steps = interval_seconds = None
    if n >= 2:
        for _att, g in ckpts.groupby("attempt"):
            if len(g) >= 2:
                interval_steps = float(np.median(np.diff(g["step"].to_numpy())))
                interval_seconds = None if clock else float(np.median(np.diff(g["time"].to_numpy())))
                break
    out: dict[str, Any] = {
        "count": n,
        "seconds": seconds,
        "mean_seconds": mean,
        "source": source,
        "overhead_fraction": seconds / wall if seconds is not None and wall else None,
        "interval_steps": interval_steps,
        "interval_seconds": interval_seconds,
        "failures": failures,
        "failure_rate_per_hour": failures / wall * 3600 if wall else None,
        "mtbf_seconds": wall / failures if wall and failures else None,
        "optimal_interval_seconds": None,
        "optimal_interval_young_seconds": None,
        "optimal_interval_steps": None,
        "optimal_note": None,
    }
    if clock:
        out["failure_rate_per_hour"] = out["mtbf_seconds"] = None
        out["optimal_note"] = f"the failure rate is unknown ({clock}): Young/Daly has nothing to weigh"
    elif not failures:
        out["optimal_note"] = "no failed attempts: the failure rate is unknown, Young/Daly has nothing to weigh"
    elif not out["mtbf_seconds"]:
        out["optimal_note"] = "no wall time to rate the failures by"
    elif not mean:
        out["optimal_note"] = "no checkpoint durations recorded"
    else:
        opt = optimal_checkpoint_interval(mean, out["mtbf_seconds"])
        out["optimal_interval_seconds"] = opt["daly_seconds"]
        out["optimal_interval_young_seconds"] = opt["young_seconds"]
        step_secs = float(bins["step_time"].sum() / max(1, bins["timed"].sum())) if len(bins) else None
        if step_secs:
            out["optimal_interval_steps"] = max(1, round(opt["daly_seconds"] / step_secs))
    return out


def _mfu(meta: dict[str, Any], tokens_per_second: float | None, world: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' peak, when the run declared
    the FLOPs per token (or a parameter count: 6N) and the peak FLOP/s of one device."""
    peak = meta.get("peak_flops")
    fpt = declared_flops_per_token(meta)
    if not peak or not fpt or not tokens_per_second:
        return None
    return budget.mfu_from_throughput(tokens_per_second / world, fpt, peak)  # per device
