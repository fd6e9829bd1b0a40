"""Security of the collector: loopback by default, bearer token, no secret in output, no pickle.

A collector bound beyond loopback without a token would let anyone on the network write runs
and read them, so ``serve`` refuses unless ``--insecure`` is explicit. With a token, every
endpoint but ``/healthz`` (liveness probes carry no credentials) needs it; ``/metrics`` too by
default, since Prometheus sends bearer tokens (``authorization: {credentials: ...}``), with
``metrics_public`` for scrapers that cannot.
"""

from __future__ import annotations

import http.client
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.conftest import start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.config import CollectorConfig, ConfigError, load_config
from trainmon.monitor.store.storage import Storage, steps
from trainmon.monitor.web.server import _Ingress, check_bind

TOKEN = "tm-s3cret-Zq8x1vK0pL"
TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(
    url: str, *, token: str | None = None, body: dict | None = None, raw_auth: str | None = None
) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if raw_auth is not None:
        headers["Authorization"] = raw_auth
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


# -- bind rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    check_bind(CollectorConfig(host=host))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node-7.cluster"])
def test_non_loopback_bind_requires_a_token_or_explicit_insecure(host: str) -> None:
    with pytest.raises(ConfigError, match=r"requires a bearer token.*--insecure"):
        check_bind(CollectorConfig(host=host))
    check_bind(CollectorConfig(host=host, token=TOKEN))
    check_bind(CollectorConfig(host=host, insecure=True))


def test_default_bind_is_loopback() -> None:
    assert CollectorConfig().host == "127.0.0.1"
    assert load_config().host == "127.0.0.1"


def test_serve_refuses_a_public_bind_without_token_with_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"}
    proc = subprocess.run(
        [*TRAINMON, "serve", "--db", str(tmp_path / "s.sqlite"), "--host", "0.0.0.0", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0" in proc.stderr and "--insecure" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the token on every endpoint ---------------------------------------------------------------


@pytest.fixture
def guarded(tmp_path: Path):
    lc = start_collector(tmp_path / "guarded.sqlite", token=TOKEN)
    yield lc
    lc.stop()


GUARDED_GETS = ["/metrics", "/v1/runs", "/v1/runs/r1/anomalies", "/openapi.json", "/docs"]


def test_every_endpoint_but_healthz_requires_the_token(guarded) -> None:
    url = guarded.url
    assert _request(url + "/healthz")[0] == 200
    ok = batch([event("run_start", {"world_size": 1}, seq=0), *step_events(3)])
    for bad in (None, "wrong", TOKEN + "x", TOKEN[:-1], ""):
        status, body, headers = _request(url + "/v1/events", token=bad, body=ok)
        assert status == 401, bad
        assert "bearer token" in json.loads(body)["error"]
        assert headers.get("www-authenticate", headers.get("WWW-Authenticate", "")).startswith("Bearer")
        for path in GUARDED_GETS:
            assert _request(url + path, token=bad)[0] == 401, (bad, path)
    for raw in (TOKEN, f"Basic {TOKEN}", f"Token {TOKEN}"):  # only the Bearer scheme counts
        assert _request(url + "/v1/runs", raw_auth=raw)[0] == 401
    with guarded.collector.storage.connect() as conn:
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 0  # nothing got through

    assert _request(url + "/v1/events", token=TOKEN, body=ok)[0] == 200
    assert _request(url + "/v1/runs", raw_auth=f"bearer {TOKEN}")[0] == 200  # the scheme is case-insensitive
    for path in GUARDED_GETS:
        assert _request(url + path, token=TOKEN)[0] == 200, path
    metrics = _request(url + "/metrics", token=TOKEN)[1].decode()
    rejected = re.search(r'trainmon_ingest_rejected_batches_total\{reason="auth"\} (\S+)', metrics)
    assert rejected is not None and float(rejected.group(1)) >= 5 * (1 + len(GUARDED_GETS))
    assert TOKEN not in metrics


def test_metrics_can_be_left_open_for_scrapers_without_a_token(tmp_path: Path) -> None:
    lc = start_collector(tmp_path / "m.sqlite", token=TOKEN, metrics_public=True)
    try:
        assert _request(lc.url + "/metrics")[0] == 200
        assert _request(lc.url + "/v1/runs")[0] == 401
        assert _request(lc.url + "/v1/events", body=batch(step_events(1)))[0] == 401
    finally:
        lc.stop()


def test_token_comparison_is_constant_time() -> None:
    source = inspect.getsource(_Ingress._authorized)
    assert "hmac.compare_digest" in source
    assert "== self._token" not in source and "self._token ==" not in source


def test_token_is_not_in_the_config_repr() -> None:
    assert TOKEN not in repr(CollectorConfig(token=TOKEN))


# -- end to end: the hooks send $TRAINMON_TOKEN to a `trainmon serve` that requires it ---------


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "collector exited"
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("collector did not become healthy")


def _train(run: str, url: str, spool: Path, n: int) -> Any:
    import torch

    from trainmon.hooks import TrainMonitor

    mon = TrainMonitor(run, collector=url, spool_dir=spool, flush_interval=0.05, health_interval=0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start(planned_steps=n)
    for step in range(n):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss, tokens=8)
    mon.close()
    return mon


@pytest.mark.slow
def test_hooks_send_the_environment_token_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    db = tmp_path / "e2e.sqlite"
    env = {**os.environ, "TRAINMON_TOKEN": TOKEN}
    # A non-loopback bind is allowed because a token is set; the test still talks over loopback.
    proc = subprocess.Popen(
        [*TRAINMON, "-v", "serve", "--db", str(db), "--host", "0.0.0.0", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        _wait_healthy(url, proc)
        monkeypatch.setenv("TRAINMON_TOKEN", TOKEN)
        good = _train("authed", url, tmp_path / "spool-good", 12)
        assert good.transport.sent > 0 and good.transport.rejected == 0
        monkeypatch.setenv("TRAINMON_TOKEN", "not-the-token")
        bad = _train("intruder", url, tmp_path / "spool-bad", 5)
        assert bad.transport.sent == 0 and bad.transport.rejected == 0
        assert list((tmp_path / "spool-bad").glob("*.jsonl"))  # kept on disk until the token is fixed
        status, body, _ = _request(url + "/v1/runs", token=TOKEN)
        assert status == 200 and [r["run"] for r in json.loads(body)] == ["authed"]
        assert _request(url + "/v1/runs", token="not-the-token")[0] == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert TOKEN not in output  # debug logging on, wrong and right tokens sent: still never printed
    with Storage(str(db)).connect() as conn:
        stored = conn.execute(select(steps.c.run, steps.c.step).order_by(steps.c.step)).all()
    assert [tuple(r) for r in stored] == [("authed", i) for i in range(12)]

    runs = subprocess.run([*TRAINMON, "runs", "--db", str(db)], capture_output=True, text=True, env=env, timeout=60)
    assert runs.returncode == 0 and TOKEN not in runs.stdout + runs.stderr


def test_token_flag_never_appears_in_error_output(tmp_path: Path) -> None:
    # A port in use makes serve fail after parsing the token: the error must not echo it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [*TRAINMON, "-v", "serve", "--db", str(tmp_path / "s.sqlite"), "--port", str(port), "--token", TOKEN],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode != 0
    assert TOKEN not in proc.stdout + proc.stderr


# -- no pickle on the wire or in storage -------------------------------------------------------

_UNSAFE_LOADS = re.compile(
    r"pickle\.loads?\b|Unpickler|torch\.load\b|marshal\.loads?\b|\bshelve\b|\bdill\b|PickleType|cloudpickle"
)


def test_no_pickle_deserialisation_in_the_collector_or_hooks() -> None:
    """Events are JSON on the wire and JSON/columns in storage; nothing ever unpickles input.

    Two ``pickle`` uses are allowed, each pinned below: ``hooks/fingerprint.py`` hashing ``pickle.dumps`` of RNG
    states (serialise then hash, never loaded, never sent), and the pipe between the collector and the detection
    process it started itself (``monitor/collector/detection_process.py``): each side loads only the frames the
    other wrote with ``pickle.dumps`` of lists, strings and numbers (events already validated, findings), over the
    child's own stdin and stdout; nothing from the network or the disk is ever unpickled."""
    offenders = []
    pipe = "monitor/collector/detection_process.py"
    for package in ("monitor", "hooks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(ROOT).as_posix()
            if rel == pipe:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if _UNSAFE_LOADS.search(line) or ("pickle" in line and rel != "hooks/fingerprint.py"):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []
    fingerprint = (ROOT / "hooks" / "fingerprint.py").read_text()
    uses = re.findall(r"pickle\.\w+", fingerprint)
    assert set(uses) == {"pickle.dumps"}
    assert all("_hash_bytes(pickle.dumps(" in line for line in fingerprint.splitlines() if "pickle.dumps" in line)
    # the detection pipe: a frame read off the child's pipe (``_Frames``) is all either side loads
    source = (ROOT / pipe).read_text()
    loads = [line.strip() for line in source.splitlines() if _UNSAFE_LOADS.search(line)]
    assert loads == ["call, found = pickle.loads(frame)", "message = pickle.loads(frame)"], loads
    assert "frame = frames.read(timeout=1.0)" in source and "frame = frames.read()" in source
    assert not re.search(r"\b(Unpickler|marshal|shelve|dill|cloudpickle)\b", source)


def _raw_get(url: str, path: str, cookie: str | None = None, method: str = "GET") -> tuple[int, bytes, dict]:
    """One request, redirects not followed (the browser's view of the login)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request(method, path, headers={"Cookie": cookie} if cookie else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body, {k.lower(): v for k, v in resp.getheaders()}


def test_a_browser_opens_the_web_view_of_a_guarded_collector_with_the_token_once(guarded) -> None:
    """With a token configured a browser could not open / or /runs/... at all (no way to send a bearer
    header). ?token= once sets a session cookie the pages accept; the API and ingest never do."""
    url = guarded.url
    assert (
        _request(url + "/v1/events", token=TOKEN, body=batch([event("run_start", {"world_size": 1}, seq=0)]))[0] == 200
    )
    status, body, _ = _raw_get(url, "/")
    assert status == 401 and b"?token=" in body and TOKEN.encode() not in body  # says how, in HTML
    for bad in ("wrong", TOKEN[:-1], ""):
        assert _raw_get(url, "/?token=" + urllib.parse.quote(bad))[0] == 401
    assert _raw_get(url, f"/?token={TOKEN}&token=wrong")[0] == 401  # one token, not a guess among several
    assert _raw_get(url, "/?token=%E2%82%AC%FF")[0] == 401  # not Latin-1, not UTF-8: refused, not a 500

    status, _, headers = _raw_get(url, f"/runs/r1?token={TOKEN}&x=1")
    assert status == 303 and headers["location"] == "/runs/r1?x=1"  # the token leaves the address bar
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    session = cookie.split(";")[0]
    assert _raw_get(url, "/", cookie=session)[0] == 200
    assert _raw_get(url, "/runs/r1", cookie="other=1; " + session)[0] == 200
    assert _raw_get(url, "/", cookie=session[:-1] + "0")[0] == 401

    # The cookie opens the pages only: not the API, the metrics, nor ingest.
    for path in GUARDED_GETS:
        assert _raw_get(url, path, cookie=session)[0] == 401, path
    req = urllib.request.Request(
        url + "/v1/events",
        data=json.dumps(batch([event("run_start", {"world_size": 1}, seq=1)])).encode(),
        headers={"Content-Type": "application/json", "Cookie": session},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
