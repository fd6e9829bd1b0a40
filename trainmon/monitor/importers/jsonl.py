"""trainmon's own JSONL: one wire-format event per line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from trainmon.wire import Event, WireError, validate_event

__all__ = ["read_jsonl"]

log = logging.getLogger("trainmon.import")

WARN_LINES = 10
"""Bad lines reported one by one; later ones are only counted, so a file of another format that
reaches this reader gives a dozen warnings, not one per line."""


MAX_LINE = 16 << 20
"""Bytes of one line at most (an event with per-parameter norms of a large model is a few MB). A
longer line is skipped without being held in memory: a 1 GB file with no newline costs 16 MB."""


def read_jsonl(path: Path) -> Iterator[Event]:
    """Yield valid events; a corrupt, truncated or overlong line is skipped with a warning, never fatal."""
    bad = 0
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(MAX_LINE):
            n += 1
            if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE)) and not rest.endswith(b"\n"):
                    pass  # the rest of an overlong line, read and dropped a slice at a time
                problem: Exception = ValueError(f"longer than {MAX_LINE >> 20} MiB")
            else:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line:
                    continue
                try:
                    yield validate_event(json.loads(line), f"line {n}")
                    continue
                except (ValueError, WireError) as exc:
                    problem = exc
            bad += 1
            if bad <= WARN_LINES:
                log.warning("%s: skipping line %d: %s", path, n, problem)
    if bad > WARN_LINES:
        log.warning("%s: %d unreadable lines skipped in all (the first %d reported)", path, bad, WARN_LINES)
