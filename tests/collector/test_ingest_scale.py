"""Ingest and detection work per batch does not grow with the size of the job (issue 24, goal 4).

A 16,384-rank job sends 16,384 batches a second, each from one rank. The ranks-per-run limit used
to be checked with a union of the batch's ranks and every rank the run had, so each batch cost
O(ranks) and the collector's check grew with the square of the world size (the largest single
item of the writer thread's profile at 4,096 ranks). These tests pin the limit's meaning within a
group of batches and after it, and that a batch of known ranks no longer walks the run's ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.events import batch, event
from trainmon.monitor.collector.detection import Detection
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import IngestError, IngestLimits, Ingestor, IngestResult, LimitError
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import Detector, Finding
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event, validate_batch


@pytest.fixture
def ingestor(tmp_path: Path) -> Iterator[Ingestor]:
    storage = Storage(str(tmp_path / "db.sqlite"))
    yield Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState(), IngestLimits(4, 4, 16))
    storage.close()


def _ranks(*ranks: int, run: str = "job", seq: int = 0) -> list[Event]:
    """One step of each rank (its own stream), as one batch."""
    return validate_batch(
        batch(
            [event("step", {"step": seq, "loss": 2.0}, run=run, rank=r, stream=f"{run}-r{r}", seq=seq) for r in ranks]
        )
    )


def _group(ing: Ingestor, *batches: list[Event]) -> list[IngestResult | IngestError]:
    out: list[IngestResult | IngestError] = []
    ing.ingest_group(list(batches), out.extend)
    return out


def test_the_rank_limit_counts_each_rank_once_within_a_group_and_after(ingestor: Ingestor) -> None:
    first = _group(ingestor, _ranks(0, 1), _ranks(2), _ranks(3, 4), _ranks(0, 3, seq=1))
    # 0, 1, 2 join; 3 and 4 together would make 5 ranks (refused whole); 0 again and 3 alone make 4.
    assert [type(r) for r in first] == [IngestResult, IngestResult, LimitError, IngestResult]
    assert "would have 5 ranks, at most 4" in str(first[2])
    then = _group(ingestor, _ranks(1, 2, seq=2), _ranks(4, seq=2))
    assert isinstance(then[0], IngestResult) and then[0].accepted == 2  # known ranks go on at the limit
    assert isinstance(then[1], LimitError) and "would have 5 ranks" in str(then[1])


class _NoWalk(dict):
    """A run's ranks that fail the test when walked (looked up one by one is what a batch needs)."""

    def _walked(self, *_: Any) -> Any:
        raise AssertionError("a batch walked all of the run's ranks")

    __iter__ = keys = items = values = _walked


def test_a_batch_of_known_ranks_does_not_walk_the_runs_ranks(ingestor: Ingestor) -> None:
    ingestor.limits = IngestLimits(4, 1 << 20, 16)
    assert all(isinstance(r, IngestResult) for r in _group(ingestor, _ranks(*range(64))))
    state = ingestor.live.runs["job"]
    state.ranks = _NoWalk(state.ranks)
    results = _group(ingestor, *(_ranks(r, seq=1) for r in range(64)))
    assert all(isinstance(r, IngestResult) and r.accepted == 1 for r in results)
    assert len(state.ranks) == 64


def _steps_of(ranks: range) -> list[tuple[Event, int]]:
    return [(ev, 0) for ev in _ranks(*ranks)]


def test_the_clock_skips_rank_detectors_without_a_tick() -> None:
    """The built-in rank detectors have no silence check (hangs are run-wide): the once-a-second tick
    used to call each of them for every rank, 230k empty calls a second at 16,384 ranks."""
    detection = Detection(DetectorsConfig())
    detection.observe(_steps_of(range(64)))
    detection.rank_dets = _NoWalk(detection.rank_dets)
    assert detection.tick(time.time()) == []


class _Silence(Detector):
    """A rank detector with a clock of its own: it reports every tick."""

    kind = "nan_inf"  # borrows a configured kind's section

    def __init__(self, config: object) -> None:
        self.config = config

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        return []

    def tick(self, now: float) -> list[Finding]:
        return [Finding(self.kind, "warning", None, "silent", "", {})]


def test_a_rank_detector_with_a_tick_still_gets_the_clock() -> None:
    detection = Detection(DetectorsConfig(), (_Silence,))
    detection.observe(_steps_of(range(3)))
    assert sorted(rank for _, rank, _ in detection.tick(time.time())) == [0, 1, 2]
