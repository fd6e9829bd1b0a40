"""open_run: a run id in a store, or a log file imported into memory; the errors name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.events import event, step_events
from trainmon.monitor.analysis.open_run import OpenRunError, open_run
from trainmon.monitor.importers.store import import_log
from trainmon.monitor.store.queries import run_exists
from trainmon.monitor.store.storage import Storage


def _log(path: Path, *runs: str) -> Path:
    events = []
    for run in runs:
        events += [event("run_start", {"world_size": 1}, run=run, stream=run, seq=0)]
        events += step_events(12, run=run, stream=run)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_log_file_is_imported_into_memory(tmp_path: Path) -> None:
    with open_run(_log(tmp_path / "one.jsonl", "a")) as opened:
        assert (opened.run, opened.storage.url) == ("a", "sqlite://")
        with opened.storage.connect() as conn:
            assert run_exists(conn, "a")


def test_a_run_id_is_read_from_the_store_and_a_file_when_the_store_lacks_it(tmp_path: Path) -> None:
    db = str(tmp_path / "db.sqlite")
    store = Storage(db)
    import_log(_log(tmp_path / "stored.jsonl", "stored"), store)
    store.close()
    with open_run("stored", db) as opened:
        assert (opened.run, opened.storage.url) == ("stored", f"sqlite:///{db}")
    with open_run(_log(tmp_path / "other.jsonl", "other"), db) as opened:
        assert (opened.run, opened.storage.url) == ("other", "sqlite://")
    with pytest.raises(OpenRunError, match=r"ghost: not a run in .* nor a log file or folder"):
        open_run("ghost", db)


def test_a_file_of_several_runs_needs_one_chosen(tmp_path: Path) -> None:
    path = _log(tmp_path / "two.jsonl", "a", "b")
    with pytest.raises(OpenRunError, match=r"holds runs \['a', 'b'\]; choose one with --run-a/--run-b"):
        open_run(path, choose="--run-a/--run-b")
    with pytest.raises(OpenRunError, match=r"holds runs \['a', 'b'\], not 'c'"):
        open_run(path, run="c")
    with open_run(path, run="b") as opened:
        assert opened.run == "b"


def test_what_cannot_be_opened(tmp_path: Path) -> None:
    with pytest.raises(OpenRunError, match=r"nope.jsonl: not a log file or folder \(give --db for run ids\)"):
        open_run(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="no store at"):
        open_run("a", str(tmp_path / "absent.sqlite"))
    assert not (tmp_path / "absent.sqlite").exists()  # reading never creates a store
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(OpenRunError, match=r"empty\.jsonl: empty file"):
        open_run(tmp_path / "empty.jsonl")
