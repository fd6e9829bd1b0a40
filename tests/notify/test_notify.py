"""The collector's notifier against real HTTP receivers on loopback (and a real Alertmanager).

The receiver below is a plain ``http.server`` in a thread that records every request and can
be told to answer 5xx, hang up without answering, answer slowly, or go away entirely (its port
closed: connection refused) and come back on the same port.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.collector.engine import AnomalyChange
from trainmon.monitor.config import ConfigError, NotifyConfig, NotifyTargetConfig, load_config
from trainmon.monitor.detectors.base import Finding
from trainmon.monitor.notify import Notifier, redact


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    status: int | None
    """What the receiver answered; None: it hung up without answering."""


@dataclass
class Receiver:
    """Records POSTs; ``fail``/``hang_up``/``delay`` script the next answers."""

    port: int = 0
    requests: list[Received] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    hangups: int = 0
    delay: float = 0.0
    echo: str = ""
    """Text put in failure bodies (to check that a receiver echoing a secret does not leak it)."""

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.delay:
                    time.sleep(receiver.delay)
                with receiver.cond:
                    if receiver.hangups > 0:
                        receiver.hangups -= 1
                        status = None
                    else:
                        status = receiver.failures.pop(0) if receiver.failures else 200
                    receiver.requests.append(Received(self.path, dict(self.headers), json.loads(raw), status))
                    receiver.cond.notify_all()
                if status is None:
                    self.close_connection = True  # no response at all: the client sees the connection drop
                    return
                reply = (receiver.echo if status != 200 else "ok").encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """Close the port: clients now get connection refused."""
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def fail(self, n: int, status: int = 500) -> None:
        with self.cond:
            self.failures.extend([status] * n)

    def delivered(self, path: str | None = None) -> list[Received]:
        with self.cond:
            return [r for r in self.requests if r.status == 200 and (path is None or r.path == path)]

    def wait_delivered(self, n: int, path: str | None = None, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(got := [r for r in self.requests if r.status == 200 and (path in (None, r.path))]) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver got {len(got)} of {n} expected deliveries: {self.requests}")
                self.cond.wait(left)
            return got


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    if r._server is not None:
        r.stop()


def change(
    action: str,
    kind: str = "nan_inf",
    *,
    run: str = "r1",
    rank: int = 0,
    severity: str = "critical",
    step: int = 10,
    id: int = 1,
    message: str = "loss is NaN",
    hint: str = "check the batch <X> & the LR",
) -> AnomalyChange:
    evidence = {"loss": float("nan"), "grad_norm": 3.5}
    finding = Finding(kind, severity, step, message, hint, evidence, resolved=action == "resolved")
    return AnomalyChange(action, id, run, rank, finding, severity)


def target(url: str, type: str = "webhook", **kw: Any) -> NotifyTargetConfig:
    return NotifyTargetConfig(type=type, url=url, **kw)


@pytest.fixture
def make_notifier() -> Iterator[Any]:
    made: list[Notifier] = []

    def make(*targets: NotifyTargetConfig, **kw: Any) -> tuple[Notifier, CollectorRegistry]:
        kw.setdefault("group_wait", 0.0)
        kw.setdefault("backoff", 0.05)
        registry = CollectorRegistry()
        n = Notifier(NotifyConfig(targets=list(targets), **kw), registry)
        made.append(n)
        return n, registry

    yield make
    for n in made:
        n.close(timeout=2.0)


def sent(registry: CollectorRegistry, target: str = "webhook") -> float:
    return registry.get_sample_value("trainmon_notifications_sent_total", {"target": target}) or 0.0


def failed(registry: CollectorRegistry, target: str = "webhook") -> float:
    return registry.get_sample_value("trainmon_notifications_failed_total", {"target": target}) or 0.0


def step_of(n: Notifier, *changes: AnomalyChange) -> None:
    """Submit and wait until handled and delivered, so the next change is judged separately."""
    n.submit(list(changes))
    assert n.wait_idle(10)


# --- grouping, dedupe, cooldown -----------------------------------------------------------


def test_changes_of_one_run_are_grouped_into_one_message_per_target(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url("/hook")), target(receiver.url("/slack"), "slack"), group_wait=0.5)
    n.submit([change("opened", "nan_inf", rank=0, id=1)])
    n.submit([change("opened", "loss_spike", rank=0, id=2, severity="warning", step=9)])
    n.submit([change("opened", "grad_explosion", rank=1, id=3, severity="warning")])
    n.submit([change("opened", "hang", run="r2", rank=-1, id=4)])
    assert n.wait_idle(10)
    hooks = receiver.delivered("/hook")
    assert len(hooks) == 2 and len(receiver.delivered("/slack")) == 2
    by_run = {r.body["run"]: r.body for r in hooks}
    assert [a["kind"] for a in by_run["r1"]["anomalies"]] == ["nan_inf", "loss_spike", "grad_explosion"]
    assert [a["kind"] for a in by_run["r2"]["anomalies"]] == ["hang"]
    first = by_run["r1"]["anomalies"][0]
    assert first["run"] == "r1" and first["rank"] == 0 and first["severity"] == "critical"
    assert first["status"] == "open" and first["action"] == "opened"
    assert first["steps"] == {"first": 10, "last": 10}
    assert first["message"] == "loss is NaN" and first["hint"].startswith("check the batch")
    assert first["evidence"] == {"loss": "NaN", "grad_norm": 3.5}  # strict JSON: NaN as the wire marker
    assert "collector_url" not in by_run["r1"]
    assert (sent(registry, "webhook"), sent(registry, "slack")) == (2.0, 2.0)


def test_open_and_resolve_within_the_group_wait_go_out_as_one_resolved_entry(receiver: Receiver, make_notifier):
    n, _ = make_notifier(target(receiver.url()), group_wait=0.3)
    n.submit([change("opened", step=10), change("updated", step=11), change("resolved", step=12)])
    assert n.wait_idle(10)
    (only,) = receiver.delivered()
    (entry,) = only.body["anomalies"]
    assert (entry["action"], entry["steps"]) == ("resolved", {"first": 10, "last": 12})
    assert entry["ended_at"] is not None


def test_dedupe_opened_once_updates_on_severity_change_resolved_once(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url()))
    step_of(n, change("opened", severity="warning", step=1))
    step_of(n, change("opened", severity="warning", step=2))  # seen twice: not news
    for s in (3, 4, 5):
        step_of(n, change("updated", severity="warning", step=s))  # same severity: not news
    step_of(n, change("updated", severity="critical", step=6))  # escalation: news
    step_of(n, change("updated", severity="critical", step=7))
    step_of(n, change("resolved", step=8))
    step_of(n, change("resolved", step=9))  # already resolved: not news
    got = [(r.body["anomalies"][0]["action"], r.body["anomalies"][0]["severity"]) for r in receiver.delivered()]
    assert got == [("opened", "warning"), ("updated", "critical"), ("resolved", "critical")]
    steps = receiver.delivered()[-1].body["anomalies"][0]["steps"]
    assert steps == {"first": 1, "last": 8}


def test_min_severity_holds_back_info_until_it_escalates(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url()), min_severity="warning")
    step_of(n, change("opened", severity="info"))
    step_of(n, change("updated", severity="info"))
    assert receiver.delivered() == []
    step_of(n, change("updated", severity="warning"))
    step_of(n, change("resolved"))
    assert [r.body["anomalies"][0]["action"] for r in receiver.delivered()] == ["opened", "resolved"]


def test_a_flap_within_the_cooldown_is_not_notified_again(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url()), cooldown=1.5)
    step_of(n, change("opened", id=1))
    step_of(n, change("resolved", id=1))
    step_of(n, change("opened", id=2))  # the flap
    step_of(n, change("resolved", id=2))
    time.sleep(0.2)
    assert [r.body["anomalies"][0]["action"] for r in receiver.delivered()] == ["opened", "resolved"]
    time.sleep(1.5)  # cooldown over: a new opening is news again
    step_of(n, change("opened", id=3))
    assert [r.body["anomalies"][0]["action"] for r in receiver.delivered()] == ["opened", "resolved", "opened"]
    assert receiver.delivered()[-1].body["anomalies"][0]["id"] == 3


def test_a_reopen_still_open_when_the_cooldown_ends_is_notified_then(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url()), cooldown=1.0)
    step_of(n, change("opened", id=1))
    step_of(n, change("resolved", id=1))
    t0 = time.monotonic()
    step_of(n, change("opened", id=2, step=30))
    assert len(receiver.delivered()) == 2
    got = receiver.wait_delivered(3, timeout=5)
    assert time.monotonic() - t0 > 0.5  # not before the cooldown
    last = got[-1].body["anomalies"][0]
    assert (last["action"], last["id"], last["steps"]["first"]) == ("opened", 2, 30)


def test_other_anomalies_are_not_affected_by_a_cooldown(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url()), cooldown=60)
    step_of(n, change("opened", rank=0, id=1))
    step_of(n, change("resolved", rank=0, id=1))
    step_of(n, change("opened", rank=1, id=2))  # another rank: its own (run, kind, rank)
    step_of(n, change("opened", "loss_spike", rank=0, id=3))  # another kind
    got = [(r.body["anomalies"][0]["kind"], r.body["anomalies"][0]["rank"]) for r in receiver.delivered()]
    assert got == [("nan_inf", 0), ("nan_inf", 0), ("nan_inf", 1), ("loss_spike", 0)]


# --- retry, backoff, timeouts -------------------------------------------------------------


def test_retries_after_5xx_and_delivers_once_when_the_receiver_recovers(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()), max_attempts=5)
    receiver.fail(2, 500)
    step_of(n, change("opened"))
    assert [r.status for r in receiver.requests] == [500, 500, 200]
    assert len(receiver.delivered()) == 1
    assert (sent(registry), failed(registry)) == (1.0, 0.0)


def test_retries_on_429_and_hang_ups(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()))
    receiver.fail(1, 429)
    receiver.hangups = 1
    step_of(n, change("opened"))
    assert [r.status for r in receiver.requests] == [None, 429, 200]
    assert (sent(registry), failed(registry)) == (1.0, 0.0)


def test_retries_while_the_receiver_is_down_and_delivers_when_it_is_back(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()), backoff=0.1, max_attempts=8)
    receiver.stop()  # connection refused
    n.submit([change("opened")])
    time.sleep(0.5)  # a few refused attempts
    assert receiver.requests == []
    receiver.start()  # same port
    assert n.wait_idle(15)
    assert len(receiver.delivered()) == 1 and len(receiver.requests) == 1
    assert (sent(registry), failed(registry)) == (1.0, 0.0)


def test_gives_up_after_max_attempts_counts_it_and_keeps_going(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()), max_attempts=3)
    receiver.fail(3, 503)
    step_of(n, change("opened", run="r1"))
    assert [r.status for r in receiver.requests] == [503, 503, 503]
    assert (sent(registry), failed(registry)) == (0.0, 1.0)
    step_of(n, change("opened", run="r2"))  # the target is not stuck on the dropped message
    assert [r.body["run"] for r in receiver.delivered()] == ["r2"]


def test_a_4xx_is_not_retried(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()), max_attempts=5)
    receiver.fail(1, 400)
    step_of(n, change("opened"))
    assert [r.status for r in receiver.requests] == [400]
    assert failed(registry) == 1.0


def test_a_slow_receiver_times_out_and_never_blocks_submit(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url(), timeout=0.3), max_attempts=2)
    receiver.delay = 1.0
    t0 = time.monotonic()
    for i in range(200):
        n.submit([change("opened", run=f"r{i}", id=i)])
    assert time.monotonic() - t0 < 0.9  # far less than one answer of the receiver
    deadline = time.monotonic() + 10
    while failed(registry) < 1.0:  # the first message times out twice (0.3 s each), then is dropped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    receiver.delay = 0.0
    assert n.wait_idle(30)
    assert sent(registry) + failed(registry) == 200.0
    assert sent(registry) >= 150.0  # the rest got through once the receiver answered in time


def test_a_full_queue_drops_and_counts_instead_of_blocking(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url()), queue_size=1)
    receiver.delay = 0.5
    n.submit([change("opened", run=f"r{i}", id=i) for i in range(50)])
    assert n.wait_idle(30)
    dropped = registry.get_sample_value("trainmon_notifications_dropped_changes_total") or 0.0
    # The notifier's queue holds one change and the sender's queue one message (while another is
    # in flight for 0.5 s): most are dropped, each counted once, as a change or as a message.
    assert dropped + failed(registry) >= 40
    assert dropped + failed(registry) + sent(registry) == 50


# --- payloads and secrets -----------------------------------------------------------------


def test_slack_payload_has_text_and_blocks_with_run_kind_severity_message_hint(receiver: Receiver, make_notifier):
    n, _ = make_notifier(target(receiver.url("/slack"), "slack"), collector_url="http://collector:9400/")
    step_of(n, change("opened", run="gpt-7b", message="loss is NaN at step 10", hint="lower the LR <now>"))
    (msg,) = receiver.delivered("/slack")
    body = msg.body
    assert set(body) == {"text", "blocks"}
    assert "gpt-7b" in body["text"] and "nan_inf" in body["text"] and "CRITICAL" in body["text"]
    header, section, context = body["blocks"]
    assert header["type"] == "header" and header["text"]["type"] == "plain_text"
    assert "gpt-7b" in header["text"]["text"]
    assert section["type"] == "section" and section["text"]["type"] == "mrkdwn"
    text = section["text"]["text"]
    for part in ("gpt-7b", "nan_inf", "CRITICAL", "loss is NaN at step 10", "rank 0", "step 10"):
        assert part in text
    assert "_Hint:_ lower the LR &lt;now&gt;" in text  # mrkdwn control characters escaped
    assert context["type"] == "context"
    assert "<http://collector:9400/v1/runs/gpt-7b/anomalies|" in context["elements"][0]["text"]


def test_webhook_carries_the_collector_url_and_bearer_token(receiver: Receiver, make_notifier) -> None:
    n, _ = make_notifier(target(receiver.url(), token="t0ken"), collector_url="http://collector:9400")
    step_of(n, change("opened", run="a/b"))
    (msg,) = receiver.delivered()
    assert msg.headers["Authorization"] == "Bearer t0ken"
    assert msg.body["collector_url"] == "http://collector:9400"
    assert msg.body["anomalies_url"] == "http://collector:9400/v1/runs/a%2Fb/anomalies"


def test_urls_and_tokens_from_the_environment_never_reach_the_log(
    receiver: Receiver, make_notifier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret_url = receiver.url("/services/T0001/B0002/SECRETpath")
    monkeypatch.setenv("TRAINMON_SLACK_URL", secret_url)
    monkeypatch.setenv("TRAINMON_HOOK_TOKEN", "tok-SECRET")
    receiver.echo = f"bad token tok-SECRET for {secret_url}"  # a receiver echoing the secrets back
    receiver.fail(1, 500)
    receiver.fail(1, 401)
    caplog.set_level(logging.DEBUG)
    n, registry = make_notifier(
        NotifyTargetConfig(type="slack", url_env="TRAINMON_SLACK_URL", token_env="TRAINMON_HOOK_TOKEN"),
        max_attempts=3,
    )
    step_of(n, change("opened"))  # 500 then 401: retried once, then dropped
    step_of(n, change("opened", run="r2"))  # delivered
    assert [r.status for r in receiver.requests] == [500, 401, 200]
    assert receiver.requests[-1].path == "/services/T0001/B0002/SECRETpath"
    assert receiver.requests[-1].headers["Authorization"] == "Bearer tok-SECRET"
    assert (failed(registry, "slack"), sent(registry, "slack")) == (1.0, 1.0)
    logged = caplog.text
    assert "SECRETpath" not in logged and "T0001" not in logged and "tok-SECRET" not in logged
    assert f"slack http://127.0.0.1:{receiver.port}/…" in logged  # the redacted form names the target
    assert "HTTP 500" in logged and "HTTP 401" in logged


def test_redact_keeps_scheme_and_host_only() -> None:
    assert redact("https://hooks.slack.com/services/T/B/X") == "https://hooks.slack.com/…"
    assert redact("https://user:pw@example.com:8443/x?token=1") == "https://example.com:8443/…"
    assert redact("http://alertmanager:9093") == "http://alertmanager:9093"


def test_alertmanager_payload_and_resend_while_open(receiver: Receiver, make_notifier) -> None:
    n, registry = make_notifier(target(receiver.url(""), "alertmanager"), resend_interval=0.3)
    step_of(n, change("opened", run="r1", rank=3, severity="warning"))
    first = receiver.delivered()[0]  # (a slow machine may have re-posted it already)
    assert first.path == "/api/v2/alerts"
    (alert,) = first.body
    assert alert["labels"] == {
        "alertname": "TrainmonAnomaly",
        "run": "r1",
        "kind": "nan_inf",
        "rank": "3",
        "severity": "warning",
    }
    assert set(alert["annotations"]) == {"summary", "description", "hint"}
    assert "loss is NaN" in alert["annotations"]["summary"]
    assert alert["startsAt"].endswith("Z") and "endsAt" not in alert
    resent = receiver.wait_delivered(3, timeout=5)  # re-posted while open
    assert all(r.body[0]["labels"] == alert["labels"] and "endsAt" not in r.body[0] for r in resent[1:])
    step_of(n, change("updated", run="r1", rank=3, severity="critical"))
    # Severity is a label: the critical alert starts, the warning one ends in the same request.
    ((critical, warning),) = [r.body for r in receiver.delivered() if len(r.body) == 2]
    assert (critical["labels"]["severity"], "endsAt" in critical) == ("critical", False)
    assert (warning["labels"]["severity"], "endsAt" in warning) == ("warning", True)
    step_of(n, change("resolved", run="r1", rank=3))
    ((resolved,),) = [r.body for r in receiver.delivered() if "endsAt" in r.body[0]]
    assert resolved["endsAt"] >= resolved["startsAt"] and resolved["labels"]["severity"] == "critical"
    count = len(receiver.delivered())
    time.sleep(0.8)
    assert len(receiver.delivered()) == count  # nothing open: nothing re-posted
    assert sent(registry, "alertmanager") == count


# --- configuration --------------------------------------------------------------------------


def test_notify_targets_load_from_toml_as_a_list_of_tables(tmp_path: Path) -> None:
    path = tmp_path / "trainmon.toml"
    path.write_text(
        """
port = 9500
[detectors.nan_inf]
resolve_after = 7
[notify]
group_wait = 2
cooldown = 60
[[notify.targets]]
type = "slack"
url_env = "TRAINMON_SLACK_URL"
[[notify.targets]]
type = "alertmanager"
url = "http://127.0.0.1:9093"
timeout = 2
"""
    )
    config = load_config(path)
    assert config.port == 9500 and config.detectors.nan_inf.resolve_after == 7  # other fields as before
    assert (config.notify.group_wait, config.notify.cooldown) == (2.0, 60.0)
    assert [(t.type, t.url, t.url_env, t.timeout) for t in config.notify.targets] == [
        ("slack", "", "TRAINMON_SLACK_URL", 5.0),
        ("alertmanager", "http://127.0.0.1:9093", "", 2.0),
    ]


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        ('[[notify.targets]]\nurll = "x"\n', "notify.targets[0].urll: unknown field"),
        ('[[notify.targets]]\nurl = "http://a"\n[[notify.targets]]\ntimeout = "2"\n', "notify.targets[1].timeout"),
        ('[notify]\ntargets = "http://a"\n', "notify.targets: expected a list of tables"),
        ("[notify]\ncooldown = true\n", "notify.cooldown: expected float"),
    ],
)
def test_bad_notify_fields_are_named(tmp_path: Path, toml: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        load_config(path)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (NotifyConfig(targets=[NotifyTargetConfig(type="pagerduty", url="http://a")]), r"targets\[0\]\.type"),
        (NotifyConfig(targets=[NotifyTargetConfig(url_env="TRAINMON_UNSET_VAR")]), "TRAINMON_UNSET_VAR is not set"),
        (NotifyConfig(targets=[NotifyTargetConfig()]), r"targets\[0\]\.url: no URL"),
        (NotifyConfig(targets=[NotifyTargetConfig(url="hooks.slack.com/x")]), "expected an http"),
        (NotifyConfig(min_severity="page"), "notify.min_severity"),
    ],
)
def test_bad_notify_values_are_refused_when_the_notifier_is_built(config: NotifyConfig, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        Notifier(config, None, environ={})


def test_without_targets_the_notifier_is_inert() -> None:
    n = Notifier(NotifyConfig(), CollectorRegistry())
    assert not n.enabled
    n.submit([change("opened")])
    assert n.wait_idle(0.1)
    n.close()


# --- with the real collector and the real Alertmanager -------------------------------------


def test_collector_notifies_a_nan_step_end_to_end(tmp_path: Path, receiver: Receiver) -> None:
    notify = NotifyConfig(
        targets=[target(receiver.url())], group_wait=0.1, collector_url="http://collector.example:9400"
    )
    lc = start_collector(tmp_path / "trainmon.sqlite", notify=notify)
    try:
        run_start = event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 100}, run="e2e", seq=0)
        status, _ = lc.post(batch([run_start, *step_events(30, run="e2e", loss=lambda i: "NaN" if i == 25 else 4.0)]))
        assert status == 200
        msg = receiver.wait_delivered(1)[0]
        assert lc.collector.notifier is not None and lc.collector.notifier.wait_idle(10)
        assert msg.body["run"] == "e2e" and msg.body["collector_url"] == "http://collector.example:9400"
        nan = [a for r in receiver.delivered() for a in r.body["anomalies"] if a["kind"] == "nan_inf"]
        assert len(nan) == 1
        assert (nan[0]["rank"], nan[0]["severity"], nan[0]["status"]) == (0, "critical", "open")
        assert nan[0]["steps"]["first"] == 25 and nan[0]["message"] and nan[0]["hint"]
        _, text = lc.get("/metrics")
        assert f'trainmon_notifications_sent_total{{target="webhook"}} {len(receiver.delivered())}.0' in text.decode()
    finally:
        lc.stop()


def _parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alertmanager_binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: Receiver) -> Iterator[str]:
    binary = _alertmanager_binary()
    if binary is None:
        pytest.skip("Alertmanager binary not found (Debian package prometheus-alertmanager)")
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        f"""
route:
  receiver: test
  group_by: [run]
  group_wait: 100ms
  group_interval: 500ms
  repeat_interval: 1h
receivers:
  - name: test
    webhook_configs:
      - url: {receiver.url("/am")}
        send_resolved: true
"""
    )
    port = _free_port()
    log = (tmp_path / "alertmanager.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"alertmanager did not start: {(tmp_path / 'alertmanager.log').read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_real_alertmanager_receives_and_routes_the_anomaly(alertmanager: str, receiver: Receiver, make_notifier):
    n, registry = make_notifier(target(alertmanager, "alertmanager"))
    step_of(n, change("opened", "nan_inf", run="am-run", rank=2, severity="critical"))
    assert sent(registry, "alertmanager") == 1.0
    (firing,) = receiver.wait_delivered(1, "/am", timeout=20)
    assert firing.body["status"] == "firing"
    (alert,) = firing.body["alerts"]
    assert alert["labels"] == {
        "alertname": "TrainmonAnomaly",
        "run": "am-run",
        "kind": "nan_inf",
        "rank": "2",
        "severity": "critical",
    }
    assert alert["annotations"]["hint"].startswith("check the batch")
    assert "loss is NaN" in alert["annotations"]["summary"]
    step_of(n, change("resolved", "nan_inf", run="am-run", rank=2))
    resolved = receiver.wait_delivered(2, "/am", timeout=20)[-1]
    assert resolved.body["status"] == "resolved"
    assert resolved.body["alerts"][0]["labels"]["run"] == "am-run"


def test_after_a_restart_open_anomalies_are_not_paged_again_but_still_reposted(
    tmp_path: Path, receiver: Receiver
) -> None:
    notify = NotifyConfig(
        targets=[target(receiver.url("/hook")), target(receiver.url(""), "alertmanager")],
        group_wait=0.0,
        resend_interval=0.3,
    )
    db = tmp_path / "trainmon.sqlite"
    lc = start_collector(db, notify=notify)
    try:
        run_start = event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 100}, run="rs", seq=0)
        lc.post(batch([run_start, *step_events(30, run="rs", loss=lambda i: "NaN" if i == 25 else 4.0)]))
        receiver.wait_delivered(1, "/hook")
        started = receiver.wait_delivered(1, "/api/v2/alerts")[0].body[0]["startsAt"]
    finally:
        lc.stop()
    pages = len(receiver.delivered("/hook"))
    posts = len(receiver.delivered("/api/v2/alerts"))
    lc = start_collector(db, notify=notify)
    try:
        reposted = receiver.wait_delivered(posts + 1, "/api/v2/alerts")[-1].body
        (nan,) = [a for a in reposted if a["labels"]["kind"] == "nan_inf"]
        assert nan["labels"]["run"] == "rs" and "endsAt" not in nan
        # When it opened (stored time), not when the collector restarted.
        assert abs(_parse_time(nan["startsAt"]) - _parse_time(started)) < 1.0
        assert len(receiver.delivered("/hook")) == pages  # no second page for the same anomaly
    finally:
        lc.stop()


def test_a_deleted_runs_alerts_are_ended_at_alertmanager_and_never_reposted(tmp_path: Path, receiver: Receiver) -> None:
    """Deleting a run with an open anomaly: Alertmanager gets it ended once, then nothing more about that
    run; the webhook hears nothing (a person deleted it); another run's open alert is still re-posted."""
    notify = NotifyConfig(
        targets=[target(receiver.url("/hook")), target(receiver.url(""), "alertmanager")],
        group_wait=0.0,
        resend_interval=0.3,
    )
    lc = start_collector(tmp_path / "trainmon.sqlite", notify=notify)
    try:
        for run in ("gone", "kept"):
            start = event("run_start", {"world_size": 1}, run=run, stream=f"{run}-0", seq=0)
            steps = step_events(30, run=run, stream=f"{run}-0", loss=lambda i: "NaN" if i == 25 else 4.0)
            end = event("run_end", {"status": "failed", "step": 29}, run=run, stream=f"{run}-0", seq=31)
            lc.post(batch([start, *steps, end]))
        receiver.wait_delivered(2, "/hook")
        pages = len(receiver.delivered("/hook"))

        def about(run: str) -> list[dict]:
            return [a for r in receiver.delivered("/api/v2/alerts") for a in r.body if a["labels"]["run"] == run]

        deadline = time.monotonic() + 10
        while not about("gone") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert about("gone") and all("endsAt" not in a for a in about("gone"))  # open: re-posted
        req = urllib.request.Request(f"{lc.url}/v1/runs/gone", method="DELETE")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        while not any("endsAt" in a for a in about("gone")) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [a for a in about("gone") if "endsAt" in a]
        assert [a["labels"]["kind"] for a in ended] == ["nan_inf"]
        seen, kept = len(about("gone")), len(about("kept"))
        time.sleep(1.0)  # three resend intervals
        assert len(about("gone")) == seen  # never re-posted after its end
        assert len(about("kept")) > kept  # the other run's open alert still is
        assert len(receiver.delivered("/hook")) == pages
    finally:
        lc.stop()
