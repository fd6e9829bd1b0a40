"""The collector's single write path: request bodies in, acknowledgements out.

One thread decodes, validates and commits every batch the HTTP layer receives, then hands the
group to the detectors (in a child process: see ``trainmon.monitor.collector.detection_process``) and goes on with
the next group; each batch is answered when its group's detection is done, so a producer that
got its acknowledgement can read the anomalies its events raised. Batches that
arrive while a group is being committed wait in a queue and go into the next group, so a
thousand ranks cost a few transactions (and fsyncs) a second, and no request thread ever
contends for a lock: under load the queue is the batching; requests that trickle in wait a few
milliseconds for company (``_LINGER_S``). A batch is acknowledged only after
its group committed; a refused batch (bad JSON, schema, a stream conflict) is answered alone
and never touches the others of its group. Each body is stamped with the collector's wall time
when it was received: the producers' clocks are judged by it (``trainmon.clock``).

The queue is bounded: beyond ``max_pending`` waiting bodies the collector answers 503 at once
(with ``Retry-After``) instead of growing without limit; the producer's transport spools the
batch and retries, so overload costs latency, never data.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import sqlalchemy.exc

from trainmon import wire
from trainmon.monitor.collector.exporter import CollectorMetrics
from trainmon.monitor.collector.ingest import BatchTooLarge, IngestError, Ingestor, IngestResult, LimitError

__all__ = ["IngestWriter", "Reply"]

log = logging.getLogger("trainmon.collector")

# (HTTP status, JSON body, extra headers)
Reply = tuple[int, dict[str, Any], list[tuple[bytes, bytes]]]
# (request body, callback, perf_counter when received, wall time when received, the producer's wall time when it
# sent the request (wire.SENT_HEADER) or None: the producer's clock is judged by the two)
_Pending = tuple[bytes, Callable[[Reply], None], float, float, float | None]

# Bodies per transaction, in bytes (~800 step events): big enough that a commit is rare, small enough that
# a batch waits for at most ~0.1 s of someone else's group (latency). A larger body is a group of its own.
_MAX_GROUP_BYTES = 512 << 10
# How long a group with room waits for more batches, from its oldest one's arrival. Requests that trickle in (a node
# forwarder's: one a node a second, spread over the second) each found the writer idle and were committed alone: with
# 8 ranks a request, py-spy's samples in the collector's commits rose from 50 to 159 (session 11). A producer waits
# 1 s for its flush anyway; under load the queue fills a group and nothing waits. Where waiting catches nothing
# (one producer that sends its next batch only once this one is acknowledged) it stops, and is tried again later.
_LINGER_S = 0.02
_IDLE_LINGERS = 3  # waits in a row that caught no batch ...
_LINGER_RETRY_S = 1.0  # ... stop the waiting for this long


class IngestWriter:
    """Owns ingestion: ``submit`` from any thread; replies come from the writer thread, or from the
    detection reader thread once the group's detection is done."""

    def __init__(
        self, ingestor: Ingestor, metrics: CollectorMetrics, max_pending: int = 4096, max_bytes: int = 256 << 20
    ) -> None:
        self._ingestor = ingestor
        self._metrics = metrics
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self.queued_bytes = 0  # bodies waiting in the queue (the ingress adds what it is still receiving)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._ready = threading.Condition()
        self._stop = False
        self._busy_since: float | None = None  # when the oldest batch of the group being committed arrived
        self._lingering = False  # the group being formed waits for more batches (_LINGER_S)
        self._idle_lingers = 0  # waits in a row that caught nothing
        self._linger_after = 0.0  # no waiting before this perf_counter time
        self.write_failure: tuple[float, str] | None = None  # (since, why) while commits fail; /healthz says it
        self._thread = threading.Thread(target=self._run, name="trainmon-writer", daemon=True)
        self._thread.start()

    def submit(self, body: bytes, done: Callable[[Reply], None], sent: float | None = None) -> None:
        """Queue a request body (``sent``: when the producer sent it, on its clock, if it said); ``done(reply)``
        is called once, when it is committed and detected, or refused."""
        with self._ready:
            if self._stop or len(self._queue) >= self._max_pending or self.queued_bytes + len(body) > self._max_bytes:
                self._metrics.rejected.labels("overload").inc()
                done(_overloaded(len(self._queue)))
                return
            self.queued_bytes += len(body)
            self._queue.append((body, self._answer_once(done), time.perf_counter(), time.time(), sent))
            self._metrics.inflight.inc()
            self._ready.notify()

    def _answer_once(self, done: Callable[[Reply], None]) -> Callable[[Reply], None]:
        answered = False

        def answer(reply: Reply) -> None:
            nonlocal answered
            if answered:  # after an internal error the writer answers every batch of the group again
                return
            answered = True
            self._metrics.inflight.dec()
            done(reply)

        return answer

    def lag(self) -> float:
        """Seconds the oldest batch received but not yet handed to the detectors has waited.

        Silence (a hang) must be judged on what the collector has read, not on what waits in its
        own queue: a slow commit would otherwise look like a thousand ranks going quiet at once."""
        with self._ready:
            waiting = [self._queue[0][2]] if self._queue else []
        busy = self._busy_since
        if busy is not None:
            waiting.append(busy)
        return time.perf_counter() - min(waiting) if waiting else 0.0

    def close(self, timeout: float = 30.0) -> None:
        """Commit what was queued within ``timeout`` seconds, then stop the thread (answers of the last
        groups may follow). Batches still queued at the deadline are answered 503, not acknowledged:
        their producers send them again to the next collector."""
        with self._ready:
            self._stop = True
            self._ready.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return
        with self._ready:
            abandoned = list(self._queue)  # the thread returns when it finds the queue empty
            self._queue.clear()
            self.queued_bytes = 0
        for _, done, _, _, _ in abandoned:
            done((503, {"error": "collector shutting down; retry later"}, [(b"retry-after", b"1")]))

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stop:
                    self._ready.wait()
                if not self._queue:
                    return
                group = [self._queue.popleft()]
                size = len(group[0][0])
                self._busy_since = group[0][2]  # FIFO: the first is the oldest
                lingered = 0  # batches that came while the group waited
                while True:
                    while self._queue and size + len(self._queue[0][0]) <= _MAX_GROUP_BYTES:
                        group.append(self._queue.popleft())
                        size += len(group[-1][0])
                        lingered += self._lingering
                    now = time.perf_counter()
                    left = group[0][2] + _LINGER_S - now
                    if self._queue or self._stop or left <= 0 or now < self._linger_after:
                        break  # full, closing, waited long enough, or waiting has been catching nothing
                    self._lingering = True
                    self._ready.wait(left)
                if self._lingering:
                    self._lingering = False
                    self._idle_lingers = 0 if lingered else self._idle_lingers + 1
                    if self._idle_lingers >= _IDLE_LINGERS:  # one producer waiting on its own acks: try later
                        self._linger_after, self._idle_lingers = time.perf_counter() + _LINGER_RETRY_S, 0
                self.queued_bytes -= size
            try:
                self._ingest(group)
            except Exception as exc:  # the writer must outlive any bug in one group
                log.exception("ingest of a group failed")
                for _, done, _, _, _ in group:
                    done((500, {"error": f"collector error: {exc}"}, []))
            finally:
                self._busy_since = None

    def _ingest(self, group: list[_Pending]) -> None:
        batches: list[list[wire.Event]] = []
        waiting: list[tuple[Callable[[Reply], None], float]] = []
        arrivals: list[float] = []
        sents: list[float | None] = []
        for body, done, received, arrival, sent in group:
            events = self._decode(body, done)
            if events is not None:
                batches.append(events)
                waiting.append((done, received))
                arrivals.append(arrival)
                sents.append(sent)
        if batches:
            self._commit(batches, waiting, arrivals, sents)

    def _commit(
        self,
        batches: list[list[wire.Event]],
        waiting: list[tuple[Callable[[Reply], None], float]],
        arrivals: list[float],
        sents: list[float | None],
    ) -> None:
        """One transaction for the batches. If it fails on a batch's data rather than on the database,
        each batch gets a transaction of its own: the others of the group commit, and the one that
        cannot be stored is refused (422: retrying would fail forever), without the SQL."""
        try:
            self._ingestor.ingest_group(
                batches, lambda results: self._answer(batches, waiting, results), arrivals=arrivals, sents=sents
            )
            self.write_failure = None
            return
        except Exception as exc:  # nothing of the group was stored or acknowledged
            failure = exc
        if len(batches) > 1 and not isinstance(failure, _OUTAGE):
            log.warning("a group of %d batches failed (%s); committing them one by one", len(batches), failure)
            for events, pending, arrival, sent in zip(batches, waiting, arrivals, sents, strict=True):
                self._commit([events], [pending], [arrival], [sent])
            return
        if len(batches) == 1 and isinstance(failure, _UNSTORABLE) and not isinstance(failure, _OUTAGE):
            problem = str(getattr(failure, "orig", None) or failure).splitlines()[0][:200]
            log.error("a batch of %d events could not be stored and was refused: %s", len(batches[0]), problem)
            self._metrics.rejected.labels("unstorable").inc()
            waiting[0][0]((422, {"error": f"events could not be stored ({type(failure).__name__}: {problem})"}, []))
            return
        log.error("storage failed; %d batches answered 503", len(batches), exc_info=failure)
        self._metrics.rejected.labels("storage").inc(len(batches))
        problem = str(getattr(failure, "orig", None) or failure).splitlines()[0][:200]
        if self.write_failure is None:
            self.write_failure = (time.time(), problem)
        for done, _ in waiting:
            done((503, {"error": f"storage failed, retry later: {problem}"}, [(b"retry-after", b"1")]))

    def _answer(
        self,
        batches: list[list[wire.Event]],
        waiting: list[tuple[Callable[[Reply], None], float]],
        results: list[IngestResult | IngestError],
    ) -> None:
        now = time.perf_counter()
        for events, (done, received), result in zip(batches, waiting, results, strict=True):
            self._metrics.latency.observe(now - received)
            if isinstance(result, LimitError):
                self._metrics.rejected.labels("limit").inc()
                done((429, {"error": str(result)}, [(b"retry-after", b"5")]))
                continue
            if isinstance(result, BatchTooLarge):
                self._metrics.rejected.labels("too_large").inc()
                done((413, {"error": str(result)}, []))
                continue
            if isinstance(result, IngestError):
                self._metrics.rejected.labels("conflict").inc()
                done((409, {"error": str(result)}, []))
                continue
            self._metrics.batches.inc()
            self._metrics.duplicates.inc(result.duplicates)
            for kind, n in collections.Counter(ev.kind for ev in events).items():
                self._metrics.events.labels(kind).inc(n)
            payload: dict[str, Any] = {"accepted": result.accepted, "duplicates": result.duplicates}
            if result.stored_as:  # a job kept apart from another under its run name: its findings are there
                payload["stored_as"] = result.stored_as
            done((200, payload, []))

    def _decode(self, body: bytes, done: Callable[[Reply], None]) -> list[wire.Event] | None:
        try:
            raw = orjson.loads(body)  # strict JSON, as the format says: no bare NaN tokens
        except orjson.JSONDecodeError as exc:
            self._metrics.rejected.labels("json").inc()
            done((400, {"error": f"body is not valid JSON: {exc}"}, []))
            return None
        try:
            return wire.validate_batch(raw)
        except wire.WireError as exc:
            self._metrics.rejected.labels("schema").inc()
            done((422, {"error": str(exc), "field": exc.path}, []))
            return None


# The database is unreachable or failing as a whole: every batch is answered 503 and retried.
_OUTAGE = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.TimeoutError, OSError)
# Errors that one batch's data can cause: alone in its transaction, such a batch is refused for good.
_UNSTORABLE = (sqlalchemy.exc.DataError, sqlalchemy.exc.IntegrityError, RecursionError, ValueError, TypeError)


def _overloaded(pending: int) -> Reply:
    return (
        503,
        {"error": f"collector overloaded ({pending} batches waiting); retry later"},
        [(b"retry-after", b"1")],
    )
