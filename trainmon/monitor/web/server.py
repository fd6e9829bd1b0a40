"""The collector's HTTP API (FastAPI, so the OpenAPI description comes for free)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import re
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
import uvicorn
from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trainmon import wire
from trainmon.monitor.analysis import live_view
from trainmon.monitor.collector.engine import AnomalyChange, Engine
from trainmon.monitor.collector.exporter import CollectorMetrics, DetectionCollector, TrainingCollector
from trainmon.monitor.collector.ingest import IngestLimits, Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.collector.open_findings import OpenFindings
from trainmon.monitor.collector.writer import IngestWriter, Reply
from trainmon.monitor.config import CollectorConfig, ConfigError
from trainmon.monitor.core.escape import visible_controls
from trainmon.monitor.detectors import SEVERITIES
from trainmon.monitor.notify import Notifier, open_anomalies
from trainmon.monitor.store.queries import (
    anomaly_rows,
    open_findings_of_running_runs,
    run_anomaly_states,
    run_exists,
    run_rows,
)
from trainmon.monitor.store.retention import RunLiveError, apply_retention, delete_ended_run, describe_retention
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.web import read_api
from trainmon.monitor.web.pages import WebView, html_response, register_docs

__all__ = ["Collector", "check_bind", "create_app", "serve"]

log = logging.getLogger("trainmon.collector")


@dataclass
class Collector:
    """Everything one collector process holds: storage, live state, detectors, metrics."""

    config: CollectorConfig
    storage: Storage
    live: LiveState
    ingestor: Ingestor
    registry: CollectorRegistry
    metrics: CollectorMetrics
    notifier: Notifier | None = None
    findings: OpenFindings = field(default_factory=OpenFindings)  # for acknowledgements that ask for them

    def __post_init__(self) -> None:
        self.writer = IngestWriter(
            self.ingestor, self.metrics, self.config.max_pending_batches, self.config.max_inflight_bytes
        )
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_forever, name="trainmon-ticker", daemon=True)
        self._ticker.start()
        self._retainer: threading.Thread | None = None

    def _tick_forever(self) -> None:
        # Detectors that fire on silence (a hung rank sends nothing) need a clock of their own.
        while not self._stop.wait(1.0):
            try:
                # The clock held back by the writer's backlog; what it changes goes to publish().
                self.ingestor.engine.tick(time.time() - self.writer.lag())
            except Exception:
                log.exception("detector tick failed; continuing")
            try:
                for run in self.ingestor.evict(self.config.evict_after_seconds, self.config.evict_idle_seconds):
                    self.findings.forget(run)
                    log.info("run %s evicted from memory (ended or idle); it stays in storage", run)
            except Exception:
                log.exception("eviction failed; continuing")

    def start_retention(self) -> None:
        """Apply ``[retention]`` now and every ``check_seconds`` on a thread of its own (``trainmon serve``)."""
        self._retainer = threading.Thread(target=self._retain_forever, name="trainmon-retention", daemon=True)
        self._retainer.start()

    def _retain_forever(self) -> None:
        limits = self.config.retention
        while True:
            try:  # each run is deleted a batch at a time: ingest waits at most one batch
                apply_retention(
                    self.storage,
                    max_age_days=limits.max_age_days,
                    max_bytes=limits.max_bytes,
                    now=time.time(),
                    stale_after=self.config.evict_idle_seconds,
                    live=self.live_runs(),
                    forget=self.forget,
                )
            except Exception:
                log.exception("retention pass failed; will retry")
            if self._stop.wait(limits.check_seconds):
                return

    def live_runs(self) -> set[str]:
        """Runs still receiving events: running, and heard from within the idle timeout."""
        now = time.monotonic()
        with self.live.lock:
            return {
                r.run
                for r in self.live.runs.values()
                if r.status == "running" and now - r.received_at <= self.config.evict_idle_seconds
            }

    def delete(self, run: str) -> int:
        """Delete a run that is not live from the store and from memory; the rows deleted. ``KeyError``
        for an unknown run, ``RunLiveError`` for one still receiving events."""
        live = run in self.live_runs()
        rows = delete_ended_run(self.storage, run, self.config.evict_idle_seconds, live=live)
        self.forget(run)
        log.info("run %s deleted (%d rows)", visible_controls(run), rows)
        return rows

    def forget(self, run: str) -> None:
        """Drop a deleted run from memory: detectors and open anomalies, live values and exported series,
        the findings acknowledgements carry, the alerts the notifier would keep re-posting."""
        self.ingestor.forget(run)
        self.findings.forget(run)
        if self.notifier is not None:
            self.notifier.forget(run)

    def close(self, timeout: float | None = None) -> None:
        """Commit what was received, detect it and answer it, within ``timeout`` seconds whatever the
        detection process does (default: half the configured shutdown grace)."""
        timeout = self.config.shutdown_grace_seconds / 2 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._stop.set()
        self.writer.close(max(0.0, deadline - time.monotonic() - 2))  # what was received is committed ...
        # ... and detected, and answered; a detection still running at the deadline is dropped (logged).
        self.ingestor.engine.close(max(1.0, deadline - time.monotonic()))
        self.writer.close(2)  # a writer that waited for detection slots has been let go
        self._ticker.join(2)
        if self._retainer is not None:
            self._retainer.join(2)  # a pass cut short here resumes at the next start (a delete is repeatable)
        if self.notifier is not None:
            self.notifier.close()
        self.storage.close()

    @classmethod
    def open(cls, config: CollectorConfig) -> Collector:
        storage = Storage(config.db, background_checkpoint=True)
        live = LiveState()
        with storage.connect() as conn:
            # Counters of runs still going survive a restart; ended runs are no longer exported.
            live.load_anomalies(run_anomaly_states(conn))
            findings = OpenFindings()
            findings.load(open_findings_of_running_runs(conn))
        registry = CollectorRegistry()
        registry.register(TrainingCollector(live, findings=findings, limits=config.series))
        notifier = Notifier(config.notify, registry, open_anomalies(storage) if config.notify.targets else ())

        def publish(changes: list[AnomalyChange]) -> None:
            for ch in changes:
                live.anomaly(ch.run, ch.finding.kind, ch.action, ch.severity, ch.previous)
                _log_change(ch)
            findings.apply(changes)
            notifier.submit(changes)

        engine = Engine(storage, config.detectors, process=True, on_changes=publish)
        registry.register(DetectionCollector(engine.detection))
        limits = IngestLimits(config.max_live_runs, config.max_ranks_per_run, config.max_runs_per_batch)
        ingestor = Ingestor(storage, engine, live, limits, clash_window=config.clash_window_seconds)
        metrics = CollectorMetrics(registry)
        for name in _EXPORTED_LIMITS:
            metrics.limits.labels(name).set(getattr(config, name))
        return cls(config, storage, live, ingestor, registry, metrics, notifier, findings)


def _log_change(ch: AnomalyChange) -> None:
    """One console line when an anomaly opens, changes severity or resolves (not per update)."""
    if ch.action == "updated" and ch.severity == ch.previous:
        return
    f = ch.finding
    what = {"opened": "opened", "resolved": "resolved"}.get(ch.action, f"now {ch.severity}")
    log.log(
        logging.WARNING if ch.action != "resolved" and ch.severity == "critical" else logging.INFO,
        "anomaly %s: %s %s on run %s%s at step %s: %s",
        what,
        ch.severity,
        f.kind,
        visible_controls(ch.run),
        "" if ch.rank < 0 else f" rank {ch.rank}",
        f.step,
        visible_controls(f.message[:200]),
    )


# Limits shown in /metrics (trainmon_collector_limit{limit=...}), next to the refusals they cause.
_EXPORTED_LIMITS = (
    "max_body_bytes",
    "max_pending_batches",
    "max_inflight_bytes",
    "max_live_runs",
    "max_ranks_per_run",
    "max_runs_per_batch",
    "header_timeout_seconds",
    "body_timeout_seconds",
)


class _Replies:
    """Replies from the writer thread to the event loop, with one wake-up per burst, not per batch
    (each ``call_soon_threadsafe`` writes to the loop's self-pipe: a syscall and a loop iteration)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future, Reply]] = []

    def put(self, fut: asyncio.Future, reply: Reply) -> None:
        with self._lock:
            self._pending.append((fut, reply))
            if len(self._pending) > 1:
                return  # a wake-up is on its way and will take this one too
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped, nobody waits any more
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fut, reply in pending:
            if not fut.done():  # the writer may answer a batch twice after an internal error; the first wins
                fut.set_result(reply)


class _Ingress:
    """The ASGI app the collector serves.

    Bearer auth on every path but ``open_paths``, then ``POST /v1/events`` handled here in plain
    ASGI, since it is the one hot path (a thousand ranks post every second): the body goes to the
    writer thread and the reply comes back through a future, with none of FastAPI's per-request
    machinery. Everything else (the read API, ``/metrics``, ``/openapi.json``) is FastAPI's.
    A token refusal is a 401 counted as ``auth``; the comparison is constant-time, so response
    timing does not reveal how much of a guess was right.

    A browser cannot send a bearer header, so the web pages (``GET /``, ``GET /runs/...``) also take
    the token once as ``?token=``: the reply redirects to the same page without it and sets a session
    cookie (an HMAC of the token, HttpOnly, SameSite=Strict) that only those pages accept. The API,
    ``/metrics`` and ingest still need the header, so a page elsewhere cannot use the cookie to write.
    """

    def __init__(self, api: FastAPI, collector: Collector) -> None:
        self.api = api
        self.collector = collector
        config = collector.config
        self._token = config.token.encode() if config.token else None
        self._session = (
            hmac.new(self._token, b"trainmon web session", hashlib.sha256).hexdigest().encode() if self._token else b""
        )
        # On a loopback bind, only loopback names (and the configured ones) in Host: DNS rebinding.
        self._hosts: frozenset[bytes] | None = None
        if _is_loopback(config.host):
            names = {"localhost", "127.0.0.1", "[::1]", "::1", config.host, *config.allowed_hosts}
            self._hosts = frozenset(n.lower().encode() for n in names)
        self._open = frozenset({"/healthz"} | ({"/metrics"} if config.metrics_public else set()))
        self._limit = config.max_body_bytes
        self._inflight_limit = config.max_inflight_bytes
        self._body_timeout = config.body_timeout_seconds
        self._receiving = 0  # bytes of bodies being received (one event loop: no lock)
        self._metrics = collector.metrics
        self._replies: _Replies | None = None  # made on the first request, on the serving loop

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        if (problem := self._foreign(scope)) is not None:
            self._metrics.rejected.labels("origin").inc()
            await self._reply(send, 403, {"error": problem})
            return
        if self._token is not None and scope["path"] not in self._open and not self._authorized(scope):
            if _is_page(scope):
                if self._has_session(scope):
                    await self.api(scope, receive, send)
                elif (query := self._page_token(scope)) is not None:
                    await self._log_in(scope, send, query)
                else:
                    self._metrics.rejected.labels("auth").inc()
                    await _html(send, 401, _LOGIN_PAGE)
                return
            await self._refuse(scope, send)
            return
        if scope["path"] != "/v1/events":
            await self.api(scope, receive, send)
        elif scope["method"] != "POST":
            await self._reply(send, 405, {"error": "method not allowed: POST events here"}, [(b"allow", b"POST")])
        else:
            await self._events(scope, receive, send)

    def _foreign(self, scope: dict) -> str | None:
        """Why a request may come from a web page rather than a producer or a user (None: it does not).

        A page the user opens can send requests to 127.0.0.1: as a cross-site request (its Origin
        names another site) or, after rebinding its own DNS name to 127.0.0.1, as a same-origin one
        (its Host names that site). Producers and CLIs send neither an Origin nor a foreign Host."""
        host = origin = b""
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.lower()
            elif name == b"origin":
                origin = value.lower()
        if self._hosts is not None and _host_name(host) not in self._hosts:
            return f"Host {host.decode(errors='replace')!r} is not this collector's (loopback only; allowed_hosts)"
        if origin and origin.partition(b"://")[2] != host:
            return f"cross-site request from Origin {origin.decode(errors='replace')!r} refused"
        return None

    def _authorized(self, scope: dict) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credential = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._token or b"")

    def _has_session(self, scope: dict) -> bool:
        for name, value in scope["headers"]:
            if name == b"cookie":
                for part in value.split(b";"):
                    key, _, given = part.strip().partition(b"=")
                    if key == _SESSION_COOKIE and hmac.compare_digest(given, self._session):
                        return True
        return False

    def _page_token(self, scope: dict) -> str | None:
        """The page's query without ``token`` when ``token`` is right (None otherwise)."""
        pairs = urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in pairs if k == "token"]
        if len(given) != 1 or not hmac.compare_digest(given[0].encode("utf-8", "replace"), self._token or b""):
            return None
        return urllib.parse.urlencode([(k, v) for k, v in pairs if k != "token"])

    async def _log_in(self, scope: dict, send: Any, query: str) -> None:
        path = scope.get("raw_path") or scope["path"].encode()
        location = path + (b"?" + query.encode() if query else b"")
        cookie = _SESSION_COOKIE + b"=" + self._session + b"; Path=/; HttpOnly; SameSite=Strict; Max-Age=604800"
        headers = [(b"location", location), (b"set-cookie", cookie), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 303, "headers": [*headers, (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, scope: dict, send: Any) -> None:
        self._metrics.rejected.labels("auth").inc()
        given = any(k == b"authorization" for k, _ in scope["headers"])
        problem = "invalid" if given else "missing"
        message = (
            f"{problem} bearer token: this collector requires 'Authorization: Bearer <token>' "
            "(the token it was started with, --token or $TRAINMON_TOKEN)"
        )
        await self._reply(send, 401, {"error": message}, [(b"www-authenticate", b'Bearer realm="trainmon"')])

    async def _events(self, scope: dict, receive: Any, send: Any) -> None:
        declared = media = b""
        sent: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"content-type":
                media = value.partition(b";")[0].strip().lower()
            elif name == _SENT_HEADER:
                sent = value
        if media != b"application/json":
            # Also what keeps a web page from posting events: text/plain needs no CORS preflight, JSON does.
            self._metrics.rejected.labels("content_type").inc()
            await self._reply(send, 415, {"error": "Content-Type must be application/json"})
            return
        if declared.isdigit() and int(declared) > self._limit:
            await self._too_large(send, f"body of {int(declared)} bytes exceeds the limit of {self._limit} bytes")
            return
        query = scope["query_string"]
        asked = _findings_query(query, self.collector.findings.revision) if query else None
        if isinstance(asked, str):
            self._metrics.rejected.labels("schema").inc()
            await self._reply(send, 422, {"error": asked})
            return
        body = bytearray()
        try:
            async with asyncio.timeout(self._body_timeout):
                refusal = await self._receive_body(receive, body)
        except TimeoutError:
            self._metrics.rejected.labels("slow_body").inc()
            await self._reply(send, 408, {"error": f"request body not received within {self._body_timeout:g} s"})
            return
        finally:
            self._receiving -= len(body)
        if refusal is not None:
            status, reason, message = refusal
            if status:
                self._metrics.rejected.labels(reason).inc()
                await self._reply(send, status, {"error": message}, [(b"retry-after", b"1")] if status == 503 else [])
            return
        loop = asyncio.get_running_loop()
        if self._replies is None or self._replies.loop is not loop:
            self._replies = _Replies(loop)
        replies = self._replies
        fut: asyncio.Future = loop.create_future()
        self.collector.writer.submit(bytes(body), lambda reply: replies.put(fut, reply), wire.parse_sent(sent))
        status, payload, headers = await fut
        if asked is not None and status == 200:
            run, severity, after = asked
            run = payload.get("stored_as", {}).get(run, run)  # the job's own run, not another job's of its name
            found, revision = self.collector.findings.since(run, severity, after) if run else ([], after)
            payload = {**payload, "findings": found, "findings_rev": revision}
        await self._reply(send, status, payload, headers)

    async def _receive_body(self, receive: Any, body: bytearray) -> tuple[int, str, str] | None:
        """Read the body into ``body``; (status, reason, message) if it is refused (status 0: gone)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return 0, "", ""  # the producer gave up; it will resend (nothing was acknowledged)
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > self._limit:
                return 413, "too_large", f"body exceeds the limit of {self._limit} bytes"
            if self._receiving + self.collector.writer.queued_bytes + len(chunk) > self._inflight_limit:
                return 503, "overload", f"collector busy: {self._inflight_limit} bytes in flight; retry later"
            body += chunk
            self._receiving += len(chunk)
            if not message.get("more_body", False):
                return None

    async def _too_large(self, send: Any, message: str) -> None:
        self._metrics.rejected.labels("too_large").inc()
        await self._reply(send, 413, {"error": message})

    @staticmethod
    async def _reply(send: Any, status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        body = orjson.dumps(payload)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})


_SENT_HEADER = wire.SENT_HEADER.lower().encode()  # ASGI gives header names lower-cased

_SESSION_COOKIE = b"trainmon_session"

_LOGIN_PAGE = b"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>trainmon: token needed</title>
</head><body style="font-family:sans-serif;max-width:40em;margin:3em auto">
<h1>This collector needs its token</h1>
<p>It was started with a bearer token (<code>--token</code> or <code>$TRAINMON_TOKEN</code>). Open this page once
as <code>/?token=YOUR_TOKEN</code>: the collector then sets a cookie for its pages and drops the token from the
address. The API and <code>/metrics</code> still take <code>Authorization: Bearer &lt;token&gt;</code>.</p>
</body></html>"""


def _is_page(scope: dict) -> bool:
    """The web view's pages, which a browser opens (and which never change anything)."""
    return scope["method"] in ("GET", "HEAD") and (scope["path"] == "/" or scope["path"].startswith("/runs/"))


async def _html(send: Any, status: int, body: bytes) -> None:
    head = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"content-security-policy", b"default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"),
        (b"www-authenticate", b'Bearer realm="trainmon"'),
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _findings_query(query: bytes, revision: int) -> tuple[str, str, int] | str | None:
    """``?findings=SEVERITY&run=RUN[&after=REV]`` of ``POST /v1/events``: (run, severity, after), an error
    message, or None when findings are not asked for. Without ``after``: changes from now on."""
    params = dict(urllib.parse.parse_qsl(query.decode("latin-1")))
    severity = params.get("findings")
    if severity is None:
        return None
    if severity not in SEVERITIES:
        return f"findings: one of {', '.join(SEVERITIES)}, got {severity[:40]!r}"
    run = params.get("run", "")
    if run and re.fullmatch(wire.RUN_ID_PATTERN, run) is None:
        return f"run: invalid run id {run[:140]!r}"
    after = params.get("after")
    if after is None:
        return run, severity, revision
    if not after.isdigit() or int(after) > _MAX_REVISION:
        return f"after: a revision from a previous answer (0 to {_MAX_REVISION}), got {after[:40]!r}"
    return run, severity, int(after)


_MAX_REVISION = 2**62
_FINDING_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string"},
        "severity": {"type": "string", "enum": list(SEVERITIES)},
        "rank": {"type": "integer", "description": "-1: the run as a whole"},
        "first_step": {"type": ["integer", "null"]},
        "last_step": {"type": ["integer", "null"]},
        "message": {"type": "string"},
    },
    "required": ["kind", "severity", "rank", "first_step", "last_step", "message"],
}


def _events_openapi() -> dict[str, Any]:
    """The OpenAPI operation of ``POST /v1/events`` (served by ``_Ingress``, not a FastAPI route)."""
    return {
        "post": {
            "summary": "Ingest a batch of events (wire format v1)",
            "operationId": "post_events_v1_events_post",
            "parameters": [
                {
                    "name": "findings",
                    "in": "query",
                    "required": False,
                    "description": "also answer with the open findings of `run` at or above this severity "
                    "(for producers that stop training on them)",
                    "schema": {"type": "string", "enum": list(SEVERITIES)},
                },
                {
                    "name": "run",
                    "in": "query",
                    "required": False,
                    "description": "whose findings (without it, none)",
                    "schema": {"type": "string", "pattern": wire.RUN_ID_PATTERN},
                },
                {
                    "name": "after",
                    "in": "query",
                    "required": False,
                    "description": "`findings_rev` of the previous answer: only findings opened or updated "
                    "since (without it: from this request on)",
                    "schema": {"type": "integer", "minimum": 0, "maximum": _MAX_REVISION},
                },
            ],
            "requestBody": {"required": True, "content": {"application/json": {"schema": wire.json_schema()}}},
            "responses": {
                "200": {
                    "description": "Stored (durable) or recognised as already stored",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "accepted": {"type": "integer", "minimum": 0},
                                    "duplicates": {"type": "integer", "minimum": 0},
                                    "findings": {
                                        "type": "array",
                                        "items": _FINDING_SCHEMA,
                                        "description": "with ?findings=: the run's open findings at or above "
                                        "that severity changed since `after`, most severe first (at most 10)",
                                    },
                                    "findings_rev": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "description": "with ?findings=: send it back as `after`",
                                    },
                                },
                                "required": ["accepted", "duplicates"],
                            }
                        }
                    },
                },
                "400": {"description": "body is not JSON"},
                "403": {"description": "a cross-site Origin, or a Host that is not this loopback collector's"},
                "415": {"description": "Content-Type is not application/json"},
                "401": {"description": "missing or invalid bearer token (collectors started with a token)"},
                "409": {"description": "events contradict stored data (stream reused by another run or rank)"},
                "408": {"description": "the body did not arrive within body_timeout_seconds"},
                "413": {
                    "description": "body larger than the limit, or more runs in one batch than max_runs_per_batch: "
                    "send it again in smaller batches"
                },
                "422": {
                    "description": "schema violation (`field` names the offending field), a batch whose data "
                    "the database cannot store, or an invalid findings query"
                },
                "429": {"description": "a limit on live runs or ranks per run: retry after `Retry-After`"},
                "503": {"description": "overloaded or storage failed: nothing stored, retry after `Retry-After`"},
            },
        }
    }


def _json_or_404(read: Callable[[], Any]) -> Any:
    """What ``read()`` answers, JSON-safe; an unknown run (``KeyError``) is a 404 saying which."""
    try:
        return wire.json_safe(read())
    except KeyError as exc:
        raise HTTPException(404, {"error": exc.args[0]}) from exc


def create_app(collector: Collector) -> _Ingress:
    app = FastAPI(
        title="trainmon collector",
        version="1",
        description="Ingests training events, stores them, detects anomalies, exports to Prometheus.",
        docs_url=None,  # Swagger UI and ReDoc load from a CDN, blank on an air-gapped cluster: register_docs below
        redoc_url=None,
    )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema["paths"] = {"/v1/events": _events_openapi(), **schema["paths"]}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        body = exc.detail if isinstance(exc.detail, dict) else {"error": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code)

    @app.get("/healthz", summary="Liveness, database reachability, and whether writes succeed")
    def healthz() -> dict[str, Any]:
        try:
            collector.storage.ping()
        except Exception as exc:  # report, do not crash: this endpoint exists to say what is wrong
            raise HTTPException(503, {"status": "unhealthy", "error": f"database: {exc}"}) from exc
        if (failing := collector.writer.write_failure) is not None:  # readable is not writable (a full disk)
            since, why = failing
            error = f"writes failing for {time.time() - since:.0f} s: {why}"
            raise HTTPException(503, {"status": "unhealthy", "error": error})
        return {"status": "ok", "database": collector.storage.dialect}

    @app.get("/metrics", summary="Prometheus exposition")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(collector.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/runs", summary="Runs with their latest step, loss and open anomalies")
    def list_runs() -> list[dict[str, Any]]:
        with collector.storage.connect() as conn:
            return wire.json_safe(run_rows(conn))

    @app.get(
        "/v1/runs/{run}",
        summary="Status of a run: progress, ETA, recent loss and tokens/s, phase split, ranks, open anomalies",
        responses={404: {"description": "no such run"}},
    )
    def run_status(run: str, window: Annotated[int, Query(ge=2, le=2000)] = 120) -> dict[str, Any]:
        return _json_or_404(lambda: live_view.run_status(collector.storage, run, window))

    @app.get(
        "/v1/runs/{run}/steps",
        summary="Steps of one rank's newest attempt after step `since`, oldest first (at most `limit`)",
        responses={404: {"description": "no such run"}},
    )
    def run_steps(
        run: str,
        since: Annotated[int, Query(ge=-1, le=2**62)] = -1,
        rank: Annotated[int, Query(ge=0, le=2**31)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[dict[str, Any]]:
        return _json_or_404(lambda: live_view.steps_since(collector.storage, run, since, rank, limit))

    @app.get(
        "/v1/runs/{run}/anomalies",
        summary="Anomalies of a run, oldest first",
        responses={404: {"description": "no such run"}},
    )
    def list_anomalies(run: str) -> list[dict[str, Any]]:
        with collector.storage.connect() as conn:
            if not run_exists(conn, run):
                raise HTTPException(404, {"error": f"no run {run!r}"})
            return wire.json_safe(anomaly_rows(conn, run))

    @app.delete(
        "/v1/runs/{run}",
        summary="Delete a run from the store and from the collector's memory (archive it first: /export)",
        responses={
            404: {"description": "no such run"},
            409: {"description": "the run is still receiving events (not ended, not idle past the timeout)"},
        },
    )
    def delete_run_route(run: Annotated[str, Path(pattern=wire.RUN_ID_PATTERN)]) -> dict[str, Any]:
        try:
            rows = collector.delete(run)  # a plain function: runs on the thread pool, off the event loop
        except KeyError as exc:
            raise HTTPException(404, {"error": exc.args[0]}) from exc
        except RunLiveError as exc:
            raise HTTPException(409, {"error": str(exc)}) from exc
        return {"deleted": run, "rows": rows}

    # The web view: plain functions, so rendering runs on the thread pool, off the ingest event loop.
    pages = WebView(collector.storage, collector.config.web_cache_seconds, collector.config.web_refresh_seconds)
    app.state.web = pages

    @app.get("/", response_class=HTMLResponse, summary="The runs (HTML): health, progress, open findings")
    def runs_page() -> HTMLResponse:
        return html_response(pages.index())

    @app.get(
        "/runs/{run:path}",
        response_class=HTMLResponse,
        summary="One run (HTML): verdict, plots and findings; reloads itself while the run is live",
        responses={404: {"description": "no such run"}},
    )
    def run_page(run: str) -> HTMLResponse:
        try:
            return html_response(pages.run(run))
        except KeyError:
            return html_response(pages.not_found(run), 404)

    read_api.register(app, collector)  # what the reading commands' --url asks for (the post-mortem, its report)
    register_docs(app)  # /docs: the API reference rendered here from the OpenAPI schema, no CDN
    return _Ingress(app, collector)


def _timed_protocol(timeout: float, metrics: CollectorMetrics) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol with a deadline for the request headers: uvicorn has none, so a
    client that connects and sends its headers a byte a minute (slowloris) would hold a connection
    and its memory for ever."""

    class HeaderDeadline(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                metrics.rejected.labels("slow_headers").inc()
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app: _Ingress, host: str, port: int, log_level: str) -> uvicorn.Config:
    """One uvicorn configuration for the daemon, the demo and the tests."""
    config = app.collector.config
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        http=_timed_protocol(config.header_timeout_seconds, app.collector.metrics),
        access_log=False,  # one line per batch from every rank costs more than the batch; metrics count them
        proxy_headers=False,  # no X-Forwarded-* rewriting: a middleware call per request, never used here
        server_header=False,
        # Requests waiting for an acknowledgement get half the grace; closing the collector the rest.
        timeout_graceful_shutdown=config.shutdown_grace_seconds / 2,
    )


class ServerThread:
    """A uvicorn server on a background thread (demo and tests); ``stop()`` shuts it down."""

    def __init__(self, app: _Ingress, host: str, port: int) -> None:
        self.server = uvicorn.Server(uvicorn_config(app, host, port, "warning"))
        self.thread = threading.Thread(target=self.server.run, name="trainmon-collector", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("collector failed to start (is the port in use?)")
            time.sleep(0.02)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class _DaemonServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful stop, so the process would die by the signal;
    a daemon that stopped cleanly should exit 0, so trainmon handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def stop(_signum: int, _frame: Any) -> None:
            self.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _host_name(host: bytes) -> bytes:
    """The name in a Host header, without its port ("[::1]:9400" -> "[::1]")."""
    if host.startswith(b"["):
        return host.partition(b"]")[0] + b"]"
    return host.rpartition(b":")[0] if host.count(b":") == 1 else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything: treat it as exposed


MIN_TOKEN_LENGTH = 16


def check_bind(config: CollectorConfig) -> None:
    """Refuse a non-loopback bind without a token unless ``insecure`` was asked for explicitly:
    anyone on the network could otherwise write runs or read them."""
    if config.token and len(config.token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"token: at least {MIN_TOKEN_LENGTH} characters (a short token can be guessed); "
            "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )
    if _is_loopback(config.host) or config.token:
        return
    if not config.insecure:
        raise ConfigError(
            f"refusing to listen on {config.host}: a non-loopback address requires a bearer token "
            "(--token or $TRAINMON_TOKEN, or token in the config file); pass --insecure to serve it "
            "without authentication on a network you trust"
        )
    log.warning("listening on %s without a token (--insecure): anyone who can reach it can write", config.host)


def serve(config: CollectorConfig) -> None:
    """Run the collector in the foreground until SIGTERM or SIGINT."""
    check_bind(config)
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))  # run start/end and anomaly lines on the console
    collector = Collector.open(config)
    host = f"[{config.host}]" if ":" in config.host else config.host
    login = " (open it once as /?token=<the token>; a cookie keeps the browser in)" if config.token else ""
    log.info("web view at http://%s:%d/%s", host, config.port, login)
    log.info("%s", describe_retention(config.retention.max_age_days, config.retention.max_bytes))
    collector.start_retention()
    server = _DaemonServer(uvicorn_config(create_app(collector), config.host, config.port, "info"))
    try:
        server.run()
    finally:
        collector.close()
    if not server.started:
        raise SystemExit(f"trainmon serve: could not listen on {config.host}:{config.port}")
