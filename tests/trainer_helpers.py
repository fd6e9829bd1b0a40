"""Run the reference trainer as a subprocess and read what it emitted (the raw JSONL stream)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainmon.reference_trainer import command

ROOT = Path(__file__).resolve().parents[1]
# Small and fast: process start-up (importing torch) dominates these runs.
TINY = ["--seq-len", "32", "--batch-size", "8"]


def trainer_env() -> dict[str, str]:
    """The environment of every trainer the tests start: one OpenMP thread, as other tests run alongside."""
    return command.trainer_env(threads=1)


def run_trainer(
    out: Path, *args: str, steps: int = 12, run: str = "t", check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``python -m trainmon.reference_trainer --run RUN --steps N --out OUT ARGS...``; fails the test on error."""
    cmd = command.trainer_command(run, steps, out, extra=args)
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def trainer_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m trainmon.reference_trainer ARGS...`` as given (``--help``, a bad config...), not checked."""
    cmd = [sys.executable, "-m", command.MODULE, *args]
    return subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout)


def torchrun(out: Path, *args: str, nproc: int = 2, steps: int = 8, run: str = "ddp", timeout: float = 180):
    """The same through ``torchrun --standalone`` on CPU (gloo)."""
    cmd = command.trainer_command(run, steps, out, extra=args, ranks=nproc)
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a JSONL file, as written (non-finite floats stay the strings "NaN", ...)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def of_kind(events: Sequence[dict], kind: str) -> list[dict[str, Any]]:
    """The ``fields`` of every event of one kind, in order."""
    return [e["fields"] for e in events if e["kind"] == kind]


def step_fields(events: Sequence[dict]) -> dict[int, dict[str, Any]]:
    """Step → fields of its last ``step`` event (a resumed run re-does some steps)."""
    return {f["step"]: f for f in of_kind(events, "step")}


def losses(events: Sequence[dict]) -> dict[int, Any]:
    return {s: f["loss"] for s, f in step_fields(events).items()}


def attempts(events: Sequence[dict]) -> list[list[dict[str, Any]]]:
    """Events split per producer process (one ``stream`` per attempt), in file order."""
    out: dict[str, list] = {}
    for e in events:
        out.setdefault(e["stream"], []).append(e)
    return list(out.values())


def read_labels(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "labels.json").read_text())
