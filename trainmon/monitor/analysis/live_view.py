"""``trainmon runs`` and ``trainmon status RUN [--follow]``: where a run stands, right now.

The same small status summary is computed by the collector (``GET /v1/runs/{run}``) or locally
from a store, so the terminal view works against either. It reads only the newest steps of each
rank through the primary key (``ORDER BY step DESC LIMIT window``), never the run's history,
so a refresh costs the same at step 100 and at step 1,000,000, and a collector can serve it
while it ingests. This module stays free of pandas and matplotlib: the collector imports it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from trainmon.flops import declared_flops_per_token
from trainmon.monitor.analysis.termfit import FittedTable
from trainmon.monitor.analysis.verdict import SEVERITY_ORDER, health
from trainmon.monitor.core import budget
from trainmon.monitor.core.attempts import failed_attempts
from trainmon.monitor.core.escape import escape_for_terminal, visible_controls
from trainmon.monitor.core.fmt import fmt as _fmt
from trainmon.monitor.core.fmt import steps_text
from trainmon.monitor.core.stacks import hang_stacks, rank_ranges
from trainmon.monitor.store.event_reads import latest_eval
from trainmon.monitor.store.queries import (
    anomaly_rows,
    newest_attempt,
    run_exists,
    run_row,
    run_rows,
    step_base,
    stream_ends,
    stream_rows,
)
from trainmon.monitor.store.step_reads import latest_step, recent_steps, steps_after
from trainmon.monitor.store.storage import PHASE_COLUMNS, Storage

__all__ = [
    "DbSource",
    "HttpSource",
    "SourceError",
    "follow",
    "render_status",
    "run_status",
    "run_table",
    "sparkline",
    "steps_since",
]

_BLOCKS = "▁▂▃▄▅▆▇█"


class SourceError(RuntimeError):
    """The collector or store could not answer; the message says which and why."""


_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def _float(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)  # 'NaN' text (SQLite) and "NaN" (JSON) become nan
    except (TypeError, ValueError):
        return None


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return statistics.median(vals) if vals else None


RECENT_STEPS = 10  # the steps a "now" figure is taken over (tokens/s in status, runs and the web view)


def tokens_per_second(rows: list[dict[str, Any]], world: int) -> float | None:
    """The one definition of tokens/s, here over ``rows`` (steps of one rank): every rank's tokens over
    the step time, all phases included (the post-mortem's whole-run figure is the same over every
    step). A median of per-step rates would skip a slow step the run did pay for."""
    timed = [(x["tokens"], _float(x["step_time"])) for x in rows if x.get("tokens") and _float(x.get("step_time"))]
    seconds = sum(t for _, t in timed)
    return sum(n for n, _ in timed) * world / seconds if seconds else None


def run_status(storage: Storage, run: str, window: int = 120, now: float | None = None) -> dict[str, Any]:
    """Progress, ETA, recent trends, phase split, per-rank spread and open anomalies of ``run``.

    Raises ``KeyError`` for an unknown run. Floats may be NaN: pass through ``json_safe``.
    """
    window = max(2, min(window, 2000))
    now = time.time() if now is None else now
    with storage.connect() as conn:
        row = run_row(conn, run)
        if row is None:
            raise KeyError(f"no run {run!r}")
        newest: dict[int, dict[str, Any]] = {}
        for s in stream_rows(conn, run):
            newest[s["rank"]] = s  # each rank's newest attempt
        attempts = 1 + max((s["attempt"] for s in newest.values()), default=-1)
        ranks = sorted(newest)
        lead = next((r for r in ranks if newest[r]["attempt"] == attempts - 1), ranks[0] if ranks else None)
        recent = recent_steps(conn, run, lead, newest[lead]["attempt"], window) if lead is not None else []
        per_rank = []
        rank_window = window if len(ranks) <= 64 else 20
        for r in ranks:
            rows = recent if r == lead else recent_steps(conn, run, r, newest[r]["attempt"], rank_window)
            if not rows:
                per_rank.append({"rank": r, "host": newest[r]["host"], "step": None})
                continue
            compute = [
                sum(x[f"phase_{p}"] or 0.0 for p in ("forward", "backward", "optimizer"))
                if any(x[f"phase_{p}"] is not None for p in ("forward", "backward", "optimizer"))
                else None
                for x in rows
            ]
            per_rank.append(
                {
                    "rank": r,
                    "host": newest[r]["host"],
                    "attempt": newest[r]["attempt"],
                    "step": rows[-1]["step"],
                    "last_seen": newest[r]["last_time"],
                    "step_time": _median([_float(x["step_time"]) for x in rows]),
                    "compute": _median(compute),
                    "comm": _median([_float(x["phase_comm"]) for x in rows]),
                    "ended": newest[r]["end_status"],
                }
            )
        ev = latest_eval(conn, run)
        stored = anomaly_rows(conn, run)
        open_anomalies = [
            {k: a[k] for k in ("kind", "severity", "rank", "first_step", "last_step", "message", "hint")}
            | _stacks_of(a)
            for a in stored
            if a["status"] == "open"
        ]
        # the serious findings that resolved: the post-mortem still reports them (one story)
        recovered = [
            {k: a[k] for k in ("kind", "severity", "rank", "first_step", "last_step", "message", "hint")}
            for a in stored
            if a["status"] != "open" and a["severity"] in ("critical", "warning")
        ]
        ends = stream_ends(conn, run)
    world = row.world_size or len(ranks) or 1
    meta = row.meta or {}
    last = recent[-1] if recent else None
    step = None if last is None else last["step"]
    pace = None  # wall seconds per step over the window (includes what step_time does not: evals, I/O)
    if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
        pace = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
    if pace is None or pace <= 0:
        pace = _median([_float(x["step_time"]) for x in recent])
    planned = row.planned_steps
    done = None if step is None else step + 1 - step_base(row.config)
    remaining = None if planned is None or done is None else max(0, planned - done)
    finished = row.status != "running"
    tps = [(x["tokens"] * world / x["step_time"]) if x["tokens"] and _float(x["step_time"]) else None for x in recent]
    phase_sums = {p: sum(_float(x[f"phase_{p}"]) or 0.0 for x in recent) for p in PHASE_COLUMNS}
    total = sum(phase_sums.values())
    timed = sum(_float(x["step_time"]) or 0.0 for x in recent)
    if total and timed > total:
        phase_sums["other"] += timed - total
        total = timed
    tps_now = tokens_per_second(recent[-RECENT_STEPS:], world)
    fpt = declared_flops_per_token(meta)
    mfu = (
        budget.mfu_from_throughput(tps_now / world, fpt, meta["peak_flops"])
        if tps_now and fpt and meta.get("peak_flops")
        else None
    )
    run_health = health(stored, failed_attempts(ends), done)
    step_times = [r["step_time"] for r in per_rank if r.get("step_time")]
    mid = statistics.median(step_times) if step_times else None
    for r in per_rank:
        r["lag_steps"] = None if step is None or r.get("step") is None else step - r["step"]
        r["step_time_rel"] = r["step_time"] / mid if r.get("step_time") and mid else None
    return {
        "run": run,
        "status": row.status,
        "world_size": world,
        "planned_steps": planned,
        "step": step,
        "attempts": attempts,
        "steps_done": done,
        "progress": None if planned in (None, 0) or done is None else min(1.0, done / planned),
        "seconds_per_step": pace,
        "eta_seconds": None if finished or remaining is None or pace is None else remaining * pace,
        "loss": None if last is None else _float(last["loss"]),
        "eval_loss": None if ev is None else _float(ev.loss),
        "eval_step": None if ev is None else ev.step,
        "tokens_per_second": tps_now,
        "mfu": mfu,
        "updated_at": row.updated_at,
        "age_seconds": max(0.0, now - row.updated_at),
        "precursors": _precursor_coverage(newest[lead].get("start") if lead is not None else None),
        "recent": {
            "steps": [x["step"] for x in recent],
            "loss": [_float(x["loss"]) for x in recent],
            "tokens_per_second": tps,
            "grad_norm": [_float(x["grad_norm"]) for x in recent],
            "lr": [_float(x["lr"]) for x in recent],
        },
        "phases": {p: v / total for p, v in phase_sums.items()} if total else None,
        "ranks": per_rank,
        "open_anomalies": open_anomalies,
        "recovered_anomalies": [a for a in recovered if _heads(a, run_health)],
        "health": run_health,
    }


def _heads(a: dict[str, Any], h: dict[str, Any]) -> bool:
    """``a`` is one of the first-level problems :func:`verdict.health` counted."""
    return any(
        (p["kind"], p["rank"], p["first_step"]) == (a["kind"], a["rank"], a["first_step"]) for p in h["problems"]
    )


def run_table(storage: Storage) -> list[dict[str, Any]]:
    """``GET /v1/runs``'s rows plus the latest tokens/s, the kinds and severities of the open
    anomalies, and the run's ``health`` (:func:`verdict.health`, the post-mortem's definition)."""
    with storage.connect() as conn:
        rows = run_rows(conn)
        for r in rows:
            last = latest_step(conn, r["run"])
            world = r["world_size"] or 1
            recent = [] if last is None else recent_steps(conn, r["run"], last["rank"], last["attempt"], RECENT_STEPS)
            r["tokens_per_second"] = tokens_per_second(recent, world)
            stored = anomaly_rows(conn, r["run"])
            opened = [a for a in stored if a["status"] == "open"]
            r["open_kinds"] = sorted({a["kind"] for a in opened})
            r["open_severities"] = sorted({a["severity"] for a in opened})
            r["health"] = health(stored, failed_attempts(stream_ends(conn, r["run"])), r.get("steps_done"))
    return rows


def steps_since(storage: Storage, run: str, since: int = -1, rank: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
    """Steps of ``rank``'s newest attempt after step ``since``, oldest first (at most ``limit``).

    Raises ``KeyError`` for an unknown run."""
    limit = max(1, min(limit, 10_000))
    with storage.connect() as conn:
        if not run_exists(conn, run):
            raise KeyError(f"no run {run!r}")
        attempt = newest_attempt(conn, run, rank)
        return [] if attempt is None else steps_after(conn, run, rank, attempt, since, limit)


# -- where the numbers come from --------------------------------------------------------------


class DbSource:
    """Read a store directly (SQLite path or SQLAlchemy URL); it must exist: reading never creates one."""

    def __init__(self, db: str) -> None:
        try:
            self.storage = Storage(db, create=False)
        except FileNotFoundError as exc:
            raise SourceError(str(exc)) from exc
        self.where = self.storage.url

    def runs(self) -> list[dict[str, Any]]:
        return run_table(self.storage)

    def status(self, run: str, window: int = 120) -> dict[str, Any]:
        return run_status(self.storage, run, window)

    def postmortem(self, run: str, series: bool = True) -> Any:
        """The post-mortem :class:`~trainmon.monitor.analysis.postmortem.Analysis` of ``run``, its
        series too (``--out`` draws them); without ``series``, its summary alone (``summarize``).
        ``KeyError`` for an unknown run."""
        from trainmon.monitor.analysis.postmortem import analyse, summarize  # pandas: only for a post-mortem

        return analyse(self.storage, run) if series else summarize(self.storage, run)


DEFAULT_COLLECTOR = "http://127.0.0.1:9400"
DEFAULT_STORE = "trainmon.sqlite"  # what ``trainmon serve`` writes without --db
ANALYSIS_TIMEOUT = 600.0  # seconds a collector may take over a post-mortem (a million steps: ~10 s)


def default_source(token: str | None = None) -> DbSource | HttpSource:
    """Where ``runs`` and ``status`` look without --db/--url: the local collector ($TRAINMON_COLLECTOR,
    else 127.0.0.1:9400) first, then the store a collector started here would have written."""
    url = os.environ.get("TRAINMON_COLLECTOR") or DEFAULT_COLLECTOR
    http = HttpSource(url, token, timeout=10.0)
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(http.url + "/healthz", timeout=1.0):
                return http
        except urllib.error.HTTPError:
            return http  # it answers (perhaps unhealthy): let the real request say what is wrong
        except OSError:
            pass
    if Path(DEFAULT_STORE).is_file():
        return DbSource(DEFAULT_STORE)
    raise SourceError(
        f"no collector answers at {url} and there is no ./{DEFAULT_STORE}: start one with `trainmon serve`, "
        "or point at one with --url URL or at a store with --db PATH"
    )


class HttpSource:
    """Ask a collector (``GET /v1/runs``, ``GET /v1/runs/{run}``), with its bearer token if it has one."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.where = self.url
        self.token = token
        self.timeout = timeout

    def _get(self, path: str, timeout: float | None = None) -> Any:
        return json.loads(self._fetch(path, timeout))

    def _fetch(self, path: str, timeout: float | None = None) -> bytes:
        with self.open("GET", path, timeout) as resp:
            return resp.read()

    def open(self, method: str, path: str, timeout: float | None = None) -> Any:
        """The collector's open response to ``method path`` (its body read as it arrives: an export streams);
        an error answer as ``KeyError`` (404) or ``SourceError`` carrying the collector's message."""
        req = urllib.request.Request(self.url + path, method=method)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as err:
            try:
                detail = json.loads(err.read() or b"{}").get("error", "")
            except (ValueError, AttributeError):
                detail = ""
            if err.code == 404:
                raise KeyError(detail or f"{path}: not found on {self.url}") from err
            raise SourceError(f"{self.url}{path}: HTTP {err.code} {detail}".strip()) from err
        except (urllib.error.URLError, OSError) as err:
            raise SourceError(f"cannot reach the collector at {self.url}: {getattr(err, 'reason', err)}") from err

    def runs(self) -> list[dict[str, Any]]:
        rows = self._get("/v1/runs")
        for r in rows[:50]:  # the newest runs: one small status request each
            try:
                st = self.status(r["run"], window=10)
            except KeyError:
                continue
            r["tokens_per_second"] = st.get("tokens_per_second")
            r["open_kinds"] = sorted({a["kind"] for a in st.get("open_anomalies", [])})
            r["open_severities"] = sorted({a["severity"] for a in st.get("open_anomalies", [])})
            if isinstance(st.get("health"), dict):
                r["health"] = st["health"]
        return rows

    def status(self, run: str, window: int = 120) -> dict[str, Any]:
        return _revive(self._get(f"/v1/runs/{urllib.parse.quote(run, safe='')}?window={window}"))

    def postmortem(self, run: str, series: bool = True) -> dict[str, Any]:
        """The post-mortem summary the collector computed on its store (``GET /v1/runs/{run}/postmortem``),
        the same JSON ``trainmon postmortem RUN --db STORE --json`` prints; ``KeyError`` for an unknown run.
        ``series`` is :meth:`DbSource.postmortem`'s: a collector's report comes as its page (``report_page``)."""
        path = f"/v1/runs/{urllib.parse.quote(run, safe='')}/postmortem"
        return _revive(self._get(path, ANALYSIS_TIMEOUT))

    def export_to(self, run: str, path: Path) -> int:
        """Write ``run``'s events to ``path`` as the collector exports them (``GET /v1/runs/{run}/export``, JSONL that
        ``trainmon postmortem FILE`` reads back); the number of events. ``KeyError`` for an unknown run."""
        lines = 0
        url = f"/v1/runs/{urllib.parse.quote(run, safe='')}/export"
        with self.open("GET", url, ANALYSIS_TIMEOUT) as resp, open(path, "wb") as out:
            for line in resp:  # one event a line, as it arrives
                out.write(line)
                lines += 1
        return lines

    def report_page(self, run: str) -> bytes:
        """The post-mortem's self-contained HTML report, plots inline (``GET /v1/runs/{run}/report``)."""
        return self._fetch(f"/v1/runs/{urllib.parse.quote(run, safe='')}/report", ANALYSIS_TIMEOUT)


def _revive(value: Any) -> Any:
    """Undo ``json_safe``: the wire format's "NaN"/"Infinity" markers back to floats."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    if isinstance(value, dict):
        return {k: _revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_revive(v) for v in value]
    return value


# -- rendering ------------------------------------------------------------------------------


def _stacks_of(anomaly: dict[str, Any]) -> dict[str, Any]:
    """A hang's grouped stacks (where the ranks wait), the one piece of evidence the live view shows."""
    stacks = (anomaly.get("evidence") or {}).get("stacks") if anomaly["kind"] == "hang" else None
    return {"evidence": {"stacks": stacks}} if stacks else {}


def _stack_lines(found: list[dict[str, Any]]) -> list[Text]:
    """Where the ranks of an open hang wait: the summary and each group's innermost frames."""
    out = []
    for st in hang_stacks(found):
        out.append(Text(visible_controls(f"where the ranks wait: {st['summary']}"), style="bold"))
        for g in st["groups"]:
            frames = "\n".join(f"    {line}" for line in g["frames"][:4])
            out.append(Text(visible_controls(f"  {rank_ranges(g['ranks'])}:") + "\n" + visible_controls(frames)))
    return out


def sparkline(values: list[float | None], width: int = 48) -> str:
    """Unicode block sparkline of the finite values, resampled to at most ``width`` characters;
    a non-finite value shows as ``!``, an absent one (None: not logged) as a space: absent is not NaN.

    A character standing for several values shows the one furthest from the series' median, as the
    plots keep their bins' extremes: a mean would flatten a one-step spike (or a throughput dip) into
    the steps around it, and a non-finite value anywhere in it shows as ``!``."""
    if not values:
        return ""
    values = [_float(v) for v in values]
    if len(values) > width:
        every = [v for v in values if v is not None and v == v and abs(v) != float("inf")]
        middle = statistics.median(every) if every else 0.0
        chunk = len(values) / width
        resampled: list[float | None] = []
        for i in range(width):
            part = values[int(i * chunk) : max(int(i * chunk) + 1, int((i + 1) * chunk))]
            finite = [v for v in part if v is not None and v == v and abs(v) != float("inf")]
            if len(finite) < sum(v is not None for v in part):
                resampled.append(float("nan"))  # a non-finite step in this character's range
            elif finite:
                resampled.append(max(finite, key=lambda v: abs(v - middle)))
            else:
                resampled.append(None)
        values = resampled
    finite = [v for v in values if v is not None and v == v and abs(v) != float("inf")]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif v != v or abs(v) == float("inf"):
            out.append("!")
        else:
            out.append(_BLOCKS[0 if hi == lo else round((v - lo) / (hi - lo) * (len(_BLOCKS) - 1))])
    return "".join(out)


class _Spark:
    """A :func:`sparkline` as wide as the space it is given (8 to 48 characters): squeezed, it
    resamples rather than being cut ("▁▂▃…" lost the newest steps)."""

    def __init__(self, values: list[float | None]) -> None:
        self.values = values

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        yield Text(sparkline(self.values, width=max(1, options.max_width)), no_wrap=True)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        natural = len(sparkline(self.values))
        return Measurement(min(8, natural), natural).clamp(max_width=options.max_width)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _cell(v: Any, digits: int = 4) -> str:
    """A value formatted with :func:`_fmt`, ready for a table cell (cells are parsed as markup)."""
    return escape_for_terminal(_fmt(v, digits))


def _precursor_coverage(start: Any) -> dict[str, Any] | None:
    """What the hooks said they measure for the instability precursors (``run_start.precursors``); None
    for a producer that did not say (an import, another client, a run without ``watch``)."""
    got = start.get("precursors") if isinstance(start, dict) else None
    if not isinstance(got, dict):
        return None
    names = got.get("unrecognised")
    measured = got.get("attention")
    return {
        "attention": [str(n) for n in measured] if isinstance(measured, list) else [],
        "unrecognised": [str(n) for n in names] if isinstance(names, list) else [],
        "lm_head": bool(got.get("lm_head")),
    }


def _unmeasured_line(coverage: Any) -> str | None:
    """One line naming what the precursors do not watch: silence about an unrecognised model would read as
    "no instability coming"."""
    if not isinstance(coverage, dict):
        return None
    missed = coverage.get("unrecognised") or []
    if not missed and coverage.get("attention") and coverage.get("lm_head"):
        return None
    what = []
    if missed:
        shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
        what.append(
            f"attention logits not measured on {shown} (not recognised: name them with watch(..., attention=[...]))"
        )
    elif not coverage.get("attention"):
        what.append("no attention module recognised (name them with watch(..., attention=[...]))")
    if not coverage.get("lm_head"):
        what.append("output logits not measured (no LM head found: start(vocab_size=...) names it)")
    return "instability precursors: " + "; ".join(what)


def render_status(st: dict[str, Any], source: str = "") -> RenderableType:
    """The status view: progress bar with ETA, trends, phase split, ranks, open anomalies.

    Everything in ``st`` is data (from a store, or a collector's JSON): it goes into ``Text``
    with its control characters made visible, or into table cells through ``escape_for_terminal``.
    """
    parts: list[RenderableType] = []
    step = st.get("step")
    done = st.get("steps_done", None if step is None else step + 1)
    base = 0 if step is None or done is None else step + 1 - done  # 1 for logs that count from 1 (HF)
    planned = st.get("planned_steps")
    head = Text.assemble(
        (visible_controls(f"run {st['run']}"), "bold"),
        visible_controls(f"  {st['status']}  "),
        visible_controls(f"step {_fmt(done)}" + (f"/{_fmt(planned)}" if planned else "")),
        visible_controls(f"  attempt {st.get('attempts')}"),
        visible_controls(f"  world {st.get('world_size')}"),
        (f"  last update {_duration(st.get('age_seconds'))} ago", "dim"),
    )
    parts.append(head)
    if st.get("progress") is not None:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=1.0, completed=st["progress"], width=50),
            f"{100 * st['progress']:.1f}%",
            f"ETA {_duration(st.get('eta_seconds'))}" if st.get("eta_seconds") is not None else "",
            f"({_cell(st.get('seconds_per_step'), 3)} s/step)",
        )
        parts.append(bar)
    recent = st.get("recent") or {}
    trends = Table.grid(padding=(0, 2))
    trends.add_column(style="bold", no_wrap=True)
    trends.add_column()
    trends.add_column(justify="right", no_wrap=True)
    trends.add_row("loss", _Spark(recent.get("loss") or []), _cell(st.get("loss")))
    tps = recent.get("tokens_per_second") or []
    if st.get("tokens_per_second") is not None or any(v is not None for v in tps):  # a loop may log no tokens
        trends.add_row(f"tokens/s (last {RECENT_STEPS} steps)", _Spark(tps), _cell(st.get("tokens_per_second")))
    if any(v is not None for v in recent.get("grad_norm") or []):
        gn = recent["grad_norm"]
        trends.add_row("grad norm", _Spark(gn), _cell(gn[-1] if gn else None))
    extra = []
    if st.get("eval_loss") is not None:
        extra.append(visible_controls(f"eval loss {_fmt(st['eval_loss'])} @ step {st.get('eval_step')}"))
    if st.get("mfu") is not None:
        extra.append(f"MFU {100 * st['mfu']:.1f}%")
    parts.append(trends)
    if extra:
        parts.append(Text("   ".join(extra)))
    phases = st.get("phases")
    if phases:
        used = {p: v for p, v in phases.items() if v and v > 0.005}
        shares = "  ".join(f"{p} {100 * v:.0f}%" for p, v in used.items())
        parts.append(Text(visible_controls(f"phases (recent steps): {shares}")))
    ranks = st.get("ranks") or []
    if len(ranks) > 1:
        headers = ("rank", "host", "step", "lag", "step time", "x median", "compute", "comm wait")
        rows, styles = [], []
        for r in ranks:
            rel = r.get("step_time_rel")
            slow = (rel is not None and rel > 1.1) or (r.get("lag_steps") or 0) > 2
            rows.append(
                [
                    _fmt(r["rank"]),
                    _fmt(r.get("host")),
                    _fmt(None if r.get("step") is None else r["step"] + 1 - base),
                    _fmt(r.get("lag_steps")),
                    _fmt(r.get("step_time"), 3),
                    _fmt(rel, 3),
                    _fmt(r.get("compute"), 3),
                    _fmt(r.get("comm"), 3),
                ]
            )
            styles.append("bold red" if slow else "")
        # a long host name goes below the table first, then the figures a reader needs least
        drop = ("host", "x median", "lag", "comm wait")
        parts.append(FittedTable(headers, rows, drop, row_styles=styles, title="ranks", title_justify="left"))
    unmeasured = _unmeasured_line(st.get("precursors"))
    if unmeasured:
        parts.append(Text(visible_controls(unmeasured), style="yellow"))
    h = st.get("health")
    if isinstance(h, dict) and h.get("headline"):
        parts.append(Text(visible_controls(str(h["headline"])), style="bold green" if h.get("healthy") else "bold red"))
    found = st.get("open_anomalies") or []
    if found:
        # One line per finding, then its text across the whole width (a table column squeezed it
        # to ~24 characters at 80 columns: 40 lines for two findings).
        parts.append(Text("open anomalies", style="bold"))
        for a in _by_severity(found):
            parts += _finding_lines(a)
            parts.append(Padding(Text(visible_controls(f"→ {a['hint']}"), style="dim"), (0, 0, 0, 4)))
        parts += _stack_lines(found)
    else:
        parts.append(Text("no open anomalies", style="green"))
    recovered = st.get("recovered_anomalies") or []
    if recovered:
        # what the post-mortem still counts as problems though they resolved (a recovered spike)
        parts.append(Text("recovered", style="bold"))
        for a in _by_severity(recovered):
            parts += _finding_lines(a, recovered=True)
    return Panel(Group(*parts), title="trainmon status", subtitle=escape_for_terminal(source) or None, expand=False)


def _by_severity(anomalies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(anomalies, key=lambda a: (SEVERITY_ORDER.get(a["severity"], 3), a["first_step"] or 0))


def _finding_lines(a: dict[str, Any], recovered: bool = False) -> list[Any]:
    """A finding across the panel: severity, kind, rank and steps on one line (an open one "since
    step N"), its message below."""
    sev = str(a["severity"])
    head = Text("  ")
    head.append(visible_controls(sev), style=_SEVERITY_STYLE.get(sev, ""))
    rank = "all ranks" if a["rank"] < 0 else f"rank {a['rank']}"
    where = steps_text(a["first_step"], a["last_step"], still_open=not recovered)
    head.append(visible_controls(f"  {a['kind']}  {rank}  {where}" + ("  recovered" if recovered else "")))
    return [head, Padding(Text(visible_controls(str(a["message"]))), (0, 0, 0, 4))]


def follow(
    fetch: Callable[[], dict[str, Any]],
    console: Console,
    interval: float = 2.0,
    max_refreshes: int | None = None,
    source: str = "",
) -> int:
    """Refresh the status view every ``interval`` seconds until the run ends (one more refresh
    after), Ctrl-C, or ``max_refreshes``. On a terminal the view redraws in place (rich Live);
    piped, each refresh is printed after the previous one, so logs show the history."""
    from rich.live import Live

    refreshes = 0

    def frame() -> tuple[RenderableType, bool]:
        try:
            st = fetch()
        except SourceError as exc:  # a collector restart should not end the view
            return Text(visible_controls(f"waiting: {exc}"), style="yellow"), False
        return render_status(st, source), st.get("status") != "running"

    view, ended = frame()
    refreshes += 1
    if not console.is_terminal:
        console.print(view)
        while not ended and (max_refreshes is None or refreshes < max_refreshes):
            time.sleep(interval)
            view, ended = frame()
            refreshes += 1
            console.rule(time.strftime("%H:%M:%S"))
            console.print(view)
        return 0
    with Live(view, console=console, auto_refresh=False) as live:
        while not ended and (max_refreshes is None or refreshes < max_refreshes):
            time.sleep(interval)
            view, ended = frame()
            refreshes += 1
            live.update(view, refresh=True)
    return 0
