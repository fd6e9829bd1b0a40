"""Detection in a child process, so the collector's two halves run on two cores.

One collector process runs under one GIL: decoding, validating and committing a thousand
ranks' batches, and running fourteen detectors over every event, took turns on one core, and
batches queued behind each other (issue 7: p99 ingest-to-anomaly above 2 s at 100k samples/s).
Detection is pure computation over the committed events, so it moves to a child process: the
writer thread commits group N+1 while the child looks at group N.

The child is ``python -m trainmon.monitor.collector.detection_process``, talking over its stdin and stdout in
length-prefixed frames. Not ``multiprocessing``: its spawn and forkserver methods re-run the
parent's ``__main__`` in the child (a user script that opens a collector without a
``__main__`` guard would start it again), and fork is unsafe in a process with threads. The
parent sends events (pickled column by column, ``_events``: NaN and infinities cross as the
floats the detectors must see) and gets findings back; storage, the anomaly table and notifications stay
in the parent (``trainmon.monitor.collector.engine``). The child ignores SIGINT and SIGTERM and exits when its
stdin closes, so it never outlives the collector, and a signal to the collector (or, since it
runs in a session of its own, to the collector's process group) cannot kill it half-way through
a group. If it dies anyway, the parent answers what was in flight with no findings
(the events are stored; only their detection is lost, and logged), starts a new child, and
re-primes it from storage as after a restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import json
import logging
import operator
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from trainmon.monitor.collector.detection import Detection, Keyed
from trainmon.monitor.config import DetectorsConfig, detectors_config
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.monitor.detectors.batch import Reading
from trainmon.wire import Event

__all__ = ["Answer", "DetectionProcess", "LocalDetection", "SplitDetection"]

log = logging.getLogger("trainmon.collector")

Items = list[tuple[Event, int]]


class Segment(NamedTuple):
    """A run of consecutive events of one stream (a producer's batch is one), with each event's seq, time, kind
    and fields read once: what the ingest looks up, checks and counts once per segment rather than once per event
    (a whole batch of an import). Read together, as the batch arrives, while its events are in the CPU's caches:
    read at the write, after the dedupe and the bookkeeping, the fields of a million events took 3% of the
    Ingestor's CPU. The pipe's encoding reads the rest of what it sends (``_columns``), not every event's ten
    attributes again (0.23 s of a million-row import's CPU, a third of what its pipe cost)."""

    events: list[Event]
    seqs: list[int]
    times: list[float]
    kinds: list[str]
    fields: list[dict[str, Any]]


Part = tuple[Segment, int]
"""Events stored together: a segment (of one stream, run and rank: the ingest's, or what it stored of one) and its
events' attempt."""


def parts(items: Items) -> list[Part]:
    """``items`` (events with their attempts) as :data:`Part` s: each run of consecutive items of one stream, run,
    rank and attempt."""
    return [_part(list(same)) for _, same in itertools.groupby(items, _part_key)]


def _part(items: Items) -> Part:
    events = [e for e, _ in items]
    segment = Segment(
        events,
        [e.seq for e in events],
        [e.time for e in events],
        [e.kind for e in events],
        [e.fields for e in events],
    )
    return segment, items[0][1]


def pairs(done: list[Part]) -> Items:
    """The parts' events, each with its attempt, in order."""
    events, attempts = map(_FIRST, map(_FIRST, done)), map(itertools.repeat, map(_SECOND, done))
    return list(itertools.chain.from_iterable(map(zip, events, attempts)))


def _part_key(item: tuple[Event, int]) -> tuple[str, str, int, int]:
    event, attempt = item
    return event.stream, event.run, event.rank, attempt


_RUN = operator.attrgetter("run")
_RANK = operator.attrgetter("rank")
_STREAM = operator.attrgetter("stream")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


Answer = Callable[[list[Keyed]], None]
"""What a detection calls with the findings of one call, keyed (``detection.Keyed``) and in key order."""


class LocalDetection:
    """Detection in the caller's thread (imports, tests, benchmarks): callbacks run before return."""

    generation = 0
    inflight = 0
    lost = 0

    def __init__(self, config: DetectorsConfig, detectors: tuple[type[Detector], ...] = ALL_DETECTORS) -> None:
        self.detection = Detection(config, detectors)

    def feed_rank(self, run: str, rank: int, history: Items) -> None:
        self.detection.feed_rank(run, rank, history)

    def feed_run(self, run: str, history: Items) -> None:
        self.detection.feed_run(run, history)

    def observe(self, stored: list[Part], done: Answer) -> None:
        done(self.detection.observe_keyed(pairs(stored)))

    def tick(self, now: float, done: Answer) -> None:
        done(self.detection.tick_keyed(now))

    def forget(self, run: str) -> None:
        self.detection.forget(run)

    def close(self, timeout: float = 0.0) -> None:
        pass


class DetectionProcess:
    """A :class:`Detection` in a child process, driven over a pipe; results come back by callback.

    Calls are sent in order and answered in order. ``observe`` blocks once ``max_inflight``
    groups wait for their findings, so a child that falls behind slows the writer (and the
    collector's queue turns producers away with 503) instead of buffering without bound.
    ``generation`` counts the children started: when it changes, the detectors fed so far are
    gone and the engine feeds their history again. A child that answers nothing for
    ``stuck_after`` seconds while a call waits (a detector in an endless loop, a stopped process)
    is killed and replaced like a dead one: otherwise the collector would stop acknowledging.
    The default leaves room for priming a thousand ranks' history after a restart.

    Three threads touch the pipes, and only one of them may ever block on the child's stdin: a
    sender (the writer or the ticker) writes under ``_write_lock``; the reader drains stdout and
    takes nothing but the short ``_lock`` of the pending table; callbacks run on a dispatcher
    thread of their own. So the child can always hand its replies over and go back to reading
    its stdin, whatever locks the callbacks need (they take the engine's lock, which a sender may
    hold while it writes a rank's history). Holding a lock across a blocking write that the
    reader also needed froze the collector for good under load (both pipes full).
    """

    def __init__(
        self,
        config: DetectorsConfig,
        max_inflight: int = 8,
        stuck_after: float = 120.0,
        only: frozenset[str] | None = None,
    ) -> None:
        """``only``: the kinds of the built-in detectors the child runs (all when None; see :class:`SplitDetection`)."""
        setup = {"config": dataclasses.asdict(config), "only": None if only is None else sorted(only)}
        self._config = json.dumps(setup).encode()
        self._stuck_after = stuck_after
        self.generation = 0
        self.lost = 0  # calls answered with no findings because the child was gone, stuck or stopped
        self._lock = threading.Lock()  # the pending table, ``_closing``; never held across I/O
        self._write_lock = threading.Lock()  # the child's stdin, and the swap to a new child
        # call id -> (callback, monotonic time sent)
        self._pending: dict[int, tuple[Answer, float]] = {}
        self._ids = itertools.count()
        self._slots = threading.Semaphore(max_inflight)
        self._closing = False
        self._answers: queue.SimpleQueue[tuple[Answer, list[Keyed]] | None] = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch, name="trainmon-detection-callbacks", daemon=True)
        self._dispatcher.start()
        self._start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def inflight(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._pending)

    def _start(self) -> None:
        # The parent's import path, so the child finds this package wherever the collector found it; none
        # of its secrets (the bearer token, notification URLs): the child only computes.
        env = {k: v for k, v in os.environ.items() if not _secret(k)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            start_new_session=True,  # Ctrl-C or a TERM to the collector's process group does not reach it
        )
        self._proc, self._started = proc, time.monotonic()
        with contextlib.suppress(ImportError, OSError, AttributeError):  # Linux only; the default elsewhere
            import fcntl

            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        with contextlib.suppress(OSError):  # died at once: the reader sees it and starts another
            _write_frame(proc.stdin.fileno(), self._config)
        self._reader = threading.Thread(target=self._read, args=(proc,), name="trainmon-detection-reader", daemon=True)
        self._reader.start()

    def feed_rank(self, run: str, rank: int, history: Items) -> None:
        self._send(["feed_rank", run, rank, _events(history)])

    def feed_run(self, run: str, history: Items) -> None:
        self._send(["feed_run", run, _events(history)])

    def observe(self, stored: list[Part], done: Answer) -> None:
        self.observe_columns(_encode(stored)[0], done)

    def observe_columns(self, columns: list[tuple[Any, ...]], done: Answer) -> None:
        """:meth:`observe` of events already encoded for the pipe (``_encode``)."""
        self._slots.acquire()
        self._send(["observe", columns], done)

    def tick(self, now: float, done: Answer) -> None:
        self._slots.acquire()
        self._send(["tick", now], done)

    def forget(self, run: str) -> None:
        self._send(["forget", run])

    def close(self, timeout: float = 10.0) -> None:
        """Let the child answer what it was sent within ``timeout`` seconds, then stop it.

        Bounded whatever the child does: one that is stuck (or stopped) is killed at the deadline,
        and the calls it never answered get no findings (their events are stored; only their
        detection is lost, and logged)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        proc = self._proc
        # From a thread of its own: the write blocks if the child does not read, and must not hold up the deadline.
        threading.Thread(target=self._write, args=(_STOP,), name="trainmon-detection-stop", daemon=True).start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("detection process %s did not finish within %.0f s of shutdown; killing it", proc.pid, timeout)
            proc.kill()
            proc.wait(5)
        self._reader.join(5)  # it has read every answer the child wrote
        with self._lock:
            lost, self._pending = [done for done, _ in self._pending.values()], {}
            self.lost += len(lost)
        if lost:
            log.error("shutdown: %d groups lost their detection (their events are stored)", len(lost))
        for done in lost:
            self._answers.put((done, []))
        self._answers.put(None)
        self._dispatcher.join(timeout)  # the last answers' callbacks have run
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def _send(self, message: list[Any], done: Answer | None = None) -> None:
        key = None
        if done is not None:
            key = next(self._ids)
            message.insert(1, key)
        data = pickle.dumps(message, _PROTOCOL)  # outside any lock: the tick thread sends too
        if key is not None:
            with self._lock:
                closing = self._closing
                if closing:
                    self.lost += 1
                else:
                    self._pending[key] = (done, time.monotonic())  # before the write: the answer may come first
            if closing:  # the dispatcher may be gone: answer here, with no findings
                self._slots.release()
                done([])
                return
        if self._write(data) or key is None:
            return
        with self._lock:  # the child is gone; the reader is replacing it and may have answered this call already
            lost = self._pending.pop(key, None)
            self.lost += lost is not None
        if lost is not None:
            self._answers.put((lost[0], []))

    def _write(self, data: bytes) -> bool:
        """One frame to the child; False if it is gone. Blocks while the child is a pipe-full behind."""
        with self._write_lock:
            try:
                _write_frame(self._proc.stdin.fileno(), data)
                return True
            except (OSError, ValueError):  # a dead child's pipe (EPIPE), or one closed at shutdown
                return False

    def _dispatch(self) -> None:
        while (answer := self._answers.get()) is not None:
            done, found = answer
            self._slots.release()
            try:
                done(found)
            except Exception:  # a callback bug must not stop later groups from being answered
                log.exception("detection callback failed")

    def _read(self, proc: subprocess.Popen) -> None:
        frames = _Frames(proc.stdout.fileno())
        while True:
            try:
                frame = frames.read(timeout=1.0)
                if frame is None:
                    if self._stuck(proc):
                        break
                    continue
                call, found = pickle.loads(frame)
                findings: list[Keyed] = [(tuple(key), (run, rank, Finding(*f))) for key, run, rank, f in found]
            except (EOFError, OSError):
                break
            except Exception:  # a reply this side cannot read: start over rather than leave groups unanswered
                log.exception("unreadable reply from the detection process; replacing it")
                break
            with self._lock:
                entry = self._pending.pop(call, None)
            if entry is not None:
                self._answers.put((entry[0], findings))
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # dead already, or unreadable: a sender blocked on its stdin gets EPIPE now
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if self._closing:
            return
        if time.monotonic() - self._started < 1.0:
            time.sleep(1.0)  # a child that cannot even start: retry once a second, not in a tight loop
        with self._write_lock, self._lock:
            if self._closing or self._proc is not proc:
                return
            lost, self._pending = [done for done, _ in self._pending.values()], {}
            log.error(
                "detection process %s died (exit code %s); %d groups in flight lost their detection; restarting",
                proc.pid,
                proc.returncode,
                len(lost),
            )
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            self._start()
            self.generation += 1
            self.lost += len(lost)
        for done in lost:
            self._answers.put((done, []))

    def _stuck(self, proc: subprocess.Popen) -> bool:
        with self._lock:
            oldest = min((sent for _, sent in self._pending.values()), default=None)
        if oldest is None or time.monotonic() - oldest < self._stuck_after:
            return False
        log.error("detection process %s answered nothing for %.0f s; replacing it", proc.pid, self._stuck_after)
        return True


_PIPE_BYTES = 1 << 20
"""The child's stdin holds this much (Linux's default ceiling for a pipe; 64 KiB by default): two batches of an
import's 5,000 events, so the sender runs up to two batches ahead instead of waiting for the child to finish
the previous one before each write, and a batch slower to make on one side than the other evens out."""
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_STOP = pickle.dumps(["stop"], _PROTOCOL)


class SplitDetection:
    """Detection shared out: the detectors of ``in_thread`` run in the caller's thread, the others in a
    :class:`DetectionProcess`, and each call's findings are the two halves' merged by key (``detection.Keyed``): the
    order one detection of them all gives.

    An import's thread parses and stores while the child detects; with the child running every detector it was
    the slower of the two by half. The child gets each call first, so both halves work on it at once."""

    def __init__(self, config: DetectorsConfig, in_thread: frozenset[str]) -> None:
        self._here = Detection(config, only=in_thread)
        self._child = DetectionProcess(config, only=frozenset(c.kind for c in ALL_DETECTORS) - in_thread)

    @property
    def generation(self) -> int:
        return self._child.generation

    @property
    def inflight(self) -> int:
        return self._child.inflight

    @property
    def lost(self) -> int:
        return self._child.lost

    def feed_rank(self, run: str, rank: int, history: Items) -> None:
        self._child.feed_rank(run, rank, history)
        self._here.feed_rank(run, rank, history)

    def feed_run(self, run: str, history: Items) -> None:
        self._child.feed_run(run, history)
        self._here.feed_run(run, history)

    def observe(self, stored: list[Part], done: Answer) -> None:
        """The events are read once for both halves: the columns the child is sent are those this thread's
        detectors read (``_Batch``)."""
        columns, batch = _encode(stored)
        join = _Join(done)
        self._child.observe_columns(columns, join.half)
        join.half(batch.observe(self._here))

    def tick(self, now: float, done: Answer) -> None:
        join = _Join(done)
        self._child.tick(now, join.half)
        join.half(self._here.tick_keyed(now))

    def forget(self, run: str) -> None:
        self._child.forget(run)
        self._here.forget(run)

    def close(self, timeout: float = 10.0) -> None:
        self._child.close(timeout)


class _Join:
    """One call's two halves: the second to arrive, on whichever thread, merges them and answers. Answers stay in
    call order: a call's own half is done before the next call is sent, and the child answers in order."""

    __slots__ = ("_done", "_first", "_lock")

    def __init__(self, done: Answer) -> None:
        self._done = done
        self._first: list[Keyed] | None = None
        self._lock = threading.Lock()

    def half(self, keyed: list[Keyed]) -> None:
        with self._lock:
            first, self._first = self._first, keyed
        if first is not None:
            self._done(list(heapq.merge(first, keyed, key=_KEY)) if first and keyed else first or keyed)


_KEY = operator.itemgetter(0)


def _secret(name: str) -> bool:
    """Environment variables the detection child must not inherit."""
    upper = name.upper()
    return upper.startswith("TRAINMON_") or any(w in upper for w in ("TOKEN", "SECRET", "PASSWORD", "WEBHOOK"))


class _Batch:
    """One call's events and their attempts, with what detection reads of every event: its kind and fields, and the
    (run, rank) of a batch of one (None otherwise). Both sides of the pipe have these at hand as columns (``_encode``,
    ``_decode``), and hand them to their detectors' :class:`Reading` rather than read them from the events again:
    with the events and attempts as two lists rather than pairs, that is seven passes over the batch fewer on each
    side. Per million events in batches of 5,000, encoding, pickling and the parent's detection's reads cost 0.69 s
    of CPU instead of 0.9 s, and the child's unpickling, rebuilding and reads 0.85 s instead of 1.05 s (a loaded
    machine's figures)."""

    __slots__ = ("attempts", "events", "fields", "key", "kinds")

    def __init__(
        self,
        events: list[Event],
        attempts: list[int],
        kinds: list[str],
        fields: list[dict[str, Any]],
        key: tuple[str, int] | None,
    ) -> None:
        self.events = events
        self.attempts = attempts
        self.kinds = kinds
        self.fields = fields
        self.key = key

    def observe(self, detection: Detection) -> list[Keyed]:
        with Reading(self.events, self.fields, self.kinds):
            return detection.observe_events(self.events, self.attempts, self.key)


def _encode(stored: list[Part]) -> tuple[list[tuple[Any, ...]], _Batch]:
    """Events as the pipe carries them, and as a :class:`_Batch` for this side: one column per constructor argument,
    and the attempts (and the events themselves, for the batch), of the parts the ingest stored.

    A column whose values are all equal to its first (an import's 5,000 events share their kind, run, rank, host,
    stream, missing clock offset and attempt) goes as that value alone, which the child repeats. Those columns hold
    validated str and int values and None, for which equal means interchangeable; a float (a clock offset) is
    never collapsed, as 0.0 equals -0.0. The child rebuilds the events with one ``map(Event, *columns)`` (in C).
    Per million events of one stream, against one argument tuple per event: this side 0.33 s of CPU to encode and
    pickle instead of 0.37 s, the child 0.65 s to unpickle and rebuild instead of 0.69 s. What is left is the
    field dicts (0.16 s pickled, 0.2 s unpickled) and ``Event.__init__`` (0.18 s, a plain slots class). The ten
    columns cost each call about 2 us more on either side, which a group of some 30 events makes up (a live group
    of 256 from 32 streams costs the same as before): a collector whose groups are that small is nearly idle."""
    if not stored:
        return [], _Batch([], [], [], [], None)
    wire, events, kinds, fields, attempts = _columns(stored)
    return wire, _Batch(events, attempts, kinds, fields, _key(wire))


def _events(items: Items) -> list[tuple[Any, ...]]:
    """The pipe's columns alone (a rank's or run's history): none for no events."""
    return _columns(parts(items))[0] if items else []


def _columns(
    stored: list[Part],
) -> tuple[list[tuple[Any, ...]], list[Event], list[str], list[dict[str, Any]], list[int]]:
    """The columns the pipe carries, and the events, kinds, fields and attempts: the parts' own columns joined,
    their run, rank, stream and attempt (one a part) given once where every part has the same (else read event by
    event), and each event's host and clock offset read (in bytecode: a slot read there costs a third of an
    ``attrgetter`` call). A million-row import's batches: 0.07 s of CPU, against 0.23 s for a tuple of each event's
    attributes transposed. No Python code runs per part: a live group's parts are a few events each (256 events of
    32 streams: 47 us against 43, which its parts made instead of (event, attempt) pairs pay back)."""
    segments, attempts = zip(*stored, strict=True)
    by_column = list(zip(*segments, strict=True))
    events, seqs, times, kinds, fields = (list(itertools.chain.from_iterable(c)) for c in by_column)
    heads = list(map(_FIRST, by_column[0]))
    if len(attempts) == 1:
        attempt_column = [attempts[0]] * len(events)
    else:
        attempt_column = list(itertools.chain.from_iterable(map(itertools.repeat, attempts, map(len, by_column[0]))))
    columns = [
        _collapsed(tuple(kinds)),
        _one(list(map(_RUN, heads))) or tuple([e.run for e in events]),
        _one(list(map(_RANK, heads))) or tuple([e.rank for e in events]),
        _collapsed(tuple([e.host for e in events])),
        _one(list(map(_STREAM, heads))) or tuple([e.stream for e in events]),
        _collapsed(tuple([e.clock_offset for e in events])),
        _one(list(attempts)) or tuple(attempt_column),
        tuple(seqs),
        tuple(times),
        tuple(fields),
    ]
    return columns, events, kinds, fields, attempt_column


def _one(values: list[Any]) -> tuple[Any, ...]:
    """A column of one value a part (``values``: each part's) as :func:`_collapsed` gives it where every part has
    the same value; else empty (the column is read event by event)."""
    first = values[0]
    return (first,) if type(first) is not float and values.count(first) == len(values) else ()


def _collapsed(column: tuple[Any, ...]) -> tuple[Any, ...]:
    first = column[0]
    if type(first) is float or column[-1] != first:  # the last value first: a live group's streams differ there
        return column
    return column[:1] if column.count(first) == len(column) else column


def _decode(columns: list[tuple[Any, ...]]) -> _Batch:
    """``_encode``'s batch again, from its columns."""
    if not columns:
        return _Batch([], [], [], [], None)
    n = len(columns[-1])
    kinds, runs, ranks, hosts, streams, offsets, attempts, seqs, times, fields = (
        c if len(c) == n else c * n for c in columns
    )
    events = list(map(Event, kinds, runs, ranks, hosts, streams, seqs, times, fields, offsets))
    return _Batch(events, list(attempts), list(kinds), list(fields), _key(columns))


def _items(columns: list[tuple[Any, ...]]) -> Items:
    """``_events``' items again."""
    batch = _decode(columns)
    return list(zip(batch.events, batch.attempts, strict=True))


def _key(columns: list[tuple[Any, ...]]) -> tuple[str, int] | None:
    """The (run, rank) of every event where the columns of runs and ranks are collapsed to one value."""
    runs, ranks = columns[1], columns[2]
    return (runs[0], ranks[0]) if len(runs) == 1 and len(ranks) == 1 else None


def _found(keyed: list[Keyed]) -> list[list[Any]]:
    return [
        [key, run, rank, [f.kind, f.severity, f.step, f.message, f.hint, f.evidence, f.resolved, f.rank]]
        for key, (run, rank, f) in keyed
    ]


class _Frames:
    """Length-prefixed frames from a pipe (4 bytes big-endian, then the payload).

    Each frame is read straight into a buffer of its own size, which is what is returned: no read into a
    scratch buffer, no copies. Reading each chunk with ``os.read(fd, 1 MiB)`` into a growing buffer cost the
    detection child 0.5 s of CPU on a million-row import (a 1 MiB allocation per read, the frame copied
    twice out of the buffer), most of it when the child waited for the pipe and woke to a part of a frame."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._head = bytearray(4)
        self._frame: bytearray | None = None  # the payload being read, once its length is known
        self._got = 0  # bytes of the head or the payload read so far

    def read(self, timeout: float | None = None) -> bytearray | None:
        """The next frame; None when nothing arrived for ``timeout`` seconds. Raises EOFError."""
        while True:
            buf = self._head if self._frame is None else self._frame
            if self._got == len(buf):
                self._got = 0
                if self._frame is None:
                    self._frame = bytearray(int.from_bytes(self._head, "big"))
                    continue
                frame, self._frame = self._frame, None
                return frame
            if timeout is not None and not select.select([self._fd], [], [], timeout)[0]:
                return None
            n = os.readv(self._fd, [memoryview(buf)[self._got :]])
            if not n:
                raise EOFError
            self._got += n


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _serve() -> None:
    """The child: a Detection, fed over stdin until ``stop`` or the parent's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.dup(1)  # frames go to the real stdout; anything printed goes to stderr instead
    os.dup2(2, 1)
    frames = _Frames(0)
    try:
        setup = json.loads(frames.read())
        only = setup["only"]
        detection = Detection(detectors_config(setup["config"]), only=None if only is None else frozenset(only))
    except EOFError:
        return
    while True:
        try:
            frame = frames.read()
        except EOFError:
            return
        # No collection while a message is decoded and handled: its events and rows are acyclic garbage that
        # reference counting frees, and the collector's passes over them took 3.7 of the 4.3 us that decoding an
        # event cost. It runs again between messages, once the message is gone (``_handle``'s locals).
        gc.disable()
        try:
            if not _handle(detection, frame, out):
                return
        finally:
            gc.enable()


def _handle(detection: Detection, frame: bytearray, out: int) -> bool:
    """One message from the parent; False for ``stop``.

    Its own function so that the message (5,000 events' rows and field dicts) is freed when it returns, before
    the collector runs again: held until the next one replaced it, it was still alive at the first allocation
    after ``gc.enable``, and every collection between messages scanned it, and then again in the next
    generation, for nothing: 0.45 s of the child's CPU on a million-row import (182 + 17 collections, 5
    objects collected)."""
    message = pickle.loads(frame)
    if message[0] == "stop":
        return False
    _answer(detection, message, out)
    return True


def _answer(detection: Detection, message: list[Any], out: int) -> None:
    op = message[0]
    found: list[Keyed] = []
    try:
        if op == "observe":
            found = _decode(message[2]).observe(detection)
        elif op == "tick":
            found = detection.tick_keyed(message[2])
        elif op == "feed_rank":
            detection.feed_rank(message[1], message[2], _items(message[3]))
        elif op == "feed_run":
            detection.feed_run(message[1], _items(message[2]))
        elif op == "forget":
            detection.forget(message[1])
    except Exception:  # a detector bug costs this group's findings, not the process
        log.exception("detection (%s) failed", op)
    if op in ("observe", "tick"):  # the calls the parent waits for
        _write_frame(out, pickle.dumps([message[1], _found(found)], _PROTOCOL))


if __name__ == "__main__":
    _serve()
