"""Turn logs on disk into wire-format events, so stored and imported runs share one analysis.

Only trainmon's own JSONL (written by ``file://`` collectors and by the transport's spool)
is read so far; other formats (HF ``trainer_state.json``, TensorBoard, CSV, llm.c and nanoGPT
logs) come with the post-mortem work.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hooks.wire import Event
from monitor.importers.jsonl import read_jsonl

__all__ = ["read_events"]


def read_events(path: str | Path) -> Iterator[Event]:
    """Events of a log file, in file order; raises ``ValueError`` for an unknown format."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    raise ValueError(f"{path}: unrecognised log format (expected trainmon JSONL)")
