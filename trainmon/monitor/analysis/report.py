"""Rendering the post-mortem: rich text in the terminal, and one self-contained HTML page.

Both open with the verdict (:mod:`trainmon.monitor.analysis.verdict`): healthy, or the findings
that matter with when, how bad, what to do, and what it cost. The details follow. The HTML page
embeds its plots as base64 PNGs and carries its own CSS, so it can be mailed, attached to a ticket
or opened offline; the collector's web view (:mod:`trainmon.monitor.web.pages`) serves the same
page, with a refresh while the run is live.

Human-facing conventions, kept in one place so every view agrees: numbers through :func:`fmt`
(``31,470``, never ``3.147e+04``); attempts numbered from 1 (the summary, the store and the
Prometheus labels count from 0); in the terminal, long text (messages, hints, paths) goes below its
table instead of into a narrow column, and a command in backticks is never broken across lines.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import re
import textwrap
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainmon.monitor.analysis.termfit import FittedTable
from trainmon.monitor.analysis.verdict import finding_numbers, problems_line, verdict
from trainmon.monitor.core.escape import escape_for_terminal, visible_controls
from trainmon.monitor.core.fmt import attempt_label, fmt
from trainmon.monitor.core.stacks import hang_stacks, rank_ranges
from trainmon.monitor.store.storage import PHASE_COLUMNS

__all__ = [
    "fmt",
    "html_text",
    "print_runs",
    "print_summary",
    "render_html",
    "run_health",
    "run_link",
    "write_html",
    "write_report",
]


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 1:
        return f"{seconds:.2g} s"  # a 14 ms save is not "0.0 s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rank(rank: int | None) -> str:
    return "all" if rank is None or rank < 0 else str(rank)


def _who(rank: int | None) -> str:
    """``rank 5``, or ``all ranks`` for a finding about the run as a whole."""
    return "all ranks" if rank is None or rank < 0 else f"rank {rank}"


def _steps(first: Any, last: Any) -> str:
    if first is None:
        return "-"
    return str(first) if last in (None, first) else f"{first}-{last}"


def _part_steps(part: dict[str, Any], attempts: list[dict[str, Any]]) -> str:
    """A tenth of the run's steps; one that spans a resume is the end of one attempt and the start
    of the next (``72, 50-62``), not a range running backwards."""
    spans = part.get("attempts") or []
    if len(spans) < 2:
        return _steps(part["first_step"], part["last_step"])
    by = {a["attempt"]: a for a in attempts}
    end_first = (by.get(spans[0]) or {}).get("last_step")
    start_last = (by.get(spans[-1]) or {}).get("first_step")
    if end_first is None or start_last is None:
        return f"{part['first_step']}, …{part['last_step']}"
    return f"{_steps(part['first_step'], end_first)}, {_steps(start_last, part['last_step'])}"


def _seconds_rel(value: float | None, rel: float | None) -> str:
    """``0.123 s (x1.05)``: a median and its ratio to the median rank; ``-`` when there is none."""
    if value is None:
        return "-"
    return f"{fmt(value, 3)} s" + ("" if rel is None else f" (x{fmt(rel, 3)})")


def _unknown(s: dict[str, Any], key: str) -> str | None:
    """``unknown (why)`` when the summary lists ``key`` as unknown (see the postmortem module), else None."""
    why = (s.get("unknown") or {}).get(key)
    return None if why is None else f"unknown ({why})"


def tokens_per_second_label(s: dict[str, Any]) -> str:
    """The definition, said where the figure is shown: every rank's tokens over the step time
    (all phases: checkpoints, evals and stalls included). ``trainmon status`` shows the same
    quantity over its recent window; a detector's baseline excludes checkpoint and eval time and
    is per rank, so it reads higher."""
    world = s.get("world_size") or 1
    return "mean tokens/s (whole run" + (f", all {world} ranks" if world > 1 else "") + ")"


def overview_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's headline figures as (label, text) pairs, shared by terminal and HTML.

    A figure the summary lists under ``unknown`` reads ``unknown (why)``, never a number."""
    ck = s.get("checkpoint") or {}
    steps = fmt(s.get("steps"))
    if s.get("planned_steps"):
        steps += f" of {fmt(s['planned_steps'])} planned"
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
        else "-"  # no failed attempt: no rate to give (the attempts row says none failed)
    )
    if not ck.get("failures") and not opt and "checkpoint.optimal_interval_seconds" not in (s.get("unknown") or {}):
        optimal = "-"  # Young/Daly has no failure to weigh: a line that says nothing
    needs = "peak_flops" if s.get("n_params") else "flops_per_token or n_params, and peak_flops"  # what is missing
    mfu = _unknown(s, "mfu") or (pct(s["mfu"]) if s.get("mfu") is not None else f"- (needs {needs})")
    from trainmon.monitor.core import goodput  # numpy: only when a post-mortem is shown

    rows = [
        ("goodput", goodput.headline(s) or "-"),
        ("status", status),
        ("steps", steps),
        ("attempts", _attempts_cell(s, len(resumes))),
        ("world size", fmt(s.get("world_size"))),
        ("wall time", _unknown(s, "duration_seconds") or duration(s.get("duration_seconds"))),
        ("tokens", fmt(s.get("tokens"))),
        ("final train loss", fmt(s.get("final_loss"))),
        ("final eval loss", fmt(s.get("final_eval_loss"))),
        (tokens_per_second_label(s), _unknown(s, "tokens_per_second") or fmt(s.get("tokens_per_second"))),
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
    return [(k, v) for k, v in rows if v not in ("-", "none recorded") or k in ("status", "steps")]


def _attempts_cell(s: dict[str, Any], resumes: int) -> str:
    """``2 (1 failed), 1 resume(s)``; a last attempt that was interrupted says so (it is not a failure);
    ``1`` for a run that started once and finished (nothing else to say)."""
    parts = [f"{s.get('failures', 0)} failed"]
    last = (s.get("attempts_detail") or [{}])[-1]
    if last.get("status") == "interrupted" and not last.get("failed"):
        parts.append("the last interrupted")
    if s.get("attempts") == 1 and not resumes and last.get("status") == "finished":
        return "1"
    return f"{s.get('attempts')} ({', '.join(parts)}), {resumes} resume(s)"


def run_health(open_severities: list[str], status: str | None) -> str:
    """One word for a run in a list: ``critical``/``warning`` (its worst open finding), ``failed``
    (it ended badly with nothing open), else ``healthy``."""
    for sev in ("critical", "warning"):
        if sev in open_severities:
            return sev
    return "failed" if status in ("failed", "lost") else "healthy"  # an interruption is how it ended


# -- terminal -------------------------------------------------------------------------------
# Every value that came from a producer goes through escape_for_terminal before it meets a rich
# markup string or a table cell (both are parsed as markup), or into rich Text (not parsed) with
# its controls made visible; only trainmon's own styling is markup.

_COMMAND = re.compile(r"`[^`\n]+`")
_KEEP = "\x00"  # stands for a space inside a command while the text is wrapped


def _wrap(text: str, width: int) -> list[str]:
    """``text`` wrapped at ``width`` on spaces only: no word, path or backticked command is broken
    (a command longer than ``width`` stays whole on its own line)."""
    lines: list[str] = []
    for para in text.split("\n"):
        kept = _COMMAND.sub(lambda m: m.group().replace(" ", _KEEP), para)
        wrapped = textwrap.wrap(kept, width=max(20, width), break_long_words=False, break_on_hyphens=False)
        lines.extend(line.replace(_KEEP, " ") for line in wrapped or [""])
    return lines


def _prose(console: Console, text: str, indent: int = 0, style: str = "", first: str = "") -> None:
    """Print data text wrapped at the console width with a hanging indent; lines are printed with
    ``soft_wrap`` so rich never re-breaks them (a long command overflows rather than splits)."""
    pad = " " * indent
    lines = _wrap(visible_controls(text), console.width - indent)
    for i, line in enumerate(lines):
        lead = first if i == 0 and first else pad
        console.print(Text(lead + line, style=style), soft_wrap=True)


def _cell(value: Any, digits: int = 4) -> str:
    """A value formatted with :func:`fmt`, ready for a table cell or a markup string."""
    return escape_for_terminal(fmt(value, digits))


_COLOUR = {"critical": "red", "warning": "yellow", "info": "cyan"}


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """The whole post-mortem: the verdict, then the details."""
    console = console or Console(emoji=False)
    console.print(Text(visible_controls(f"post-mortem of run {summary['run']}"), style="bold"), soft_wrap=True)
    _print_verdict(summary, console)
    head = Table(show_header=False, box=None, title="overview", title_justify="left")
    head.add_column(style="bold", no_wrap=True)
    head.add_column()
    for label, value in overview_rows(summary):
        head.add_row(escape_for_terminal(label), escape_for_terminal(value))
    console.print(head)
    _print_timeline(summary, console)
    _print_stacks(summary, console)
    _print_attempts(summary, console)
    _print_phases(summary, console)
    _print_ranks(summary, console)
    _print_health(summary, console)
    for note in summary.get("notes") or []:
        _prose(console, note, 6, "dim", first="note: ")


def _print_verdict(s: dict[str, Any], console: Console) -> None:
    v = verdict(s)
    console.rule(style="green" if v["healthy"] else "red")
    console.print(Text(v["headline"].upper(), style="bold green" if v["healthy"] else "bold red"), soft_wrap=True)
    for place, f in enumerate(v["findings"], 1):
        sev = f["severity"]
        head = Text(f"{place}. ", style="bold")
        head.append(f["kind"], style="bold")
        head.append(f" #{f['number']}")  # its number in the timeline and on the plots
        head.append(f"  {sev}", style=_COLOUR.get(sev, ""))
        said = [f["when"], _who(f["rank"]), *([f["state"]] if f["state"] else [])]
        tail = visible_controls("  " + ", ".join(said))
        short = tail.rsplit(", ", 1)[0] + ","
        if len(head) + len(tail) <= console.width:
            console.print(head + Text(tail))
        elif len(head) + len(short) <= console.width:  # the last part on its own line, not wrapped to column 0
            console.print(head + Text(short))
            _prose(console, said[-1], 4, first="    ")
        else:
            console.print(head)
            _prose(console, ", ".join(said), 4, first="    ")
        _prose(console, f["what"], 4, first="    ")
        _prose(console, f["todo"], 4, "dim", first="  → ")
    if v["more"]:
        console.print(f"and {v['more']} more warning(s) in the timeline below", style="dim")
    for line in v["cost"]:
        _prose(console, line, 7, first="cost: ")
    gaps = s.get("not_checked") or []
    if gaps:
        console.print("not checked (the input does not carry what they need):", style="bold")
        for gap in gaps:
            _prose(console, _gap_text(gap), 4, first="  - ")
    console.rule(style="green" if v["healthy"] else "red")


def _gap_text(gap: dict[str, Any]) -> str:
    """One entry of the summary's ``not_checked`` (:mod:`coverage`): the checks, then why."""
    return f"{gap['unchecked']} ({gap['why']})"


def _print_timeline(s: dict[str, Any], console: Console) -> None:
    timeline = s.get("timeline")
    if timeline is None:  # a summary from an older caller: the flat list
        timeline = [{**a, "level": 1} for a in s["anomalies"]]
    if not timeline:
        console.print("[green]no anomalies[/green]")
        return
    numbers = finding_numbers(s)
    table = Table(title="anomaly timeline (└ explains the finding above)", title_justify="left")
    for col in ("#", "steps", "kind", "severity", "rank", "status"):
        table.add_column(col, no_wrap=True)
    texts = []
    for e in timeline:
        n = numbers.get(e.get("anomaly")) if e["level"] == 1 else None
        tag = f"#{n}" if n is not None else ("└" if e["level"] == 2 else "")
        sev = e["severity"]
        table.add_row(
            tag,
            escape_for_terminal(_steps(e["first_step"], e["last_step"])),
            ("" if e["level"] == 1 else "└ ") + escape_for_terminal(e["kind"]),
            f"[{_COLOUR.get(sev, 'white')}]{escape_for_terminal(sev)}[/]",
            escape_for_terminal(_rank(e["rank"])),
            _cell(e.get("status")),
        )
        texts.append((tag, e))
    console.print(table)
    for tag, e in texts:
        label = f"{tag} {e['kind']} @ {_steps(e['first_step'], e['last_step'])}: "
        indent = 4 if e["level"] == 1 else 6
        _prose(console, label + e["message"], indent, first=" " * (indent - 4))
        _prose(console, e["hint"], indent, "dim", first=" " * (indent - 4) + "  → ")


def _print_stacks(s: dict[str, Any], console: Console) -> None:
    """Where the ranks of a hang waited: the hooks' stack captures, grouped (innermost frame first)."""
    for st in hang_stacks(s["anomalies"]):
        console.print(Text(f"where the ranks waited (hang at step {st['first_step']})", style="bold"))
        _prose(console, st["summary"], 4)
        for g in st["groups"]:
            console.print(Text(visible_controls(f"    {rank_ranges(g['ranks'])}:")))
            for line in g["frames"][:8]:
                console.print(Text(visible_controls(f"      {line}")), soft_wrap=True)


def _print_attempts(s: dict[str, Any], console: Console) -> None:
    attempts = s.get("attempts_detail") or []
    if len(attempts) < 2 and not s.get("resumes"):
        return
    table = Table(title="attempts and resumes", title_justify="left")
    for col in ("attempt", "steps", "ended", "resumed from step"):
        table.add_column(col, no_wrap=True)
    resumed = {r["attempt"]: r for r in s.get("resumes") or []}
    below = []
    for a in attempts:
        r = resumed.get(a["attempt"])
        label = attempt_label(a["attempt"])
        table.add_row(
            label,
            escape_for_terminal(_steps(a["first_step"], a["last_step"])),
            _cell(a["status"]),
            escape_for_terminal(str(r["step"])) if r else "-",
        )
        if r and r.get("path"):
            below.append((f"attempt {label} resumed from ", r["path"]))
        if a.get("error"):
            below.append((f"attempt {label} error: ", a["error"]))
    console.print(table)
    for lead, text in below:
        _prose(console, lead + text, 4)


def _print_phases(s: dict[str, Any], console: Console) -> None:
    phases = s.get("phases")
    if not phases:
        return
    used = [p for p in PHASE_COLUMNS if (phases["overall"].get(p) or 0) > 0.0005]
    attempts = s.get("attempts_detail") or []
    table = Table(
        title="where the step time went, per tenth of the run",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("steps", no_wrap=True)
    for p in used:
        table.add_column(p, justify="right", no_wrap=True)
    for part in phases["by_part"]:
        table.add_row(escape_for_terminal(_part_steps(part, attempts)), *[pct(part["shares"][p]) for p in used])
    table.add_row("[bold]overall[/bold]", *[f"[bold]{pct(phases['overall'][p])}[/bold]" for p in used])
    console.print(table)


def _print_ranks(s: dict[str, Any], console: Console) -> None:
    ranks = s.get("ranks") or []
    if len(ranks) < 2:
        return
    headers = ["rank", "host", "step time", "compute", "comm wait", "data", "anomalies"]
    rows = [
        [
            fmt(r["rank"]),
            fmt(r["host"]),
            _seconds_rel(r["step_time"], r["step_time_rel"]),
            _seconds_rel(r["compute"], r["compute_rel"]),
            _seconds_rel(r["comm"], r["comm_rel"]),
            _seconds_rel(r["data"], None),
            ", ".join(map(str, r["anomalies"])) or "-",
        ]
        for r in ranks
    ]
    console.print(
        FittedTable(
            headers,
            rows,
            drop=("host", "anomalies", "data", "comm wait"),  # said below the table when it is too wide
            row_styles=["bold red" if r["slow"] else "" for r in ranks],
            title="per rank (medians; x = relative to the median rank)",
            title_justify="left",
        )
    )


# (summary key, column title, how to show it): a column whose every row is empty is left out.
_HEALTH_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("max_temperature_c", "max temp °C", lambda v: fmt(v, 3)),
    ("min_sm_clock_hz", "min SM clock GHz", lambda v: fmt(v / 1e9, 3)),
    ("max_ecc_corrected", "ECC corrected", fmt),
    ("max_ecc_uncorrected", "ECC uncorrected", fmt),
    ("max_host_mem_ratio", "max host memory", pct),
)


def _health_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, Callable[[Any], str]]]:
    return [c for c in _HEALTH_COLUMNS if any(r.get(c[0]) is not None for r in rows)]


def _print_health(s: dict[str, Any], console: Console) -> None:
    rows = s.get("health") or []
    if not rows:
        return
    cols = _health_columns(rows)
    headers = ["rank", "host", *[c[1] for c in cols]]
    cells = [
        [fmt(r["rank"]), fmt(r["host"]), *[show(r[key]) if r.get(key) is not None else "-" for key, _, show in cols]]
        for r in rows
    ]
    console.print(FittedTable(headers, cells, drop=("host",), title="node health per rank", title_justify="left"))
    for r in rows:
        for e in r["events"]:
            text = f"rank {r['rank']} {e['severity']} @ {_steps(e['first_step'], e['last_step'])}: {e['message']}"
            _prose(console, text, 4)


def _ago(seconds: float) -> str:
    """How long ago: ``12s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def print_runs(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    """The runs, one line each. Names, numbers and kinds are never cut (no ``demo-2…``): the open
    anomalies are listed below the table, attempts get a column only when a run has several, and
    the last update is an age (``14m``). When the table is wider than the terminal (long run names
    at 80 columns), each name gets a line of its own with its figures below it, and the figures a
    reader needs least (age, attempts, tokens/s) drop out first if even those do not fit."""
    console = console or Console(emoji=False)
    several = any((r.get("attempts") or 1) > 1 for r in rows)
    headers = ["status", "step", "loss", "tokens/s", *(["attempts"] if several else []), "age"]
    right = ("loss", "tokens/s", "attempts", "age")
    below = []
    cells = []
    now = time.time()
    for r in rows:
        step = "-" if r.get("step") is None else fmt(r.get("steps_done", r["step"] + 1))
        if r.get("planned_steps"):
            step += f"/{fmt(r['planned_steps'])}"
        opened = r.get("open_anomalies") or 0
        kinds = r.get("open_kinds") or []
        h = r.get("health") if isinstance(r.get("health"), dict) else {}
        if opened or h.get("problems"):
            line = Text(visible_controls(f"    {r['run']}: "))
            if opened:
                line.append(f"{opened} open", style="red")
                line.append(visible_controls(f": {', '.join(map(str, kinds))}" if kinds else ""))
            if h.get("problems"):  # verdict.health, as the post-mortem counts them (a recovered spike too)
                line.append(visible_controls(("; " if opened else "") + f"{h['headline']}: {problems_line(h)}"))
            below.append(line)
        cells.append([fmt(r["status"]), step, fmt(r.get("loss")), fmt(r.get("tokens_per_second")),
                      *([fmt(r.get("attempts"))] if several else []), _ago(now - r["updated_at"])])  # fmt: skip
    names = [str(r["run"]) for r in rows]
    table = FittedTable(["run", *headers], [[n, *c] for n, c in zip(names, cells, strict=True)], right=right,
                        title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)  # fmt: skip
    if table.fits(console, console.width):
        console.print(table)
    else:
        _print_stacked(console, names, headers, cells, right)
    for line in below:
        console.print(line)  # wraps at spaces; it holds names, never a command


def _print_stacked(
    console: Console, names: list[str], headers: list[str], cells: list[list[str]], right: tuple[str, ...]
) -> None:
    """Each name on a line of its own (whole, however long), its figures indented below it."""
    widths = {i: max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)}
    keep = list(range(len(headers)))
    drops = [headers.index(h) for h in ("age", "attempts", "tokens/s") if h in headers]  # the least needed first
    while drops and 2 + sum(widths[i] for i in keep) + 3 * (len(keep) - 1) > console.width:
        keep.remove(drops.pop(0))

    def line(values: list[str]) -> str:
        out = [values[i].rjust(widths[i]) if headers[i] in right else values[i].ljust(widths[i]) for i in keep]
        return "  " + "   ".join(out).rstrip()

    console.print(Text("runs", style="italic"))
    console.print(Text(line(headers), style="bold"), soft_wrap=True)
    for name, values in zip(names, cells, strict=True):
        console.print(Text(visible_controls(name), style="bold"), soft_wrap=True)
        console.print(Text(visible_controls(line(values))), soft_wrap=True)


# -- HTML -----------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.l2 td:nth-child(3) { padding-left: 24px; }
.critical { color: #b00020; font-weight: bold; }
.warning { color: #b36b00; font-weight: bold; }
.info { color: #1f5fa8; }
.healthy { color: #1b7f3b; font-weight: bold; }
.failed { color: #b00020; font-weight: bold; }
.hint { color: #555; font-size: 0.92em; }
.slow td { background: #fdecea; }
img { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
.note { color: #666; font-style: italic; }
.verdict { border: 2px solid #b00020; background: #fdf3f4; padding: 10px 16px; border-radius: 6px; }
.verdict.ok { border-color: #1b7f3b; background: #f1faf3; }
.verdict h2 { border: none; margin: 4px 0 8px; }
.verdict ol { padding-left: 1.2em; } .verdict li { margin: 6px 0; }
code { background: #f4f4f4; padding: 0 3px; }
nav { margin-bottom: 8px; }
"""


def html_text(v: Any) -> str:
    """Data as HTML text: numbers through :func:`fmt`, control characters visible (``\\x1b``),
    escaped with quotes (it may land in an attribute)."""
    return html.escape(visible_controls(v if isinstance(v, str) else fmt(v)), quote=True)


def _prose_html(text: str) -> str:
    """Data text as HTML: escaped, with backticked commands set as code."""
    out, pos = [], 0
    for m in _COMMAND.finditer(text):
        out.append(html_text(text[pos : m.start()]))
        out.append(f"<code>{html_text(m.group()[1:-1])}</code>")
        pos = m.end()
    out.append(html_text(text[pos:]))
    return "".join(out)


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


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _stacks_html(s: dict[str, Any]) -> str:
    parts = []
    for st in hang_stacks(s["anomalies"]):
        parts.append(f"<h2>Where the ranks waited (hang at step {html_text(st['first_step'])})</h2>")
        parts.append(f"<p>{html_text(st['summary'])}</p>")
        for g in st["groups"]:
            frames = html_text("\n".join(g["frames"]))
            parts.append(f"<p><b>{html_text(rank_ranges(g['ranks']))}</b></p><pre>{frames}</pre>")
    return "".join(parts)


def _verdict_html(s: dict[str, Any]) -> str:
    v = verdict(s)
    parts = [f'<section class="verdict{" ok" if v["healthy"] else ""}" id="verdict">']
    parts.append(f'<h2 class="{"healthy" if v["healthy"] else "critical"}">{html_text(v["headline"])}</h2>')
    if v["findings"]:
        parts.append("<ol>")
        for f in v["findings"]:
            sev = html.escape(f["severity"])
            when = ", ".join(filter(None, [f["when"], _who(f["rank"]), f["state"]]))
            parts.append(
                f'<li><b>{html_text(f["kind"])}</b> #{f["number"]} <span class="{sev}">{sev}</span> '
                f"&middot; {html_text(when)}"
                f"<div>{_prose_html(f['what'])}</div>"
                f'<div class="hint">&rarr; {_prose_html(f["todo"])}</div></li>'
            )
        parts.append("</ol>")
    if v["more"]:
        parts.append(f"<p>and {v['more']} more warning(s) in the timeline below</p>")
    if v["cost"]:
        parts.append("<p><b>Cost:</b> " + "; ".join(html_text(c) for c in v["cost"]) + "</p>")
    gaps = s.get("not_checked") or []
    if gaps:
        parts.append("<p><b>Not checked</b> (the input does not carry what they need):</p><ul>")
        parts.extend(f"<li>{html_text(_gap_text(gap))}</li>" for gap in gaps)
        parts.append("</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def render_html(
    summary: dict[str, Any],
    images: dict[str, bytes],
    *,
    refresh_seconds: int | None = None,
    home: str | None = None,
    generated_by: str = "trainmon postmortem",
) -> str:
    """The post-mortem as one HTML page: verdict first, then the details, each plot (PNG bytes by
    name, see :mod:`~trainmon.monitor.analysis.plots`) with the section it belongs to. Sections
    without data are left out. ``refresh_seconds`` reloads the page (a live run); ``home`` is a
    link back to the list of runs. Every value from the summary is escaped."""
    s = summary
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">' if refresh_seconds else "",
        f"<title>trainmon: {html_text(s['run'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<nav><a href="{html.escape(home, quote=True)}">&larr; all runs</a></nav>' if home else "",
        f"<h1>Run <code>{html_text(s['run'])}</code></h1>",
        _verdict_html(s),
        "<h2>Overview</h2>",
        _table(None, [[f"<b>{html_text(k)}</b>", html_text(v)] for k, v in overview_rows(s)]),
    ]
    if "loss" in images:
        parts.append(f"<h2>Loss</h2>{_img(images['loss'], 'loss')}")
    parts.append("<h2>Anomaly timeline</h2>")
    parts.append(_timeline_html(s))
    parts.append(_stacks_html(s))
    for name, title in (
        ("grad_norm", "Gradient norm"),
        ("lr", "Learning rate"),
        ("precursors", "Instability precursors"),
    ):
        if name in images:
            parts.append(f"<h2>{title}</h2>{_img(images[name], title)}")
    parts.append(_attempts_html(s))
    phases = s.get("phases")
    if "throughput" in images or phases:
        parts.append("<h2>Throughput and phases</h2>")
    if "throughput" in images:
        parts.append(_img(images["throughput"], "throughput"))
    if phases:
        used = [p for p in PHASE_COLUMNS if (phases["overall"].get(p) or 0) > 0.0005]
        attempts = s.get("attempts_detail") or []
        rows = [
            [html_text(_part_steps(p, attempts)), *[html_text(pct(p["shares"][c])) for c in used]]
            for p in phases["by_part"]
        ]
        rows.append(["<b>overall</b>", *[f"<b>{html_text(pct(phases['overall'][c]))}</b>" for c in used]])
        parts.append(_table(["steps", *used], rows))
    parts.append(_ranks_html(s, images))
    parts.append(_health_html(s, images))
    for note in s.get("notes") or []:
        parts.append(f'<p class="note">Note: {html_text(note)}</p>')
    parts.append(f'<p class="note">Written by {html_text(generated_by)} at {dt.datetime.now():%Y-%m-%d %H:%M:%S}.</p>')
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _timeline_html(s: dict[str, Any]) -> str:
    timeline = s.get("timeline") or []
    if not timeline:
        return "<p>No anomalies.</p>"
    numbers = finding_numbers(s)
    rows, classes = [], []
    for e in timeline:
        n = numbers.get(e.get("anomaly")) if e["level"] == 1 else None
        sev = html.escape(e["severity"])
        rows.append(
            [
                f"#{n}" if n is not None else "",
                html_text(_steps(e["first_step"], e["last_step"])),
                ("" if e["level"] == 1 else "&#8627;&nbsp;") + html_text(e["kind"]),
                f'<span class="{sev}">{sev}</span>',
                html_text(_rank(e["rank"])),
                html_text(e.get("status")),
                f'{_prose_html(e["message"])}<div class="hint">&rarr; {_prose_html(e["hint"])}</div>',
            ]
        )
        classes.append("l2" if e["level"] == 2 else "")
    return _table(["#", "steps", "kind", "severity", "rank", "status", "what, and what to check"], rows, classes)


def _attempts_html(s: dict[str, Any]) -> str:
    attempts = s.get("attempts_detail") or []
    if len(attempts) < 2 and not s.get("resumes"):
        return ""
    resumed = {r["attempt"]: r for r in s.get("resumes") or []}
    rows = []
    for a in attempts:
        r = resumed.get(a["attempt"])
        rows.append(
            [
                html_text(attempt_label(a["attempt"])),
                html_text(_steps(a["first_step"], a["last_step"])),
                html_text(a["status"]),
                html_text(f"step {r['step']} ({r.get('path') or '?'})" if r else "-"),
                html_text(a.get("error")),
            ]
        )
    return "<h2>Attempts and resumes</h2>" + _table(["attempt", "steps", "ended", "resumed from", "error"], rows)


def _ranks_html(s: dict[str, Any], images: dict[str, bytes]) -> str:
    ranks = s.get("ranks") or []
    if len(ranks) < 2:
        return ""
    parts = ["<h2>Ranks</h2>"]
    if "rank_heatmap" in images:
        parts.append(_img(images["rank_heatmap"], "per-rank step time"))
    rows = [
        [
            html_text(r["rank"]),
            html_text(r["host"]),
            html_text(_seconds_rel(r["step_time"], r["step_time_rel"])),
            html_text(_seconds_rel(r["compute"], r["compute_rel"])),
            html_text(_seconds_rel(r["comm"], r["comm_rel"])),
            html_text(_seconds_rel(r["data"], None)),
            html_text(", ".join(r["anomalies"]) or "-"),
        ]
        for r in ranks
    ]
    head = ["rank", "host", "step time", "compute", "comm wait", "data", "anomalies"]
    parts.append(_table(head, rows, ["slow" if r["slow"] else "" for r in ranks]))
    return "\n".join(parts)


def _health_html(s: dict[str, Any], images: dict[str, bytes]) -> str:
    hrows = s.get("health") or []
    if not hrows and "gpu_health" not in images:
        return ""
    parts = ["<h2>Node health</h2>"]
    if "gpu_health" in images:
        parts.append(_img(images["gpu_health"], "node health"))
    cols = _health_columns(hrows)
    rows = [
        [
            html_text(r["rank"]),
            html_text(r["host"]),
            *[html_text(show(r[key]) if r.get(key) is not None else "-") for key, _, show in cols],
            "<br>".join(
                f'<span class="{html.escape(ev["severity"])}">{html_text(ev["severity"])}</span> '
                f"@{html_text(_steps(ev['first_step'], ev['last_step']))}: {_prose_html(ev['message'])}"
                for ev in r["events"]
            )
            or "-",
        ]
        for r in hrows
    ]
    if rows:
        parts.append(_table(["rank", "host", *[c[1] for c in cols], "events"], rows))
    return "\n".join(parts)


def run_link(run: str) -> str:
    """The web view's path of ``run`` (quoted: a run name is data)."""
    return "/runs/" + urllib.parse.quote(run, safe="")


def write_html(summary: dict[str, Any], images: dict[str, bytes], path: Path) -> Path:
    """One HTML file holding the tables and the plots (base64), nothing loaded from elsewhere."""
    path.write_text(render_html(summary, images), encoding="utf-8")
    return path


def write_report(analysis: Any, out: Path, progress: Callable[[str], Any] | None = None) -> Path:
    """PNG plots and ``report.html`` under ``out``; returns the HTML path."""
    from trainmon.monitor.analysis.plots import render_plots  # matplotlib only when plots are asked for
    from trainmon.wire import json_safe

    out.mkdir(parents=True, exist_ok=True)
    images = render_plots(analysis, progress)
    for name, png in images.items():
        (out / f"{name}.png").write_bytes(png)
    return write_html(json_safe(analysis.summary), images, out / "report.html")
