"""The trainer never waits more than a few seconds on any collector, however broken (issue 15, items 2-3).

Before: against a server that accepts TCP and never answers, ``close()`` took 17 s and left its sender
thread alive, and the trainer's own SIGTERM handler ran 17 s late; against one that trickles its answer
a byte every 3 s, every event was lost and nothing counted it; with the spool's disk full, one failed
send threw away every later batch even after the collector came back; retry delays grew to 30 s.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.conftest import start_collector
from tests.disks import fill, small_tmpfs
from trainmon.hooks.transport import _MAX_BACKOFF, Transport
from trainmon.monitor.store.storage import steps

ROOT = Path(__file__).resolve().parents[2]


def _step(i: int, run: str = "h") -> dict:
    return {
        "kind": "step",
        "run": run,
        "rank": 0,
        "host": "h",
        "stream": f"{run}-s",
        "time": time.time(),
        "fields": {"step": i, "loss": 2.0},
    }


class _LoopbackServer:
    """A TCP server on loopback that hands each connection it accepts to ``_accepted`` (on its thread)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        for c in self.conns:
            c.close()
        self.sock.close()


class _BadServer(_LoopbackServer):
    """Accepts and then never answers (``trickle=None``), or reads the request and answers one byte every
    ``trickle`` seconds."""

    def __init__(self, trickle: float | None = None) -> None:
        self.trickle = trickle
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        if self.trickle is not None:
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        answer = b'HTTP/1.1 200 OK\r\nContent-Length: 32\r\n\r\n{"accepted": 300, "duplicates":0}'
        try:
            conn.recv(1 << 20)
            for b in answer:
                if self._stop.wait(self.trickle):
                    return
                conn.sendall(bytes([b]))
        except OSError:
            return


@pytest.fixture
def hung() -> Iterator[_BadServer]:
    server = _BadServer()
    yield server
    server.close()


def _spooled_lines(spool: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in spool.glob("*.jsonl"))


def test_close_is_bounded_against_a_collector_that_never_answers(hung: _BadServer, tmp_path: Path) -> None:
    t = Transport(f"http://127.0.0.1:{hung.port}", spool_dir=tmp_path / "spool", timeout=5.0)
    for i in range(300):
        t.put(_step(i))
    time.sleep(0.7)  # the first send is in flight, stuck on the silent server
    t0 = time.monotonic()
    t.close(timeout=2.0)
    took = time.monotonic() - t0
    assert took < 3.5, f"close took {took:.1f} s"
    assert not t._thread.is_alive()
    assert t.sent == 0 and t.dropped == t.dropped_spool == 0
    assert _spooled_lines(tmp_path / "spool") == 300  # nothing acknowledged, everything kept


def test_a_trickling_collector_costs_a_timeout_not_the_events(tmp_path: Path) -> None:
    server = _BadServer(trickle=3.0)
    try:
        t = Transport(f"http://127.0.0.1:{server.port}", spool_dir=tmp_path / "spool", timeout=1.0)
        for i in range(300):
            t.put(_step(i))
        time.sleep(2.5)  # one request of 1 s in all, however slowly bytes arrive, then spooled
        assert t.spooled == 300
        t.put(_step(300))
        t.close(timeout=2.0)
    finally:
        server.close()
    assert _spooled_lines(tmp_path / "spool") == 301
    assert t.dropped == t.dropped_spool == 0


def test_backoff_is_capped_so_a_recovered_collector_is_found_quickly() -> None:
    assert _MAX_BACKOFF <= 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A tiny tmpfs, filled up: every write to it fails with ENOSPC."""
    with small_tmpfs(tmp_path / "full", "64k") as mount:
        fill(mount)
        yield mount


def test_a_full_spool_disk_and_a_collector_blip_lose_nothing(
    full_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = _free_port()
    with caplog.at_level(logging.WARNING, logger="trainmon.transport"):
        t = Transport(f"http://127.0.0.1:{port}", spool_dir=full_disk, timeout=2.0, flush_interval=0.1)
        for i in range(1000):  # the collector is down: the sends fail, the spool is full
            t.put(_step(i, run="full"))
            if i % 100 == 0:
                time.sleep(0.1)
        time.sleep(1.0)
        lc = start_collector(tmp_path / "db.sqlite", port=port)  # back, on the same port
        try:
            for i in range(1000, 2000):
                t.put(_step(i, run="full"))
                if i % 100 == 0:
                    time.sleep(0.05)
            t.close(timeout=15.0)
            with lc.collector.storage.connect() as conn:
                stored = conn.execute(select(func.count()).select_from(steps).where(steps.c.run == "full")).scalar()
        finally:
            lc.stop()
    assert stored == 2000
    assert t.dropped == t.dropped_spool == 0
    assert t.sent == 2000
    spool_warnings = [r for r in caplog.records if "cannot spool" in r.getMessage()]
    assert len(spool_warnings) == 1  # said once, not once per batch
    assert not [r for r in caplog.records if "sender failed" in r.getMessage()]  # no tracebacks


_TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    from trainmon import TrainMonitor

    if sys.argv[2] == "own-handler":
        def handler(signum, frame):
            print(f"handler {time.time():.3f}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, handler)
    mon = TrainMonitor("sig", collector=sys.argv[1], spool_dir=sys.argv[3], health_interval=0, heartbeat_interval=0)
    for i in range(50):
        mon.emit("step", {"step": i, "loss": 1.0})
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["own-handler", "default"])
def test_sigterm_is_not_delayed_by_a_hung_collector(hung: _BadServer, tmp_path: Path, mode: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAINER)
    spool = tmp_path / "spool"
    proc = subprocess.Popen(
        [sys.executable, str(script), f"http://127.0.0.1:{hung.port}", mode, str(spool)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the sender is stuck in a request to the silent server
        sent_at = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        took = time.time() - sent_at
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    if mode == "own-handler":
        handled_at = float(out.split()[1])
        assert handled_at - sent_at < 0.5, "the trainer's own SIGTERM handler was delayed"
        assert proc.returncode == 0
    else:
        assert proc.returncode == -signal.SIGTERM
    assert took < 2.0 + 2.0, f"the trainer took {took:.1f} s to stop"  # close_timeout, with a margin
    assert _spooled_lines(spool) >= 51  # the steps and run_end, kept for the next process


class _CutServer(_LoopbackServer):
    """Reads each request, sends the first bytes of a 200 answer, then closes, or trickles one more header
    byte every 50 ms (never a whole line) until the request's budget cuts the connection."""

    def __init__(self, prefix: bytes, then_close: bool) -> None:
        self.prefix, self.then_close = prefix, then_close
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(1 << 20)
                conn.sendall(self.prefix)
                while not self.then_close and not self._stop.wait(0.05):
                    conn.sendall(b"a")
            except OSError:
                return


@pytest.mark.parametrize(
    ("prefix", "then_close"),
    [
        (b"HTTP/1.1 200 OK\r\n", True),  # the collector (or a proxy) gone right after the status line
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n", True),
        (b"HTTP/1.1 200 OK\r\nx-trickle: ", False),  # a trickle cut by the budget mid-header
        (b"HTTP/1.1 200 OK\r\ncontent-length: 30\r\nx-trickle: ", False),
    ],
)
def test_an_answer_cut_after_its_status_line_is_no_acknowledgement(
    tmp_path: Path, prefix: bytes, then_close: bool
) -> None:
    """Issue 27: ``http.client`` reads a connection cut in the headers as a whole 200 with an empty body;
    the batch was counted as sent, never stored, never spooled, and no counter said so."""
    server = _CutServer(prefix, then_close)
    try:
        t = Transport(f"http://127.0.0.1:{server.port}", spool_dir=tmp_path / "spool", timeout=0.5)
        for i in range(10):
            t.put(_step(i))
        t.close(timeout=2.0)
    finally:
        server.close()
    assert t.sent == 0
    assert _spooled_lines(tmp_path / "spool") == 10
