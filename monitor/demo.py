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

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from trainmon.monitor.analysis.escape import escape_for_terminal, visible_controls
from trainmon.monitor.analysis.live_view import render_status, run_status
from trainmon.monitor.analysis.postmortem import analyse
from trainmon.monitor.analysis.report import fmt, print_summary, write_report
from trainmon.monitor.collector.server import Collector, ServerThread, create_app
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.store.storage import Storage

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


def _view(storage: Storage, run: str) -> RenderableType:
    """The same status view as ``trainmon status RUN --follow``, read from the demo's store."""
    try:
        return render_status(run_status(storage, run), source="demo")
    except KeyError:
        return Text(visible_controls(f"waiting for run {run} to report..."))


def run_demo(out: Path, steps: int = 1000, injects: list[str] | None = None) -> int:
    console = Console(emoji=False)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "trainmon.sqlite"
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    collector = Collector.open(CollectorConfig(db=str(db)))
    server = ServerThread(create_app(collector), "127.0.0.1", 0)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    console.print(f"collector on {url} (metrics: {url}/metrics), store {escape_for_terminal(db)}")
    run_dir = out / run
    cmd = [
        sys.executable,
        "-m",
        "trainmon.reference_trainer",
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
    console.print("trainer: " + escape_for_terminal(" ".join(cmd[1:])))
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        with Live(_view(collector.storage, run), console=console, refresh_per_second=2) as view:
            while proc.poll() is None:
                time.sleep(0.5)
                view.update(_view(collector.storage, run))
            time.sleep(1.0)  # the trainer flushed on exit; let the last batch land
            view.update(_view(collector.storage, run))
    finally:
        log.close()
    if proc.returncode != 0:
        console.print(f"[red]trainer exited with {proc.returncode}; see {escape_for_terminal(log.name)}[/red]")
    analysis = analyse(collector.storage, run)
    summary = analysis.summary
    console.print()
    print_summary(summary, console)
    report = write_report(analysis, run_dir / "report")
    labels_path = run_dir / "labels.json"
    if labels_path.exists():
        _print_labels(console, json.loads(labels_path.read_text()), summary["anomalies"])
    db_shown = escape_for_terminal(db)
    console.print(
        f"\nreport: {escape_for_terminal(report)} (plots next to it)\n"
        f"store: {db_shown}\n"
        f"again later: trainmon postmortem {run} --db {db_shown}\n"
        f"live metrics were at {url}/metrics (the collector stops with the demo; "
        f"`trainmon serve --db {db_shown}` serves the store again)"
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
            escape_for_terminal(fmt(lab.get("kind", "?"))),
            escape_for_terminal(fmt(lab.get("rank"))),
            escape_for_terminal(f"{fmt(lab.get('first_step'))}-{fmt(lab.get('last_step'))}"),
            escape_for_terminal(fmt(lab.get("expected_detection"))),
            f"step {escape_for_terminal(hits[0]['first_step'])}" if hits else "[yellow]not detected[/yellow]",
        )
    console.print(table)
