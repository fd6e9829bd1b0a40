"""Ingest load: N simulated ranks against a real ``trainmon serve`` on SQLite, with detection.

Each simulated rank is a real ``trainmon.hooks.transport.Transport`` (bounded queue, sender thread,
keep-alive HTTP, disk spool), exactly what ``TrainMonitor`` uses, fed step events shaped like
the reference trainer's at ``--step-hz`` steps per second. The ranks are spread over
``--procs`` client processes so the load generator is not limited by one GIL. The collector is
a ``trainmon serve --db FILE`` subprocess: validation, SQLite WAL with ``synchronous=FULL``,
all detectors and the live state are on, as in production. ``--postgres`` stores in a
throwaway PostgreSQL cluster instead (initdb + pg_ctl on loopback, fsync on; its server
processes share the machine and are not counted in the collector's CPU).

Faults: every ``--fault-every`` seconds one known rank sends a NaN loss; the anomaly's
``opened_at`` (stamped by the collector when it stores the anomaly) minus the moment the
faulty step was handed to the transport is the ingest-to-anomaly latency. It includes the
transport's batching (``--flush-interval``), the HTTP round trip, validation, the commit and
the detector.

Figures: sustained metric samples/s (each numeric field of a stored step event is a sample;
measured from the growth of the steps table after a warmup), p50/p99 latency, the collector's
own receive-to-acknowledgement latency (its ``trainmon_ingest_duration_seconds`` histogram,
so the transport's batching can be told apart from the collector's queueing), and the
collector's CPU and RSS over time (psutil, summed over the collector and its children: the
detection process), growth = late median minus early median.

    .venv/bin/python bench/ingest_load.py --quick      # ~45 s, 1,024 ranks, 20 s measured, no sweep
    .venv/bin/python bench/ingest_load.py              # 60 s measured, then the rank sweep (~3 min)
    .venv/bin/python bench/ingest_load.py --sweep-only --collectors 1,2 --ranks-per-batch 1,8
    .venv/bin/python bench/ingest_load.py --soak 600   # 10-minute soak for the RSS figure
    .venv/bin/python bench/ingest_load.py --quick --postgres   # on a throwaway PostgreSQL cluster
    .venv/bin/python bench/ingest_load.py --quick --forward    # the headline twice: per rank, then per node

``--forward`` runs the headline a second time against a fresh collector, the ranks grouped 8 per node
through real forwarders (``trainmon.hooks.forwarder``: each node's transports meet on a socket of their
own, one of them posting the node's batches as one request), and compares what a stored step costs the
collector in CPU in the two runs (``fwd_cpu_ratio``: per node / per rank).

Rank sweep (issue 24): how large a job one collector keeps up with. World sizes (``--sweep``,
1,024, 4,096 and 16,384 by default) at 1 step/s per rank (``--sweep-step-hz``), each against a
fresh collector and store. A rank is not a ``Transport`` thread here (16k threads would measure the
load generator) but a coroutine doing what one does: its own keep-alive connection, a batch per
flush interval at a phase of its own, the same step events, resent on a refusal. The figure is
the latency of every measured step from the moment it was due to its acknowledgement (stored and
detected: the collector answers after detection), p99 over the window; steps never acknowledged
count as infinite. ``max_ranks_p99_2s`` is the largest world size within p99 <= 2 s with none
below it failing. ``--ranks-per-batch 8`` sends a node's 8 ranks in one request (a per-node
forwarder); ``--collectors N`` splits the job into N node groups, each with a collector of its
own: the scale-out plan, measured in the same run as one collector.

Figures and what limits them: ``bench/README.md`` ("ingest_load.py").

The last line is ``samples_per_s=... p50_latency_s=... p99_latency_s=... rss_growth_mib=...``,
then ``us_per_step`` and ``requests_per_s`` (the collector's CPU per stored step and its requests per
second), with ``--forward`` the second run's ``fwd_*`` figures and ``fwd_cpu_ratio``, then with a sweep
``max_ranks_p99_2s=...`` and per point ``r{ranks}_steps_per_s r{ranks}_p99_s r{ranks}_cores
r{ranks}_us_per_step`` (suffixed ``_per8``, ``_c2`` for the other configurations); ``--sweep-only`` prints the
sweep's keys alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
import psutil
import sqlalchemy
import sqlalchemy.pool
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from trainmon.hooks.transport import Transport
from trainmon.wire import MAX_EVENTS_PER_BATCH, VERSION

RUN = "load"
SAMPLE_FIELDS = 19  # numeric leaves of the step below, ``step`` itself not counted
RANKS_PER_NODE = 8  # --forward: ranks sharing a forwarder


def _step_fields(step: int, rank: int, nan: bool) -> dict[str, Any]:
    """A step like the reference trainer's: 12 scalars, one LR group, 7 phases."""
    loss = math.nan if nan else 3.0 + 1.0 / (1 + step * 0.01) + 0.01 * ((step * 7 + rank) % 5)
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0 + 0.05 * ((step + rank) % 7),
        "grad_norm_clipped": 1.0,
        "clip_coef": 1.0,
        "lr": [3e-4],
        "tokens": 4096,
        "samples": 8,
        "micro_batches": 1,
        "scheduler_steps": 1,
        "step_time": 0.25,
        "phases": {
            "data": 0.01,
            "forward": 0.08,
            "backward": 0.12,
            "comm": 0.02,
            "optimizer": 0.015,
            "checkpoint": 0.0,
            "other": 0.005,
        },
        "mem_allocated_bytes": 2_000_000_000 + rank,
        "mem_peak_bytes": 3_000_000_000 + rank,
    }


def _event(kind: str, rank: int, stream: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "run": RUN, "rank": rank, "host": f"node-{rank // 8}", "stream": stream,
            "time": time.time(), "fields": fields}  # fmt: skip


def _client(
    ranks: list[int],
    world: int,
    url: str,
    spool: str,
    step_hz: float,
    flush: float,
    t_start: float,
    t_stop: float,
    faults: dict[int, float],
    out: Any,
    forward: bool,
) -> None:
    """One client process: a Transport per rank, steps paced by wall clock; reports fault times.

    ``forward``: the ranks of each node (8 consecutive ranks, spread over the client processes) send through
    their node's forwarder; a node is told apart from the others on this host by a launch id of its own."""
    transports = {}
    for r in ranks:
        os.environ["TRAINMON_LAUNCH_ID"] = f"{RUN}-node{r // RANKS_PER_NODE}"
        transports[r] = Transport(
            url, spool_dir=f"{spool}/rank{r}", flush_interval=flush, queue_size=1 << 16, forward=forward
        )
    streams = {r: f"load{os.getpid()}r{r}" for r in ranks}
    for r in ranks:
        start = {"world_size": world, "planned_steps": 10**6, "vocab_size": 64, "framework": "bench"}
        transports[r].put(_event("run_start", r, streams[r], start))
    pending = dict(faults)  # rank -> wall time to send a NaN at
    sent_faults: dict[int, float] = {}
    while time.time() < t_start:
        time.sleep(0.01)
    step = 0
    period = 1.0 / step_hz
    while True:
        due = t_start + step * period
        now = time.time()
        if due > t_stop:
            break
        if due > now:
            time.sleep(due - now)
        for r in ranks:
            nan = r in pending and time.time() >= pending[r]
            if nan:
                del pending[r]
                sent_faults[r] = time.time()
            transports[r].put(_event("step", r, streams[r], _step_fields(step, r, nan)))
        step += 1
    dropped = sum(t.dropped for t in transports.values())
    for r in ranks:
        transports[r].put(_event("run_end", r, streams[r], {"status": "finished", "step": step - 1}))
    for t in transports.values():
        t.close(timeout=30)
    spooled = sum(t.spooled for t in transports.values())
    out.send({"faults": sent_faults, "steps": step, "dropped": dropped, "spooled": spooled})


class _Sender:
    """What sends for one simulated rank in the sweep (or for one node's ranks, ``--ranks-per-batch``).

    Like ``Transport``: a tick every ``flush`` seconds (at a phase of its own, since every rank's
    sender thread starts at a different moment), each tick sends what was queued as one batch on a
    keep-alive connection of its own and waits for the answer; what becomes due meanwhile waits for
    the next tick, so a slow collector gets fewer, larger batches. A refusal (503, 429) or a lost
    connection keeps the events for the next tick, as the transport's spool does, so no event is
    lost or counted twice. Without a thread per rank: 16,384 ``Transport`` threads would measure the
    load generator, not the collector. With several ranks (the ranks of a node, forwarded by a node
    agent) each rank keeps its own stream and sequence numbers; only the request is shared.
    """

    def __init__(self, ranks: list[int], port: int) -> None:
        self.ranks = ranks
        self.port = port  # the collector of its node group
        self.streams = {r: f"sweep{os.getpid()}r{r}" for r in ranks}
        self.seqs = dict.fromkeys(ranks, 0)
        self.made = 0  # steps generated so far (step k is due at t_start + k / step_hz)
        self.queue: list[tuple[float, bytes]] = []  # (due time, encoded event) not yet acknowledged
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def event(self, kind: str, rank: int, fields: dict[str, Any], due: float) -> None:
        ev = _event(kind, rank, self.streams[rank], fields)
        ev["time"], ev["seq"] = due, self.seqs[rank]
        self.seqs[rank] += 1
        self.queue.append((due, orjson.dumps(ev)))


async def _post(sender: _Sender, host: str, body: bytes) -> int:
    """POST one batch on the sender's connection (reconnecting once if it went stale); the HTTP status."""
    head = (
        f"POST /v1/events HTTP/1.1\r\nHost: {host}:{sender.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    for attempt in (0, 1):
        try:
            if sender.conn is None:
                sender.conn = await asyncio.open_connection(host, sender.port)
            reader, writer = sender.conn
            writer.write(head + body)
            status_line = await reader.readuntil(b"\r\n")
            headers = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in headers.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            return int(status_line.split()[1])
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            if sender.conn is not None:
                sender.conn[1].close()
            sender.conn = None
            if attempt:
                return 0
    return 0


async def _sim_ranks(senders: list[tuple[list[int], int]], world: int, host: str, pipe: Any) -> dict[str, Any]:
    """Every sender of one client process on one event loop.

    First each rank's ``run_start`` until acknowledged (a job's start: the collector primes its
    detectors), then the parent's clock: steps from ``t_start``, the latency of each step due in
    ``[t_measure, t_stop)`` from due to acknowledged (stored and detected)."""
    sims = [_Sender(ranks, port) for ranks, port in senders]
    start = {"world_size": world, "planned_steps": 10**6, "vocab_size": 64, "framework": "bench"}
    latencies: list[float] = []
    refused = slow = batches = 0

    async def send(sim: _Sender, t_measure: float, t_stop: float) -> None:
        nonlocal refused, slow, batches
        sent = sim.queue[:MAX_EVENTS_PER_BATCH]
        body = b'{"version":%d,"events":[%b]}' % (VERSION, b",".join(line for _, line in sent))
        t0 = time.time()
        status = await _post(sim, host, body)
        acked = time.time()
        batches += 1
        slow += acked - t0 > 5.0  # what a Transport (5 s timeout) would have spooled and resent
        if status == 200:
            del sim.queue[: len(sent)]
            latencies.extend(acked - due for due, _ in sent if t_measure <= due < t_stop)
        else:
            refused += 1

    async def begin(sim: _Sender) -> None:
        await asyncio.sleep(random.random())  # the ranks of a job start within a second, not at once
        for rank in sim.ranks:
            sim.event("run_start", rank, start, time.time())
        while sim.queue:
            await send(sim, 0.0, 0.0)
            if sim.queue:
                await asyncio.sleep(1.0)

    await asyncio.gather(*(begin(sim) for sim in sims))
    pipe.send("started")
    step_hz, flush, t_start, t_measure, t_stop, drain = pipe.recv()

    async def run(sim: _Sender) -> None:
        tick = t_start + random.random() * flush  # each rank's sender thread started at its own moment
        while True:
            now = time.time()
            if tick > now:
                await asyncio.sleep(tick - now)
            now = time.time()
            producing = now < t_stop
            while producing and t_start + sim.made / step_hz <= min(now, t_stop):
                due = t_start + sim.made / step_hz
                for rank in sim.ranks:
                    sim.event("step", rank, _step_fields(sim.made, rank, False), due)
                sim.made += 1
            if not producing and (not sim.queue or now > t_stop + drain):
                break
            if sim.queue:
                await send(sim, t_measure, t_stop)
            tick = max(tick + flush, time.time())
        if sim.conn is not None:
            sim.conn[1].close()

    tasks = [asyncio.ensure_future(run(sim)) for sim in sims]
    _, late = await asyncio.wait(tasks, timeout=t_stop + drain + 5.0 - time.time())
    for task in late:  # a request still unanswered past the drain: its events count as not acknowledged
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    unacked = sum(1 for sim in sims for due, _ in sim.queue if t_measure <= due < t_stop)
    return {"latencies": latencies, "unacked": unacked, "refused": refused, "slow": slow, "batches": batches}


def _sweep_client(senders: list[tuple[list[int], int]], world: int, host: str, pipe: Any) -> None:
    """One client process of the sweep (a uvloop event loop, as the collector has)."""
    uvloop.install()
    pipe.send(asyncio.run(_sim_ranks(senders, world, host, pipe)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("collector exited during start")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("collector did not become healthy")


def _stored_steps(store: sqlalchemy.Engine) -> int:
    if store.dialect.name == "sqlite":  # rowids only grow: the count without a scan
        query = "SELECT coalesce(max(rowid), 0) FROM steps"
    else:
        query = "SELECT count(*) FROM steps"
    with store.connect() as conn:
        return conn.exec_driver_sql(query).scalar_one()


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    """The collector and its children (the detection process)."""
    with contextlib.suppress(psutil.Error):
        return [proc, *proc.children(recursive=True)]
    return [proc]


def _cpu(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of the processes still there."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += sum(p.cpu_times()[:2])
    return total


def _rss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


def _metrics(url: str) -> tuple[list[tuple[float, float]], float]:
    """Cumulative (upper bound, count) of the collector's receive-to-acknowledgement histogram, and the
    requests (batches) it accepted."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    buckets: list[tuple[float, float]] | None = None
    requests = math.nan
    for family in text_string_to_metric_families(text):
        if family.name == "trainmon_ingest_duration_seconds":
            buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
        elif family.name == "trainmon_ingest_batches":
            requests = sum(s.value for s in family.samples if s.name.endswith("_total"))
    if buckets is None:
        raise SystemExit("collector exports no trainmon_ingest_duration_seconds")
    return buckets, requests


def _bucket_quantile(start: list[tuple[float, float]], end: list[tuple[float, float]], q: float) -> float:
    """Quantile of the window's observations, interpolated within buckets as Prometheus does."""
    counts = [(le, b - a) for (le, b), (_, a) in zip(end, start, strict=True)]
    total = counts[-1][1]
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le, n in counts:
        if n >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(n - below, 1e-9)
        lower, below = le, n
    return lower


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds after the warmup")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--soak", type=float, help="measured seconds for an RSS soak (overrides --duration)")
    ap.add_argument("--quick", action="store_true", help="20 s measured, under a minute in all")
    # 1,024 ranks x 5.3 steps/s x 19 samples = 103k samples/s offered: issue 7's 100k, with a few % to spare.
    ap.add_argument("--step-hz", type=float, default=5.3, help="steps per second per rank (offered load)")
    # A thousand-rank job sends every second (TrainMonitor's default is 0.5 s): half the requests for the same data.
    ap.add_argument("--flush-interval", type=float, default=1.0, help="transport flush interval (seconds)")
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--fault-every", type=float, default=1.0, help="seconds between injected NaNs")
    ap.add_argument("--db", help="SQLite file or SQLAlchemy URL (default: a temporary SQLite file)")
    ap.add_argument(
        "--postgres", action="store_true", help="store in a throwaway PostgreSQL cluster (fsync on) instead"
    )
    ap.add_argument(
        "--forward",
        action="store_true",
        help=f"run the headline again with the ranks sending through a forwarder per node of {RANKS_PER_NODE}",
    )
    ap.add_argument("--profile", help="py-spy profile of the collector to this file (.svg: flame graph, else raw)")
    ap.add_argument(
        "--sweep",
        type=lambda text: [int(w) for w in text.split(",") if w],
        help="world sizes of the rank sweep, comma-separated (default 1024,4096,16384; none with --quick, '' none)",
    )
    ap.add_argument("--sweep-step-hz", type=float, default=1.0, help="steps per second per rank in the sweep")
    ap.add_argument("--sweep-warmup", type=float, default=10.0)
    ap.add_argument("--sweep-duration", type=float, default=20.0, help="measured seconds of each sweep point")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep without the 1,024-rank headline run")
    ap.add_argument(
        "--collectors",
        type=lambda text: [int(k) for k in text.split(",")],
        default=[1],
        help="collectors in the sweep, each owning a contiguous node group, comma-separated sweeps (keys _cN)",
    )
    ap.add_argument(
        "--ranks-per-batch",
        type=lambda text: [int(k) for k in text.split(",")],
        default=[1],
        help="ranks whose events share a request in the sweep, comma-separated sweeps (1: each rank's transport; "
        "8: a node agent for 8 ranks)",
    )
    args = ap.parse_args()
    if args.sweep is None:  # the headline alone takes --quick's minute
        args.sweep = [] if args.quick else [1024, 4096, 16384]
    if args.quick:
        args.duration, args.warmup = 20.0, 8.0
        args.sweep_duration, args.sweep_warmup = 6.0, 4.0
    if args.soak:
        args.duration = args.soak

    tmp = Path(tempfile.mkdtemp(prefix="trainmon-load-"))
    with contextlib.ExitStack() as stack:
        if args.postgres:  # initdb + pg_ctl on loopback, as the storage tests do
            from tests.postgres import create_database, throwaway_cluster

            cluster = stack.enter_context(throwaway_cluster(fsync=True))
            new_db: Callable[[str], str] = lambda name: create_database(cluster, prefix=f"{name}_")  # noqa: E731
        else:
            new_db = lambda name: str(tmp / f"{name}.sqlite")  # noqa: E731
        line = []
        if not args.sweep_only:
            alone = _load(args, tmp, args.db or new_db("load"), stack, forward=False)
            line.append(" ".join(f"{k}={v}" for k, v in alone.items()))
            if args.forward:
                node = _load(args, tmp, new_db("load_forward"), stack, forward=True)
                ratio = float(node["us_per_step"]) / float(alone["us_per_step"])
                line.append(" ".join(f"fwd_{k}={node[k]}" for k in _FORWARD_KEYS) + f" fwd_cpu_ratio={ratio:.3f}")
        if args.sweep:
            line.append(_sweep(args, tmp, new_db))
        print(" ".join(line))


def _start_collector(db: str, log: Path, port: int, config: Path | None = None) -> subprocess.Popen:
    """``trainmon serve`` as a user starts it (no token, loopback)."""
    env = {k: v for k, v in os.environ.items() if k != "TRAINMON_TOKEN"}
    command = [sys.executable, "-m", "trainmon.monitor.cli", "serve", "--db", db, "--port", str(port)]
    if config is not None:
        command += ["--config", str(config)]
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def _store(db: str) -> sqlalchemy.Engine:
    return sqlalchemy.create_engine(db if "://" in db else f"sqlite:///{db}", poolclass=sqlalchemy.pool.NullPool)


# The second headline run's figures on the last line (prefixed ``fwd_``), with --forward.
_FORWARD_KEYS = ("samples_per_s", "p99_latency_s", "ack_p99_s", "missed_faults", "us_per_step", "requests_per_s")


def _load(args: argparse.Namespace, tmp: Path, db: str, stack: contextlib.ExitStack, forward: bool) -> dict[str, str]:
    """The headline run: ``--ranks`` real transports at ``--step-hz`` (``forward``: through a forwarder per node
    of 8); its key=value summary."""
    store = _store(db)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    collector = _start_collector(db, tmp / ("collector-forward.log" if forward else "collector.log"), port)
    clients: list[mp.process.BaseProcess] = []
    stack.callback(_leave_nothing_behind, collector, clients)  # whatever goes wrong below
    _wait_healthy(url, collector)
    proc = psutil.Process(collector.pid)

    t_start = time.time() + 3.0  # time for the clients to open their transports
    t_measure = t_start + args.warmup
    t_stop = t_measure + args.duration
    fault_times = [t_measure + k * args.fault_every for k in range(int(args.duration / args.fault_every))]
    fault_ranks = [(7 + 37 * k) % args.ranks for k in range(len(fault_times))]
    assert len(set(fault_ranks)) == len(fault_ranks) or args.ranks < len(fault_ranks)
    plan = dict(zip(fault_ranks, fault_times, strict=True))
    ctx = mp.get_context("spawn")
    pipes = []
    for k in range(args.procs):
        ranks = list(range(k, args.ranks, args.procs))
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_client,
            args=(ranks, args.ranks, url, str(tmp / ("spool-forward" if forward else "spool")), args.step_hz,
                  args.flush_interval, t_start, t_stop, {r: t for r, t in plan.items() if r in set(ranks)}, send,
                  forward),
        )  # fmt: skip
        p.start()
        clients.append(p)
        pipes.append(recv)
    client_procs = [psutil.Process(p.pid) for p in clients]

    spy = None
    profile = args.profile
    if profile and forward:  # beside the first run's
        profile = str(Path(profile).with_suffix(".forward" + Path(profile).suffix))
    if profile:
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "-o", profile, "--pid", str(collector.pid),
             "--duration", str(int(args.duration)), "--rate", "50", "--nonblocking",
             "--format", "flamegraph" if profile.endswith(".svg") else "raw"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    print(f"collector pid {collector.pid} on {url}, store {store.url.render_as_string(hide_password=True)}")
    offered_samples = args.ranks * args.step_hz * SAMPLE_FIELDS
    print(f"{args.ranks} ranks x {args.step_hz} steps/s = {offered_samples:,.0f} samples/s offered;")
    print(
        f"flush every {args.flush_interval}s; {len(plan)} NaN faults; warmup {args.warmup}s, measured {args.duration}s"
        + (f"; {RANKS_PER_NODE} ranks per node, through its forwarder" if forward else "; a request per rank")
    )
    rss: list[tuple[float, float]] = []
    counts: list[tuple[float, int]] = []
    cpu_start = None
    last_print = 0.0
    while time.time() < t_stop:
        now = time.time()
        rss.append((now, _rss_mib(_tree(proc))))
        if now >= t_measure and cpu_start is None:
            cpu_start = (now, _cpu(_tree(proc)))
            load_start = _cpu(client_procs)
            counts.append((now, _stored_steps(store)))
            acks_start, requests_start = _metrics(url)
        if now - last_print >= (30 if args.duration > 120 else 5):
            last_print = now
            print(
                f"  t={now - t_start:6.1f}s  stored_steps={_stored_steps(store):>10,}  "
                f"collector_rss={rss[-1][1]:7.1f} MiB"
            )
        time.sleep(min(1.0, max(0.0, t_stop - time.time())))
    end = time.time()
    counts.append((end, _stored_steps(store)))
    acks_end, requests_end = _metrics(url)
    cpu_used = _cpu(_tree(proc)) - cpu_start[1] if cpu_start else math.nan
    load_used = _cpu(client_procs) - load_start if cpu_start else math.nan
    rss.append((end, _rss_mib(_tree(proc))))

    reports = [pipe.recv() for pipe in pipes]
    for p in clients:
        p.join(60)
    if spy is not None:
        spy.wait(60)
    time.sleep(1.0)

    with store.connect() as conn:
        opened = dict(
            conn.execute(
                sqlalchemy.text(
                    "SELECT rank, min(opened_at) FROM anomalies WHERE run = :run AND kind = 'nan_inf' GROUP BY rank"
                ),
                {"run": RUN},
            ).all()
        )
        other = conn.execute(
            sqlalchemy.text(
                "SELECT kind, count(*) FROM anomalies WHERE run = :run AND kind != 'nan_inf' GROUP BY kind"
            ),
            {"run": RUN},
        ).all()
        examples = conn.execute(
            sqlalchemy.text(
                "SELECT kind, rank, first_step, opened_at, message FROM anomalies"
                " WHERE run = :run AND kind != 'nan_inf' ORDER BY id LIMIT 5"
            ),
            {"run": RUN},
        ).all()
        total_steps = conn.exec_driver_sql("SELECT count(*) FROM steps").scalar_one()
    store.dispose()
    stop_s = _terminate(collector)

    sent_faults = {r: t for rep in reports for r, t in rep["faults"].items()}
    latencies = [opened[r] - t if r in opened else math.inf for r, t in sent_faults.items()]
    missed = sum(1 for x in latencies if math.isinf(x))
    (t0, n0), (t1, n1) = counts[0], counts[-1]
    steps_per_s = (n1 - n0) / (t1 - t0)
    samples_per_s = steps_per_s * SAMPLE_FIELDS
    offered = args.ranks * args.step_hz
    dropped = sum(rep["dropped"] for rep in reports)
    spooled = sum(rep["spooled"] for rep in reports)
    expected_steps = sum(len(range(k, args.ranks, args.procs)) * rep["steps"] for k, rep in enumerate(reports))

    measured = [m for t, m in rss if t >= t_measure]
    k = max(1, len(measured) // 10)
    early = statistics.median(measured[: 2 * k] if len(measured) > 4 * k else measured[:k])
    late = statistics.median(measured[-k:])
    growth = late - early

    print()
    print(f"stored steps/s        {steps_per_s:,.0f} (offered {offered:,.0f}); {n1 - n0:,} steps in {t1 - t0:.1f}s")
    print(f"samples/s             {samples_per_s:,.0f} ({SAMPLE_FIELDS} numeric fields per step)")
    print(f"collector CPU         {cpu_used / (t1 - t0):.2f} cores over the measured window")
    us_per_step = 1e6 * cpu_used / max(1, n1 - n0)
    requests_per_s = (requests_end - requests_start) / (t1 - t0)
    print(f"collector CPU a step  {us_per_step:.0f} us; {requests_per_s:,.0f} requests/s")
    print(f"load generator CPU    {load_used / (t1 - t0):.2f} cores (the simulated ranks share the machine)")
    print(f"all steps stored      {total_steps:,} of {expected_steps:,} sent")
    print(f"producers             dropped {dropped}, spooled {spooled} (spooled: timed out or backed off)")
    finite = sorted(x for x in latencies if math.isfinite(x))
    worst = max(finite, default=math.nan)
    print(f"ingest-to-anomaly     p50 {_pct(latencies, 0.5):.3f}s  p99 {_pct(latencies, 0.99):.3f}s  max {worst:.3f}s")
    ack50, ack99 = (_bucket_quantile(acks_start, acks_end, q) for q in (0.5, 0.99))
    print(f"collector ack         p50 {ack50:.3f}s  p99 {ack99:.3f}s  (received -> committed, measured window)")
    print(f"faults                {len(latencies)} injected, {missed} not detected")
    print(f"other anomalies       {dict(other) or 'none'}")
    for kind, rank, step, opened_at, message in examples:  # false positives: what they said, and when
        print(f"  {kind} rank {rank} step {step} at t={opened_at - t_start:.1f}s: {message}")
    peak = max(m for _, m in rss)
    print(f"collector stop        exited {stop_s:.1f}s after SIGTERM")
    print(f"collector RSS         start {rss[0][1]:.1f} MiB, early {early:.1f}, late {late:.1f}, peak {peak:.1f}")
    print(f"RSS growth            {growth:+.1f} MiB (late median - early median, measured window)")
    if len(measured) > 10:
        step = max(1, len(measured) // 10)
        print("RSS over time (MiB)   " + " ".join(f"{m:.0f}" for m in measured[::step]))
    if profile:
        print(f"profile               {profile}")
    return {
        "samples_per_s": f"{samples_per_s:.0f}",
        "steps_per_s": f"{steps_per_s:.0f}",
        "p50_latency_s": f"{_pct(latencies, 0.5):.3f}",
        "p99_latency_s": f"{_pct(latencies, 0.99):.3f}",
        "ack_p99_s": f"{ack99:.3f}",
        "missed_faults": f"{missed}",
        "rss_growth_mib": f"{growth:.1f}",
        "ranks": f"{args.ranks}",
        "seconds": f"{t1 - t0:.0f}",
        "sigterm_exit_s": f"{stop_s:.1f}",
        "us_per_step": f"{us_per_step:.0f}",
        "requests_per_s": f"{requests_per_s:.0f}",
    }


# The sweep's bar: a step acknowledged (stored and detected) within 2 s of being due, for 99 % of them.
SWEEP_P99_S = 2.0


def _sweep(args: argparse.Namespace, tmp: Path, new_db: Callable[[str], str]) -> str:
    """World sizes one after another, each against a fresh collector and store; the key=value summary.

    For each ``--ranks-per-batch`` value: 1 is what every rank's transport does today; 8 is what a
    node agent forwarding its node's 8 ranks in one request would send (keys suffixed ``_per8``)."""
    keys = []
    for ncol, per in itertools.product(args.collectors, args.ranks_per_batch):
        print(
            f"\nrank sweep: {args.sweep} ranks at {args.sweep_step_hz} step/s, {per} rank(s) per request, "
            f"{ncol} collector(s), flush {args.flush_interval}s, warmup {args.sweep_warmup}s, "
            f"measured {args.sweep_duration}s each"
        )
        points = []
        for world in args.sweep:
            name = f"sweep{world}x{per}c{ncol}"
            with contextlib.ExitStack() as stack:
                points.append(_sweep_point(args, world, per, ncol, tmp / name, new_db(name), stack))
            p = points[-1]
            print(
                f"  {world:>6} ranks: {p['steps_per_s']:8,.0f} of {p['offered']:,.0f} steps/s stored; "
                f"due->acknowledged p50 {p['p50']:.2f}s p99 {p['p99']:.2f}s; collector {p['cores']:.2f} cores "
                f"({p['us_per_step']:.0f} us of CPU a stored step), "
                f"simulated ranks {p['client_cores']:.2f}; {p['batches']:,} batches, {p['refused']} refused, "
                f"{p['slow']} over 5 s, {p['unacked']} not acknowledged; collector RSS peak {p['rss']:.0f} MiB; "
                f"all ranks started (run_start acknowledged) in {p['started_s']:.1f}s; load average {p['load']}"
            )
        # The largest world size kept within the bar, with none below it that was not (no lucky point).
        best = 0
        for p in sorted(points, key=lambda p: p["world"]):
            if p["p99"] > SWEEP_P99_S:
                break
            best = p["world"]
        print(f"largest world size within p99 <= {SWEEP_P99_S:g} s: {best or 'none'}")
        tag = ("" if per == 1 else f"_per{per}") + ("" if ncol == 1 else f"_c{ncol}")
        keys.append(f"max_ranks_p99_2s{tag}={best}")
        for p in points:
            w = f"r{p['world']}{tag}"
            keys.append(
                f"{w}_steps_per_s={p['steps_per_s']:.0f} {w}_p99_s={p['p99']:.3f} {w}_cores={p['cores']:.2f} "
                f"{w}_us_per_step={p['us_per_step']:.0f}"
            )
    return " ".join(keys)


def _sweep_point(
    args: argparse.Namespace, world: int, per: int, ncol: int, tmp: Path, db: str, stack: contextlib.ExitStack
) -> dict[str, Any]:
    """``world`` simulated ranks at ``--sweep-step-hz``, ``per`` ranks per request, against ``ncol`` fresh
    collectors, each owning a contiguous node group (its own SQLite file, or the one PostgreSQL database)."""
    tmp.mkdir()
    config = tmp / "collector.toml"
    # One job of ``world`` ranks (not 429), each with a batch in the queue at times (not 503): the limits a
    # deployment of that size sets; the defaults fit a 1,024-rank job.
    config.write_text(f"max_ranks_per_run = {max(8192, world)}\nmax_pending_batches = {max(4096, 2 * world)}\n")
    dbs = [db if "://" in db or ncol == 1 else str(Path(db).with_suffix(f".c{j}.sqlite")) for j in range(ncol)]
    ports = [_free_port() for _ in range(ncol)]
    clients: list[mp.process.BaseProcess] = []
    collectors = []
    # One after the other: collectors that start together on a fresh PostgreSQL database race to create
    # its schema (both run the migrations; one fails on alembic_version).
    for j, (d, port) in enumerate(zip(dbs, ports, strict=True)):
        collectors.append(_start_collector(d, tmp / f"collector{j}.log", port, config))
        stack.callback(_leave_nothing_behind, collectors[-1], clients)
        _wait_healthy(f"http://127.0.0.1:{port}", collectors[-1])
    procs = [psutil.Process(c.pid) for c in collectors]
    stores = [_store(d) for d in dict.fromkeys(dbs)]
    for store in stores:
        stack.callback(store.dispose)

    def tree() -> list[psutil.Process]:
        return [p for proc in procs for p in _tree(proc)]

    def stored() -> int:
        return sum(_stored_steps(store) for store in stores)

    ctx = mp.get_context("spawn")
    pipes = []
    t_begin = time.time()
    groups = [list(range(first, min(first + per, world))) for first in range(0, world, per)]
    senders = [(ranks, ports[i * ncol // len(groups)]) for i, ranks in enumerate(groups)]
    for k in range(args.procs):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_sweep_client, args=(senders[k :: args.procs], world, "127.0.0.1", theirs))
        p.start()
        clients.append(p)
        pipes.append(ours)
    for pipe in pipes:  # every rank's run_start acknowledged: the job has started
        if not pipe.poll(600):
            raise SystemExit(f"{world} ranks did not start within 600 s")
        pipe.recv()
    started_s = time.time() - t_begin
    t_start = time.time() + 0.5
    t_measure = t_start + args.sweep_warmup
    t_stop = t_measure + args.sweep_duration
    for pipe in pipes:
        pipe.send((args.sweep_step_hz, args.flush_interval, t_start, t_measure, t_stop, 10.0))
    client_procs = [psutil.Process(p.pid) for p in clients]
    peak = 0.0
    while time.time() < t_measure:
        peak = max(peak, _rss_mib(tree()))
        time.sleep(0.5)
    cpu0, load0, n0, t0 = _cpu(tree()), _cpu(client_procs), stored(), time.time()
    while time.time() < t_stop:
        peak = max(peak, _rss_mib(tree()))
        time.sleep(min(0.5, max(0.0, t_stop - time.time())))
    cpu1, load1, n1, t1 = _cpu(tree()), _cpu(client_procs), stored(), time.time()
    reports = [pipe.recv() for pipe in pipes]
    for p in clients:
        p.join(30)
    for collector in collectors:
        _terminate(collector)
    latencies = [x for rep in reports for x in rep["latencies"]]
    unacked = sum(rep["unacked"] for rep in reports)
    latencies += [math.inf] * unacked
    return {
        "world": world,
        "offered": world * args.sweep_step_hz,
        "steps_per_s": (n1 - n0) / (t1 - t0),
        "p50": _pct(latencies, 0.5),
        "p99": _pct(latencies, 0.99),
        "cores": (cpu1 - cpu0) / (t1 - t0),
        # CPU time per step stored: what a step costs the collector whatever share of the machine it got
        "us_per_step": 1e6 * (cpu1 - cpu0) / max(1, n1 - n0),
        "client_cores": (load1 - load0) / (t1 - t0),
        "batches": sum(rep["batches"] for rep in reports),
        "refused": sum(rep["refused"] for rep in reports),
        "slow": sum(rep["slow"] for rep in reports),
        "unacked": unacked,
        "rss": peak,
        "started_s": started_s,
        "load": _loadavg(),
    }


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _terminate(collector: subprocess.Popen, grace: float = 30.0) -> float:
    """SIGTERM, then SIGKILL to the whole tree if it is not gone within ``grace``; seconds it took."""
    t0 = time.monotonic()
    tree = _tree(psutil.Process(collector.pid))
    collector.send_signal(signal.SIGTERM)
    try:
        collector.wait(grace)
    except subprocess.TimeoutExpired:
        print(f"collector still running {grace:.0f}s after SIGTERM: killing it and its children", file=sys.stderr)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    collector.wait()
    return time.monotonic() - t0


def _leave_nothing_behind(collector: subprocess.Popen, clients: list[mp.process.BaseProcess]) -> None:
    for p in clients:
        if p.is_alive():
            p.kill()
    if collector.poll() is None:
        _terminate(collector)


if __name__ == "__main__":
    main()
