"""The collector's web view: ``GET /`` lists the runs, ``GET /runs/{run}`` shows one run, live.

Server-rendered HTML with nothing to build and nothing fetched from elsewhere: the run page is the
post-mortem's own HTML (:func:`trainmon.monitor.analysis.report.render_html`, plots inline as
PNG), so the browser, the report file and the terminal say the same thing. A page of a running
run, and the list, reload themselves (``<meta http-equiv="refresh">``); no script runs, and the
Content-Security-Policy forbids any (run names, messages and host names are producer data; every
one is escaped, this is the second fence).

Rendering a run reads its whole history and draws six plots: hundreds of milliseconds, seconds on
a million steps. The routes are plain functions, so the server runs them on its thread pool, never
on the event loop that acknowledges the producers' batches; one page renders at a time (a lock,
so a dozen open tabs cost one render, not twelve concurrent ones), and a page is cached for
``cache_seconds`` or three times what it took to render, whichever is longer, so a slow render is
not repeated back to back.
"""

from __future__ import annotations

import html
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from trainmon.monitor.analysis.live_view import RECENT_STEPS, run_table
from trainmon.monitor.analysis.report import html_text, render_html, run_health, run_link
from trainmon.monitor.analysis.verdict import problems_line
from trainmon.monitor.core.fmt import fmt
from trainmon.monitor.store.storage import Storage
from trainmon.wire import json_safe

__all__ = ["WebView", "api_page", "html_response", "register_docs"]

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
_MAX_CACHED = 64  # pages kept; the oldest go first


def html_response(body: str, status: int = 200) -> HTMLResponse:
    """An HTML page with the headers that keep it inert: no scripts, no framing, no sniffing."""
    headers = {
        "content-security-policy": CSP + "; frame-ancestors 'none'",
        "x-content-type-options": "nosniff",
        "cache-control": "no-store",
        "referrer-policy": "no-referrer",
    }
    return HTMLResponse(body, status_code=status, headers=headers)


class WebView:
    """The pages of one collector's store, rendered on demand and cached briefly (see the module)."""

    def __init__(self, storage: Storage, cache_seconds: float = 2.0, refresh_seconds: int = 5) -> None:
        self.storage = storage
        self.cache_seconds = cache_seconds
        self.refresh_seconds = refresh_seconds
        self._lock = threading.Lock()  # one render at a time; held while rendering
        self._cache: dict[str, tuple[float, str]] = {}  # key -> (expires, page)

    def _cached(self, key: str, render: Callable[[], str]) -> str:
        with self._lock:
            now = time.monotonic()
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
            page = render()
            took = time.monotonic() - now
            self._cache.pop(key, None)
            if len(self._cache) >= _MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            self._cache[key] = (time.monotonic() + max(self.cache_seconds, 3 * took), page)
            return page

    def index(self) -> str:
        """``GET /``: every run with its health, progress and open findings."""
        return self._cached("", self._render_index)

    def run(self, run: str) -> str:
        """``GET /runs/{run}``: the run's verdict, plots and findings; ``KeyError`` for an unknown run."""
        return self._cached("run:" + run, lambda: self._render_run(run))

    def _render_run(self, run: str) -> str:
        from trainmon.monitor.analysis.plots import render_plots  # pandas and matplotlib: on first use
        from trainmon.monitor.analysis.postmortem import analyse

        analysis = analyse(self.storage, run)
        summary = json_safe(analysis.summary)
        live = summary.get("status") == "running"
        return render_html(
            summary,
            render_plots(analysis),
            refresh_seconds=self.refresh_seconds if live else None,
            home="/",
            generated_by="the trainmon collector",
        )

    def _render_index(self) -> str:
        rows = run_table(self.storage)
        body = []
        for r in rows:
            h = r.get("health")  # verdict.health: the post-mortem's definition (one story)
            health = h["word"] if isinstance(h, dict) else run_health(r.get("open_severities") or [], r.get("status"))
            done = r.get("steps_done", None if r.get("step") is None else r["step"] + 1)
            progress = fmt(done)
            if r.get("planned_steps"):
                progress += f" / {fmt(r['planned_steps'])}"
                if done is not None:
                    progress += f" ({100 * min(1.0, done / r['planned_steps']):.0f}%)"
            kinds = ", ".join(r.get("open_kinds") or [])
            findings = f"{r.get('open_anomalies') or 0} open" + (f" ({kinds})" if kinds else "")
            if isinstance(h, dict) and h.get("problems"):
                findings += f"; {h['headline']}: {problems_line(h)}"
            updated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["updated_at"]))
            cells = [
                f'<a href="{html_text(run_link(r["run"]))}">{html_text(r["run"])}</a>',
                f'<span class="{health}">{health}</span>',
                html_text(r.get("status")),
                html_text(progress),
                html_text(fmt(r.get("loss"))),
                html_text(fmt(r.get("tokens_per_second"))),
                html_text(r.get("attempts")),
                html_text(findings),
                html_text(updated),
            ]
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        head = ("run", "health", "status", "steps", "loss", f"tokens/s (last {RECENT_STEPS} steps)", "attempts")
        head += ("open findings", "updated")
        table = (
            "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "\n".join(body) + "</table>"
            if body
            else "<p>No runs yet: point a trainer's TrainMonitor at this collector.</p>"
        )
        return _page("trainmon: runs", f"<h1>Runs</h1>{table}", self.refresh_seconds)

    def not_found(self, run: str) -> str:
        """The page for a run the store does not have."""
        return _page(
            "trainmon: no such run", f'<nav><a href="/">&larr; all runs</a></nav><p>No run {html_text(repr(run))}.</p>'
        )


_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
th { background: #f4f4f4; }
.critical, .failed { color: #b00020; font-weight: bold; } .warning { color: #b36b00; font-weight: bold; }
.healthy { color: #1b7f3b; font-weight: bold; }
pre { font-size: 0.85em; background: #f7f7f7; padding: 6px; overflow-x: auto; }
"""


def _page(title: str, body: str, refresh_seconds: int | None = None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">' if refresh_seconds else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}<title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )


# -- the API reference ------------------------------------------------------------------------


def register_docs(app: FastAPI) -> None:
    """Serve ``GET /docs``: the API reference as a page of its own, rendered from ``app.openapi()``.

    FastAPI's ``/docs`` (Swagger UI) and ``/redoc`` load their scripts and styles from a CDN, so
    on a cluster without internet they are blank; the app must be created with ``docs_url=None,
    redoc_url=None`` and this route registered instead. The page needs nothing from elsewhere and
    runs no script (the web view's headers); ``/openapi.json`` stays the machine-readable schema.
    """

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def api_reference() -> HTMLResponse:
        return html_response(api_page(app.openapi()))


_METHODS = ("get", "post", "put", "patch", "delete", "head")
_CONSTRAINTS = ("enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "format")


def api_page(schema: dict[str, Any]) -> str:
    """An OpenAPI schema as one HTML page: each operation with its parameters, request body and
    responses, then the named schemas. Every string of the schema is escaped (it is our own, but
    descriptions hold backticks, angle brackets and patterns)."""
    info = schema.get("info") or {}
    ops = [
        (method, path, op)
        for path, item in (schema.get("paths") or {}).items()
        for method, op in item.items()
        if method in _METHODS
    ]
    toc = "".join(
        f'<li><a href="#{_anchor(m, p)}"><code>{m.upper()} {html_text(p)}</code></a> '
        f"{html_text(op.get('summary', ''))}</li>"
        for m, p, op in ops
    )
    body = [
        f"<h1>{html_text(info.get('title', 'API'))} <small>version {html_text(info.get('version', '?'))}</small></h1>",
        f"<p>{html_text(info.get('description', ''))}</p>",
        '<p>The same, machine-readable: <a href="/openapi.json">/openapi.json</a> (OpenAPI '
        f'{html_text(schema.get("openapi", ""))}). The web view: <a href="/">the runs</a>.</p>',
        f"<ul>{toc}</ul>",
    ]
    body += [_operation(m, p, op) for m, p, op in ops]
    named = (schema.get("components") or {}).get("schemas") or {}
    if named:
        body.append("<h2>Schemas</h2>")
        body += [f'<h3 id="schema-{html_text(n)}">{html_text(n)}</h3>{_json_block(s)}' for n, s in named.items()]
    return _page(f"{info.get('title', 'API')}: API reference", "\n".join(body))


def _anchor(method: str, path: str) -> str:
    return html_text(method + "-" + "".join(c if c.isalnum() else "-" for c in path).strip("-"))


def _operation(method: str, path: str, op: dict[str, Any]) -> str:
    parts = [f'<h2 id="{_anchor(method, path)}"><code>{method.upper()} {html_text(path)}</code></h2>']
    parts.append(f"<p>{html_text(op.get('summary', ''))}</p>")
    if op.get("description"):
        parts.append(f"<p>{html_text(op['description'])}</p>")
    params = op.get("parameters") or []
    if params:
        rows = "".join(
            f"<tr><td><code>{html_text(p['name'])}</code></td><td>{html_text(p.get('in'))}</td>"
            f"<td>{'yes' if p.get('required') else 'no'}</td><td>{_type(p.get('schema') or {})}</td>"
            f"<td>{html_text(p.get('description', ''))}</td></tr>"
            for p in params
        )
        head = "<tr><th>parameter</th><th>in</th><th>required</th><th>type</th><th>meaning</th></tr>"
        parts.append(f"<table>{head}{rows}</table>")
    request = op.get("requestBody")
    if request:
        for ctype, content in (request.get("content") or {}).items():
            parts.append(f"<p>Request body ({html_text(ctype)}){' required' if request.get('required') else ''}:</p>")
            parts.append(_json_block(content.get("schema") or {}))
    rows = []
    for status, answer in sorted((op.get("responses") or {}).items()):
        schemas = [c.get("schema") for c in (answer.get("content") or {}).values() if c.get("schema")]
        detail = "".join(_json_block(s) for s in schemas)
        rows.append(f"<tr><td>{html_text(status)}</td><td>{html_text(answer.get('description', ''))}{detail}</td></tr>")
    if rows:
        parts.append(f"<table><tr><th>status</th><th>answer</th></tr>{''.join(rows)}</table>")
    return "\n".join(parts)


def _type(schema: dict[str, Any]) -> str:
    """A parameter's type and its limits on one line: ``integer, minimum 2, maximum 2000, default 120``."""
    words = [str(schema.get("type", "any"))]
    words += [f"{k} {json.dumps(schema[k])}" for k in _CONSTRAINTS if k in schema]
    if "default" in schema:
        words.append(f"default {json.dumps(schema['default'])}")
    return html_text(", ".join(words))


def _json_block(schema: dict[str, Any]) -> str:
    """A schema, folded (``<details>`` opens without a script), as indented JSON."""
    text = json.dumps(schema, indent=2, sort_keys=False)
    return f"<details><summary>schema</summary><pre>{html.escape(text)}</pre></details>"
