"""Requests that trickle in are committed together: a group with room waits ``_LINGER_S`` for company.

Before, a node forwarder's requests (one a node a second, spread over the second) each found the writer idle and
were committed alone, one transaction and one detection round trip each. A producer that sends its next batch only
once the last is acknowledged has no company to wait for: after ``_IDLE_LINGERS`` waits that caught nothing the
writer stops waiting for ``_LINGER_RETRY_S``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.events import batch, event
from trainmon.monitor.collector import writer as writer_module
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.exporter import CollectorMetrics
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.collector.writer import IngestWriter
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage


class _Counted:
    """The real ingestor, with the groups it was handed counted."""

    def __init__(self, ingestor: Ingestor) -> None:
        self.ingestor = ingestor
        self.groups: list[int] = []

    def ingest_group(self, batches: list[Any], *args: Any, **kwargs: Any) -> None:
        self.groups.append(len(batches))
        self.ingestor.ingest_group(batches, *args, **kwargs)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[tuple[IngestWriter, _Counted]]:
    storage = Storage(str(tmp_path / "db.sqlite"))
    counted = _Counted(Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState()))
    w = IngestWriter(counted, CollectorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    yield w, counted
    w.close()
    counted.ingestor.engine.close()
    storage.close()


def _body(rank: int, seq: int) -> bytes:
    stream = f"s{rank}"
    events = [event("run_start", {"world_size": 9}, rank=rank, stream=stream, seq=0)] if seq == 0 else []
    events.append(event("step", {"step": seq, "loss": 1.0}, rank=rank, stream=stream, seq=seq + 1))
    return json.dumps(batch(events)).encode()


def _send(w: IngestWriter, body: bytes) -> threading.Event:
    done = threading.Event()
    replies: list[Any] = []

    def answer(reply: Any) -> None:
        replies.append(reply)
        done.set()

    w.submit(body, answer)
    done.replies = replies  # type: ignore[attr-defined]
    return done


def test_trickling_requests_are_committed_together(
    writer: tuple[IngestWriter, _Counted], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight ranks' requests 10 ms apart, each alone before (a commit of one step takes a few milliseconds), go
    into one or two groups under a wait long enough that a loaded machine cannot stretch the gaps past it; every
    one is acknowledged. (With the wait at 0 the same run gives 8 groups on a quiet machine.)"""
    monkeypatch.setattr(writer_module, "_LINGER_S", 0.5)
    w, counted = writer
    first = _send(w, _body(8, 0))  # the run's first batch (its run_start) is slower to store: not part of the test
    assert first.wait(30)
    counted.groups.clear()
    waits = []
    for rank in range(8):
        waits.append(_send(w, _body(rank, 0)))
        time.sleep(0.01)
    for done in waits:
        assert done.wait(30)
        assert done.replies[0][0] == 200, done.replies  # type: ignore[attr-defined]
    assert sum(counted.groups) == 8
    assert len(counted.groups) <= 2, counted.groups


def test_one_producer_waiting_on_its_acks_stops_the_waiting(writer: tuple[IngestWriter, _Counted]) -> None:
    """Sent one at a time, each acknowledged before the next: nothing ever comes to wait for, so after
    _IDLE_LINGERS waits the writer stops waiting (for _LINGER_RETRY_S), and every batch is its own group."""
    w, counted = writer
    for seq in range(writer_module._IDLE_LINGERS + 2):
        done = _send(w, _body(0, seq))
        assert done.wait(30)
        assert done.replies[0][0] == 200, done.replies  # type: ignore[attr-defined]
    assert counted.groups == [1] * (writer_module._IDLE_LINGERS + 2)
    assert w._linger_after > time.perf_counter()  # waiting suspended
