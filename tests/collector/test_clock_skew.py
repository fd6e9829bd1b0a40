"""Trainer clocks off the collector's (issue 27, part 4): liveness, ages and hang timeouts are measured on
the collector's clock, durations within a rank on the rank's own, and a skewed host is a ``node_health``
note. A real collector on loopback; the ranks post at real pace with their clocks an hour off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event
from trainmon.clock import ClockOffset, aligned
from trainmon.monitor.analysis.live_view import run_status
from trainmon.monitor.analysis.postmortem import summarize
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.hang import HangConfig
from trainmon.monitor.detectors.node_health import NodeHealthConfig
from trainmon.monitor.store.queries import stream_rows
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

HOUR = 3600.0
STEP = 0.2  # seconds between steps: real pace
# host -> (rank, seconds its clock is off the collector's: negative is behind)
HOSTS = {"good-node": (0, 0.0), "behind-node": (1, -HOUR), "ahead-node": (2, HOUR)}


# -- the offset estimate ---------------------------------------------------------------------------


def test_the_offset_is_the_least_arrival_minus_sent() -> None:
    clock = ClockOffset()
    assert clock.offset is None
    for sent, latency in ((100.0, 0.30), (101.0, 0.02), (102.0, 0.50)):
        clock.add(sent - HOUR, sent + latency)  # a clock an hour behind; latency only adds
    assert clock.offset == pytest.approx(HOUR + 0.02)


def test_a_stepped_clock_is_followed_within_two_windows() -> None:
    clock = ClockOffset(window=10.0)
    for t in range(0, 30):
        clock.add(t - HOUR, t + 0.01)
    assert clock.offset == pytest.approx(HOUR + 0.01)
    for t in range(30, 60):  # NTP fixed the clock: the offset grows back to ~0, which a plain minimum never sees
        clock.add(t, t + 0.01)
    assert clock.offset == pytest.approx(0.01)


def test_a_clock_stepped_ahead_is_followed_at_once() -> None:
    clock = ClockOffset(window=10.0)
    clock.add(0.0, 0.01)
    clock.add(1.0 + HOUR, 1.01)
    assert clock.offset == pytest.approx(-HOUR + 0.01)


def test_a_stored_estimate_holds_until_new_arrivals_replace_it() -> None:
    clock = ClockOffset(known=HOUR, window=10.0)
    assert clock.offset == HOUR
    clock.add(0.0, HOUR + 5.0)  # a replayed backlog: five seconds late
    assert clock.offset == HOUR
    clock.add(20.0, 20.0 + HOUR + 0.01)
    clock.add(31.0, 31.0 + HOUR + 0.01)
    assert clock.offset == pytest.approx(HOUR + 0.01)


def test_small_offsets_are_latency_and_leave_times_alone() -> None:
    assert aligned(100.0, None) == 100.0
    assert aligned(100.0, 0.4) == 100.0
    assert aligned(100.0, -HOUR) == 100.0 - HOUR


# -- ingest ------------------------------------------------------------------------------------------


def test_ingest_stores_the_offset_and_the_stream_times_on_the_collector_clock() -> None:
    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    now = time.time()
    events = [Event("run_start", "r", 0, "h", "s", 0, now - HOUR, {"world_size": 1})]
    events += [Event("step", "r", 0, "h", "s", i + 1, now - HOUR + i, {"step": i}) for i in range(3)]
    ingestor.ingest(events, arrival=now + 2.05)
    assert [ev.clock_offset for ev in events] == [pytest.approx(HOUR + 0.05)] * 4
    with storage.connect() as conn:
        (stream,) = stream_rows(conn, "r")
    assert stream["clock_offset"] == pytest.approx(HOUR + 0.05)
    assert stream["started_at"] == pytest.approx(now + 0.05)
    assert stream["last_time"] == pytest.approx(now + 2.05)
    assert storage.run_ids() == ["r"]
    # a restarted collector goes on from the stored estimate
    again = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    late = Event("step", "r", 0, "h", "s", 4, now - HOUR + 3, {"step": 3})
    again.ingest([late], arrival=now + 30.0)  # a retried batch, late: the stored minimum stands
    assert late.clock_offset == pytest.approx(HOUR + 0.05)


def test_events_that_did_not_arrive_live_keep_their_times() -> None:
    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    ev = Event("step", "r", 0, "h", "s", 1, 1000.0, {"step": 0})
    ingestor.ingest([ev])
    assert ev.clock_offset is None
    with storage.connect() as conn:
        (stream,) = stream_rows(conn, "r")
    assert (stream["clock_offset"], stream["last_time"]) == (None, 1000.0)


# -- a live collector ----------------------------------------------------------------------------------


def _collector(tmp_path: Path) -> LiveCollector:
    return start_collector(
        tmp_path / "db.sqlite",
        detectors=DetectorsConfig(
            hang=HangConfig(min_timeout=2.0, first_step_timeout=3.0),
            node_health=NodeHealthConfig(skew_sustain=1.0),
        ),
    )


class Ranks:
    """Ranks of one run posting one batch per event, each stamping events with its own clock."""

    def __init__(self, lc: LiveCollector, run: str, hosts: dict[str, tuple[int, float]]) -> None:
        self.lc, self.run, self.hosts = lc, run, hosts
        self.seq = dict.fromkeys(hosts, 0)
        self.step = dict.fromkeys(hosts, -1)

    def post(self, host: str, kind: str, fields: dict) -> None:
        rank, skew = self.hosts[host]
        self.seq[host] += 1
        ev = event(kind, fields, run=self.run, rank=rank, stream=f"s-{host}", seq=self.seq[host], t=time.time() + skew)
        ev["host"] = host
        status, body = self.lc.post(batch([ev]))
        assert status == 200, body

    def start(self) -> None:
        for host, (_, _) in self.hosts.items():
            self.post(host, "run_start", {"world_size": len(self.hosts), "planned_steps": 10_000})

    def steps(self, n: int, hosts: list[str] | None = None) -> None:
        for _ in range(n):
            time.sleep(STEP)
            for host in hosts or list(self.hosts):
                self.step[host] += 1
                self.post(host, "step", {"step": self.step[host], "loss": 2.0, "tokens": 512, "step_time": STEP})

    def end(self) -> None:
        for host in self.hosts:
            self.post(host, "run_end", {"status": "finished", "step": self.step[host]})

    def anomalies(self, kind: str) -> list[dict]:
        return [a for a in self.lc.get_json(f"/v1/runs/{self.run}/anomalies") if a["kind"] == kind]


def test_clocks_an_hour_off_give_no_hang_no_stretched_run_true_ages_and_a_skew_note(tmp_path: Path) -> None:
    lc = _collector(tmp_path)
    try:
        ranks = Ranks(lc, "skewed", HOSTS)
        started = time.time()
        ranks.start()
        ranks.steps(12)
        (row,) = lc.get_json("/v1/runs")
        now = time.time()
        assert started - 1 <= row["created_at"] <= now and now - 2 <= row["updated_at"] <= now + 0.5, row
        status = run_status(lc.collector.storage, "skewed")
        assert status["age_seconds"] < 2, status
        assert all(now - 2 <= r["last_seen"] <= now + 0.5 for r in status["ranks"]), status["ranks"]
        ranks.steps(8)
        ranks.end()
        wall = time.time() - started
        assert ranks.anomalies("hang") == []
        notes = ranks.anomalies("node_health")
        assert sorted(a["rank"] for a in notes) == [1, 2], notes
        by_rank = {a["rank"]: a["message"] for a in notes}
        assert by_rank[1].startswith("behind-node: clock 3600.") and "behind the collector's" in by_rank[1]
        assert by_rank[2].startswith("ahead-node: clock 3600.") and "ahead of the collector's" in by_rank[2]
        summary = summarize(lc.collector.storage, "skewed")
        assert summary["duration_seconds"] == pytest.approx(wall, abs=1.5)
        assert summary["goodput"]["wall_seconds"] <= wall + 1.5
        assert summary["goodput"]["fraction"] > 0.5, summary["goodput"]
        assert all(started - 1 <= a["started_at"] <= a["ended_at"] <= time.time() for a in summary["attempts_detail"])
    finally:
        lc.stop()


def test_a_clean_run_has_no_skew_note(tmp_path: Path) -> None:
    lc = _collector(tmp_path)
    try:
        ranks = Ranks(lc, "clean", {"node-a": (0, 0.0), "node-b": (1, 0.0)})
        ranks.start()
        ranks.steps(10)
        ranks.end()
        assert ranks.anomalies("node_health") == []
        with lc.collector.storage.connect() as conn:
            assert all(abs(s["clock_offset"]) < 0.5 for s in stream_rows(conn, "clean"))
    finally:
        lc.stop()


@pytest.mark.parametrize("skew", [HOUR, -HOUR])
def test_a_skewed_rank_that_goes_silent_is_hung(tmp_path: Path, skew: float) -> None:
    """Silence is measured on arrival: a clock an hour ahead no longer hides a hang for an hour."""
    lc = _collector(tmp_path)
    try:
        ranks = Ranks(lc, "quiet", {"node-a": (0, 0.0), "skewed-node": (1, skew)})
        ranks.start()
        ranks.steps(10)
        ranks.steps(35, hosts=["node-a"])  # the skewed rank stops stepping for 7 s: past its 4 s timeout
        hung = ranks.anomalies("hang")
        assert [a["rank"] for a in hung] == [1], hung
        assert "skewed-node" in hung[0]["message"]
        assert float(hung[0]["message"].split(" for ")[1].split(" s")[0]) < 10  # seconds, not an hour
    finally:
        lc.stop()


# -- a backlog sent now (a spool replayed after an outage) -----------------------------------------------


def test_a_backlog_sent_now_says_nothing_false_about_the_clock() -> None:
    """Events two hours old, sent now (a spool replayed after the collector was down for the stream's
    whole life): the producer's send time is the sample, so the offset is latency, not two hours."""
    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    now = time.time()
    events = [Event("step", "r", 0, "h", "s", i, now - 2 * HOUR + i, {"step": i}) for i in range(3)]
    ingestor.ingest(events, arrival=now, sent=now - 0.02)
    assert [ev.clock_offset for ev in events] == [pytest.approx(0.02)] * 3
    with storage.connect() as conn:
        (stream,) = stream_rows(conn, "r")
    assert stream["last_time"] == pytest.approx(now - 2 * HOUR + 2)  # its own times: the clock is right


def test_the_transport_says_when_it_sent_and_a_replayed_backlog_gets_no_skew_note(tmp_path: Path) -> None:
    from trainmon.hooks.transport import Transport

    lc = _collector(tmp_path)
    try:
        transport = Transport(lc.url, spool_dir=tmp_path / "spool", flush_interval=0.05)
        old = time.time() - 2 * HOUR  # a right clock; the events were spooled two hours ago
        ranks = Ranks(lc, "replayed", {"node-a": (0, 0.0)})
        for i, kind in enumerate(["run_start", *["step"] * 40]):
            fields = {"world_size": 1} if kind == "run_start" else {"step": i - 1, "loss": 2.0, "step_time": 0.2}
            ev = event(kind, fields, run="replayed", stream="s-replay", t=old + 5.0 * i)
            del ev["seq"]  # numbered by the transport
            transport.put(ev)
        assert transport.flush(timeout=10)
        transport.close()
        with lc.collector.storage.connect() as conn:
            (stream,) = stream_rows(conn, "replayed")
        assert abs(stream["clock_offset"]) < 1.0, stream
        assert ranks.anomalies("node_health") == []
    finally:
        lc.stop()


def test_an_exported_skewed_stream_keeps_its_start_and_end_among_its_own_times() -> None:
    """The store keeps a stream's start and end on the collector's clock; the export gives them back on
    the producer's, so a file read back has no run that starts an hour after its steps."""
    from trainmon.monitor.store.export import run_events

    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    now = time.time()
    t0 = now - HOUR  # the producer's clock: an hour behind
    events = [Event("run_start", "r", 0, "h", "s", 0, t0, {"world_size": 1})]
    events += [Event("step", "r", 0, "h", "s", i + 1, t0 + i, {"step": i, "loss": 2.0}) for i in range(5)]
    events.append(Event("run_end", "r", 0, "h", "s", 6, t0 + 5, {"status": "finished", "step": 4}))
    ingestor.ingest(events, arrival=now + 5.02, sent=t0 + 5)
    with storage.connect() as conn:
        exported = list(run_events(conn, "r"))
    assert [e["kind"] for e in exported] == ["run_start", *["step"] * 5, "run_end"]
    assert [e["time"] for e in exported] == pytest.approx([t0, *(t0 + i for i in range(5)), t0 + 5])
