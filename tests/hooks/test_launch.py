"""The launch id: the same on every rank of one job, different for another job, sent in ``run_start``."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from trainmon.hooks import TrainMonitor
from trainmon.hooks.launch import launch_id
from trainmon.wire import validate_event


def _torchrun(rank: int, run_id: str = "3f2a", port: str = "29500") -> dict[str, str]:
    """What torchrun puts in each worker's environment (those the launch id may read)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % 2),
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "node-0",
        "MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(rank // 4),
    }


def test_every_rank_of_a_torchrun_job_shares_the_id_and_another_job_differs() -> None:
    ids = {launch_id(env=_torchrun(rank)) for rank in range(4)}
    assert len(ids) == 1
    other = launch_id(env=_torchrun(0, run_id="9c1d", port="29501"))
    assert other not in ids
    restarted = {**_torchrun(1), "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_PORT": "40123"}
    assert launch_id(env=restarted) in ids  # an elastic restart is the same job: its rendezvous id is kept


def test_torchrun_without_a_rendezvous_id_is_told_apart_by_its_rendezvous_address() -> None:
    """The static rendezvous' run id is "none" for every job: two jobs at once differ in their port."""
    job1 = [launch_id(env={**_torchrun(rank, run_id="none")}) for rank in range(4)]
    job2 = launch_id(env={**_torchrun(0, run_id="none", port="29501")})
    assert len(set(job1)) == 1 and job2 != job1[0]
    loopback = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    assert socket.gethostname() in (launch_id(env=loopback) or "")  # 127.0.0.1:29500 on two hosts: two jobs


def test_slurm_jobs_differ_and_the_override_wins() -> None:
    a = {"SLURM_JOB_ID": "1201", "SLURM_STEP_ID": "0", "WORLD_SIZE": "8"}
    b = {**a, "SLURM_JOB_ID": "1202"}
    assert launch_id(env=a) == launch_id(env=dict(a)) != launch_id(env=b)
    assert launch_id(env={**a, "TRAINMON_LAUNCH_ID": "mine"}) == "mine"


def test_a_single_process_is_its_own_launch_and_a_multi_rank_job_without_a_launcher_sends_none() -> None:
    assert launch_id(env={}) == f"process:{socket.gethostname()}:{os.getpid()}"
    assert launch_id(world_size=4, env={}) is None  # one id per process would split the job into clashing runs


@pytest.mark.parametrize("override", [None, "job-42"])
def test_run_start_carries_it_and_validates(tmp_path: Path, override: str | None) -> None:
    path = tmp_path / "events.jsonl"
    mon = TrainMonitor("launch", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    mon.start(**({} if override is None else {"launch_id": override}))
    mon.close()
    (start,) = [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "run_start"]
    assert start["fields"]["launch_id"] == (override or launch_id())
    assert validate_event(start).fields["launch_id"] == start["fields"]["launch_id"]
