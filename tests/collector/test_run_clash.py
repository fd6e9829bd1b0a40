"""Two jobs under one run name (issue 27, part 5): kept apart and named, never merged.

Two jobs of two ranks each post under the run name "test" at the same time, interleaved batch by
batch, with losses far apart (a merged series would spike at every switch). Each job is stored as a
run of its own, detection sees each alone, both carry a ``run_clash`` finding naming the other, and
``trainmon runs`` lists both. A relaunch after the first job ended is still a restart (attempt 1 of
the same run), and the routing survives a collector restart. On SQLite and on a real PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.events import batch, event, step_events
from tests.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from trainmon.monitor.cli import main
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor, IngestResult
from trainmon.monitor.collector.launches import derived_run
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.queries import anomaly_rows, run_rows, stream_rows
from trainmon.monitor.store.step_reads import latest_step
from trainmon.monitor.store.storage import Storage
from trainmon.wire import validate_batch

T0 = 1.7e9
STEPS = 60
CHUNK = 10  # steps per batch
# launch id -> (loss level, hosts of ranks 0 and 1)
JOBS = {"job-a": (2.0, ("node-a0", "node-a1")), "job-b": (9.0, ("node-b0", "node-b1"))}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "db.sqlite") if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
def storage(url: str) -> Iterator[Storage]:
    store = Storage(url)
    yield store
    store.close()


def _ingestor(storage: Storage) -> Ingestor:
    return Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())


def _post(ingestor: Ingestor, events: list[dict[str, Any]]) -> IngestResult:
    return ingestor.ingest(validate_batch(batch(events)))


def _host(ev: dict[str, Any], host: str) -> dict[str, Any]:
    return {**ev, "host": host}


def _start(launch: str | None, rank: int, stream: str, t: float, host: str) -> dict[str, Any]:
    fields = {"world_size": 2, "planned_steps": STEPS, **({"launch_id": launch} if launch else {})}
    return _host(event("run_start", fields, run="test", rank=rank, stream=stream, t=t), host)


def _steps(launch: str, rank: int, first: int, t0: float = T0) -> list[dict[str, Any]]:
    level, hosts = JOBS[launch]
    out = step_events(
        CHUNK, start_seq=first + 1, run="test", rank=rank, stream=f"{launch}-r{rank}", loss=lambda i: level - 0.001 * i
    )
    for i, ev in enumerate(out):
        ev["fields"]["step"] = first + i
        ev["time"] = t0 + 0.5 * (first + i)
    return [_host(ev, hosts[rank]) for ev in out]


def _run_concurrently(ingestor: Ingestor) -> None:
    """Both jobs start within a second and post every CHUNK steps, rank by rank, job by job."""
    for launch, (_, hosts) in JOBS.items():
        for rank in (0, 1):
            _post(ingestor, [_start(launch, rank, f"{launch}-r{rank}", T0 + 0.1 * rank, hosts[rank])])
    for first in range(0, STEPS, CHUNK):
        for rank in (0, 1):
            for launch in JOBS:
                _post(ingestor, _steps(launch, rank, first))


def _losses(storage: Storage, run: str) -> set[float]:
    with storage.connect() as conn:
        return {round(latest_step(conn, run)["loss"])}  # type: ignore[index]


def test_two_concurrent_jobs_under_one_name_are_stored_apart_and_named(
    storage: Storage, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ingestor = _ingestor(storage)
    _run_concurrently(ingestor)
    second = derived_run("test", "job-b")
    # What an acknowledgement's findings must be looked up by: job B's own run, not the name it sends.
    assert _post(ingestor, _steps("job-b", 0, STEPS)).stored_as == {"test": second}
    assert _post(ingestor, _steps("job-a", 0, STEPS)).stored_as == {}
    with storage.connect() as conn:
        assert {r["run"] for r in run_rows(conn)} == {"test", second}
        for run, launch in (("test", "job-a"), (second, "job-b")):
            streams = stream_rows(conn, run)
            # two ranks, one attempt each: the other job is no "attempt 1"
            assert sorted((s["rank"], s["attempt"], s["host"]) for s in streams) == [
                (0, 0, JOBS[launch][1][0]),
                (1, 0, JOBS[launch][1][1]),
            ]
        found = {run: anomaly_rows(conn, run) for run in ("test", second)}
    assert _losses(storage, "test") == {2} and _losses(storage, second) == {9}
    for run, other, launch, other_launch in (("test", second, "job-a", "job-b"), (second, "test", "job-b", "job-a")):
        # nothing of the merged series (spikes, a rollback advice): only the clash, on each run
        assert [(a["kind"], a["severity"], a["rank"]) for a in found[run]] == [("run_clash", "warning", -1)]
        clash = found[run][0]
        assert clash["evidence"]["launch_id"] == launch
        (named,) = clash["evidence"]["others"]
        assert named["run"] == other and named["launch_id"] == other_launch
        assert set(named["hosts"]) <= set(JOBS[other_launch][1]) and named["hosts"]
        assert other in clash["message"] and other_launch in clash["message"] and named["hosts"][0] in clash["message"]
        assert "run name of its own" in clash["hint"]
    assert main(["runs", "--db", url]) == 0
    listed = capsys.readouterr().out
    assert "test: 1 open: run_clash" in listed and f"{second}: 1 open: run_clash" in listed


@pytest.mark.parametrize(
    ("ended", "gap"), [(True, 30.0), (False, 3.0), (False, 30.0), (False, 1800.0)], ids=["ended", "3s", "30s", "30min"]
)
def test_a_relaunch_after_the_job_ended_or_went_silent_is_a_restart_of_the_same_run(
    storage: Storage, ended: bool, gap: float
) -> None:
    """The first job ended (rank 0's run_end), or was killed without a word (OOM, SIGKILL) and relaunched with a
    new launch id (a new process, torchrun --standalone's fresh rendezvous id) `gap` seconds later: a restart,
    not a second job. The first job sent every 0.5 s; silent for seconds, it has stopped."""
    ingestor = _ingestor(storage)
    for rank in (0, 1):
        _post(ingestor, [_start("job-a", rank, f"job-a-r{rank}", T0, JOBS["job-a"][1][rank])])
        _post(ingestor, _steps("job-a", rank, 0))
        if ended:
            end = event(
                "run_end", {"status": "failed", "step": CHUNK - 1}, run="test", rank=rank, stream=f"job-a-r{rank}"
            )
            _post(ingestor, [{**end, "seq": CHUNK + 1, "time": T0 + 0.5 * CHUNK}])
    later = T0 + 0.5 * (CHUNK if ended else CHUNK - 1) + gap
    for rank in (0, 1):
        _post(ingestor, [_start("job-b", rank, f"job-b-r{rank}", later, JOBS["job-b"][1][rank])])
        _post(ingestor, _steps("job-b", rank, CHUNK, t0=later))
    with storage.connect() as conn:
        assert [r["run"] for r in run_rows(conn)] == ["test"]
        assert sorted((s["rank"], s["attempt"]) for s in stream_rows(conn, "test")) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert "run_clash" not in {a["kind"] for a in anomaly_rows(conn, "test")}


def test_a_crash_and_relaunch_within_one_imported_batch_is_a_restart(storage: Storage) -> None:
    """A trainer's own events file (one batch on import): the crashed process, then 8 s later its relaunch."""
    ingestor = _ingestor(storage)
    first = [_start("process:a:1", 0, "p1", T0, "a"), *_steps("job-a", 0, 0)]
    for ev in first[1:]:
        ev["stream"] = "p1"
    later = T0 + 0.5 * CHUNK + 8.0
    second = [_start("process:a:2", 0, "p2", later, "a"), *_steps("job-a", 0, CHUNK, t0=later)]
    for i, ev in enumerate(second[1:]):
        ev["stream"], ev["seq"] = "p2", i + 1
    _post(ingestor, first + second)
    with storage.connect() as conn:
        assert [r["run"] for r in run_rows(conn)] == ["test"]
        assert sorted(s["attempt"] for s in stream_rows(conn, "test")) == [0, 1]


def test_ranks_of_one_job_go_together_and_survive_a_collector_restart(url: str) -> None:
    storage = Storage(url)
    _run_concurrently(_ingestor(storage))
    storage.close()
    second = derived_run("test", "job-b")

    storage = Storage(url)  # a new collector: nothing in memory
    ingestor = _ingestor(storage)
    later = T0 + 0.5 * STEPS
    # A stream it has stored goes on in its run; new processes of each job (rank 1 restarted first) find theirs.
    _post(ingestor, _steps("job-b", 0, STEPS, t0=T0))
    for launch, stream in (("job-b", "job-b-r1-again"), ("job-a", "job-a-r1-again")):
        restart = _start(launch, 1, stream, later, JOBS[launch][1][1])
        more = [{**ev, "stream": stream, "seq": i + 1} for i, ev in enumerate(_steps(launch, 1, STEPS, t0=T0))]
        _post(ingestor, [restart, *more])
    with storage.connect() as conn:
        assert {r["run"] for r in run_rows(conn)} == {"test", second}
        for run in ("test", second):
            assert sorted((s["rank"], s["attempt"]) for s in stream_rows(conn, run)) == [(0, 0), (1, 0), (1, 1)]
            assert [a["kind"] for a in anomaly_rows(conn, run)] == ["run_clash"]  # named once, not again
    assert _losses(storage, "test") == {2} and _losses(storage, second) == {9}
    storage.close()


def test_a_producer_without_a_launch_id_is_stored_as_before(storage: Storage) -> None:
    """Older hooks: the collector cannot tell a second job from a restart, and does not guess."""
    ingestor = _ingestor(storage)
    for stream in ("old-1", "old-2"):
        _post(ingestor, [_start(None, 0, stream, T0, "node-a0")])
    with storage.connect() as conn:
        assert sorted(s["attempt"] for s in stream_rows(conn, "test")) == [0, 1]
        assert anomaly_rows(conn, "test") == []
