"""The data lifecycle on SQLite and on a real PostgreSQL (issue 27, part 3): deleting a run, exporting
it as JSONL that the post-mortem reads back to the same report, and retention by age and by size."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.events import event, step_events
from trainmon.monitor.analysis.postmortem import analyse
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import ConfigError, DetectorsConfig, load_config
from trainmon.monitor.importers.store import import_log
from trainmon.monitor.store.export import export_lines
from trainmon.monitor.store.lifecycle import delete_run, store_bytes
from trainmon.monitor.store.retention import apply_retention, describe_retention
from trainmon.monitor.store.storage import Storage, metadata
from trainmon.wire import validate_batch

BASE = 1_700_000_000.0  # event times: November 2023, so ages are known whatever today is
DAY = 86400.0


def _ingestor(storage: Storage) -> Ingestor:
    return Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())


def _timed(events: list[dict[str, Any]], t0: float, dt: float = 1.0) -> list[dict[str, Any]]:
    return [{**e, "time": t0 + i * dt} for i, e in enumerate(events)]


def _whole_run(run: str, t0: float = BASE, n: int = 60, ended: bool = True) -> list[dict[str, Any]]:
    """Two ranks with every stored kind of event: steps (a NaN loss, per-layer norms), an evaluation, a
    checkpoint, a resume, health samples, and each rank's run_end."""
    out: list[dict[str, Any]] = []
    for rank in (0, 1):
        stream = f"{run}-s{rank}"
        start = {"world_size": 2, "vocab_size": 64, "planned_steps": n, "config": {"lr": 1e-3}}
        evs = [event("run_start", start, run=run, rank=rank, stream=stream, seq=0)]
        evs += step_events(n, run=run, rank=rank, stream=stream, loss=lambda i: "NaN" if i == 41 else 4.1 - 0.01 * i)
        evs[6]["fields"]["layer_grad_norms"] = {"h.0.w": 0.5, "h.1.w": 0.25}
        extra = [
            event("eval", {"step": 30, "loss": 3.9, "metrics": {"acc": 0.5}, "duration": 2.0}),
            event("checkpoint", {"step": 30, "path": "/ckpt/30", "duration": 1.5, "bytes": 1 << 20}),
            event("resume", {"step": 30, "path": "/ckpt/30", "duration": 0.5}),
            event("health", {"cpu_percent": 90.0, "gpus": [{"index": 0, "temperature_c": 70.0}]}),
        ]
        for k, e in enumerate(extra):
            evs.insert(32 + k, {**e, "run": run, "rank": rank, "stream": stream})
        if ended:
            evs.append(event("run_end", {"status": "finished", "step": n - 1}, run=run, rank=rank, stream=stream))
        for seq, e in enumerate(evs):
            e["seq"] = seq
        out += _timed(evs, t0)
    return sorted(out, key=lambda e: e["time"])


def _store(storage: Storage, events: list[dict[str, Any]]) -> None:
    ingestor = _ingestor(storage)
    for i in range(0, len(events), 50):
        ingestor.ingest(validate_batch({"version": 1, "events": events[i : i + 50]}))


def _rows_of(storage: Storage, run: str) -> dict[str, int]:
    with storage.connect() as conn:
        return {
            t.name: conn.execute(select(func.count()).select_from(t).where(t.c.run == run)).scalar_one()
            for t in metadata.sorted_tables
            if "run" in t.c
        }


def test_delete_removes_every_row_of_the_run_and_nothing_else(store: Storage) -> None:
    _store(store, _whole_run("gone") + _whole_run("kept", t0=BASE + 5))
    before = _rows_of(store, "kept")
    assert all(_rows_of(store, "gone").values())  # every table holds some of it: the test covers each

    deleted = delete_run(store, "gone", batch_rows=7)  # many small transactions

    assert set(_rows_of(store, "gone").values()) == {0}
    assert deleted == sum(before.values())  # the two runs are alike
    assert _rows_of(store, "kept") == before
    assert store.run_ids() == ["kept"]


def test_delete_while_another_run_is_ingested_loses_none_of_it(store: Storage) -> None:
    _store(store, _whole_run("gone", n=400))
    ingestor = _ingestor(store)
    errors: list[BaseException] = []

    def ingest_other() -> None:
        try:
            evs = [event("run_start", {"world_size": 1}, run="busy", stream="b0", seq=0)]
            evs += step_events(600, run="busy", stream="b0")
            for i in range(0, len(evs), 20):
                ingestor.ingest(validate_batch({"version": 1, "events": evs[i : i + 20]}))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    writer = threading.Thread(target=ingest_other)
    writer.start()
    delete_run(store, "gone", batch_rows=25)
    writer.join(120)

    assert errors == []
    assert set(_rows_of(store, "gone").values()) == {0}
    assert _rows_of(store, "busy")["steps"] == 600
    assert store.run_ids() == ["busy"]


def _report(storage: Storage, run: str) -> dict[str, Any]:
    summary = analyse(storage, run).summary
    found = summary["anomalies"]
    return {
        "anomalies": sorted((a["kind"], a["severity"], a["rank"], a["first_step"], a["last_step"]) for a in found),
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "goodput": summary["goodput"]["fraction"],
        "attempts": summary["attempts"],
    }


def test_an_exported_run_reads_back_to_the_same_post_mortem(store: Storage, tmp_path: Path) -> None:
    _store(store, _whole_run("archived"))
    path = tmp_path / "archived.jsonl"
    with store.connect() as conn:
        path.write_bytes(b"".join(export_lines(conn, "archived")))

    again = Storage("sqlite://")
    assert import_log(path, again).runs == ["archived"]

    expected = _report(store, "archived")
    assert expected["anomalies"] and expected["steps"] == 60  # the NaN was found: there is something to compare
    assert _report(again, "archived") == expected
    assert _rows_of(again, "archived") == _rows_of(store, "archived")  # every stored row came back
    again.close()


def test_retention_by_age_deletes_only_finished_runs_past_the_limit(store: Storage) -> None:
    now = BASE + 100 * DAY
    _store(store, _whole_run("old", t0=BASE, n=20))  # finished 100 days ago
    _store(store, _whole_run("old-but-live", t0=BASE, n=20, ended=False))  # said nothing for 100 days
    _store(store, _whole_run("young", t0=now - 10 * DAY, n=20))
    _store(store, _whole_run("held", t0=BASE, n=20))
    _store(store, _whole_run("running", t0=now - 60, n=20, ended=False))
    forgotten: list[str] = []

    deleted = apply_retention(
        store, max_age_days=90, max_bytes=0, now=now, stale_after=3600, live={"held"}, forget=forgotten.append
    )

    assert deleted == forgotten == ["old-but-live", "old"]  # least recently updated first; a silent
    # "running" run crashed without run_end: it goes too
    assert sorted(store.run_ids()) == ["held", "running", "young"]
    assert apply_retention(store, max_age_days=0, max_bytes=0, now=now, stale_after=3600) == []  # both off


def test_retention_by_size_deletes_the_oldest_finished_runs_until_under(store: Storage) -> None:
    now = BASE + DAY
    for i, run in enumerate(("first", "second", "third")):
        _store(store, _whole_run(run, t0=BASE + i * 1000, n=300))
    _store(store, _whole_run("running", t0=now - 60, n=300, ended=False))

    just_under = store_bytes(store) - 1
    assert apply_retention(store, max_age_days=0, max_bytes=just_under, now=now, stale_after=3600) == ["first"]
    assert store_bytes(store) <= just_under

    assert apply_retention(store, max_age_days=0, max_bytes=1, now=now, stale_after=3600) == ["second", "third"]
    assert store.run_ids() == ["running"]  # never a running one, however full the store


def test_store_bytes_shrinks_when_a_run_is_deleted(store: Storage) -> None:
    _store(store, _whole_run("a", n=300) + _whole_run("b", t0=BASE + 5, n=300))
    both = store_bytes(store)
    delete_run(store, "a")
    one = store_bytes(store)
    assert 0 < one < both * 0.75


def test_retention_config_is_checked_and_described(tmp_path: Path) -> None:
    config = load_config()
    assert (config.retention.max_age_days, config.retention.max_bytes) == (90.0, 50 << 30)
    assert describe_retention(90.0, 50 << 30) == (
        "retention: deletes finished runs older than 90 days and the oldest finished runs while the store "
        "exceeds 50 GiB"
    )
    assert describe_retention(0, 0) == "retention: off (runs are kept for ever)"
    for line, field in (
        ("max_age_days = -1", "retention.max_age_days"),
        ("max_bytes = -5", "retention.max_bytes"),
        ("check_seconds = 0", "retention.check_seconds"),
        ("max_bytes = '1GB'", "retention.max_bytes"),
    ):
        path = tmp_path / "c.toml"
        path.write_text(f"[retention]\n{line}\n")
        with pytest.raises(ConfigError, match=field):
            load_config(path)


def test_a_deleted_run_can_start_again_from_nothing(store: Storage) -> None:
    _store(store, _whole_run("again", n=40))
    delete_run(store, "again")
    _store(store, _whole_run("again", t0=time.time(), n=40))  # the same streams and sequence numbers
    assert _rows_of(store, "again")["steps"] == 80  # stored anew, not taken for duplicates of what was deleted
