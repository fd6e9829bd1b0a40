"""The collector never freezes under load and always stops within its grace period.

Issue 15, item 0: under the ingest benchmark the collector froze for good. The writer thread held
the detection process's lock while it wrote a group to the child's stdin; the child was blocked
writing a large reply to its stdout; the reader thread, which should have drained that stdout,
waited for the same lock. Both pipes full, nobody moving, and SIGTERM could not end it either.
These tests recreate it the way it happened: large groups in, large replies out, faster than the
child drains, with the cores busy; then a collector whose child stops answering must still exit
on SIGTERM within its grace period, with every acknowledged event stored.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from tests.events import batch, event, step_events
from trainmon.monitor.collector.detection_process import DetectionProcess, parts
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage, steps
from trainmon.wire import Event

pytestmark = pytest.mark.slow


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Two processes spinning on the two cores, as on the shared machine where the freeze was seen."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _nan_group(run: str, ranks: int) -> list[tuple[Event, int]]:
    """Every rank of a fresh run reports a NaN: one finding per rank, so the reply is large too."""
    fields = {"step": 1, "loss": math.nan, "grad_norm": math.nan, "note": "x" * 200}
    return [(Event("step", run, r, "h", f"s{r}", 1, 1e9, fields), 0) for r in range(ranks)]


def test_large_groups_and_large_replies_never_freeze_the_pipes(busy_cores: None) -> None:
    """A sender holding a lock the callbacks need (the engine's, while it writes a rank's history)
    and a child whose replies outgrow the pipe: every call is still answered."""
    detection = DetectionProcess(DetectorsConfig())
    engine_lock = threading.Lock()
    answered: list[int] = []

    def done(found: list) -> None:
        with engine_lock:  # the engine stores findings under the lock its priming holds
            answered.append(len(found))

    history = [(Event("step", "primed", 0, "h", "s", i, 1e9 + i, {"step": i, "loss": 3.0}), 0) for i in range(2000)]

    def send() -> None:
        for g in range(40):
            detection.observe(parts(_nan_group(f"r{g}", 300)), done)
            with engine_lock:
                detection.feed_rank("primed", g, history)  # ~200 KB written while holding the lock

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        deadline = time.monotonic() + 90
        while len(answered) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(answered) == 40, f"{len(answered)} of 40 groups answered: the pipes froze"
        assert answered == [300] * 40  # each reply carried every rank's finding
    finally:
        detection.close(5)
    sender.join(5)
    assert not sender.is_alive()


def test_close_is_bounded_when_the_child_stops_answering() -> None:
    detection = DetectionProcess(DetectorsConfig())
    answers: list[list] = []
    os.kill(detection.pid, signal.SIGSTOP)
    detection.observe(parts(_nan_group("stopped", 3)), answers.append)
    t0 = time.monotonic()
    detection.close(2.0)
    assert time.monotonic() - t0 < 6
    assert answers == [[]]  # answered, with no findings
    assert not psutil.pid_exists(detection.pid) or psutil.Process(detection.pid).status() == psutil.STATUS_ZOMBIE
    late: list[list] = []
    detection.observe(parts(_nan_group("late", 1)), late.append)  # after close: answered at once, never blocks
    assert late == [[]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(
        url + "/v1/events", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # timed out or refused: not acknowledged


def _ended(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll ``condition`` until it holds: the cores are busy on purpose, so each step takes what it takes."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def test_sigterm_ends_a_loaded_collector_whose_detection_froze(tmp_path: Path, busy_cores: None) -> None:
    """The grace bounds the collector's own shutdown: the frozen detection is cut off by its deadline.
    What follows, the interpreter's exit (about 0.3 s of CPU), is not the collector's to bound and
    takes seconds of wall time on cores this busy: the exit is awaited, not timed."""
    grace = 6.0
    config = tmp_path / "collector.toml"
    config.write_text(f"shutdown_grace_seconds = {grace}\n")
    db = tmp_path / "store.sqlite"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "collector.log"
    collector = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainmon.monitor.cli",
            "serve",
            "--db",
            str(db),
            "--port",
            str(port),
            "--config",
            str(config),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"},
    )
    try:
        deadline = time.monotonic() + 60
        while _post(url, batch([event("run_start", {"world_size": 8}, run="load", seq=0)])) != 200:
            assert collector.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        acked: dict[int, set[int]] = {r: set() for r in range(8)}
        posting_since: dict[int, float | None] = dict.fromkeys(range(8))  # when a rank's request in flight began
        stop = threading.Event()

        def produce(rank: int) -> None:
            seq = 1
            while not stop.is_set():
                evs = step_events(
                    20, run="load", rank=rank, stream=f"r{rank}", start_seq=seq,
                    loss=lambda i, s=seq: "NaN" if (s + i) % 97 == 0 else 3.0,
                )  # fmt: skip
                for e in evs:
                    e["fields"]["step"] = e["seq"]
                posting_since[rank] = time.monotonic()
                if _post(url, batch(evs)) == 200:
                    acked[rank].update(e["seq"] for e in evs)
                posting_since[rank] = None
                seq += 20

        producers = [threading.Thread(target=produce, args=(r,), daemon=True) for r in range(8)]
        for p in producers:
            p.start()
        _wait_for(lambda: all(acked.values()), 60, "a batch of every rank acknowledged before the freeze")
        (child,) = psutil.Process(collector.pid).children()
        child.suspend()  # detection stops answering: acknowledgements stall, requests wait
        frozen = time.monotonic()

        def all_waiting() -> bool:
            return all(since is not None and since > frozen for since in posting_since.values())

        _wait_for(all_waiting, 60, "every rank's request waiting on the frozen detection")
        collector.send_signal(signal.SIGTERM)
        stop.set()  # the requests in flight stay; no new ones (the listener closes on SIGTERM anyway)
        _wait_for(lambda: _ended(child), grace + 3, "the frozen detection cut off within the grace")
        rc = collector.wait(60)  # a frozen collector never exits; this one only has to finish exiting
        for p in producers:
            p.join(10)
        assert rc == 0, log.read_text()
    finally:
        if collector.poll() is None:
            collector.kill()
    store = Storage(str(db))
    try:
        with store.connect() as conn:
            rows = conn.execute(select(steps.c.rank, steps.c.step).where(steps.c.run == "load")).all()
    finally:
        store.close()
    stored: dict[int, set[int]] = {r: set() for r in range(8)}
    for rank, step in rows:
        stored[rank].add(step)
    for rank in range(8):
        assert acked[rank] <= stored[rank], f"rank {rank}: acknowledged steps missing from storage"
