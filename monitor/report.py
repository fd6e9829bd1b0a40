"""Terminal rendering of summaries and run lists (rich tables)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["fmt", "print_runs", "print_summary"]


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    head = Table(title=f"run {summary['run']}", show_header=False, box=None)
    for key in (
        "status",
        "steps",
        "planned_steps",
        "attempts",
        "world_size",
        "final_loss",
        "final_eval_loss",
        "tokens",
        "tokens_per_second",
        "duration_seconds",
    ):
        head.add_row(key.replace("_", " "), fmt(summary.get(key)))
    console.print(head)
    found = summary["anomalies"]
    if not found:
        console.print("[green]no anomalies[/green]")
        return
    table = Table(title="anomalies")
    for col in ("#", "kind", "severity", "rank", "steps", "status", "message"):
        table.add_column(col, overflow="fold")
    for i, a in enumerate(found, 1):
        steps = f"{fmt(a['first_step'])}-{fmt(a['last_step'])}"
        rank = "all" if a["rank"] < 0 else str(a["rank"])
        table.add_row(str(i), a["kind"], a["severity"], rank, steps, a["status"], a["message"])
    console.print(table)
    for i, a in enumerate(found, 1):
        console.print(f"[bold]{i}.[/bold] {a['kind']}: {a['hint']}")


def print_runs(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="runs")
    for col in ("run", "status", "step", "loss", "attempts", "open anomalies", "updated"):
        table.add_column(col)
    for r in rows:
        updated = dt.datetime.fromtimestamp(r["updated_at"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            r["run"], r["status"], fmt(r["step"]), fmt(r["loss"]), fmt(r["attempts"]), fmt(r["open_anomalies"]), updated
        )
    console.print(table)
