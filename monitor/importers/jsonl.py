"""trainmon's own JSONL: one wire-format event per line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from trainmon.hooks.wire import Event, WireError, validate_event

__all__ = ["read_jsonl"]

log = logging.getLogger("trainmon.import")

WARN_LINES = 10
"""Bad lines reported one by one; later ones are only counted, so a file of another format that
reaches this reader gives a dozen warnings, not one per line."""


def read_jsonl(path: Path) -> Iterator[Event]:
    """Yield valid events; a corrupt or truncated line is skipped with a warning, never fatal."""
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield validate_event(json.loads(line), f"line {n}")
            except (ValueError, WireError) as exc:
                bad += 1
                if bad <= WARN_LINES:
                    log.warning("%s: skipping line %d: %s", path, n, exc)
    if bad > WARN_LINES:
        log.warning("%s: %d unreadable lines skipped in all (the first %d reported)", path, bad, WARN_LINES)
