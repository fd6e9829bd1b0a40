"""Full-state checkpoints, written atomically.

Layout: ``OUT/checkpoints/step_0000123/`` holds ``shared.pt`` (written by rank 0: model,
optimizer, scheduler, loss scaler, step/token counters, config), ``rankN.pt`` per rank (its
RNG states and data position, which differ between ranks) and ``meta.json``. Every file goes
to a temporary name and is ``os.replace``d into place, and ``meta.json`` is written last, by
rank 0, after every rank has saved: a directory without it is an interrupted save and is never
resumed from.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "capture_rng", "latest_checkpoint", "load_checkpoint", "restore_rng", "save_checkpoint"]

CHECKPOINTS = "checkpoints"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path, slow_seconds: float = 0.0) -> int:
    """``torch.save`` to a temporary file, fsync, then ``os.replace``; returns bytes written.

    ``slow_seconds`` spreads the write over that many seconds (the ``checkpoint_stall`` fault:
    a slow filesystem).
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    chunks = 16 if slow_seconds > 0 else 1
    size = len(data)
    with open(tmp, "wb") as f:
        for i in range(chunks):
            f.write(data[i * size // chunks : (i + 1) * size // chunks])
            if slow_seconds > 0:
                time.sleep(slow_seconds / chunks)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return size


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from: Python, NumPy, torch CPU and each CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step_{step:07d}"


def save_checkpoint(
    out: str | Path,
    step: int,
    *,
    shared: dict[str, Any] | None,
    rank_state: dict[str, Any],
    rank: int,
    world_size: int,
    barrier: Any,
    keep: int,
    slow_seconds: float = 0.0,
) -> tuple[Path, int]:
    """Save one checkpoint (collective: every rank calls it). Returns (directory, bytes this rank wrote)."""
    d = step_dir(out, step)
    d.mkdir(parents=True, exist_ok=True)
    written = 0
    if shared is not None:
        written += atomic_save(shared, d / "shared.pt", slow_seconds)
    written += atomic_save(rank_state, d / f"rank{rank}.pt", 0.0 if shared is not None else slow_seconds)
    barrier()  # SYNC (collective): every rank's files exist before the checkpoint is marked complete
    if rank == 0:
        meta = {"step": step, "world_size": world_size, "time": time.time()}
        tmp = d / ".meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, d / "meta.json")
        _fsync_dir(d)
        for old in _complete(Path(out))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return d, written


def _complete(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out`` (``out/checkpoints/step_*/meta.json``)."""
    done = _complete(Path(out))
    return done[-1] if done else None


def load_checkpoint(d: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Read ``(meta, shared, rank_state)`` of one checkpoint directory onto the CPU."""
    meta = json.loads((d / "meta.json").read_text())
    rank_file = d / f"rank{rank}.pt"
    if not rank_file.is_file():
        raise FileNotFoundError(
            f"resume: {d} has no state for rank {rank} (saved with world size {meta['world_size']})"
        )
    # weights_only=False: the file holds RNG states (Python tuples, NumPy arrays); it is our own.
    shared = torch.load(d / "shared.pt", map_location="cpu", weights_only=False)
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
    return meta, shared, rank_state
