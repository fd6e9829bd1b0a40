"""``trainmon demo``: the whole product in one command, on a laptop CPU.

Starts a collector in this process (embedded SQLite, a free loopback port), runs the
reference trainer in a subprocess with a few injected faults (the trainer is a separate
process, as it would be in real life, and the collector side never imports torch), shows a
live view while it trains, and ends with the post-mortem and where to look next.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from monitor.config import CollectorConfig
from monitor.live import LiveState
from monitor.postmortem import summarize
from monitor.report import fmt, print_summary
from monitor.server import Collector, ServerThread, create_app

__all__ = ["DEFAULT_INJECTS", "run_demo"]

DEFAULT_INJECTS = ("loss_spike@300:scale=50", "data_stall@500:seconds=0.5,steps=4", "lr_frozen@650", "nan@900")
# A model big enough that a step takes tens of milliseconds on a laptop core: a minute of training.
TRAINER_ARGS = (
    "--n-layer",
    "4",
    "--n-embd",
    "128",
    "--n-head",
    "4",
    "--eval-every",
    "100",
    "--checkpoint-every",
    "250",
)


def _view(live: LiveState, run: str, planned: int, started: float) -> Table:
    table = Table(title=f"trainmon demo — run {run}", expand=False)
    for col in ("step", "loss", "grad norm (pre/post clip)", "lr", "tokens/s", "anomalies"):
        table.add_column(col)
    with live.lock:
        state = live.runs.get(run)
        rank = state.ranks.get(0) if state else None
        if rank is None or rank.step < 0:
            table.add_row("starting…", "", "", "", "", "")
            return table
        f = rank.last
        lr = (f.get("lr") or [None])[0]
        opened = sum(state.anomalies_total.values())
        active = ", ".join(f"{k}" for (k, _), n in state.anomalies_active.items() if n) or "-"
        table.add_row(
            f"{rank.step + 1}/{planned}  ({time.monotonic() - started:.0f}s)",
            fmt(f.get("loss")),
            f"{fmt(f.get('grad_norm'), 3)} / {fmt(f.get('grad_norm_clipped'), 3)}",
            fmt(lr, 3),
            fmt(rank.tokens_per_second, 4),
            f"{opened} opened; active: {active}",
        )
    return table


def run_demo(out: Path, steps: int = 1000, injects: list[str] | None = None) -> int:
    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    db = out / "trainmon.sqlite"
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    collector = Collector.open(CollectorConfig(db=str(db)))
    server = ServerThread(create_app(collector), "127.0.0.1", 0)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    console.print(f"collector on {url} (metrics: {url}/metrics), store {db}")
    run_dir = out / run
    cmd = [
        sys.executable,
        "-m",
        "reference_trainer",
        "--run",
        run,
        "--steps",
        str(steps),
        "--out",
        str(run_dir),
        "--collector",
        url,
    ]
    for spec in injects if injects is not None else DEFAULT_INJECTS:
        cmd += ["--inject", spec]
    console.print("trainer: " + " ".join(cmd[1:]))
    started = time.monotonic()
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        with Live(_view(collector.live, run, steps, started), console=console, refresh_per_second=4) as view:
            while proc.poll() is None:
                time.sleep(0.25)
                view.update(_view(collector.live, run, steps, started))
            time.sleep(1.0)  # the trainer flushed on exit; let the last batch land
            view.update(_view(collector.live, run, steps, started))
    finally:
        log.close()
    if proc.returncode != 0:
        console.print(f"[red]trainer exited with {proc.returncode}; see {log.name}[/red]")
    summary = summarize(collector.storage, run)
    console.print()
    print_summary(summary, console)
    labels_path = run_dir / "labels.json"
    if labels_path.exists():
        _print_labels(console, json.loads(labels_path.read_text()), summary["anomalies"])
    console.print(
        f"\nstore: {db}\n"
        f"again later: trainmon postmortem {run} --db {db}\n"
        f"live metrics were at {url}/metrics (the collector stops with the demo; "
        f"`trainmon serve --db {db}` serves the store again)"
    )
    server.stop()
    collector.close()
    return 0 if proc.returncode == 0 else 1


def _print_labels(console: Console, labels: list[dict], anomalies: list[dict]) -> None:
    """Injected faults next to what the detectors said about them."""
    table = Table(title="injected faults (labels.json) vs detections")
    for col in ("fault", "rank", "steps", "expected detector", "detected at"):
        table.add_column(col)
    for lab in labels:
        hits = [
            a
            for a in anomalies
            if a["kind"] == lab.get("expected_detection")
            and a["first_step"] is not None
            and a["first_step"] >= lab.get("first_step", 0)
        ]
        table.add_row(
            lab.get("kind", "?"),
            fmt(lab.get("rank")),
            f"{fmt(lab.get('first_step'))}-{fmt(lab.get('last_step'))}",
            fmt(lab.get("expected_detection")),
            ", ".join(f"step {a['first_step']}" for a in hits[:1]) or "[yellow]not detected[/yellow]",
        )
    console.print(table)
