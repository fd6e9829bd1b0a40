"""The collector's HTTP API (FastAPI, so the OpenAPI description comes for free)."""

from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import select, text
from starlette.concurrency import run_in_threadpool

from hooks import wire
from monitor import live_view
from monitor.config import CollectorConfig, ConfigError
from monitor.engine import Engine
from monitor.exporter import CollectorMetrics, TrainingCollector
from monitor.ingest import IngestError, Ingestor, IngestResult
from monitor.live import LiveState
from monitor.notify import Notifier, open_anomalies
from monitor.queries import anomaly_rows, run_rows
from monitor.storage import Storage, anomalies, runs

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

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_forever, name="trainmon-ticker", daemon=True)
        self._ticker.start()

    def _tick_forever(self) -> None:
        # Detectors that fire on silence (a hung rank sends nothing) need a clock of their own.
        while not self._stop.wait(1.0):
            try:
                changes = self.ingestor.engine.tick()
                for ch in changes:
                    self.live.anomaly(ch.run, ch.finding.kind, ch.action, ch.severity, ch.previous)
                if self.notifier is not None:
                    self.notifier.submit(changes)
            except Exception:
                log.exception("detector tick failed; continuing")
            try:
                for run in self.ingestor.evict(self.config.evict_after_seconds, self.config.evict_idle_seconds):
                    log.info("run %s evicted from memory (ended or idle); it stays in storage", run)
            except Exception:
                log.exception("eviction failed; continuing")

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(5)
        if self.notifier is not None:
            self.notifier.close()
        self.storage.close()

    @classmethod
    def open(cls, config: CollectorConfig) -> Collector:
        storage = Storage(config.db)
        live = LiveState()
        with storage.connect() as conn:
            # Counters of runs still going survive a restart; ended runs are no longer exported.
            live.load_anomalies(
                conn.execute(
                    select(anomalies.c.run, anomalies.c.kind, anomalies.c.severity, anomalies.c.status)
                    .join(runs, runs.c.run == anomalies.c.run)
                    .where(runs.c.status == "running")
                ).all()
            )
        engine = Engine(storage, config.detectors)
        registry = CollectorRegistry()
        registry.register(TrainingCollector(live))
        notifier = Notifier(config.notify, registry, open_anomalies(storage) if config.notify.targets else ())
        return cls(
            config, storage, live, Ingestor(storage, engine, live), registry, CollectorMetrics(registry), notifier
        )


def _reject(metrics: CollectorMetrics, status: int, reason: str, message: str, field: str | None = None) -> None:
    metrics.rejected.labels(reason).inc()
    detail: dict[str, Any] = {"error": message}
    if field is not None:
        detail["field"] = field
    raise HTTPException(status_code=status, detail=detail)


class _BearerAuth:
    """Requires ``Authorization: Bearer TOKEN`` on every path but ``open_paths`` (plain ASGI: no
    per-request overhead beyond a header scan). The comparison is constant-time, so response
    timing does not reveal how much of a guess was right; a refusal is a 401 counted as ``auth``."""

    def __init__(self, app: Any, token: str, open_paths: frozenset[str], metrics: CollectorMetrics) -> None:
        self.app = app
        self._token = token.encode()
        self._open = open_paths
        self._metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, credential = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._token):
            await self.app(scope, receive, send)
            return
        self._metrics.rejected.labels("auth").inc()
        problem = "missing" if given is None else "invalid"
        body = json.dumps(
            {
                "error": f"{problem} bearer token: this collector requires 'Authorization: Bearer <token>' "
                "(the token it was started with, --token or $TRAINMON_TOKEN)"
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="trainmon"'),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def create_app(collector: Collector) -> FastAPI:
    app = FastAPI(
        title="trainmon collector",
        version="1",
        description="Ingests training events, stores them, detects anomalies, exports to Prometheus.",
    )
    app.state.collector = collector
    metrics = collector.metrics
    if collector.config.token:
        open_paths = {"/healthz"} | ({"/metrics"} if collector.config.metrics_public else set())
        app.add_middleware(_BearerAuth, token=collector.config.token, open_paths=frozenset(open_paths), metrics=metrics)
    limit = collector.config.max_body_bytes

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        body = exc.detail if isinstance(exc.detail, dict) else {"error": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code)

    @app.post(
        "/v1/events",
        summary="Ingest a batch of events (wire format v1)",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": wire.json_schema()}}}
        },
        responses={
            400: {"description": "body is not JSON"},
            413: {"description": "body larger than the limit"},
            409: {"description": "events contradict stored data (stream reused by another run or rank)"},
            422: {"description": "schema violation; `field` names the offending field"},
        },
    )
    async def post_events(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            _reject(metrics, 413, "too_large", f"body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                _reject(metrics, 413, "too_large", f"body exceeds the limit of {limit} bytes")

        def decode_and_ingest() -> tuple[list[wire.Event], IngestResult]:
            # On a worker thread, parsing included: a 10,000-event spool replay takes a while to
            # decode and validate, and the event loop must keep serving the other ranks meanwhile.
            try:
                raw = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                _reject(metrics, 400, "json", f"body is not valid JSON: {exc}")
            try:
                events = wire.validate_batch(raw)
            except wire.WireError as exc:
                _reject(metrics, 422, "schema", str(exc), exc.path)
            metrics.inflight.inc()
            try:
                return events, collector.ingestor.ingest(events)
            except IngestError as exc:
                _reject(metrics, 409, "conflict", str(exc))
            finally:
                metrics.inflight.dec()

        t0 = time.perf_counter()
        events, result = await run_in_threadpool(decode_and_ingest)
        if collector.notifier is not None:
            collector.notifier.submit(result.changes)
        metrics.latency.observe(time.perf_counter() - t0)
        metrics.batches.inc()
        metrics.duplicates.inc(result.duplicates)
        for kind, n in collections.Counter(ev.kind for ev in events).items():
            metrics.events.labels(kind).inc(n)
        return {"accepted": result.accepted, "duplicates": result.duplicates}

    @app.get("/healthz", summary="Liveness and database reachability")
    def healthz() -> dict[str, Any]:
        try:
            with collector.storage.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # report, do not crash: this endpoint exists to say what is wrong
            raise HTTPException(503, {"status": "unhealthy", "error": f"database: {exc}"}) from exc
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
        try:
            return wire.json_safe(live_view.run_status(collector.storage, run, window))
        except KeyError as exc:
            raise HTTPException(404, {"error": exc.args[0]}) from exc

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
        try:
            return wire.json_safe(live_view.steps_since(collector.storage, run, since, rank, limit))
        except KeyError as exc:
            raise HTTPException(404, {"error": exc.args[0]}) from exc

    @app.get(
        "/v1/runs/{run}/anomalies",
        summary="Anomalies of a run, oldest first",
        responses={404: {"description": "no such run"}},
    )
    def list_anomalies(run: str) -> list[dict[str, Any]]:
        with collector.storage.connect() as conn:
            if conn.execute(select(runs.c.run).where(runs.c.run == run)).first() is None:
                raise HTTPException(404, {"error": f"no run {run!r}"})
            return wire.json_safe(anomaly_rows(conn, run))

    return app


class ServerThread:
    """A uvicorn server on a background thread (demo and tests); ``stop()`` shuts it down."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything: treat it as exposed


def check_bind(config: CollectorConfig) -> None:
    """Refuse a non-loopback bind without a token unless ``insecure`` was asked for explicitly:
    anyone on the network could otherwise write runs or read them."""
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
    collector = Collector.open(config)
    server = _DaemonServer(
        uvicorn.Config(
            create_app(collector),
            host=config.host,
            port=config.port,
            log_level="info",
            lifespan="off",
            access_log=False,  # one line per batch from every rank costs more than the batch; metrics count them
        )
    )
    try:
        server.run()
    finally:
        collector.close()
    if not server.started:
        raise SystemExit(f"trainmon serve: could not listen on {config.host}:{config.port}")
