"""Which files a log path is: what the import reads, and what decides whether its detection gets a process."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainmon.monitor.importers import log_files, read_events
from trainmon.monitor.importers.store import _PROCESS_FROM, _size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "importers"


def test_a_run_folder_is_its_event_files_not_its_checkpoints(tmp_path: Path) -> None:
    """A TensorBoard run folder beside a checkpoint bigger than the detection process's threshold: the log is the
    event file, so a short log is not given a process (0.25 s of start-up) for the checkpoint's bytes."""
    event_file = tmp_path / "events.out.tfevents.fixture"
    shutil.copy(FIXTURES / "events.out.tfevents.fixture", event_file)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (_PROCESS_FROM + 1))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"\0" * 1024)
    assert log_files(tmp_path) == [event_file]
    assert _size(tmp_path) == event_file.stat().st_size < _PROCESS_FROM
    assert any(e.kind == "step" for e in read_events(tmp_path))  # the same files are read


def test_a_spool_folder_is_its_rank_streams(tmp_path: Path) -> None:
    """A run's spool folder: the JSONL segments of each rank folder, in the order they are read; other files in
    it are not the log."""
    for rank in (0, 1):
        d = tmp_path / f"rank{rank}"
        d.mkdir()
        for name in ("1000-1.jsonl", "2000-1.jsonl"):
            (d / name).write_text("")
    (tmp_path / "notes.txt").write_text("x" * 100)
    files = log_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "rank0/1000-1.jsonl",
        "rank0/2000-1.jsonl",
        "rank1/1000-1.jsonl",
        "rank1/2000-1.jsonl",
    ]
    assert _size(tmp_path) == 0


def test_a_file_is_itself_and_a_missing_one_has_no_size(tmp_path: Path) -> None:
    log = tmp_path / "metrics.csv"
    log.write_text("step,loss\n1,2.0\n")
    assert log_files(log) == [log]
    assert _size(log) == log.stat().st_size
    assert _size(tmp_path / "absent.csv") == 0
