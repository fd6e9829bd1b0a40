"""The launch id: what every rank of one job shares and no other job running at the same time has.

A run name is the user's choice, and two jobs may pick the same one at once (a relaunch while the
old job still runs, two people naming their run "test"). The collector tells them apart by the
launch id each rank sends in ``run_start``: streams of one launch are one job (its ranks, and its
restarts), streams of another launch under the same name while the first is live are a second job,
stored apart and named as a clash (``trainmon.monitor.collector.launches``).

It is built from what the launcher gives every rank of a job alike, most explicit first:

* ``TRAINMON_LAUNCH_ID`` (or ``start(launch_id=...)``): the user's word wins, for launchers not
  listed here or to make separately started processes one job.
* ``SLURM_JOB_ID`` (and ``SLURM_STEP_ID``): the scheduler's own id, unique among the jobs it runs,
  the same on every node of an allocation, and kept by a requeue (a restart of the same job).
* ``TORCHELASTIC_RUN_ID``: torchrun's rendezvous id, shared by every agent of the job and kept across
  its elastic restarts (a restart is an attempt of the same job, not a new job). Its default,
  ``"none"`` (the static rendezvous when ``--rdzv-id`` is not given), is shared by every job that
  did not set it, so it is skipped.
* ``MASTER_ADDR:MASTER_PORT``: the rendezvous address every launcher (torchrun, DeepSpeed,
  Accelerate, Lightning, a hand-written ``mp.spawn``) hands to each rank; two jobs running at once
  cannot both listen on it. A loopback address is only unique on its host, so the host is added
  (every rank of a single-node job is on that host).

With none of these a single-process job is its own launch (host and process id: unique among the
processes running at once). A job of several ranks without any of them sends no launch id: the
ranks have nothing in common to derive one from, and one id per process would split the job into
clashing runs; the collector then treats its streams as it always has (see its docstring).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["launch_id"]

_LOOPBACK = ("localhost", "127.", "::1", "0.0.0.0")


def launch_id(world_size: int | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """This process's launch id (None: a multi-rank job without a shared source, see the module docstring).

    ``world_size``: the job's declared number of ranks (default ``$WORLD_SIZE``, else 1)."""
    env = os.environ if env is None else env
    explicit = env.get("TRAINMON_LAUNCH_ID")
    if explicit:
        return explicit
    parts = []
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        parts.append(f"slurm:{env['SLURM_JOB_ID']}" + (f".{step}" if step else ""))
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        parts.append(f"torchelastic:{elastic}")
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        addr = env["MASTER_ADDR"]
        where = f"{socket.gethostname()}/" if addr.startswith(_LOOPBACK) else ""
        parts.append(f"rendezvous:{where}{addr}:{env['MASTER_PORT']}")
    if parts:
        return " ".join(parts)
    ranks = world_size if world_size is not None else int(env.get("WORLD_SIZE", "1"))
    return f"process:{socket.gethostname()}:{os.getpid()}" if ranks <= 1 else None
