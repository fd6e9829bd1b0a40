"""Moves events from the training thread to the collector without ever making training wait.

The training thread only appends to a bounded deque (a few hundred nanoseconds, no lock, no
I/O); when the deque is full the event is dropped and counted, never waited for. A daemon
sender thread drains it every ``flush_interval`` seconds and POSTs batches. When the collector
cannot be reached, batches go to JSONL segment files in a spool directory and are replayed in
order once it answers again; the collector deduplicates by (stream, seq), so a batch sent twice
is stored once. Segments left behind by an earlier process (a crash while the collector was
down) are replayed too.

The ranks of one node can share their requests: with forwarding on (several local ranks on Linux, by
default; ``trainmon.hooks.forwarder``), each batch goes to the node's forwarder, which posts the node's
batches as one request and relays the collector's answer; everything above holds per rank as before.

``file://PATH`` targets skip HTTP entirely and append JSONL, one event per line, for offline
runs that are imported later; spool segments use the same line format.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import logging
import math
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from trainmon.hooks.forwarder import (
    LINGER_FRACTION,
    ForwarderGone,
    NodeLink,
    blames_the_batch,
    forwarding,
    node_address,
)
from trainmon.hooks.launch import launch_id
from trainmon.hooks.policy import StopPolicy
from trainmon.wire import MAX_EVENTS_PER_BATCH, SENT_HEADER, VERSION, json_safe

__all__ = ["Transport"]

log = logging.getLogger("trainmon.transport")
_JITTER = random.Random()  # our own: retry jitter must not move the trainer's global RNG (resume checks hash it)

_SEGMENT_BYTES = 4 << 20
# Retry delays double from 0.5 s up to this (with jitter): a collector that is back is found within seconds.
_MAX_BACKOFF = 5.0
_REPLAY_BATCH = 1000  # spooled events per request on replay: a recovering collector gets small bites
# The sender thread holds the GIL for at most _SLICE_S of Python work at a time, then sleeps _PAUSE_S:
# a training thread coming back from a torch op (which releases the GIL) waits for the GIL at most one
# slice, instead of a whole flush's worth of encoding (~25 steps x ~60 us at flush_interval=0.5 s).
_SLICE_S = 200e-6
_PAUSE_S = 100e-6


def encode_event(event: dict[str, Any]) -> str:
    """One event as a JSON line (strict JSON: no bare NaN tokens).

    The C encoder first; only an event with a non-finite float (a NaN loss) takes the Python walk
    that swaps in the format's markers. The sender thread shares the GIL with training.
    """
    try:
        return json.dumps(event, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(json_safe(event), separators=(",", ":"), allow_nan=False)


class _HttpSink:
    """POSTs batches over one keep-alive connection (or hands them to the node's forwarder, ``link``);
    raises ``OSError`` when it cannot deliver.

    A request has ``timeout`` seconds in all, not per socket operation: a collector that accepts the
    connection and never answers, or trickles its answer a byte at a time, would otherwise hold the
    sender (and a closing trainer) for ever. The process's watchdog (``_Watchdog``) shuts the socket
    down when the budget is spent, which wakes the blocked read with an error.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float,
        policy: StopPolicy | None = None,
        link: NodeLink | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(f"collector: unsupported URL scheme in {url!r}, use http://, https:// or file://")
        self._https = parsed.scheme == "https"
        self._netloc = parsed.netloc
        self._path = parsed.path.rstrip("/") + "/v1/events"
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._policy = policy  # asks each acknowledgement for the run's findings and files them
        self._link = link
        self._conn: http.client.HTTPConnection | None = None
        self._until = 0.0  # monotonic end of the request in flight; 0: none
        self._lock = threading.Lock()  # the connection and ``_until``, between the sender and the watchdog

    @property
    def serving(self) -> bool:
        return self._link is not None and self._link.serving

    @property
    def phase(self) -> float | None:
        return None if self._link is None else self._link.phase

    def send(self, lines: list[str], deadline: float = float("inf")) -> None:
        """Deliver within ``timeout`` seconds, and by ``deadline`` (monotonic) at the latest."""
        query = "" if self._policy is None else self._policy.query()
        with self._budget(deadline):
            status, text = self._exchange(lines, query)
        if status < 300:
            if self._policy is not None:
                self._policy.receive(text)
            return
        if status == 413 and len(lines) > 1:
            half = len(lines) // 2
            self.send(lines[:half], deadline)
            self.send(lines[half:], deadline)
            return
        if status in (401, 403):  # a token problem is fixed by an operator, not by dropping data
            raise OSError(f"collector refused the bearer token ({status}); set TRAINMON_TOKEN")
        if blames_the_batch(status):
            # The collector will never accept this batch; keeping it would block the spool.
            raise _Rejected(f"collector rejected {len(lines)} events: {status} {text[:300]!r}")
        raise OSError(f"collector answered {status}")

    def post(self, body: bytes, query: str, deadline: float) -> tuple[int, bytes]:
        """One request to the collector, as is: its status and body (the node's forwarder posts with this)."""
        with self._budget(deadline):
            return self._post(body, query)

    @contextlib.contextmanager
    def _budget(self, deadline: float) -> Iterator[None]:
        """The request in flight has ``timeout`` seconds in all, and ends by ``deadline`` at the latest."""
        with self._lock:
            self._until = min(time.monotonic() + self._timeout, deadline)
        _WATCHDOG.watch(self)
        try:
            yield
        finally:
            _WATCHDOG.forget(self)
            with self._lock:
                self._until = 0.0

    def _exchange(self, lines: list[str], query: str) -> tuple[int, bytes]:
        if self._link is not None:
            try:
                answer = self._link.exchange(lines, query, self._until)
            except ForwarderGone:
                if time.monotonic() >= self._until:  # aborted: the budget is spent
                    raise
                answer = None  # the forwarder died mid-request: post directly (the collector deduplicates)
            if answer is not None:
                return answer
        return self._post(f'{{"version":{VERSION},"events":[{",".join(lines)}]}}'.encode(), query)

    def _post(self, body: bytes, query: str) -> tuple[int, bytes]:
        for attempt in (0, 1):  # one silent retry on a stale keep-alive connection
            with self._lock:
                if self._conn is None:
                    cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                    self._conn = cls(self._netloc, timeout=max(0.05, self._until - time.monotonic()))
                conn = self._conn
            try:
                path = f"{self._path}?{query}" if query else self._path
                # When this request left, on this host's clock: the collector judges the clock by it, since a
                # batch replayed from the spool holds events from long ago (trainmon.clock).
                headers = {**self._headers, SENT_HEADER: repr(time.time())}
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                text = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                if attempt or time.monotonic() >= self._until:
                    raise OSError(f"collector unreachable: {exc}") from exc
                continue
            if resp.status < 300 and not _complete(resp, text):
                self._drop(conn)
                raise OSError("collector's acknowledgement was cut off before its end; not taken as one")
            return resp.status, text
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            conn.close()
            if self._conn is conn:
                self._conn = None

    def cut(self, deadline: float) -> None:
        """End the request in flight by ``deadline`` (monotonic) at the latest, and do not retry it."""
        with self._lock:
            if self._until:
                self._until = min(self._until, deadline)

    def abort(self, late_only: bool = False) -> None:
        """Fail the request in flight (from any thread; ``late_only``: only if past its budget)."""
        with self._lock:
            if late_only and not (self._until and time.monotonic() > self._until):
                return
            sock = self._conn.sock if self._conn is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            if self._link is not None:
                self._link.abort()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        if self._link is not None:
            self._link.close()


def _complete(resp: http.client.HTTPResponse, body: bytes) -> bool:
    """Whether a 2xx answer arrived whole. ``http.client`` ends the headers at the end of the stream and
    then reads the body to it: a connection cut after the status line (the request's budget spent while
    the collector trickled its answer, a collector or proxy gone mid-answer) reads as a complete 200 with
    an empty body, and its batch was taken as delivered and lost (issue 27). A length or chunked framing
    proves the end (a short body raises ``IncompleteRead``); without one, the collector's answer is a
    JSON object, which a cut leaves unparseable."""
    if resp.chunked or resp.getheader("Content-Length") is not None:
        return True
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


class _Watchdog:
    """One thread per process that ends requests past their budget (``_HttpSink.abort``).

    One for all sinks, not one per sink: a load generator or a process with many transports would
    otherwise run a polling thread per transport. It looks five times a second while any request is
    in flight and sleeps otherwise; a budget is therefore kept to within 0.2 s.
    """

    _PERIOD = 0.2

    def __init__(self) -> None:
        self._busy: set[_HttpSink] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, sink: _HttpSink) -> None:
        with self._cond:
            self._busy.add(sink)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trainmon-send-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, sink: _HttpSink) -> None:
        with self._cond:
            self._busy.discard(sink)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._busy:
                    self._cond.wait()
                busy = list(self._busy)
            now = time.monotonic()
            for sink in busy:
                if 0 < sink._until < now:
                    sink.abort(late_only=True)
            time.sleep(self._PERIOD)


_WATCHDOG = _Watchdog()


class _Rejected(Exception):
    """The collector refused a batch as malformed: drop it (counted), do not retry."""


class Transport:
    """Bounded, non-blocking hand-off from the training thread to the collector.

    Args:
        target: ``http://host:port`` of a collector, or ``file://PATH`` to write JSONL.
        spool_dir: where undeliverable batches wait; required for HTTP targets.
        queue_size: events held in memory before new ones are dropped (and counted).
        spool_max_bytes: disk budget of the spool; beyond it events are dropped (counted).
        flush_interval: seconds between sends; larger batches cost less per event.
        token: bearer token for collectors that require one.
        poll: called by the sender thread before each send; returns events that became ready
            there (step records whose device values have landed).
        policy: asks the collector, with each batch, for the run's findings and files them
            there for the training thread (HTTP targets only).
        forward: send through the node's forwarder (``trainmon.hooks.forwarder``), one request per node
            and flush: True, False, or None for ``$TRAINMON_FORWARD`` (``1``/``0``), else on where several
            ranks share this node (``$LOCAL_WORLD_SIZE`` > 1) on Linux. HTTP targets only.
    """

    def __init__(
        self,
        target: str,
        *,
        spool_dir: str | os.PathLike[str] | None = None,
        queue_size: int = 65536,
        spool_max_bytes: int = 1 << 30,
        flush_interval: float = 0.5,
        token: str | None = None,
        timeout: float = 5.0,
        poll: Callable[[], Iterable[dict[str, Any]]] | None = None,
        policy: StopPolicy | None = None,
        forward: bool | None = None,
    ) -> None:
        forward = forwarding(forward)  # validated for every target: a bad setting is an error wherever it is
        self._poll = poll  # called on the sender thread before each drain: events completed there
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._seq = 0  # numbered here, in queue order, so producers on several threads stay ordered
        self._cap = queue_size
        self._flush_interval = flush_interval
        self.dropped = 0  # events dropped because the queue was full (training thread only)
        self.dropped_spool = 0  # events dropped because the spool was full
        self.rejected = 0  # events the collector refused as malformed
        self.sent = 0
        self.spooled = 0  # events that waited on disk for the collector
        self._file = None
        self._sink: _HttpSink | None = None
        if target.startswith("file://"):
            path = Path(target[len("file://") :])
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        else:
            if spool_dir is None:
                raise ValueError("spool_dir is required for an HTTP collector")
            link = None
            if forward:
                link = NodeLink(
                    node_address(target, token, launch_id()),
                    lambda: _HttpSink(target, token, timeout).post,
                    flush_interval * LINGER_FRACTION,
                )
            self._sink = _HttpSink(target, token, timeout, policy, link)
            # Created on first use and removed once drained: a run whose collector was up throughout
            # leaves no folder behind. ``_made`` holds the folders this transport created, deepest first.
            self._spool = Path(spool_dir)
            self._made: list[Path] = []
            self._spool_max = spool_max_bytes
            self._segment: Path | None = None
            self._backoff = 0.0
            self._retry_at = 0.0
            # Batches the spool could not take (disk full, read-only): they wait here, bounded by
            # queue_size events, behind the spooled ones. Lost only if the process ends first (counted).
            self._held: collections.deque[list[str]] = collections.deque()
            self._held_events = 0
            self._spool_broken = False  # logged once per episode, not once per batch
        self._deadline = float("inf")  # set by close(): after it, nothing waits on the network
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._stop = False
        self._flushing = False  # flush() asked for everything, not only what the tick found queued
        self._slice_start = 0.0
        self._thread = threading.Thread(target=self._run, name="trainmon-sender", daemon=True)
        self._thread.start()

    # -- training thread ------------------------------------------------------------------

    def put(self, event: dict[str, Any]) -> bool:
        """Queue an event; never blocks. Returns False (and counts) when the queue is full."""
        if len(self._queue) >= self._cap:
            self.dropped += 1
            return False
        self._queue.append(event)
        return True

    def wake(self) -> None:
        """Send now rather than at the next tick (never blocks)."""
        self._wake.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Ask the sender to deliver (or spool) everything queued; True when it did in time."""
        self._idle.clear()
        self._flushing = True
        self._wake.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued within ``timeout`` seconds, spool the rest, and stop the thread.

        Bounded however broken the collector is (hung, trickling, gone): a request still in flight at
        the deadline is aborted and its batch spooled with everything else not yet acknowledged, to
        be sent by the next process that uses this spool. Events that could be neither sent nor
        spooled (disk full) are counted in ``dropped_spool``."""
        if self._stop:
            return
        self._deadline = time.monotonic() + timeout
        self._stop = True
        if self._sink is not None:
            self._sink.cut(self._deadline)  # a request in flight ends by the deadline; its lines get spooled
        self._wake.set()
        self._thread.join(timeout + 1.0)  # spooling what is left is local and quick
        if self._file is not None:
            self._file.close()
        if self._sink is not None:
            self._sink.close()
            if self._held_events:
                self.dropped_spool += self._held_events
                log.error(
                    "trainmon: %d events could be neither delivered nor spooled before exit; they are lost",
                    self._held_events,
                )
                self._held.clear()
                self._held_events = 0

    @property
    def serving(self) -> bool:
        """This process forwards its node's batches (``trainmon.hooks.forwarder``)."""
        return self._sink is not None and self._sink.serving

    @property
    def pending_spool_bytes(self) -> int:
        if self._sink is None:
            return 0
        return sum(p.stat().st_size for p in self._segments())

    # -- sender thread --------------------------------------------------------------------

    def _run(self) -> None:
        # A fixed cadence: a tick every flush_interval from the previous tick, not from the end of the
        # previous send, so an event waits at most one interval plus one round trip. Each tick sends what
        # was queued when it began; what arrives during a slow send waits for the next tick instead of
        # going out in a trickle of small requests, which would cost a loaded collector more per event.
        # Forwarding, the ticks fall on the node's grid (``NodeLink.phase``) instead, so the node's ranks send
        # at one instant and their forwarder posts them as one request without lingering.
        phase = self._sink.phase if self._sink is not None and self._flush_interval > 0 else None
        due = time.monotonic()
        while True:
            due = max(due + self._flush_interval, time.monotonic())  # behind after a slow send: go at once
            if phase is not None:
                due = (math.ceil(due / self._flush_interval - phase - 1e-9) + phase) * self._flush_interval
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            stopping = self._stop
            everything, self._flushing = stopping or self._flushing, False
            try:
                self._drain(final=stopping, everything=everything)
            except Exception:  # the sender must outlive any bug in one batch
                log.exception("trainmon sender failed; continuing")
            if not self._queue:
                self._idle.set()
            if stopping:
                return

    def _breathe(self) -> None:
        """Give the GIL away after each slice of Python work (see ``_SLICE_S``)."""
        now = time.perf_counter()
        if now - self._slice_start > _SLICE_S:
            time.sleep(_PAUSE_S)  # a real sleep: sleep(0) gives the GIL back before a waiter wakes up
            self._slice_start = time.perf_counter()

    def _take(self, limit: int) -> list[str]:
        lines: list[str] = []
        q = self._queue
        limit = min(limit, MAX_EVENTS_PER_BATCH)
        while q and len(lines) < limit:
            event = q.popleft()
            event["seq"] = self._seq
            self._seq += 1
            lines.append(encode_event(event))
            self._breathe()
        return lines

    def _drain(self, final: bool, everything: bool) -> None:
        """Send what is queued now (``everything``: also what arrives meanwhile, until empty)."""
        self._slice_start = time.perf_counter()
        if self._poll is not None:
            for event in self._poll():  # lazily: each event is completed as it is taken
                self.put(event)
                self._breathe()
        budget = len(self._queue)
        while self._queue and (everything or budget > 0):
            lines = self._take(len(self._queue) if everything else budget)
            budget -= len(lines)
            if self._file is not None:
                self._file.write("\n".join(lines) + "\n")
                self._file.flush()
                self.sent += len(lines)
            else:
                self._deliver(lines)
        if self._sink is not None:
            self._replay(final)

    def _deliver(self, lines: list[str]) -> None:
        # Anything already spooled (or held) must go first, so new events join the queue behind it.
        now = time.monotonic()
        if self._held or self._segments() or now < self._retry_at or now >= self._deadline:
            self._spool_lines(lines)
            return
        try:
            self._send(lines)
        except OSError as exc:
            self._failed(exc)
            self._spool_lines(lines)

    def _send(self, lines: list[str]) -> None:
        assert self._sink is not None
        try:
            self._sink.send(lines, self._deadline)
            self.sent += len(lines)
        except _Rejected as exc:
            self.rejected += len(lines)
            log.error("%s", exc)
        self._backoff = 0.0

    def _failed(self, exc: OSError) -> None:
        self._backoff = min(_MAX_BACKOFF, max(0.5, self._backoff * 2))
        # Jitter, so a thousand ranks that lost the collector together do not return together.
        self._retry_at = time.monotonic() + self._backoff * _JITTER.uniform(0.5, 1.0)
        log.warning("trainmon: %s; spooling, retry in %.1fs", exc, self._backoff)

    def _segments(self) -> list[Path]:
        found = []
        for p in self._spool.glob("*.jsonl"):
            with contextlib.suppress(FileNotFoundError):  # replayed and removed by another process meanwhile
                found.append((p.stat().st_mtime_ns, p.name, p))
        return [p for *_, p in sorted(found)]

    def _spool_lines(self, lines: list[str]) -> None:
        """Lines to the spool; to memory if the spool cannot take them; dropped (counted) past both bounds."""
        data = ("\n".join(lines) + "\n").encode()
        if self._held:  # the spool failed before: keep the order, do not write behind what waits in memory
            self._hold(lines)
            return
        if self.pending_spool_bytes + len(data) > self._spool_max:
            self._drop(lines, f"the spool {self._spool} is over its budget of {self._spool_max} bytes")
            return
        try:
            self._write_segment(data)
        except OSError as exc:  # disk full, read-only, removed: keep sending from memory
            if not self._spool_broken:
                self._spool_broken = True
                log.warning("trainmon: cannot spool to %s (%s); holding events in memory", self._spool, exc)
            self._hold(lines)
            return
        if not self.spooled:  # once per transport: where the events wait, and how to read them meanwhile
            log.warning(
                "trainmon: spooling events to %s; they are sent when the collector is back "
                "(`trainmon postmortem %s` reads them meanwhile)",
                self._spool,
                self._spool,
            )
        self.spooled += len(lines)

    def _write_segment(self, data: bytes) -> None:
        if self._segment is None or not self._segment.exists() or self._segment.stat().st_size > _SEGMENT_BYTES:
            self._make_spool()
            self._segment = self._spool / f"{time.time_ns():020d}-{os.getpid()}.jsonl"
        with open(self._segment, "ab") as f:
            size = f.tell()
            try:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(size)  # no half line left behind for the replay to trip on
                raise

    def _make_spool(self) -> None:
        """Create the spool folder (and its missing parents), remembering which ones were made here."""
        missing = []
        folder = self._spool
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        self._spool.mkdir(parents=True, exist_ok=True)
        self._made.extend(p for p in missing if p not in self._made)

    def _tidy_spool(self) -> None:
        """The spool is drained: remove its folder, and the parents this transport created, while empty.

        A folder another rank or process still uses is not empty and stays (``rmdir`` refuses)."""
        self._segment = None
        for folder in [self._spool, *(p for p in self._made if p != self._spool)]:
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty, or not ours to remove (a mount point)
                break
        self._made = []

    def _hold(self, lines: list[str]) -> None:
        if self._held_events + len(lines) > self._cap:
            self._drop(lines, f"the spool cannot be written and {self._held_events} events already wait in memory")
            return
        self._held.append(lines)
        self._held_events += len(lines)

    def _drop(self, lines: list[str], why: str) -> None:
        if not self.dropped_spool:
            log.error("trainmon: dropping events (counted in dropped_spool): %s", why)
        self.dropped_spool += len(lines)

    def _replay(self, final: bool) -> None:
        """Send spooled segments oldest first, then what waits in memory; stop at the first failure and
        back off. At close, only until the deadline: the segments stay for the next process."""
        now = time.monotonic()
        if (now < self._retry_at and not final) or now >= self._deadline:
            return
        replayed = False
        for segment in self._segments():
            if segment == self._segment:
                self._segment = None  # start a new one for anything spooled from now on
            lines, torn = [], 0
            try:
                f = open(segment, "rb")  # noqa: SIM115 - closed by the with below
            except FileNotFoundError:  # replayed by another process of this rank meanwhile
                continue
            with f:
                for n, raw in enumerate(f):
                    text = raw.decode("utf-8", "replace").strip()
                    if not text:
                        continue
                    try:
                        json.loads(text)
                    except ValueError:  # a torn write (the process was killed mid-line): an event lost
                        log.warning("trainmon: skipping corrupt line %d of spool segment %s", n + 1, segment)
                        torn += 1
                        continue
                    lines.append(text)
                    self._breathe()
            try:
                for i in range(0, len(lines), _REPLAY_BATCH):
                    self._send(lines[i : i + _REPLAY_BATCH])
            except OSError as exc:
                self._failed(exc)
                return
            segment.unlink(missing_ok=True)
            self.dropped_spool += torn  # counted once, when the segment is done with
            replayed = True
        while self._held:
            try:
                self._send(self._held[0])
            except OSError as exc:
                self._failed(exc)
                return
            self._held_events -= len(self._held.popleft())
        if self._spool_broken:
            self._spool_broken = False
            log.warning("trainmon: events held in memory delivered; spooling to %s again", self._spool)
        if replayed or self._made:
            self._tidy_spool()
