"""The collector's memory stays bounded: fixed detector windows, finished runs evicted.

A collector lives for months and sees thousands of runs; what it holds per run (detector
instances, live values, the stream cache, the open-anomaly index) must leave memory some time
after the run ended (``evict_after_seconds``), and what it holds per rank must not grow with the
number of steps. Storage keeps everything; a run that comes back is primed from it, like after
a restart, so eviction never costs a detection or re-opens an anomaly.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path

import psutil
from sqlalchemy import select

from tests.conftest import start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.collector.detection_process import LocalDetection
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage, anomalies
from trainmon.wire import validate_batch


def _run_events(run: str, rank: int, n_steps: int, *, nan_at: int | None = None, end: bool = True) -> list[dict]:
    stream = f"{run}-r{rank}"
    evs = [event("run_start", {"world_size": 2, "vocab_size": 64}, run=run, rank=rank, stream=stream, seq=0)]
    loss = (lambda i: "NaN" if i == nan_at else 4.1 - 0.01 * i) if nan_at is not None else None
    evs += step_events(n_steps, run=run, rank=rank, stream=stream, start_seq=1, loss=loss)
    if end:
        evs.append(event("run_end", {"status": "finished", "step": n_steps - 1}, run=run, rank=rank, stream=stream,
                         seq=n_steps + 1))  # fmt: skip
    return evs


def _sizes(ing: Ingestor) -> dict[str, int]:
    eng = ing.engine
    sizes = {
        "primed_ranks": len(eng._primed_ranks),
        "primed_runs": len(eng._primed_runs),
        "open_index": len(eng._open),
        "live_runs": len(ing.live.runs),
        "stream_cache": len(ing._streams),
    }
    if isinstance(eng.detection, LocalDetection):  # a detection process holds its detectors in the child
        sizes["rank_detectors"] = len(eng.detection.detection.rank_dets)
        sizes["run_detectors"] = len(eng.detection.detection.run_dets)
    return sizes


def test_many_short_runs_leave_nothing_behind(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "churn.sqlite"))
    ing = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())

    def one_run(i: int) -> None:
        run = f"short-{i}"
        # Both ranks start, step and end (rank 0's run_end last, as in a real run); every 5th run
        # ends with an anomaly still open (NaN on the last step).
        per_rank = [_run_events(run, rank, 40, nan_at=39 if i % 5 == 0 else None) for rank in (1, 0)]
        ing.ingest(validate_batch(batch([ev for evs in per_rank for ev in evs])))
        assert ing.evict(0.0, 1e9) == [run]  # ended: gone at the next eviction pass

    for i in range(30):  # warm up: caches, compiled statements, allocator pools
        one_run(i)
    gc.collect()
    process = psutil.Process()
    rss0 = process.memory_info().rss
    objects0 = len(gc.get_objects())
    tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0]
    for i in range(30, 180):
        one_run(i)
        assert all(n == 0 for n in _sizes(ing).values()), _sizes(ing)
    gc.collect()
    traced_growth = tracemalloc.get_traced_memory()[0] - traced0
    tracemalloc.stop()
    objects_growth = len(gc.get_objects()) - objects0
    rss_growth = process.memory_info().rss - rss0
    storage.close()
    # 150 runs x 2 ranks x 42 events went through; holding even 2 KiB per run would show as 300 KiB.
    assert traced_growth < 256 << 10, traced_growth
    assert objects_growth < 2000, objects_growth
    assert rss_growth < 16 << 20, rss_growth  # allocator and SQLite page-cache noise only


def test_detector_state_does_not_grow_with_steps() -> None:
    """Per-rank state is fixed windows: 20,000 steps hold what 2,000 steps hold."""
    storage = Storage("sqlite://")
    ing = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    start = event("run_start", {"world_size": 1, "vocab_size": 64}, run="long", stream="long", seq=0)
    ing.ingest(validate_batch(batch([start])))

    def steps(first: int, n: int) -> None:
        for k in range(first, first + n, 500):
            evs = step_events(500, run="long", stream="long", start_seq=k + 1)
            for j, ev in enumerate(evs):
                ev["fields"]["step"] = k + j
                ev["fields"]["loss"] = 3.0 + 0.1 * ((k + j) % 7) / 7
            ing.ingest(validate_batch(batch(evs)))

    steps(0, 2000)
    detection = ing.engine.detection.detection
    dets = detection.rank_dets[("long", 0)].dets + detection.run_dets["long"].dets
    gc.collect()
    tracemalloc.start()
    steps(2000, 2000)
    after_2k = tracemalloc.get_traced_memory()[0]
    steps(4000, 16000)
    after_20k = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after_20k - after_2k < 128 << 10, (after_2k, after_20k, [type(d).__name__ for d in dets])


def test_eviction_timer_and_a_returning_run_keeps_its_open_anomaly(tmp_path: Path) -> None:
    lc = start_collector(tmp_path / "evict.sqlite", evict_after_seconds=0.5)
    try:
        evs = _run_events("comeback", 0, 30, nan_at=29)
        assert lc.post(batch(evs))[0] == 200
        ing = lc.collector.ingestor
        assert ("comeback", 0) in ing.engine._primed_ranks
        deadline = time.monotonic() + 10
        while ing.live.runs and time.monotonic() < deadline:  # the ticker evicts once a second
            time.sleep(0.1)
        assert all(n == 0 for n in _sizes(ing).values()), _sizes(ing)
        assert lc.get_json("/v1/runs")[0]["run"] == "comeback"  # storage keeps it

        # The same stream sends again (a late tail): the NaN anomaly is extended, not opened twice.
        more = step_events(5, run="comeback", stream="comeback-r0", start_seq=32, loss=lambda i: "NaN")
        for j, ev in enumerate(more):
            ev["fields"]["step"] = 30 + j
        assert lc.post(batch(more))[0] == 200
        with lc.collector.storage.connect() as conn:
            rows = conn.execute(
                select(anomalies.c.status, anomalies.c.first_step, anomalies.c.last_step).where(
                    anomalies.c.run == "comeback", anomalies.c.kind == "nan_inf"
                )
            ).all()
        assert [tuple(r) for r in rows] == [("open", 29, 34)]
    finally:
        lc.stop()


def test_running_runs_are_not_evicted_until_idle(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "idle.sqlite"))
    ing = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    ing.ingest(validate_batch(batch(_run_events("live", 0, 10, end=False))))
    assert ing.evict(0.0, 3600.0) == []  # still running
    time.sleep(0.05)
    assert ing.evict(0.0, 0.01) == ["live"]  # silent longer than evict_idle_seconds
    storage.close()
