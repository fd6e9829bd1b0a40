"""What the reading commands need from a collector beyond the status: the post-mortem, the export.

``trainmon postmortem RUN --url URL`` prints the same report as ``trainmon postmortem RUN --db
STORE``: the collector runs the same :func:`~trainmon.monitor.analysis.postmortem.analyse` on its
own store and answers the summary as JSON (``GET /v1/runs/{run}/postmortem``), which the command
renders exactly as it renders a local one; with ``--out`` it saves the report file the collector
renders (``GET /v1/runs/{run}/report``: the HTML report with its plots inline, as a file: no
reload, no link back to the web view). A run held by a remote collector, or by a PostgreSQL
store whose URL the on-call engineer does not have, can then be explained from anywhere the
collector answers.

The analysis reads a run's whole history (seconds on a million steps): the route is a plain
function, so the server runs it on its thread pool, never on the event loop that acknowledges the
producers' batches, and one analysis runs at a time (a lock), so a burst of requests costs one
analysis after another rather than all at once.

``trainmon export RUN FILE --url URL`` saves the run's events as JSONL (``GET /v1/runs/{run}/export``),
streamed a few thousand rows at a time from the store, so a million-step run is never held whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, StreamingResponse

from trainmon.monitor.store.export import export_lines
from trainmon.monitor.store.queries import run_exists
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.web.pages import html_response
from trainmon.wire import json_safe

__all__ = ["register"]


class _HasStorage(Protocol):
    storage: Storage


def register(app: FastAPI, collector: _HasStorage) -> None:
    """Add the reading routes to ``app`` (the collector's FastAPI application)."""
    one_at_a_time = threading.Lock()

    @app.get(
        "/v1/runs/{run}/postmortem",
        summary="The post-mortem of a run: the JSON `trainmon postmortem RUN --db STORE --json` prints",
        responses={404: {"description": "no such run"}},
    )
    def run_postmortem(run: str) -> dict[str, Any]:
        from trainmon.monitor.analysis.postmortem import analyse  # pandas: on first use

        with one_at_a_time:
            try:
                return json_safe(analyse(collector.storage, run).summary)
            except KeyError as exc:  # its message names the store's URL: not for the network
                raise HTTPException(404, {"error": f"no run {run!r}"}) from exc

    @app.get(
        "/v1/runs/{run}/report",
        response_class=HTMLResponse,
        summary="The post-mortem of a run as one self-contained HTML file (plots inline): "
        "what `trainmon postmortem RUN --url URL --out DIR` saves",
        responses={404: {"description": "no such run"}},
    )
    def run_report(run: str) -> HTMLResponse:
        from trainmon.monitor.analysis.plots import render_plots  # matplotlib: on first use
        from trainmon.monitor.analysis.postmortem import analyse
        from trainmon.monitor.analysis.report import render_html

        with one_at_a_time:
            try:
                analysis = analyse(collector.storage, run)
            except KeyError as exc:
                raise HTTPException(404, {"error": f"no run {run!r}"}) from exc
            page = render_html(
                json_safe(analysis.summary), render_plots(analysis), generated_by="the trainmon collector"
            )
        return html_response(page)

    @app.get(
        "/v1/runs/{run}/export",
        response_class=StreamingResponse,
        summary="A run's stored events as JSONL (wire format, oldest first): what `trainmon export RUN FILE "
        "--url URL` saves and `trainmon postmortem FILE` reads back",
        responses={404: {"description": "no such run"}},
    )
    def run_export(run: str) -> StreamingResponse:
        with collector.storage.connect() as conn:
            if not run_exists(conn, run):
                raise HTTPException(404, {"error": f"no run {run!r}"})
        return StreamingResponse(_exported(collector.storage, run), media_type="application/x-ndjson")


def _exported(storage: Storage, run: str) -> Iterator[bytes]:
    """The export's lines, read on the server's thread pool (a plain iterator), one connection throughout."""
    with storage.connect() as conn:
        yield from export_lines(conn, run)
