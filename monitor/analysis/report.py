"""Rendering the post-mortem: rich tables in the terminal, and one self-contained HTML file.

The HTML report embeds its plots as base64 PNGs and carries its own CSS, so it can be mailed,
attached to a ticket or opened offline without the files next to it.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainmon.monitor.analysis import goodput
from trainmon.monitor.analysis.escape import escape_for_terminal, visible_controls
from trainmon.monitor.analysis.stacks import hang_stacks, rank_ranges
from trainmon.monitor.store.storage import PHASE_COLUMNS

__all__ = ["fmt", "print_runs", "print_summary", "write_html", "write_report"]


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return f"{value:.{digits}g}"
    return str(value)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rank(rank: int | None) -> str:
    return "all" if rank is None or rank < 0 else str(rank)


def _steps(first: Any, last: Any) -> str:
    if first is None:
        return "-"
    return str(first) if last in (None, first) else f"{first}-{last}"


def _unknown(s: dict[str, Any], key: str) -> str | None:
    """``unknown (why)`` when the summary lists ``key`` as unknown (see the postmortem module), else None."""
    why = (s.get("unknown") or {}).get(key)
    return None if why is None else f"unknown ({why})"


def overview_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's headline figures as (label, text) pairs, shared by terminal and HTML.

    A figure the summary lists under ``unknown`` reads ``unknown (why)``, never a number."""
    ck = s.get("checkpoint") or {}
    steps = fmt(s.get("steps"))
    if s.get("planned_steps"):
        steps += f" of {s['planned_steps']} planned"
    if s.get("starts_mid_run"):
        steps += f"; the log starts at step {s.get('first_step')} (mid-run: the steps before it are not in it)"
    status = fmt(s.get("status"))
    if s.get("status_detail"):
        status += f": {s['status_detail']}"
    resumes = s.get("resumes") or []
    opt = ck.get("optimal_interval_seconds")
    young = duration(ck.get("optimal_interval_young_seconds"))
    optimal = _unknown(s, "checkpoint.optimal_interval_seconds") or (
        f"{duration(opt)} (~{fmt(ck.get('optimal_interval_steps'))} steps; Young {young})"
        if opt
        else (ck.get("optimal_note") or "-")
    )
    interval_seconds = _unknown(s, "checkpoint.interval_seconds") or duration(ck.get("interval_seconds"))
    observed = f"every {fmt(ck.get('interval_steps'))} steps / {interval_seconds}" if ck.get("interval_steps") else "-"
    share = _unknown(s, "checkpoint.overhead_fraction") or pct(ck.get("overhead_fraction"))
    failure_rate = _unknown(s, "checkpoint.failure_rate_per_hour") or (
        f"{fmt(ck.get('failure_rate_per_hour'), 3)}/h (MTBF {duration(ck.get('mtbf_seconds'))})"
        if ck.get("failures")
        else "no failed attempts"
    )
    mfu = _unknown(s, "mfu") or (
        pct(s["mfu"]) if s.get("mfu") is not None else "- (needs flops_per_token or n_params, and peak_flops)"
    )
    return [
        ("goodput", goodput.headline(s) or "-"),
        ("status", status),
        ("steps", steps),
        ("attempts", f"{s.get('attempts')} ({s.get('failures', 0)} failed), {len(resumes)} resume(s)"),
        ("world size", fmt(s.get("world_size"))),
        ("wall time", _unknown(s, "duration_seconds") or duration(s.get("duration_seconds"))),
        ("tokens", f"{s['tokens']:,}" if s.get("tokens") else "-"),
        ("final train loss", fmt(s.get("final_loss"))),
        ("final eval loss", fmt(s.get("final_eval_loss"))),
        ("mean tokens/s", _unknown(s, "tokens_per_second") or fmt(s.get("tokens_per_second"))),
        ("MFU", mfu),
        (
            "checkpoints",
            f"{ck.get('count', 0)}, {duration(ck.get('seconds'))} = {share} of wall time"
            if ck.get("count")
            else "none recorded",
        ),
        ("checkpoint interval", observed),
        ("failure rate", failure_rate),
        ("optimal interval (Daly)", optimal),
    ]


# -- terminal -------------------------------------------------------------------------------
# Every value that came from a producer goes through escape_for_terminal before it meets a rich
# markup string or a table cell (both are parsed as markup); only trainmon's own styling is markup.


def _cell(value: Any, digits: int = 4) -> str:
    """A value formatted with :func:`fmt`, ready for a table cell or a markup string."""
    return escape_for_terminal(fmt(value, digits))


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """The whole post-mortem as rich tables."""
    console = console or Console(emoji=False)
    head = Table(title=f"run {escape_for_terminal(summary['run'])}", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    for label, value in overview_rows(summary):
        head.add_row(label, escape_for_terminal(value))
    console.print(head)
    _print_timeline(summary, console)
    _print_stacks(summary, console)
    _print_attempts(summary, console)
    _print_phases(summary, console)
    _print_ranks(summary, console)
    _print_health(summary, console)
    for note in summary.get("notes") or []:
        console.print(f"[dim]note: {escape_for_terminal(note)}[/dim]")


def _print_timeline(s: dict[str, Any], console: Console) -> None:
    timeline = s.get("timeline")
    if timeline is None:  # a summary from an older caller: the flat list
        timeline = [{**a, "level": 1} for a in s["anomalies"]]
    if not timeline:
        console.print("[green]no anomalies[/green]")
        return
    table = Table(title="anomaly timeline (a first-level symptom, then what localises it)")
    for col in ("steps", "kind", "severity", "rank", "status", "what"):
        table.add_column(col, overflow="fold")
    colour = {"critical": "red", "warning": "yellow", "info": "cyan"}
    for e in timeline:
        indent = "" if e["level"] == 1 else "  └ "
        sev = e["severity"]
        table.add_row(
            escape_for_terminal(_steps(e["first_step"], e["last_step"])),
            indent + escape_for_terminal(e["kind"]),
            f"[{colour.get(sev, 'white')}]{escape_for_terminal(sev)}[/]",
            escape_for_terminal(_rank(e["rank"])),
            _cell(e.get("status")),
            f"{escape_for_terminal(e['message'])}\n[dim]→ {escape_for_terminal(e['hint'])}[/dim]",
        )
    console.print(table)


def _print_stacks(s: dict[str, Any], console: Console) -> None:
    """Where the ranks of a hang waited: the hooks' stack captures, grouped (innermost frame first)."""
    for st in hang_stacks(s["anomalies"]):
        console.print(Text(f"where the ranks waited (hang at step {st['first_step']})", style="bold"))
        console.print(Text(visible_controls(f"    {st['summary']}")))
        for g in st["groups"]:
            console.print(Text(visible_controls(f"    {rank_ranges(g['ranks'])}:")))
            for line in g["frames"][:8]:
                console.print(Text(visible_controls(f"      {line}")), soft_wrap=True)


def _print_attempts(s: dict[str, Any], console: Console) -> None:
    attempts = s.get("attempts_detail") or []
    if len(attempts) < 2 and not s.get("resumes"):
        return
    table = Table(title="attempts and resumes")
    for col in ("attempt", "steps", "ended", "resumed from", "error"):
        table.add_column(col, overflow="fold")
    resumed = {r["attempt"]: r for r in s.get("resumes") or []}
    for a in attempts:
        r = resumed.get(a["attempt"])
        table.add_row(
            _cell(a["attempt"]),
            escape_for_terminal(_steps(a["first_step"], a["last_step"])),
            _cell(a["status"]),
            escape_for_terminal(f"step {r['step']} ({r.get('path') or '?'})") if r else "-",
            _cell(a.get("error")),
        )
    console.print(table)


def _print_phases(s: dict[str, Any], console: Console) -> None:
    phases = s.get("phases")
    if not phases:
        return
    used = [p for p in PHASE_COLUMNS if (phases["overall"].get(p) or 0) > 0.0005]
    table = Table(title="where the step time went, per tenth of the run")
    table.add_column("steps")
    for p in used:
        table.add_column(p, justify="right")
    for part in phases["by_part"]:
        table.add_row(
            escape_for_terminal(_steps(part["first_step"], part["last_step"])), *[pct(part["shares"][p]) for p in used]
        )
    table.add_row("[bold]overall[/bold]", *[f"[bold]{pct(phases['overall'][p])}[/bold]" for p in used])
    console.print(table)


def _print_ranks(s: dict[str, Any], console: Console) -> None:
    ranks = s.get("ranks") or []
    if len(ranks) < 2:
        return
    table = Table(title="per rank (medians; x = relative to the median rank)")
    for col in ("rank", "host", "step time", "compute", "comm wait", "data", "anomalies"):
        table.add_column(col)
    for r in ranks:
        style = "bold red" if r["slow"] else ""
        table.add_row(
            _cell(r["rank"]),
            _cell(r["host"]),
            f"{_cell(r['step_time'], 3)} s (x{_cell(r['step_time_rel'], 3)})",
            f"{_cell(r['compute'], 3)} s (x{_cell(r['compute_rel'], 3)})",
            f"{_cell(r['comm'], 3)} s (x{_cell(r['comm_rel'], 3)})",
            f"{_cell(r['data'], 3)} s",
            escape_for_terminal(", ".join(map(str, r["anomalies"]))) or "-",
            style=style,
        )
    console.print(table)


def _print_health(s: dict[str, Any], console: Console) -> None:
    rows = s.get("health") or []
    if not rows:
        return
    table = Table(title="node health per rank")
    for col in ("rank", "host", "max temp C", "min SM clock GHz", "ECC corr/uncorr", "max host mem", "events"):
        table.add_column(col, overflow="fold")
    for r in rows:
        clock = r["min_sm_clock_hz"]
        table.add_row(
            _cell(r["rank"]),
            _cell(r["host"]),
            _cell(r["max_temperature_c"], 3),
            _cell(None if clock is None else clock / 1e9, 3),
            f"{_cell(r['max_ecc_corrected'])}/{_cell(r['max_ecc_uncorrected'])}",
            pct(r["max_host_mem_ratio"]),
            "\n".join(
                escape_for_terminal(f"{e['severity']} @{_steps(e['first_step'], e['last_step'])}: {e['message']}")
                for e in r["events"]
            )
            or "-",
        )
    console.print(table)


def print_runs(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console(emoji=False)
    table = Table(title="runs")
    for col in ("run", "status", "step", "loss", "tokens/s", "attempts", "open anomalies", "updated"):
        table.add_column(col)
    for r in rows:
        updated = dt.datetime.fromtimestamp(r["updated_at"]).strftime("%Y-%m-%d %H:%M:%S")
        step = "-" if r.get("steps_done") is None else str(r["steps_done"])
        if r.get("planned_steps"):
            step += f"/{r['planned_steps']}"
        opened = r.get("open_anomalies") or 0
        kinds = r.get("open_kinds") or []
        open_text = (
            f"[red]{_cell(opened)}[/red] ({escape_for_terminal(', '.join(map(str, kinds)))})"
            if opened and kinds
            else _cell(opened)
        )
        table.add_row(
            _cell(r["run"]),
            _cell(r["status"]),
            escape_for_terminal(step),
            _cell(r.get("loss")),
            "-" if r.get("tokens_per_second") is None else f"{r['tokens_per_second']:,.0f}",
            _cell(r.get("attempts")),
            open_text,
            updated,
        )
    console.print(table)


# -- HTML -----------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.l2 td:nth-child(2) { padding-left: 24px; }
.critical { color: #b00020; font-weight: bold; }
.warning { color: #b36b00; font-weight: bold; }
.info { color: #1f5fa8; }
.hint { color: #555; font-size: 0.92em; }
.slow td { background: #fdecea; }
img { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
.note { color: #666; font-style: italic; }
"""


def _e(v: Any) -> str:
    return html.escape(fmt(v) if not isinstance(v, str) else v)


def _table(head: list[str] | None, rows: list[list[str]], row_class: list[str] | None = None) -> str:
    """``rows`` hold already-escaped HTML; no header row when ``head`` is None."""
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
    for i, r in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _stacks_html(s: dict[str, Any]) -> str:
    parts = []
    for st in hang_stacks(s["anomalies"]):
        parts.append(f"<h2>Where the ranks waited (hang at step {_e(st['first_step'])})</h2>")
        parts.append(f"<p>{_e(st['summary'])}</p>")
        for g in st["groups"]:
            parts.append(f"<p><b>{_e(rank_ranges(g['ranks']))}</b></p><pre>{_e(chr(10).join(g['frames']))}</pre>")
    return "".join(parts)


def write_html(summary: dict[str, Any], plots: dict[str, Path], path: Path) -> Path:
    """One HTML file holding the tables and the plots (base64), nothing loaded from elsewhere."""
    s = summary
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trainmon post-mortem: {html.escape(s['run'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Post-mortem of run <code>{html.escape(s['run'])}</code></h1>",
        _table(None, [[f"<b>{html.escape(k)}</b>", html.escape(v)] for k, v in overview_rows(s)]),
    ]
    if "loss" in plots:
        parts.append(f"<h2>Loss</h2>{_img(plots['loss'], 'loss')}")
    parts.append("<h2>Anomaly timeline</h2>")
    timeline = s.get("timeline") or []
    if timeline:
        rows, classes = [], []
        for e in timeline:
            sev = html.escape(e["severity"])
            rows.append(
                [
                    _e(_steps(e["first_step"], e["last_step"])),
                    ("" if e["level"] == 1 else "&#8627; ") + _e(e["kind"]),
                    f'<span class="{sev}">{sev}</span>',
                    _e(_rank(e["rank"])),
                    _e(e.get("status")),
                    f'{_e(e["message"])}<div class="hint">&rarr; {_e(e["hint"])}</div>',
                ]
            )
            classes.append("l2" if e["level"] == 2 else "")
        parts.append(_table(["steps", "kind", "severity", "rank", "status", "what, and what to check"], rows, classes))
    else:
        parts.append("<p>No anomalies.</p>")
    parts.append(_stacks_html(s))
    for name, title in (("grad_norm", "Gradient norm"), ("lr", "Learning rate")):
        if name in plots:
            parts.append(f"<h2>{title}</h2>{_img(plots[name], title)}")
    attempts = s.get("attempts_detail") or []
    if attempts:
        parts.append("<h2>Attempts and resumes</h2>")
        resumed = {r["attempt"]: r for r in s.get("resumes") or []}
        rows = []
        for a in attempts:
            r = resumed.get(a["attempt"])
            rows.append(
                [
                    _e(a["attempt"]),
                    _e(_steps(a["first_step"], a["last_step"])),
                    _e(a["status"]),
                    _e(f"step {r['step']} ({r.get('path') or '?'})" if r else "-"),
                    _e(a.get("error")),
                ]
            )
        parts.append(_table(["attempt", "steps", "ended", "resumed from", "error"], rows))
    phases = s.get("phases")
    parts.append("<h2>Throughput and phases</h2>")
    if "throughput" in plots:
        parts.append(_img(plots["throughput"], "throughput"))
    if phases:
        used = [p for p in PHASE_COLUMNS if (phases["overall"].get(p) or 0) > 0.0005]
        rows = [
            [_e(_steps(p["first_step"], p["last_step"])), *[_e(pct(p["shares"][c])) for c in used]]
            for p in phases["by_part"]
        ]
        rows.append(["<b>overall</b>", *[f"<b>{_e(pct(phases['overall'][c]))}</b>" for c in used]])
        parts.append(_table(["steps", *used], rows))
    ranks = s.get("ranks") or []
    parts.append("<h2>Ranks</h2>")
    if "rank_heatmap" in plots:
        parts.append(_img(plots["rank_heatmap"], "per-rank step time"))
    if ranks:
        rows = [
            [
                _e(r["rank"]),
                _e(r["host"]),
                _e(f"{fmt(r['step_time'], 3)} s (x{fmt(r['step_time_rel'], 3)})"),
                _e(f"{fmt(r['compute'], 3)} s (x{fmt(r['compute_rel'], 3)})"),
                _e(f"{fmt(r['comm'], 3)} s (x{fmt(r['comm_rel'], 3)})"),
                _e(f"{fmt(r['data'], 3)} s"),
                _e(", ".join(r["anomalies"]) or "-"),
            ]
            for r in ranks
        ]
        parts.append(
            _table(
                ["rank", "host", "step time", "compute", "comm wait", "data", "anomalies"],
                rows,
                ["slow" if r["slow"] else "" for r in ranks],
            )
        )
    parts.append("<h2>Node health</h2>")
    if "gpu_health" in plots:
        parts.append(_img(plots["gpu_health"], "GPU health"))
    hrows = s.get("health") or []
    if hrows:
        rows = [
            [
                _e(r["rank"]),
                _e(r["host"]),
                _e(fmt(r["max_temperature_c"], 3)),
                _e(fmt(None if r["min_sm_clock_hz"] is None else r["min_sm_clock_hz"] / 1e9, 3)),
                _e(f"{fmt(r['max_ecc_corrected'])}/{fmt(r['max_ecc_uncorrected'])}"),
                _e(pct(r["max_host_mem_ratio"])),
                "<br>".join(
                    f'<span class="{html.escape(ev["severity"])}">{_e(ev["severity"])}</span> '
                    f"@{_e(_steps(ev['first_step'], ev['last_step']))}: {_e(ev['message'])}"
                    for ev in r["events"]
                )
                or "-",
            ]
            for r in hrows
        ]
        parts.append(_table(["rank", "host", "max temp C", "min SM GHz", "ECC", "max host mem", "events"], rows))
    for note in s.get("notes") or []:
        parts.append(f'<p class="note">Note: {_e(note)}</p>')
    parts.append(f'<p class="note">Written by trainmon postmortem at {dt.datetime.now():%Y-%m-%d %H:%M:%S}.</p>')
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_report(analysis: Any, out: Path, progress: Callable[[str], Any] | None = None) -> Path:
    """PNG plots and ``report.html`` under ``out``; returns the HTML path."""
    from trainmon.hooks.wire import json_safe
    from trainmon.monitor.analysis.plots import write_plots  # matplotlib only when plots are asked for

    plots = write_plots(analysis, out, progress)
    return write_html(json_safe(analysis.summary), plots, out / "report.html")
