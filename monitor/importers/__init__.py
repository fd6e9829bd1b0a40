"""Turn logs on disk into wire-format events, so stored and imported runs share one analysis.

Only trainmon's own JSONL (written by ``file://`` collectors and by the transport's spool)
is read so far; other formats (HF ``trainer_state.json``, TensorBoard, CSV, llm.c and nanoGPT
logs) come with the post-mortem work.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from pathlib import Path

from hooks.wire import Event
from monitor.importers.jsonl import read_jsonl

__all__ = ["read_events"]


def read_events(path: str | Path) -> Iterator[Event]:
    """Events of a log file, or of every ``*.jsonl`` in a folder merged in time order.

    A multi-rank run writes one file per rank; merging by time lets cross-rank detectors
    (stragglers, hangs) see the ranks side by side, as the live collector does.
    Raises ``ValueError`` for an unknown format or an empty folder.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ValueError(f"{path}: no *.jsonl files in this folder")
        return heapq.merge(*(read_jsonl(f) for f in files), key=lambda e: e.time)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    raise ValueError(f"{path}: unrecognised log format (expected trainmon JSONL or a folder of it)")
