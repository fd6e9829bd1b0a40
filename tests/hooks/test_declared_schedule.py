"""The first ten minutes with trainmon in a plain loop: the schedule declared from the scheduler
itself, and events spooled while the collector is away read by the post-mortem where they wait."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmon.hooks import TrainMonitor
from trainmon.schedules import Schedule

transformers = pytest.importorskip("transformers")

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
STEPS, WARMUP, LR = 300, 30, 3e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loop(
    collector: str,
    *,
    run: str = "plain",
    rank: int = 0,
    spool_dir: Path | None = None,
    declare: Schedule | None = None,
    extra_step_from: int | None = None,
) -> None:
    """A plain loop that keeps transformers' cosine scheduler and hands it to ``watch``.

    ``extra_step_from``: from this step on the loop steps the scheduler twice per optimizer step
    (the scheduler-per-micro-batch bug).
    """
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = transformers.get_cosine_schedule_with_warmup(opt, WARMUP, STEPS)
    mon = TrainMonitor(run, collector, rank=rank, spool_dir=spool_dir, health_interval=0, heartbeat_interval=0)
    mon.watch(model, opt, scheduler=sched)
    mon.start(planned_steps=STEPS, schedule=declare)
    for step in range(STEPS):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if extra_step_from is not None and step >= extra_step_from:
            sched.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()


def _postmortem(path: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [*TRAINMON, "postmortem", str(path), "--json"], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _run_start(path: Path) -> dict[str, Any]:
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kind"] == "run_start"
    return first["fields"]


def _drift(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in report["anomalies"] if a["kind"] == "lr_schedule_drift"]


def test_the_schedule_is_read_off_the_scheduler_and_the_run_is_silent(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _loop(f"file://{path}", spool_dir=tmp_path)
    assert _run_start(path)["schedule"] == Schedule("cosine", LR, STEPS, WARMUP).to_dict()
    report = _postmortem(path)
    assert report["steps"] == STEPS and _drift(report) == []


def test_the_cosine_preset_is_the_transformers_schedule(tmp_path: Path) -> None:
    """Declaring Schedule("cosine", ...) next to get_cosine_schedule_with_warmup raises nothing
    (it used to end at 10% of the peak and warm up one step ahead: 'sized for ~285 steps')."""
    path = tmp_path / "run.jsonl"
    _loop(f"file://{path}", spool_dir=tmp_path, declare=Schedule("cosine", LR, STEPS, WARMUP))
    assert _drift(_postmortem(path)) == []


def test_a_scheduler_stepped_twice_is_caught_against_the_schedule_read_off_it(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _loop(f"file://{path}", spool_dir=tmp_path, extra_step_from=150)
    (found,) = [a for a in _drift(_postmortem(path)) if a["severity"] != "info"]
    # Step 150 is the first to step the scheduler twice (151 is the first at the wrong LR).
    assert found["first_step"] == 150 and found["evidence"]["diagnosis"] == "per_microbatch"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_spooled_events_say_where_they_are_and_the_postmortem_reads_them_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    collector = f"http://127.0.0.1:{_closed_port()}"  # nobody listens: everything is spooled
    run_dir = tmp_path / "spool" / "away"
    with caplog.at_level(logging.WARNING, logger="trainmon.transport"):
        for rank in (0, 1):
            _loop(collector, run="away", rank=rank, spool_dir=run_dir / f"rank{rank}")
    said = [r.getMessage() for r in caplog.records if "spooling events to" in r.getMessage()]
    assert said == [
        f"trainmon: spooling events to {run_dir / f'rank{r}'}; they are sent when the collector is back "
        f"(`trainmon postmortem {run_dir / f'rank{r}'}` reads them meanwhile)"
        for r in (0, 1)
    ]  # once per transport, naming its folder
    assert all(list((run_dir / f"rank{r}").glob("*.jsonl")) for r in (0, 1))

    rank0 = _postmortem(run_dir / "rank0")
    assert (rank0["run"], rank0["steps"], rank0["status"]) == ("away", STEPS, "finished")
    both = _postmortem(run_dir)  # the run's folder: one folder per rank
    assert (both["run"], both["steps"], both["status"]) == ("away", STEPS, "finished")
    assert _drift(both) == []


def test_a_spool_folder_is_read_segment_after_segment(tmp_path: Path) -> None:
    """Segments are one stream in the order written, even where their event times interleave."""
    from trainmon.monitor.importers import read_events

    run = tmp_path / "late" / "rank0"
    run.mkdir(parents=True)
    path = tmp_path / "whole.jsonl"
    _loop(f"file://{path}", run="late", spool_dir=tmp_path)
    lines = path.read_text().splitlines()
    cut = len(lines) // 2
    # The second segment starts with an event stamped before the last one of the first (a clock step).
    second = [json.loads(x) for x in lines[cut:]]
    second[0]["time"] = json.loads(lines[cut - 1])["time"] - 1.0
    (run / f"{1:020d}-7.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    (run / f"{2:020d}-7.jsonl").write_text("\n".join(json.dumps(e) for e in second) + "\n")
    seqs = [e.seq for e in read_events(run)]
    assert seqs == sorted(seqs) and len(seqs) == len(lines)
    assert [e.seq for e in read_events(run.parent)] == seqs
