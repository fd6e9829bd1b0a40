"""``trainmon``: a thin command line over the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainmon.monitor.config import ConfigError, load_config
from trainmon.monitor.core.escape import escape_for_terminal, visible_controls
from trainmon.wire import json_safe

__all__ = ["main"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from trainmon.monitor.web.server import serve

    # Flag, then environment, then the config file; the token is never echoed back.
    token = args.token or os.environ.get("TRAINMON_TOKEN") or None
    insecure = True if args.insecure else None
    config = load_config(args.config, db=args.db, host=args.host, port=args.port, token=token, insecure=insecure)
    serve(config)
    return 0


def _cmd_postmortem(args: argparse.Namespace) -> int:
    report: Path | None = None
    with _progress(quiet=args.json) as progress:
        if args.url is None and args.db is None and Path(args.target).exists():
            analysis = _postmortem_of_file(args, progress)
            if analysis is None:
                return 2
        else:
            from trainmon.monitor.analysis.live_view import HttpSource, SourceError  # a store's run: not a file's

            try:
                source = _live_source(args)
                task = progress.add_task(f"analysing {escape_for_terminal(args.target)}", total=None)
                analysis = source.postmortem(args.target, series=args.out is not None)  # series: for plots
                if args.out is not None and isinstance(source, HttpSource):
                    out = Path(args.out)
                    page = source.report_page(args.target)  # the same report, rendered by the collector
                    out.mkdir(parents=True, exist_ok=True)
                    report = out / "report.html"
                    report.write_bytes(page)
                progress.update(task, total=1, completed=1)
            except (KeyError, SourceError) as exc:
                why = exc.args[0] if isinstance(exc, KeyError) else str(exc)
                if args.url is None and args.db is None:  # RUN|FILE: say both readings
                    why = f"{args.target} is not a file or folder; as a run: {why}"
                _error("postmortem", why)
                return 2
        summary = analysis if isinstance(analysis, dict) else analysis.summary
        if args.out is not None and report is None:
            from trainmon.monitor.analysis.report import write_report

            task = progress.add_task("plots", total=None)
            report = write_report(
                analysis, Path(args.out), lambda stage: progress.update(task, description=f"writing {stage}")
            )
            progress.update(task, total=1, completed=1)
    if args.json:
        if report is not None:
            summary = {**summary, "report": str(report)}
        print(json.dumps(json_safe(summary), allow_nan=False))
    else:
        from trainmon.monitor.analysis.report import print_summary

        print_summary(summary)
        if report is not None:
            print(visible_controls(f"report: {report}"))
    return _judged(summary, args.fail_on)


def _postmortem_of_file(args: argparse.Namespace, progress: Any) -> Any:
    """Import the log FILE (or folder) into memory and analyse it; None (said on stderr) when it cannot be.

    The analysis module is imported once the log is in: it is not needed before the parse's first line."""
    from trainmon.monitor.analysis.open_run import open_run

    name = escape_for_terminal(Path(args.target).name)  # progress descriptions are rich markup
    task = progress.add_task(f"importing {name}", total=None)
    try:
        opened = open_run(
            args.target,
            run=args.run,
            config=load_config(args.config),
            progress=lambda n: progress.update(task, description=f"importing {name}: {n:,} events"),
        )
    except ValueError as exc:  # the file, the run asked for, or the configuration
        _error("postmortem", exc)
        return None
    progress.update(task, total=1, completed=1)
    from trainmon.monitor.analysis.postmortem import analyse, summarize

    task = progress.add_task("analysing", total=None)
    read = analyse if args.out is not None else summarize  # the plots' series only for a report
    with opened:
        analysis = read(opened.storage, opened.run, lambda st: progress.update(task, description=f"analysing: {st}"))
    progress.update(task, total=1, completed=1)
    return analysis


FAIL_ON = ("warning", "critical")


def _judged(summary: dict[str, Any], fail_on: str | None) -> int:
    """``--fail-on``'s exit status: 1 when a finding at or above ``fail_on`` exists, 2 when the input
    held no step to judge, else 0 (always 0 without ``--fail-on``). The findings counted are the
    verdict's (:func:`verdict.health`: first-level findings, open or recovered), so the exit status
    says what the report's headline says."""
    from trainmon.monitor.analysis.verdict import health

    if fail_on is None:
        return 0
    if not summary.get("steps_logged"):
        return 2
    counts = health(summary.get("anomalies") or [])["counts"]
    return 1 if any(counts[sev] for sev in FAIL_ON[FAIL_ON.index(fail_on) :]) else 0


def _error(command: str, message: Any) -> None:
    """``trainmon COMMAND: message`` on stderr; the message may hold data, so controls are made visible."""
    print(visible_controls(f"trainmon {command}: {message}"), file=sys.stderr)


def _progress(quiet: bool) -> Any:
    """A transient progress display on stderr (nothing when ``quiet`` or stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )


def _cmd_import(args: argparse.Namespace) -> int:
    from trainmon.monitor.importers import ImportFormatError
    from trainmon.monitor.importers.store import import_log
    from trainmon.monitor.store.storage import Storage

    path = Path(args.file)
    if not path.exists():
        _error("import", f"{args.file} is not a file or folder")
        return 2
    try:
        result = import_log(path, Storage(args.db), load_config(args.config), run=args.run, mapping=args.map)
    except (ImportFormatError, ValueError) as exc:
        _error("import", exc)
        return 2
    again = "" if result.stored else " (already imported: nothing new)"
    print(
        visible_controls(
            f"imported {', '.join(result.runs)}: {result.stored} of {result.events} events stored in {args.db}{again}"
        )
    )
    return 0


def _live_source(args: argparse.Namespace) -> Any:
    from trainmon.monitor.analysis.live_view import DbSource, HttpSource, default_source

    token = args.token or os.environ.get("TRAINMON_TOKEN") or None
    if args.url:
        return HttpSource(args.url, token)
    if args.db:
        return DbSource(args.db)
    return default_source(token)


def _cmd_export(args: argparse.Namespace) -> int:
    import contextlib

    from trainmon.monitor.analysis.live_view import ANALYSIS_TIMEOUT, DbSource, SourceError

    target = Path(args.file)
    partial = target.with_name(target.name + ".part")  # FILE appears only complete: an archive is whole or absent
    lines = 0
    try:
        source = _live_source(args)
        with contextlib.ExitStack() as stack:
            if isinstance(source, DbSource):
                from trainmon.monitor.store.export import export_lines
                from trainmon.monitor.store.queries import run_exists

                conn = stack.enter_context(source.storage.connect())
                if not run_exists(conn, args.run):
                    raise KeyError(f"no run {args.run!r} in {source.where}")
                chunks = export_lines(conn, args.run)
            else:
                path = f"/v1/runs/{_quoted(args.run)}/export"
                chunks = stack.enter_context(source.open("GET", path, ANALYSIS_TIMEOUT))
            out = stack.enter_context(open(partial, "wb"))
            for line in chunks:  # one event a line, from either source
                out.write(line)
                lines += 1
        partial.replace(target)
    except (KeyError, SourceError, OSError) as exc:
        partial.unlink(missing_ok=True)
        _error("export", exc.args[0] if isinstance(exc, KeyError) else exc)
        return 2
    print(visible_controls(f"exported run {args.run} to {target}: {lines} events (trainmon postmortem {target})"))
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    from trainmon.monitor.analysis.live_view import ANALYSIS_TIMEOUT, DbSource, SourceError
    from trainmon.monitor.config import CollectorConfig
    from trainmon.monitor.store.retention import RunLiveError, delete_ended_run

    try:
        source = _live_source(args)
    except SourceError as exc:
        _error("delete", exc)
        return 2
    what = f"run {args.run} from {source.where}"
    if not args.yes:
        if not sys.stdin.isatty():
            _error("delete", f"refusing to delete {what} unasked: confirm with --yes (no terminal to ask on)")
            return 2
        answer = input(visible_controls(f"delete {what}? Its data cannot be recovered [y/N] "))
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    try:
        if isinstance(source, DbSource):
            rows = delete_ended_run(source.storage, args.run, CollectorConfig().evict_idle_seconds)
        else:
            with source.open("DELETE", f"/v1/runs/{_quoted(args.run)}", ANALYSIS_TIMEOUT) as resp:
                rows = json.loads(resp.read())["rows"]
    except RunLiveError as exc:  # from a store: its collector, if one runs, can tell for sure
        _error("delete", f"{exc}, or through its collector (--url)")
        return 2
    except (KeyError, SourceError) as exc:
        _error("delete", exc.args[0] if isinstance(exc, KeyError) else exc)
        return 2
    print(visible_controls(f"deleted {what} ({rows} rows)"))
    return 0


def _quoted(run: str) -> str:
    import urllib.parse

    return urllib.parse.quote(run, safe="")


def _print(result: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """``result`` on stdout: one JSON line with ``--json`` (NaN as null), else through ``render``."""
    if as_json:
        print(json.dumps(json_safe(result), allow_nan=False))
    else:
        render(result)


def _cmd_runs(args: argparse.Namespace) -> int:
    from trainmon.monitor.analysis.live_view import SourceError
    from trainmon.monitor.analysis.report import print_runs

    try:
        rows = _live_source(args).runs()
    except SourceError as exc:
        _error("runs", exc)
        return 2
    _print(rows, args.json, print_runs)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trainmon.monitor.analysis.live_view import SourceError, follow, render_status

    try:
        source = _live_source(args)
    except SourceError as exc:
        _error("status", exc)
        return 2

    def fetch() -> dict:
        return source.status(args.run, window=args.window)

    try:
        if args.follow:
            return follow(fetch, Console(emoji=False), args.interval, args.max_refreshes, source.where)
        st = fetch()
    except KeyError as exc:
        _error("status", f"{exc.args[0]} in {source.where}")
        return 2
    except SourceError as exc:
        _error("status", exc)
        return 2
    if args.json:
        print(json.dumps(json_safe(st), allow_nan=False))
    else:
        Console(emoji=False).print(render_status(st, source.where))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from trainmon.monitor.demo import run_demo

    return run_demo(out=Path(args.out), steps=args.steps, injects=args.inject)


def _cmd_grafana_provision(args: argparse.Namespace) -> int:
    from trainmon.monitor.grafana import provision_command

    return provision_command(args.url, args.token, args.folder, args.datasource_uid, args.dashboards)


def _cmd_budget(args: argparse.Namespace) -> int:
    from trainmon.monitor.core.budget import BudgetError, plan, render

    names = [a.dest for a in _budget_actions]
    try:
        result = plan(**{n: getattr(args, n) for n in names})
    except BudgetError as exc:
        _error("budget", exc)
        return 2
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        render(result)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from trainmon.monitor.analysis.compare import CompareError, compare, load_run, render

    try:
        collector = None
        if args.url:
            from trainmon.monitor.analysis.live_view import HttpSource

            collector = HttpSource(args.url, args.token or os.environ.get("TRAINMON_TOKEN") or None)
        a = load_run(args.a, args.db, args.run_a, collector)
        b = load_run(args.b, args.db, args.run_b, collector)
        result = compare(a, b, by=args.by)
    except (CompareError, FileNotFoundError) as exc:
        _error("compare", exc)
        return 2
    _print(result, args.json, render)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="Training-run monitoring for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the collector daemon until SIGTERM/SIGINT")
    p.add_argument("--db", help="SQLite path or SQLAlchemy URL (default trainmon.sqlite)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 9400)")
    p.add_argument("--config", help="TOML file with collector and detector settings")
    p.add_argument(
        "--token",
        help="bearer token required on every endpoint but /healthz (default: $TRAINMON_TOKEN; prefer the "
        "environment, a flag is visible in ps); required to bind a non-loopback address",
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without a token (trusted networks only)"
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "postmortem",
        help="explain a run from a log FILE or folder, a store (RUN --db) or a collector (RUN --url)",
        description="Explain a run: a log FILE or folder (imported into memory), or RUN from a store (--db) or "
        "a collector (--url; without either, and when RUN is no file, the local collector, then ./trainmon.sqlite). "
        "Exit status: 2 when the input cannot be read (no such file, store, collector or run), else 0; "
        "with --fail-on SEVERITY, 1 when the report holds a finding at or above SEVERITY and 2 when the input "
        "held no step to judge.",
    )
    p.add_argument("target", metavar="RUN|FILE")
    _add_live_source(p)
    p.add_argument("--run", help="which run of a multi-run FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", help="TOML file with detector settings (for FILE)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write a self-contained report.html here (plots inline; with the PNG plots beside it unless --url)",
    )
    p.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        help="exit 1 when a finding at or above this severity exists, 2 when the input could not be judged, "
        "0 otherwise (for CI jobs and post-run hooks)",
    )
    p.set_defaults(func=_cmd_postmortem)

    p = sub.add_parser("import", help="store a log FILE (JSONL, trainer_state.json, TensorBoard, CSV, llm.c/nanoGPT)")
    p.add_argument("file", metavar="FILE", help="log file or folder; the format is detected from its content")
    p.add_argument("--db", required=True, help="SQLite path or SQLAlchemy URL to store the run in")
    p.add_argument("--run", help="run id to store it under (default: from the file name)")
    p.add_argument("--map", metavar="FIELD=COLUMN,...", help="CSV column mapping, e.g. loss=train_loss,step=_step")
    p.add_argument("--config", help="TOML file with detector settings")
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("runs", help="list the runs in a store or on a collector")
    _add_live_source(p)
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("status", help="where a run stands: progress, ETA, trends, ranks, open anomalies")
    p.add_argument("run", metavar="RUN")
    _add_live_source(p)
    p.add_argument("--follow", "-f", action="store_true", help="refresh until the run ends (Ctrl-C to leave)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--window", type=int, default=120, help="recent steps the trends cover (default 120)")
    p.add_argument("--max-refreshes", type=int, help="stop following after this many refreshes")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "export",
        help="save a run's events as JSONL (`trainmon postmortem FILE` reads it back): archive before deleting",
    )
    p.add_argument("run", metavar="RUN")
    p.add_argument("file", metavar="FILE", help="the JSONL file to write (replaced if it exists)")
    _add_live_source(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "delete",
        help="delete a run from a store or a collector (asks first; --yes to skip)",
        description="Delete RUN and everything stored of it. Through its collector (--url) it also leaves the "
        "collector's memory (findings, exported series); a run still receiving events is refused. "
        "Exit status: 0 deleted, 1 not confirmed, 2 not deleted (no such run, run still live, no answer).",
    )
    p.add_argument("run", metavar="RUN")
    _add_live_source(p)
    p.add_argument("--yes", action="store_true", help="delete without asking (needed without a terminal)")
    p.set_defaults(func=_cmd_delete)

    p = sub.add_parser("demo", help="collector + reference trainer with injected faults, then a report")
    p.add_argument("--out", default="demo-out", help="folder for the store, checkpoints and events")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps to train; the faults scale with it")
    p.add_argument(
        "--inject",
        action="append",
        default=None,
        metavar="KIND@STEP[:params]",
        help="fault to inject (repeatable); default: a small set of faults",
    )
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("grafana", help="Grafana integration")
    grafana = p.add_subparsers(dest="grafana_command", required=True)
    p = grafana.add_parser("provision", help="create a folder and upload the trainmon dashboards (overwrite)")
    p.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    p.add_argument("--token", help="service account token (default: $GRAFANA_TOKEN); never printed")
    p.add_argument("--folder", default="trainmon", help="folder to put the dashboards in (default trainmon)")
    p.add_argument(
        "--datasource-uid",
        help="uid of the Prometheus datasource the dashboards default to (default: Grafana's first Prometheus)",
    )
    p.add_argument("--dashboards", help="folder holding the dashboard JSON (default: the repository's dashboards/)")
    p.set_defaults(func=_cmd_grafana_provision)
    _add_budget(sub)
    _add_compare(sub)
    return parser


def _add_live_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="read this store (SQLite path or SQLAlchemy URL); it must exist, nothing is created")
    p.add_argument(
        "--url",
        help="ask this collector; default: the local one ($TRAINMON_COLLECTOR or http://127.0.0.1:9400), "
        "then ./trainmon.sqlite",
    )
    p.add_argument("--token", help="the collector's bearer token (default: $TRAINMON_TOKEN)")


_budget_actions: list[argparse.Action] = []


def _add_budget(sub: argparse._SubParsersAction) -> None:
    from trainmon.monitor.core.budget import RECIPES

    p = sub.add_parser(
        "budget",
        help="memory, FLOPs, MFU, pipeline bubble and checkpoint arithmetic (published formulas, cited)",
        description="Give what you know; every quantity those inputs determine is printed. "
        "Sizes take units (80GB = 80e9 B, 80GiB = 80*2^30 B); counts take k/M/B/T (7B, 300B, 312T).",
    )
    add = p.add_argument
    _budget_actions[:] = [
        add("--layers", type=int, help="transformer blocks N"),
        add("--d-model", type=int, help="model width d"),
        add("--vocab", type=int, help="vocabulary size V"),
        add("--heads", type=int, help="attention heads a"),
        add("--seq", type=int, help="sequence length s"),
        add("--learned-positions", action="store_true", default=None, help="count learned position embeddings"),
        add("--precision", choices=list(RECIPES), help="bytes-per-parameter recipe (default fp32)"),
        add("--gpu-memory", help="memory of one GPU, e.g. 80GB (-> memory left; with the shape, max_micro_batch)"),
        add("--micro-batch", type=int, help="sequences per micro-batch per GPU"),
        add("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (needs --ranks)"),
        add("--ranks", type=int, help="data-parallel ranks"),
        add("--grad-accum", type=int, help="gradient-accumulation micro-batches per step (default 1)"),
        add("--params", help="parameter count, e.g. 7B (instead of the shape)"),
        add("--tokens", help="training tokens, e.g. 300B (-> train_flops)"),
        add("--gpus", type=int, help="GPUs for the MFU / time (default 1)"),
        add("--peak-flops", help="peak FLOP/s of one GPU, e.g. 312T"),
        add("--days", type=float, help="wall-clock days the training took (-> mfu)"),
        add("--mfu", type=float, help="assumed MFU, 0-1 (-> train_seconds)"),
        add("--stages", type=int, help="pipeline stages p (-> bubble_fraction)"),
        add("--micro-batches", type=int, help="micro-batches per pipeline flush m"),
        add("--bandwidth", help="all-reduce bandwidth per GPU, e.g. 200GB/s (-> allreduce_seconds)"),
        add("--allreduce-bytes", help="all-reduce payload, e.g. 14GB (default: the gradients)"),
        add("--step-seconds", type=float, help="seconds per optimizer step"),
        add("--checkpoint-seconds", type=float, help="seconds to save one checkpoint"),
        add("--checkpoint-every", type=int, help="steps between checkpoints (-> checkpoint_overhead)"),
        add("--mtbf-hours", type=float, help="mean time between failures (-> optimal_checkpoint_every)"),
    ]
    add("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_budget)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="align two runs by step or tokens and say where and how they diverge",
        description="A and B are run ids in --db or on a collector (--url), or log files/folders (imported into "
        "memory).",
    )
    p.add_argument("a", metavar="A", help="the reference run: a run id in --db or on --url, or a log file or folder")
    p.add_argument("b", metavar="B", help="the run compared with it")
    p.add_argument("--db", help="store holding run ids A and/or B (SQLite path or SQLAlchemy URL)")
    p.add_argument(
        "--url", help="collector holding run ids A and/or B, e.g. http://127.0.0.1:9400 (reads their export)"
    )
    p.add_argument("--token", help="the collector's bearer token (default: $TRAINMON_TOKEN)")
    p.add_argument("--run-a", help="which run of a multi-run file A")
    p.add_argument("--run-b", help="which run of a multi-run file B")
    p.add_argument(
        "--by", choices=["step", "tokens"], default="step", help="align by optimizer step (default) or tokens"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_compare)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        _error(args.command, f"configuration error: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
