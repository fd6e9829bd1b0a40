"""A web page in the user's browser must not reach the loopback collector (issue 15, items 7-8).

Before: a valid batch sent as ``text/plain`` with ``Origin: http://evil.example`` (what any page can
send without a CORS preflight) was stored, and ``Host: evil.example`` (a DNS name rebound to
127.0.0.1) could read ``/v1/runs``. A 1-character token was accepted.
"""

from __future__ import annotations

import http.client
import json

import pytest

from tests.conftest import LiveCollector
from tests.events import batch, step_events
from trainmon.monitor.config import CollectorConfig, ConfigError
from trainmon.monitor.web.server import check_bind


def _request(
    lc: LiveCollector, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, dict]:
    host, port = lc.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _stored_runs(lc: LiveCollector) -> set[str]:
    return {r["run"] for r in lc.get_json("/v1/runs")}


BODY = json.dumps(batch(step_events(3, run="web"))).encode()


def test_a_cross_site_text_plain_post_is_refused(live_collector: LiveCollector) -> None:
    status, body = _request(
        live_collector, "POST", "/v1/events", BODY, {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    )
    assert status == 403 and "Origin" in body["error"]
    status, body = _request(live_collector, "POST", "/v1/events", BODY, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in body["error"]
    status, _ = _request(
        live_collector, "POST", "/v1/events", BODY, {"Content-Type": "application/json", "Origin": "null"}
    )
    assert status == 403
    assert "web" not in _stored_runs(live_collector)
    _, exposition = live_collector.get("/metrics")
    assert 'trainmon_ingest_rejected_batches_total{reason="origin"} 2.0' in exposition.decode()
    assert 'trainmon_ingest_rejected_batches_total{reason="content_type"} 1.0' in exposition.decode()


def test_a_rebound_host_name_cannot_read_or_write(live_collector: LiveCollector) -> None:
    assert live_collector.post(batch(step_events(3, run="mine")))[0] == 200
    status, body = _request(live_collector, "GET", "/v1/runs", None, {"Host": "evil.example"})
    assert status == 403 and "Host" in body["error"]
    status, _ = _request(
        live_collector, "POST", "/v1/events", BODY, {"Host": "evil.example:9400", "Content-Type": "application/json"}
    )
    assert status == 403
    assert "web" not in _stored_runs(live_collector)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "LOCALHOST"])
def test_loopback_names_and_same_origin_pages_still_work(live_collector: LiveCollector, host: str) -> None:
    port = live_collector.url.rsplit(":", 1)[1]
    status, _ = _request(live_collector, "GET", "/v1/runs", None, {"Host": f"{host}:{port}"})
    assert status == 200
    status, body = _request(
        live_collector,
        "POST",
        "/v1/events",
        BODY,
        {
            "Host": f"{host}:{port}",
            "Origin": f"http://{host}:{port}",
            "Content-Type": "application/json; charset=utf-8",
        },
    )
    assert status == 200, body


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        check_bind(CollectorConfig(host="0.0.0.0", token="x"))
    check_bind(CollectorConfig(host="0.0.0.0", token="a" * 16))
