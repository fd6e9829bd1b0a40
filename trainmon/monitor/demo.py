"""``trainmon demo``: the whole product in one command, on a laptop CPU.

Starts a collector in this process (embedded SQLite, a free loopback port), runs the
reference trainer in a subprocess with a few injected faults (the trainer is a separate
process, as it would be in real life, and the collector side never imports torch), shows a
live view while it trains, and ends with the post-mortem and where to look next.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from trainmon.monitor.analysis.live_view import render_status, run_status
from trainmon.monitor.analysis.postmortem import analyse
from trainmon.monitor.analysis.report import fmt, print_summary, write_report
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.core.escape import escape_for_terminal, visible_controls
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.web.server import Collector, ServerThread, create_app
from trainmon.reference_trainer.command import trainer_command, trainer_env

__all__ = ["DEFAULT_FAULTS", "default_injects", "run_demo"]

# Fault kind, where in the run (a fraction of --steps) and its parameters: spread over the steps that
# run, whatever their number, with room between them for each detector to see it and settle.
DEFAULT_FAULTS = (
    ("loss_spike", 0.3, "scale=50"),
    ("data_stall", 0.5, "seconds=2,steps=4"),  # well beyond a step even on a busy machine (~1 s/step)
    ("lr_frozen", 0.65, ""),
    ("nan", 0.9, ""),
)
PROGRESS_SECONDS = 10.0  # a progress line this often when the output is not a terminal (make, CI, a pipe)


def _view(storage: Storage, run: str) -> RenderableType:
    """The same status view as ``trainmon status RUN --follow``, read from the demo's store."""
    try:
        return render_status(run_status(storage, run), source="demo")
    except KeyError:
        return Text(visible_controls(f"waiting for run {run} to report..."))


def default_injects(steps: int) -> list[str]:
    """The default faults placed at their fraction of ``steps``: ``trainmon demo --steps 200`` injects
    its faults inside the 200 steps it runs."""
    return [f"{kind}@{int(frac * steps)}" + (f":{params}" if params else "") for kind, frac, params in DEFAULT_FAULTS]


def _progress_line(storage: Storage, run: str, steps: int) -> str:
    try:
        st = run_status(storage, run)
    except KeyError:
        return f"waiting for run {run} to report..."
    done = st.get("steps_done")
    kinds = sorted({a["kind"] for a in st.get("open_anomalies") or []})
    loss = st.get("loss")
    return (
        f"step {'-' if done is None else done}/{steps}  loss {fmt(loss)}  "
        f"open findings: {', '.join(kinds) if kinds else 'none'}"
    )


def run_demo(out: Path, steps: int = 400, injects: list[str] | None = None) -> int:
    console = Console(emoji=False)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "trainmon.sqlite"
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    collector = Collector.open(CollectorConfig(db=str(db)))
    server = ServerThread(create_app(collector), "127.0.0.1", 0)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    console.print(f"collector on {url} (metrics: {url}/metrics), store {escape_for_terminal(db)}", soft_wrap=True)
    console.print(f"web view: {url}/runs/{run} (open it now: it follows the run)", soft_wrap=True)
    run_dir = out / run
    cmd = trainer_command(
        run, steps, run_dir, collector=url, inject=injects if injects is not None else default_injects(steps)
    )
    console.print("trainer: " + escape_for_terminal(" ".join(cmd[1:])), soft_wrap=True)
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=trainer_env())
        if console.is_terminal:
            with Live(_view(collector.storage, run), console=console, refresh_per_second=2) as view:
                while proc.poll() is None:
                    time.sleep(0.5)
                    view.update(_view(collector.storage, run))
                time.sleep(1.0)  # the trainer flushed on exit; let the last batch land
                view.update(_view(collector.storage, run))
        else:  # a live view would print nothing until the end: a line every few seconds instead
            shown = time.monotonic()
            while proc.poll() is None:
                time.sleep(0.5)
                if time.monotonic() - shown >= PROGRESS_SECONDS:
                    console.print(escape_for_terminal(_progress_line(collector.storage, run, steps)))
                    shown = time.monotonic()
            time.sleep(1.0)
            console.print(escape_for_terminal(_progress_line(collector.storage, run, steps)))
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
        f"web view: {url}/runs/{run} was live during the demo; the collector stops with it. To browse the "
        f"run again: trainmon serve --db {db_shown}, then open http://127.0.0.1:9400/runs/{run}",
        soft_wrap=True,
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
