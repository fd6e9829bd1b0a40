"""Limits on what unauthenticated loopback clients can make the collector hold (issue 15, item 6).

Before: 120 stalled uploads took the collector from 102 MB to 1 GB and held it; slow-header and
slow-body connections were never timed out; 5,000 runs were all kept in memory and exported; one
request creating 5,000 new runs stalled all ingest for 16 s. Every refusal is counted in /metrics.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event, step_events


@pytest.fixture
def strict(tmp_path: Path) -> Iterator[LiveCollector]:
    lc = start_collector(
        tmp_path / "db.sqlite",
        header_timeout_seconds=1.0,
        body_timeout_seconds=1.5,
        max_inflight_bytes=1 << 20,
        max_live_runs=3,
        max_ranks_per_run=4,
    )
    yield lc
    lc.stop()


def _refused(lc: LiveCollector, reason: str) -> float:
    _, exposition = lc.get("/metrics")
    for line in exposition.decode().splitlines():
        if line.startswith(f'trainmon_ingest_rejected_batches_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no counter for {reason}")


def _connect(lc: LiveCollector) -> socket.socket:
    host, port = lc.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _head(length: int) -> bytes:
    return (
        f"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_slow_headers_are_cut_off(strict: LiveCollector) -> None:
    with _connect(strict) as sock:
        sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        t0 = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the collector
        assert time.monotonic() - t0 < 5
    assert _refused(strict, "slow_headers") == 1


def test_a_slow_body_gets_408(strict: LiveCollector) -> None:
    with _connect(strict) as sock:
        sock.sendall(_head(1000) + b'{"version": 1')
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408")
    assert _refused(strict, "slow_body") == 1


def test_stalled_uploads_are_bounded_in_bytes(strict: LiveCollector) -> None:
    socks = []
    try:
        for _ in range(3):  # three uploads of 600 KB each that never finish: 1.8 MB against a 1 MiB budget
            s = _connect(strict)
            s.sendall(_head(700_000) + b" " * 600_000)
            socks.append(s)
            time.sleep(0.1)
        replies = []
        for s in socks:
            s.settimeout(5)
            replies.append(s.recv(4096))
        assert any(r.startswith(b"HTTP/1.1 503") for r in replies)  # refused once past the budget
        assert all(r.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) for r in replies)  # the rest timed out
    finally:
        for s in socks:
            s.close()
    assert strict.post(batch(step_events(3, run="after")))[0] == 200  # the budget is free again


def test_runs_and_ranks_are_capped_with_429(strict: LiveCollector) -> None:
    for run in ("a", "b", "c"):
        assert strict.post(batch(step_events(2, run=run, stream=f"s-{run}")))[0] == 200
    status, body = strict.post(batch(step_events(2, run="d", stream="s-d")))
    assert status == 429 and "max_live_runs" in body["error"]
    assert strict.post(batch(step_events(2, run="a", stream="s-a", start_seq=10)))[0] == 200  # a live run goes on
    ranks = [event("step", {"step": 1}, run="b", rank=r, stream=f"b{r}", seq=1) for r in range(5)]
    status, body = strict.post(batch(ranks))
    assert status == 429 and "at most 4" in body["error"]
    assert _refused(strict, "limit") == 2
    _, exposition = strict.get("/metrics")
    assert 'trainmon_collector_limit{limit="max_live_runs"} 3.0' in exposition.decode()


def test_a_batch_of_thousands_of_new_runs_does_not_stall_other_producers(tmp_path: Path) -> None:
    lc = start_collector(tmp_path / "db.sqlite")
    try:
        flood = [event("step", {"step": 1}, run=f"r{i}", stream=f"f{i}", seq=1) for i in range(5000)]
        latencies: list[float] = []

        def producer() -> None:
            for k in range(20):
                t0 = time.monotonic()
                assert lc.post(batch(step_events(5, run="steady", stream="st", start_seq=1 + 5 * k)))[0] == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.05)

        steady = threading.Thread(target=producer)
        steady.start()
        status, body = lc.post(batch(flood))
        steady.join(60)
        assert status == 413 and "max_runs_per_batch" in body["error"]
        assert max(latencies) < 2.0, f"another producer waited {max(latencies):.1f} s"
        assert len(lc.get_json("/v1/runs")) == 1
    finally:
        lc.stop()


def test_a_batch_of_more_runs_than_one_batch_may_hold_is_sent_again_in_halves_and_stored(tmp_path: Path) -> None:
    """One request holding the events of 40 runs (a node's forwarder posts every rank's batch as one: 40 small
    jobs on one node) is refused 413, not 429: the same request can never be taken, its halves can. The
    transport splits it and every run's events are stored; answered 429, it was retried whole forever."""
    from trainmon.hooks.transport import Transport

    lc = start_collector(tmp_path / "db.sqlite", max_runs_per_batch=16)
    try:
        status, body = lc.post(
            batch([event("step", {"step": 0}, run=f"job{i}", stream=f"s{i}", seq=1) for i in range(40)])
        )
        assert status == 413 and "max_runs_per_batch" in body["error"]
        assert _refused(lc, "too_large") == 1
        transport = Transport(lc.url, spool_dir=tmp_path / "spool", flush_interval=0.05)
        for i in range(40):
            ev = event("step", {"step": 1, "loss": 2.0}, run=f"job{i}", stream=f"t{i}")
            del ev["seq"]  # numbered by the transport
            transport.put(ev)
        assert transport.flush(timeout=20)
        transport.close()
        assert transport.rejected == 0
        assert len(lc.get_json("/v1/runs")) == 40
    finally:
        lc.stop()
