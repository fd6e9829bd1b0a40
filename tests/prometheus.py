"""Real Prometheus and Alertmanager for the tests, on free loopback ports in a temporary folder.

The alert rules and dashboards are only worth something if the real servers accept them and the
queries return data from a real collector, so the tests start the Debian binaries (installed by
``.ci/run``) rather than imitating them. Also here: a webhook receiver that records what
Alertmanager delivers, a test copy of the rules with short ``for:`` and windows, and a fake
``pynvml`` so that a CPU-only trainer reports GPU health through the real hooks and collector.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "trainmon.rules.yml"
ALERTMANAGER_CONFIG = REPO / "alerts" / "alertmanager.yml"
JOB = "trainmon"  # the scrape job name the rules' TrainmonCollectorDown expects

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
AMTOOL = shutil.which("amtool")

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus binary missing (Debian package 'prometheus', installed by .ci/run)"
)
needs_alertmanager = pytest.mark.skipif(
    ALERTMANAGER is None,
    reason="alertmanager binary missing (Debian package 'prometheus-alertmanager', installed by .ci/run)",
)


def free_port() -> int:
    """A port free on loopback now (the servers bind it a moment later; a clash fails loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, data: dict[str, str] | None = None, timeout: float = 10.0) -> Any:
    """GET (or form-POST) a URL and decode its JSON body."""
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    with urllib.request.urlopen(url, data=body, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last_error = exc
        time.sleep(interval)
    detail = f": {last_error}" if last_error else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")


class _Server:
    """A server binary run as a child process with its log captured to a file."""

    def __init__(self, name: str, argv: list[str], url: str, workdir: Path) -> None:
        self.name = name
        self.url = url
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                return resp.status == 200

        wait_until(ready, timeout, f"{self.name} to become ready", interval=0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Prometheus(_Server):
    """A real Prometheus scraping given targets every second, with optional rules and Alertmanager."""

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result list (raises on a PromQL error)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = http_json(self.url + "/api/v1/query", params)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        body = http_json(self.url + "/api/v1/query_range", params)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts Prometheus holds now (pending and firing)."""
        return http_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def rule_groups(self) -> list[dict[str, Any]]:
        return http_json(self.url + "/api/v1/rules")["data"]["groups"]

    def wait_scraped(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        return wait_until(lambda: self.query(expr), timeout, f"Prometheus to have {expr}")


class Alertmanager(_Server):
    """A real Alertmanager, clustering off (a test instance must not gossip with anything)."""

    def alerts(self) -> list[dict[str, Any]]:
        return http_json(self.url + "/api/v2/alerts")


def _ready(server: Any) -> Any:
    """Wait until a started server answers; stop it if it never does."""
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def start_prometheus(
    workdir: Path, targets: list[str], rule_files: list[Path] = (), alertmanager: str | None = None
) -> Prometheus:
    """Start Prometheus scraping ``targets`` (host:port) as job ``trainmon`` every second."""
    if PROMETHEUS is None:
        pytest.skip("prometheus binary missing")
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
    }
    if alertmanager is not None:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        PROMETHEUS,
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]
    return _ready(Prometheus("prometheus", argv, f"http://127.0.0.1:{port}", workdir))


def start_alertmanager(workdir: Path, config: dict[str, Any]) -> Alertmanager:
    """Start Alertmanager with ``config`` (a parsed alertmanager.yml)."""
    if ALERTMANAGER is None:
        pytest.skip("alertmanager binary missing")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        ALERTMANAGER,
        f"--config.file={workdir / 'alertmanager.yml'}",
        f"--storage.path={workdir / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    return _ready(Alertmanager("alertmanager", argv, f"http://127.0.0.1:{port}", workdir))


def alertmanager_test_config(webhook_url: str) -> dict[str, Any]:
    """alerts/alertmanager.yml as shipped (grouping, inhibition), pointed at ``webhook_url`` with
    second-scale timings so a test sees notifications quickly."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    config["route"].update(group_wait="1s", group_interval="2s", repeat_interval="1h")
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", ()):
            hook["url"] = webhook_url
    return config


def write_test_rules(dst: Path, for_: str = "0s", replace: dict[str, str] | None = None) -> Path:
    """A copy of alerts/trainmon.rules.yml for a run of seconds, not hours: every ``for:`` set to
    ``for_`` and literal pieces of expressions replaced (each must occur, so a renamed rule
    fails here instead of silently testing nothing)."""
    doc = yaml.safe_load(RULES.read_text())
    unused = dict(replace or {})
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = for_
            for old, new in (replace or {}).items():
                if old in rule["expr"]:
                    rule["expr"] = rule["expr"].replace(old, new)
                    unused.pop(old, None)
    assert not unused, f"test rule replacements not found in {RULES.name}: {list(unused)}"
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


@dataclass
class WebhookReceiver:
    """An HTTP server on loopback that records Alertmanager's webhook payloads."""

    payloads: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                with receiver._lock:
                    receiver.payloads.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert delivered so far, flattened out of the notifications."""
        with self._lock:
            return [a for p in self.payloads for a in p.get("alerts", ())]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


FAKE_NVML = '''"""Fake NVML for tests (written by tests/prometheus.py): one GPU with readings from the
environment, so a CPU-only trainer reports GPU health through the real hooks and collector."""
import os

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


def _env(name, default):
    return int(os.environ.get("FAKE_NVML_" + name, default))


class _Mem:
    total = 80 * 2**30
    used = 60 * 2**30


class _Util:
    gpu = 97
    memory = 40


def nvmlInit():
    pass


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(i):
    return i


def nvmlDeviceGetMemoryInfo(h):
    return _Mem()


def nvmlDeviceGetUtilizationRates(h):
    return _Util()


def nvmlDeviceGetPowerUsage(h):
    return 650_000


def nvmlDeviceGetClockInfo(h, kind):
    return 1755


def nvmlDeviceGetUUID(h):
    return "GPU-00000000-fake-0000-0000-000000000000"


def nvmlDeviceGetTemperature(h, sensor):
    return _env("TEMPERATURE", 60)


def nvmlDeviceGetCurrentClocksEventReasons(h):
    return _env("THROTTLE", 0)


def nvmlDeviceGetTotalEccErrors(h, kind, counter):
    return _env("ECC_UNCORRECTED", 0) if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else _env("ECC_CORRECTED", 0)
'''


def fake_nvml_env(directory: Path, temperature_c: int = 60, throttle: int = 0, ecc_uncorrected: int = 0) -> dict:
    """Environment for a trainer subprocess that imports the fake ``pynvml`` from ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pynvml.py").write_text(FAKE_NVML)
    path = os.pathsep.join(p for p in (str(directory), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "FAKE_NVML_TEMPERATURE": str(temperature_c),
        "FAKE_NVML_THROTTLE": str(throttle),
        "FAKE_NVML_ECC_UNCORRECTED": str(ecc_uncorrected),
    }


@contextlib.contextmanager
def stopping(*servers: Any) -> Iterator[None]:
    """Stop every server on the way out, whatever happened."""
    try:
        yield
    finally:
        for server in reversed(servers):
            with contextlib.suppress(Exception):
                server.stop()
