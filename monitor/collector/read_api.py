"""What the reading commands need from a collector beyond the status: the post-mortem.

``trainmon postmortem RUN --url URL`` prints the same report as ``trainmon postmortem RUN --db
STORE``: the collector runs the same :func:`~trainmon.monitor.analysis.postmortem.analyse` on its
own store and answers the summary as JSON (``GET /v1/runs/{run}/postmortem``), which the command
renders exactly as it renders a local one. A run held by a remote collector, or by a PostgreSQL
store whose URL the on-call engineer does not have, can then be explained from anywhere the
collector answers.

The analysis reads a run's whole history (seconds on a million steps): the route is a plain
function, so the server runs it on its thread pool, never on the event loop that acknowledges the
producers' batches, and one analysis runs at a time (a lock), so a burst of requests costs one
analysis after another rather than all at once.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException

from trainmon.hooks.wire import json_safe
from trainmon.monitor.store.storage import Storage

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
