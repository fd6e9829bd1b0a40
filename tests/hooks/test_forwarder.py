"""One request per node (issue 24, goal 4): the ranks of a node send through one forwarder.

Every test runs the ranks as processes of their own (a rank's transport, its policy and its spool, as
``TrainMonitor`` builds them) against a real collector on loopback, and pays no attention to how long
anything takes: ranks step at a pace, the assertions are on what the collector stored and counted.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.conftest import LiveCollector, start_collector
from trainmon.hooks.forwarder import blames_the_batch, forwarding
from trainmon.hooks.transport import Transport
from trainmon.monitor.store.storage import steps

ROOT = Path(__file__).resolve().parents[2]
RUN = "fwd"

# A rank: its transport (forwarding by $LOCAL_WORLD_SIZE, as under torchrun) with the run's findings asked
# for, a step every 50 ms for STEPS steps (a NaN loss from NAN_AT on), stopping at a boundary when its
# policy says so. It marks OUT/serving{rank} while it forwards for the node, counts the batches it handed
# over (``_HttpSink.send``: to the forwarder or, without one, to the collector) and reports in OUT/rank{rank}.json.
_RANK = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from trainmon.hooks import transport
    from trainmon.hooks.policy import StopPolicy, TrainingStopped

    url, rank, steps, nan_at, on_critical, out = sys.argv[1:]
    rank, steps, nan_at, out = int(rank), int(steps), int(nan_at), Path(out)
    sends = 0
    send = transport._HttpSink.send

    def counted(self, lines, deadline=float("inf")):
        global sends
        sends += 1
        return send(self, lines, deadline)

    transport._HttpSink.send = counted
    seen = []
    policy = StopPolicy("fwd", "stop" if on_critical == "stop" else seen.append)
    t = transport.Transport(url, spool_dir=out / f"spool{rank}", flush_interval=0.2, policy=policy)

    def event(kind, fields):
        return {"kind": kind, "run": "fwd", "rank": rank, "host": "node", "stream": f"fwd-{rank}",
                "time": time.time(), "fields": fields}

    t.put(event("run_start", {"world_size": 4}))
    stopped = None
    done = 0
    for i in range(steps):
        t.put(event("step", {"step": i, "loss": float("nan") if 0 <= nan_at <= i else 2.0 - 0.001 * i}))
        done = i + 1
        if t.serving:
            (out / f"serving{rank}").touch()
        time.sleep(0.05)
        try:
            policy.at_boundary(i)
        except TrainingStopped as exc:
            stopped = exc.finding.kind + " on rank " + str(exc.finding.rank)
            break
    t.close(timeout=10.0)
    report = {"steps": done, "sent": t.sent, "spooled": t.spooled, "dropped": t.dropped + t.dropped_spool,
              "sends": sends, "stopped": stopped}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    """
)


class _Node:
    """Rank processes of one node (one launch) started from a script in ``out``."""

    def __init__(self, url: str, out: Path) -> None:
        self.url, self.out = url, out
        self.script = out / "rank.py"
        self.script.write_text(_RANK)
        env = {k: v for k, v in os.environ.items() if k != "TRAINMON_FORWARD"}
        self.env = {**env, "PYTHONPATH": str(ROOT), "LOCAL_WORLD_SIZE": "4", "TRAINMON_LAUNCH_ID": uuid.uuid4().hex}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, rank: int, steps: int, nan_at: int = -1, on_critical: str = "record") -> None:
        args = [self.url, str(rank), str(steps), str(nan_at), on_critical, str(self.out)]
        self.procs[rank] = subprocess.Popen([sys.executable, str(self.script), *args], env=self.env)

    def wait_serving(self) -> int:
        """The rank that forwards for the node (waiting for one to take the role on)."""
        for _ in range(600):
            serving = [r for r in self.procs if (self.out / f"serving{r}").exists()]
            if serving:
                return serving[0]
            time.sleep(0.05)
        raise AssertionError("no rank became the node's forwarder")

    def reports(self) -> dict[int, dict[str, Any]]:
        for proc in self.procs.values():
            proc.wait(60)
        return {r: json.loads((self.out / f"rank{r}.json").read_text()) for r in self.procs if r in self.finished()}

    def finished(self) -> set[int]:
        return {r for r, p in self.procs.items() if p.returncode == 0}

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def node(live_collector: LiveCollector, tmp_path: Path) -> Iterator[_Node]:
    n = _Node(live_collector.url, tmp_path)
    yield n
    n.kill()


def _stored(live: LiveCollector) -> dict[tuple[int, int], int]:
    """Steps stored per (rank, attempt): a rank whose batch was stored twice shows as a second attempt."""
    with live.collector.storage.connect() as conn:
        rows = conn.execute(
            select(steps.c.rank, steps.c.attempt, func.count())
            .where(steps.c.run == RUN)
            .group_by(steps.c.rank, steps.c.attempt)
        ).all()
    return {(rank, attempt): n for rank, attempt, n in rows}


def _requests(live: LiveCollector) -> int:
    return int(live.collector.metrics.batches._value.get())


def test_a_nodes_ranks_share_requests_and_every_event_is_stored_once(
    node: _Node, live_collector: LiveCollector
) -> None:
    for rank in range(4):
        node.start(rank, steps=60)
    reports = node.reports()
    assert sorted(reports) == [0, 1, 2, 3]
    assert _stored(live_collector) == {(r, 0): 60 for r in range(4)}
    for report in reports.values():
        assert report["sent"] == 61 and report["spooled"] == report["dropped"] == 0  # the steps and run_start
    handed_over = sum(r["sends"] for r in reports.values())
    # Without the forwarder each batch is a request; with it, the node's batches of one tick are one.
    assert _requests(live_collector) < handed_over / 2, (_requests(live_collector), handed_over)


def test_the_forwarders_death_loses_nothing_and_another_rank_takes_over(
    node: _Node, live_collector: LiveCollector
) -> None:
    for rank in range(4):
        node.start(rank, steps=100)
    forwarder = node.wait_serving()
    time.sleep(1.0)  # the node's batches go through it for a while
    (node.out / f"serving{forwarder}").unlink()
    os.kill(node.procs[forwarder].pid, signal.SIGKILL)
    reports = node.reports()
    survivors = sorted(set(range(4)) - {forwarder})
    assert sorted(reports) == survivors
    stored = _stored(live_collector)
    for rank in survivors:
        assert stored[(rank, 0)] == 100 and (rank, 1) not in stored  # each step once
        assert reports[rank]["sent"] == 101 and reports[rank]["dropped"] == 0
        assert reports[rank]["spooled"] == 0  # not stalled: a lost forwarder is a direct post, not an outage
    assert [r for r in survivors if (node.out / f"serving{r}").exists()], "no rank took the forwarder's place"


def test_a_finding_reaches_a_rank_that_does_not_forward(node: _Node, live_collector: LiveCollector) -> None:
    node.start(0, steps=200)
    assert node.wait_serving() == 0
    for rank in (1, 2):
        node.start(rank, steps=200)
    node.start(3, steps=200, nan_at=10, on_critical="stop")
    reports = node.reports()
    assert not (node.out / "serving3").exists()
    assert reports[3]["stopped"] == "nan_inf on rank 3"
    assert reports[3]["steps"] < 200  # stopped at a boundary, long before the end
    assert _requests(live_collector) < sum(r["sends"] for r in reports.values())  # its answers were relayed


def test_with_the_collector_down_each_rank_spools_as_it_would_alone(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = _Node(f"http://127.0.0.1:{port}", tmp_path)
    try:
        for rank in range(4):
            node.start(rank, steps=20)
        node.wait_serving()
        reports = node.reports()
    finally:
        node.kill()
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, report in reports.items():
        assert report["sent"] == 0 and report["spooled"] == 21 and report["dropped"] == 0
        lines = [json.loads(x) for p in (tmp_path / f"spool{rank}").glob("*.jsonl") for x in p.read_text().splitlines()]
        assert sorted(e["seq"] for e in lines) == list(range(21))
    # Back up: the next process replays each rank's spool, through the forwarder or not.
    live = start_collector(tmp_path / "db.sqlite", port=port)
    try:
        for rank in range(4):
            t = Transport(live.url, spool_dir=tmp_path / f"spool{rank}", forward=True)
            t.close(timeout=10.0)
        assert _stored(live) == {(r, 0): 20 for r in range(4)}
    finally:
        live.stop()


def test_a_collector_that_never_answers_costs_each_rank_a_timeout_not_its_events(tmp_path: Path) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, never answered
    node = _Node(f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path)
    try:
        for rank in range(4):
            node.start(rank, steps=20)
        reports = node.reports()
    finally:
        node.kill()
        silent.close()
    assert sorted(reports) == [0, 1, 2, 3]  # every rank closed (bounded), none waited on the forwarder for ever
    assert all(r["sent"] == 0 and r["spooled"] == 21 and r["dropped"] == 0 for r in reports.values())


def test_the_setting() -> None:
    linux = sys.platform.startswith("linux")
    assert forwarding(None, {"LOCAL_WORLD_SIZE": "8"}) == linux
    assert not forwarding(None, {"LOCAL_WORLD_SIZE": "1"})
    assert not forwarding(None, {})  # a single rank: exactly as before
    assert not forwarding(None, {"LOCAL_WORLD_SIZE": "8", "TRAINMON_FORWARD": "0"})
    assert not forwarding(False, {"LOCAL_WORLD_SIZE": "8", "TRAINMON_FORWARD": "1"})  # the argument wins
    assert forwarding(None, {"TRAINMON_FORWARD": "1"}) == linux
    with pytest.raises(ValueError, match=r"TRAINMON_FORWARD: 1 .* or 0, got 'yes'"):
        forwarding(None, {"TRAINMON_FORWARD": "yes"})


def test_a_refusal_that_blames_the_batch_is_told_apart_from_one_that_does_not() -> None:
    assert blames_the_batch(413) and blames_the_batch(422) and blames_the_batch(400)
    assert not any(blames_the_batch(s) for s in (200, 401, 403, 408, 429, 500, 503))


def test_train_monitor_takes_the_setting(
    live_collector: LiveCollector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainmon.hooks import TrainMonitor

    def monitor(name: str, forward: bool | None = None) -> TrainMonitor:
        quiet = {"health_interval": 0, "heartbeat_interval": 0}
        return TrainMonitor("tm", live_collector.url, spool_dir=tmp_path / name, forward=forward, **quiet)

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TRAINMON_FORWARD", "maybe")
    with pytest.raises(ValueError, match="TRAINMON_FORWARD"):
        monitor("bad")
    monkeypatch.setenv("TRAINMON_FORWARD", "0")
    alone = monitor("alone")
    assert alone.transport._sink is not None and alone.transport._sink.phase is None  # posts itself, as before
    pair = [monitor("a", forward=True), monitor("b", forward=True)]  # the argument wins over the environment
    for mon in [alone, *pair]:
        mon.emit("step", {"step": 0, "loss": 1.0})
        assert mon.transport.flush()
    assert sorted(mon.transport.serving for mon in pair) == [False, True]  # one forwards for both
    for mon in [alone, *pair]:
        mon.close()
    assert [(mon.transport.sent, mon.transport.spooled) for mon in [alone, *pair]] == [(2, 0)] * 3  # the step, run_end
