"""TrainMonitor and its transport against a real collector: nothing lost, nothing doubled."""

from __future__ import annotations

import http.server
import itertools
import json
import math
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from tests.conftest import start_collector
from trainmon.hooks import TrainMonitor
from trainmon.hooks.transport import Transport
from trainmon.monitor.store.replay import step_fields
from trainmon.monitor.store.storage import steps, streams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_loop(mon: TrainMonitor, n_steps: int, start: int = 0, between=None) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon.watch(model, opt)
    mon.start(planned_steps=start + n_steps)
    losses = []
    for step in range(start, start + n_steps):
        with mon.phase("data"):
            x = torch.randn(32, 8)
            y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss, tokens=32)
        losses.append(loss.item())
        if between is not None:
            between(step)
    return losses


def _stored_steps(lc) -> list[tuple[int, int, float]]:
    with lc.collector.storage.connect() as conn:
        return [tuple(r) for r in conn.execute(select(steps.c.attempt, steps.c.step, steps.c.loss).order_by("step"))]


def test_every_signal_of_a_plain_loop_arrives(live_collector, tmp_path: Path) -> None:
    mon = TrainMonitor("plain", collector=live_collector.url, spool_dir=tmp_path / "spool", flush_interval=0.05)
    losses = _tiny_loop(mon, 20)
    mon.close()
    with live_collector.collector.storage.connect() as conn:
        rows = conn.execute(select(steps).order_by(steps.c.step)).all()
        end = conn.execute(select(streams.c.end_status, streams.c.dropped_events)).one()
    assert [r.step for r in rows] == list(range(20))
    assert [r.loss for r in rows] == pytest.approx(losses)
    for r in rows:
        assert r.grad_norm > 0 and r.grad_norm_clipped <= 0.5 + 1e-6 and step_fields(r)["lr"] == [1e-2]
        assert r.tokens == 32 and r.step_time > 0 and r.phase_data > 0 and r.phase_other >= 0
    assert tuple(end) == ("finished", 0)


def test_clip_wrapper_matches_torch_exactly(tmp_path: Path) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 3))
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 10
        return m

    theirs, ours = model(), model()
    reference = {n: p.grad.norm().item() for n, p in ours.named_parameters()}
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("clip", collector=f"file://{path}", detail_every=1, health_interval=0, heartbeat_interval=0)
    mon.watch(ours)
    returned = mon.clip_grad_norm_(ours.parameters(), 1.0)
    assert torch.equal(returned, expected)  # the same total norm ...
    for a, b in zip(theirs.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # ... and bit-identical clipped gradients
    mon.step_end(0)
    mon.close()
    (step,) = [json.loads(x)["fields"] for x in path.read_text().splitlines() if '"kind":"step"' in x]
    actual_post = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours.parameters()])).item()
    assert step["grad_norm"] == expected.item() > 1.0
    assert step["grad_norm_clipped"] == pytest.approx(actual_post, rel=1e-6)
    assert step["clip_coef"] == (1.0 / (expected + 1e-6)).item()  # torch's float32 arithmetic, exactly
    assert step["layer_grad_norms"] == pytest.approx(reference, rel=1e-6)  # names from watch()


def test_file_mode_writes_wire_format_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mon = TrainMonitor("offline", collector=f"file://{path}")
    _tiny_loop(mon, 5)
    mon.step_end(5, loss=float("nan"))
    mon.close()
    every = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["seq"] for e in every] == list(range(len(every)))
    (health,) = [e for e in every if e["kind"] == "health"]  # sampled once at start
    assert health["fields"]["rss_bytes"] > 0 and health["fields"]["host_mem_total_bytes"] > 0
    lines = [e for e in every if e["kind"] not in ("health", "heartbeat")]
    assert [e["kind"] for e in lines] == ["run_start", *["step"] * 6, "run_end"]
    assert lines[6]["fields"]["loss"] == "NaN"  # strict JSON on disk


def test_collector_down_then_up_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    lc = start_collector(tmp_path / "db.sqlite", port=port)
    holder = {"lc": lc}

    def chaos(step: int) -> None:
        time.sleep(0.01)
        if step == 10:  # the collector dies mid-run ...
            holder["lc"].server.server.should_exit = True
            holder["lc"].server.thread.join(10)
        if step == 30:  # ... and comes back on the same port and store
            holder["lc"].collector.close()
            holder["lc"] = start_collector(tmp_path / "db.sqlite", port=port)

    mon = TrainMonitor("chaos", collector=url, spool_dir=tmp_path / "spool", flush_interval=0.02)
    mon.transport._sink._timeout = 1.0
    _tiny_loop(mon, 50, between=chaos)
    mon.close()
    stored = _stored_steps(holder["lc"])
    assert [s for _, s, _ in stored] == list(range(50))  # complete, in order, no duplicates
    assert all(a == 0 for a, _, _ in stored)
    assert mon.transport.dropped == 0 and mon.transport.dropped_spool == 0
    assert mon.transport.spooled > 0  # the outage really happened
    assert list((tmp_path / "spool").glob("*.jsonl")) == []
    holder["lc"].stop()


def test_spool_left_by_a_dead_process_is_replayed_by_the_next(tmp_path: Path) -> None:
    port = _free_port()
    dead = TrainMonitor("crash", collector=f"http://127.0.0.1:{port}", spool_dir=tmp_path / "spool")
    dead.transport._sink._timeout = 0.5
    _tiny_loop(dead, 10)
    dead.transport.close()  # nothing listening: all of it goes to the spool
    segments = list((tmp_path / "spool").glob("*.jsonl"))
    assert segments
    # a torn write at the end of a segment (the process was killed mid-line) is skipped
    with open(segments[-1], "a") as f:
        f.write('{"kind":"step","run":"cra')
    lc = start_collector(tmp_path / "db.sqlite", port=port)
    try:
        again = TrainMonitor("crash", collector=lc.url, spool_dir=tmp_path / "spool", flush_interval=0.05)
        _tiny_loop(again, 5, start=10)
        again.close()
        stored = _stored_steps(lc)
        assert [(a, s) for a, s, _ in stored] == [(0, s) for s in range(10)] + [(1, s) for s in range(10, 15)]
    finally:
        lc.stop()


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    port = _free_port()  # nobody listens; the sender is slow to drain
    t = Transport(f"http://127.0.0.1:{port}", spool_dir=tmp_path / "spool", queue_size=100, flush_interval=60)
    started = time.perf_counter()
    accepted = sum(t.put({"kind": "heartbeat", "i": i}) for i in range(1000))
    elapsed = time.perf_counter() - started
    assert accepted == 100 and t.dropped == 900
    assert elapsed < 0.5  # 1000 puts; a blocking put would wait for the network
    t.close(timeout=5)


def test_nan_loss_tensor_is_sent_as_nan(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("nan", collector=f"file://{path}")
    mon.step_end(0, loss=torch.tensor(math.inf))
    mon.close()
    step = json.loads(path.read_text().splitlines()[0])
    assert step["fields"]["loss"] == "Infinity"


class _SlowCollector(http.server.BaseHTTPRequestHandler):
    """Accepts every batch after ``delay`` seconds and records when it arrived and what it held."""

    delay = 0.2
    arrivals: list[tuple[float, list[int]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.arrivals.append((time.monotonic(), [ev["i"] for ev in body["events"]]))
        time.sleep(self.delay)
        reply = b'{"accepted": 1, "duplicates": 0}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


def test_sends_keep_the_flush_cadence_when_the_collector_is_slow(tmp_path: Path) -> None:
    """A tick every flush_interval (not interval + round trip), and one request per tick: events that
    arrive during a slow send wait for the next tick instead of trickling out in extra requests."""
    _SlowCollector.arrivals = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowCollector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    t = Transport(f"http://127.0.0.1:{server.server_port}", spool_dir=tmp_path / "spool", flush_interval=0.5)
    try:
        end = time.monotonic() + 3.2
        i = 0
        while time.monotonic() < end:  # a producer that never pauses: 100 events/s
            t.put({"kind": "heartbeat", "i": i})
            i += 1
            time.sleep(0.01)
        t.close(timeout=10)
    finally:
        server.shutdown()
    arrivals = _SlowCollector.arrivals
    received = [n for _, batch in arrivals for n in batch]
    assert received == list(range(i))  # all of them, in order, once
    ticks = [at for at, _ in arrivals[:-1]]  # the last request is close()'s final drain
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert 5 <= len(ticks) <= 7, gaps  # 3.2 s at one request per 0.5 s tick; a trickle would send ~15
    assert sum(gaps) / len(gaps) < 0.6, gaps  # interval + round trip would be 0.7


def test_retries_leave_the_trainers_random_state_alone(tmp_path: Path) -> None:
    """Retry jitter draws from trainmon's own generator: a trainer that seeds ``random`` and hashes
    its state in checkpoints (resume checks do) sees the same state with the collector down."""
    import random

    port = _free_port()  # nobody listens: every send fails and schedules a jittered retry
    t = Transport(f"http://127.0.0.1:{port}", spool_dir=tmp_path / "spool", flush_interval=0.01)
    t._sink._timeout = 0.2
    random.seed(1234)
    before = random.getstate()
    for i in range(20):
        t.put({"kind": "heartbeat", "i": i})
    deadline = time.monotonic() + 10
    while t.spooled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.spooled > 0  # a send failed, so a retry was scheduled
    assert random.getstate() == before
    t.close(timeout=5)


def test_no_spool_folder_while_the_collector_is_up(live_collector, tmp_path: Path) -> None:
    """Issue 26: every run left an empty ``~/.cache/trainmon/spool/RUN/rankN`` although nothing was spooled."""
    spool = tmp_path / "cache" / "spool" / "up" / "rank0"
    mon = TrainMonitor("up", collector=live_collector.url, spool_dir=spool, flush_interval=0.02)
    _tiny_loop(mon, 20)
    mon.close()
    assert mon.transport.spooled == 0
    assert not (tmp_path / "cache").exists()  # not even the parents


def test_spool_folder_is_created_on_first_use_and_removed_once_drained(tmp_path: Path) -> None:
    port = _free_port()
    spool = tmp_path / "cache" / "spool" / "blip" / "rank0"
    holder: dict = {}

    def blip(step: int) -> None:
        time.sleep(0.01)
        if step == 10:  # nothing listened so far: the steps wait on disk; now the collector starts
            assert mon.transport.flush(5.0)
            holder["spooled"] = sorted(spool.glob("*.jsonl"))
            holder["lc"] = start_collector(tmp_path / "db.sqlite", port=port)

    mon = TrainMonitor("blip", collector=f"http://127.0.0.1:{port}", spool_dir=spool, flush_interval=0.02)
    mon.transport._sink._timeout = 0.5
    try:
        _tiny_loop(mon, 20, between=blip)
        mon.close(timeout=15.0)
        assert [s for _, s, _ in _stored_steps(holder["lc"])] == list(range(20))
    finally:
        holder["lc"].stop()
    assert holder["spooled"], "the outage did not spool"
    assert mon.transport.dropped_spool == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db.sqlite"]  # the spool and the parents it made: gone


def test_events_the_collector_refuses_are_counted_in_dropped_events(live_collector, tmp_path: Path) -> None:
    """Issue 27's invariant, every step stored or counted: a batch the collector answers 422 (one event it
    cannot take refuses its whole batch) is neither stored nor retried, so ``run_end`` counts it."""
    mon = TrainMonitor("refused", collector=live_collector.url, spool_dir=tmp_path / "spool", flush_interval=0.05)
    for step in range(10):
        mon.emit("step", {"step": step, "loss": 1.0})
    mon.transport.flush(5.0)
    mon.emit("step", {"step": 10, "loss": "not a number"})  # a loop's own field of the wrong type
    mon.transport.flush(5.0)
    for step in range(11, 20):
        mon.emit("step", {"step": step, "loss": 1.0})
    mon.close()
    with live_collector.collector.storage.connect() as conn:
        stored = len(conn.execute(select(steps.c.step)).all())
        (dropped,) = conn.execute(select(streams.c.dropped_events)).one()
    assert mon.transport.rejected >= 1 and dropped == mon.transport.rejected
    assert stored + dropped >= 20 and stored < 20


def test_a_step_the_read_back_has_no_room_for_is_counted_not_queued(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mon = TrainMonitor("full", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    mon.start()
    mon._readback.capacity = 0  # full: step_end queues a CPU step itself, without Readback.submit
    for step in range(3):
        mon.step_end(step, loss=1.0)
    mon._readback.capacity = 100  # room again for run_end
    mon.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["kind"] for e in events] == ["run_start", "run_end"]
    assert events[-1]["fields"]["dropped_events"] == 3
