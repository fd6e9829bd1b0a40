"""``summarize``'s lean reads: when no step of the lowest rank carries a step time, tokens or a phase
time (a W&B or HF log), the bins only count the steps and that rank's sample reads its key alone
(its LR too against a declared schedule), or nothing when it logged every step. These hold the lean
summary to the one every column read gives, on the cases around the probe that decides it: nothing
carried (every step logged, or gaps), the last step alone carrying a step time, a NaN one, another
rank carrying them all, a schedule to compare the LR with; the sample is strided (a small
``SAMPLE_ROWS``), as on a long run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, insert, select, update

from trainmon.monitor.analysis import postmortem
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.store.step_reads import step_bins, step_count
from trainmon.monitor.store.storage import PHASE_COLUMNS, Storage, runs, steps, streams
from trainmon.schedules import Schedule
from trainmon.wire import json_safe

STEPS = 400


@pytest.fixture
def imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Storage, str]]:
    """A W&B-style log of loss and LR (no step times, tokens or phases), imported; a strided sample."""
    monkeypatch.setattr(postmortem, "SAMPLE_ROWS", 50)
    path = tmp_path / "wandb.csv"
    rows = [f"{i},{3.0 - i / STEPS + 0.01 * math.sin(i)!r},{1e-4 * (1 + i % 3)!r}" for i in range(STEPS)]
    path.write_text("\n".join(["_step,train/loss,train/learning_rate", *rows]) + "\n")
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    yield storage, run
    storage.close()


def _lean_and_full(storage: Storage, run: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, bool]:
    """The summary as summarize reads it, as read with every column, and what the probe said."""
    said: list[bool] = []
    probe = postmortem._sums_carried
    monkeypatch.setattr(postmortem, "_sums_carried", lambda *a: said.append(probe(*a)) or said[-1])
    lean = summarize(storage, run)
    monkeypatch.setattr(postmortem, "_sums_carried", lambda *_a: True)
    full = summarize(storage, run)
    dump = lambda s: json.dumps(json_safe(s), allow_nan=False, sort_keys=True)  # noqa: E731 - NaN-safe equality
    return dump(lean), dump(full), said[0]


def _set(storage: Storage, run: str, step: int, recorded: bool, **values: Any) -> None:
    """Give a stored step ``values``, and its stream the record of them the ingest keeps (``recorded``), or no
    record at all (a store from before ``streams.step_fields``: summarize probes the steps then)."""
    with storage.engine.begin() as conn:
        conn.execute(update(steps).where(steps.c.run == run, steps.c.step == step).values(**values))
        (held,) = conn.execute(select(streams.c.step_fields).where(streams.c.run == run)).scalars()
        fields = {"phases" if name.startswith("phase_") else name for name in values}
        record = sorted({*held, *fields}) if recorded else None
        conn.execute(update(streams).where(streams.c.run == run).values(step_fields=record))


@pytest.mark.parametrize("gaps", [False, True])
def test_nothing_carried_reads_lean_and_says_the_same(imported: tuple[Storage, str], monkeypatch, gaps: bool) -> None:
    """Every step logged, the sampled ones are known without a read; with gaps, their key is read."""
    storage, run = imported
    if gaps:
        with storage.engine.begin() as conn:
            conn.execute(delete(steps).where(steps.c.run == run, steps.c.step % 9 == 4))
    lean, full, summed = _lean_and_full(storage, run, monkeypatch)
    assert not summed
    assert lean == full
    summary = json.loads(lean)
    assert summary["sample"]["stride"] > 1 and summary["sample"]["rows"] == summary["ranks"][0]["samples"] > 0


@pytest.mark.parametrize("recorded", [True, False])
@pytest.mark.parametrize("step_time", [0.5, math.nan])
def test_the_last_step_alone_carrying_a_step_time_is_found(
    imported: tuple[Storage, str], monkeypatch, step_time: float, recorded: bool
) -> None:
    storage, run = imported
    _set(storage, run, STEPS - 1, recorded, step_time=step_time)  # a NaN is stored as SQLite's 'NaN' text: carried
    lean, full, summed = _lean_and_full(storage, run, monkeypatch)
    assert summed and lean == full


def test_another_rank_with_step_and_phase_times(imported: tuple[Storage, str], monkeypatch) -> None:
    """Rank 0 (the lowest, read lean) carries none; rank 1 carries them all and is read in full."""
    storage, run = imported
    phases = {f"phase_{p}": 0.01 * (k + 1) for k, p in enumerate(PHASE_COLUMNS)}
    with storage.engine.begin() as conn:
        (stream,) = conn.execute(select(streams).where(streams.c.run == run)).mappings().all()
        conn.execute(insert(streams).values({**stream, "stream": stream["stream"] + "-1", "rank": 1}))
        rows = conn.execute(select(steps).where(steps.c.run == run)).mappings().all()
        conn.execute(insert(steps), [{**r, "rank": 1, "step_time": 0.2 + r["step"] % 5, **phases} for r in rows])
    lean, full, summed = _lean_and_full(storage, run, monkeypatch)
    assert not summed and lean == full
    ranks = json.loads(lean)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["step_time"] is None and ranks[1]["step_time"]


def test_the_lr_against_a_schedule_is_read(imported: tuple[Storage, str], monkeypatch) -> None:
    storage, run = imported
    schedule = Schedule(name="constant", peak_lr=1e-4, total_steps=STEPS, warmup_steps=0)
    with storage.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.run == run).values(schedule=schedule.to_dict()))
    lean, full, summed = _lean_and_full(storage, run, monkeypatch)
    assert not summed and lean == full
    assert json.loads(lean)["lr"]["max_rel_gap"] == pytest.approx(2.0)  # the log's LR is 1x-3x the schedule's


@pytest.mark.parametrize("curves", [False, True])
def test_bins_without_the_sums_are_the_bins_with_them(imported: tuple[Storage, str], curves: bool) -> None:
    storage, run = imported
    ranges = [(0, lo, lo + 37) for lo in range(-37, STEPS + 37, 37)]  # the first and last ranges hold no step
    with storage.connect() as conn:
        lean = step_bins(conn, run, 0, ranges, curves=curves, sums=False)
        full = step_bins(conn, run, 0, ranges, curves=curves, sums=True)
    assert [list(r.items()) for r in lean] == [list(r.items()) for r in full]
    assert sum(r["count"] for r in lean) == STEPS


def test_a_whole_attempts_ranges_are_counted_without_a_read(imported: tuple[Storage, str]) -> None:
    storage, run = imported
    ranges = [(0, lo, min(lo + 37, STEPS)) for lo in range(0, STEPS, 37)]
    with storage.connect() as conn:
        assert step_count(conn, run, 0, 0) == STEPS  # every step from the first to the last
        known = step_bins(conn, run, 0, ranges, curves=False, sums=False, whole={0})
        read = step_bins(conn, run, 0, ranges, curves=False, sums=True)
    assert [list(r.items()) for r in known] == [list(r.items()) for r in read]


@pytest.mark.parametrize("recorded", [True, False])
def test_what_the_steps_hold_is_read_from_the_streams_record(
    imported: tuple[Storage, str], monkeypatch, recorded: bool
) -> None:
    """The import recorded the fields its steps hold (step, loss, lr): the summary reads that, not a pass over the
    steps; a stream without a record (stored before it was kept) is probed, and both say the same."""
    storage, run = imported
    with storage.connect() as conn:
        assert conn.execute(select(streams.c.step_fields)).scalars().all() == [["loss", "lr", "step"]]
    if not recorded:
        with storage.engine.begin() as conn:
            conn.execute(update(streams).values(step_fields=None))
    probed: list[tuple[str, ...]] = []
    probe = postmortem.step_carries
    monkeypatch.setattr(postmortem, "step_carries", lambda *a, **k: probed.append(a[4:]) or probe(*a, **k))
    lean, full, summed = _lean_and_full(storage, run, monkeypatch)
    assert not summed and lean == full
    sums_probed = [cols for cols in probed if "step_time" in cols]
    assert sums_probed == ([] if recorded else [postmortem.SUMMED_COLUMNS])
