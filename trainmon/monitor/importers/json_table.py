"""JSON lines of metrics: one object per logged row, keyed by metric name (a table written as JSON).

What custom training loops and several tools write when they log to a file: W&B's run history
(``wandb-history.jsonl``: ``_step``, ``_timestamp``, ``train/loss``...), ``metrics.jsonl`` files of
hand-written loops (``{"step": 10, "loss": 2.31, "lr": 3e-4}``), a logger's nested records
(``{"step": 10, "train": {"loss": 2.31}}``, read as ``train/loss``). It is a table whose rows are
objects instead of lines, so it is read by the CSV importer's table rules
(:func:`trainmon.monitor.importers.csv.parse_table`: the column names it knows, the loss, grad norm and
LR recognised by structure, sparse rows of one step merged, the step base, ``--map``), not by rules of
its own.

Each object is one row and each key (nested keys joined with ``/``) one column; a key a row lacks is a
blank cell. Numbers are cells as written (``NaN``/``Infinity`` included: values, read as non-finite), text
is text, anything else (lists, booleans) is not a number. A line that is not a JSON object is skipped with
a warning, as a malformed CSV row is.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

from trainmon.fingerprint import flatten
from trainmon.monitor.importers.common import Item, LogMeta, gc_paused
from trainmon.monitor.importers.csv import DEFAULT_COLUMNS, Rows, parse_table

__all__ = ["looks_like_json_table", "parse_json_table"]

log = logging.getLogger("trainmon.import")

_STEP_KEYS = frozenset(DEFAULT_COLUMNS["step"])


def looks_like_json_table(objects: list[object], named: bool = False) -> bool:
    """The first decodable lines are objects, one of them with a step key we know (any key with
    ``named``: the user mapped the columns). Wire events and the formats read by their own importers are
    judged before this."""
    rows = [o for o in objects if o is not None]
    if not rows or not all(isinstance(o, dict) for o in rows):
        return False
    return named or any(k.lower() in _STEP_KEYS for o in rows for k in flatten(o, "/"))  # type: ignore[arg-type]


def _cell(value: Any) -> str | float:
    """A JSON value as the cell that reads back as it: a float as itself, an int by ``repr`` (exact, however
    large), text as text."""
    if type(value) is float:
        return value
    if value is None:
        return ""
    if type(value) is int:
        return repr(value)
    if isinstance(value, str):
        return value.replace("\n", " ")
    return "-"  # a list, a boolean: not a number, and not blank either


_BLOCK = 65536
"""Rows gathered before they go into their columns: a million rows are never held as a million dicts."""


@gc_paused
def parse_json_table(path: Path, mapping: dict[str, str] | None = None) -> tuple[list[Item], LogMeta]:
    columns: dict[str, list[str | float]] = {}
    lines: list[int] = []
    objects: list[dict[str, Any]] = []
    bad = 0
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                bad += 1
                log.warning("%s: line %d is not a JSON object; skipped", path, n)
                continue
            lines.append(n)
            objects.append(flatten(obj, "/"))
            if len(objects) == _BLOCK:
                _into_columns(objects, columns, len(lines) - len(objects))
                objects = []
    _into_columns(objects, columns, len(lines) - len(objects))
    header = list(columns)
    items, meta = parse_table(path, header, Rows(lines, list(columns.values())), mapping or {})
    meta.format = "json_table"
    if bad:
        meta.notes.insert(0, f"{bad} lines that are not JSON objects skipped")
    return items, meta


def _into_columns(objects: list[dict[str, Any]], columns: dict[str, list[str | float]], before: int) -> None:
    """The rows ``objects`` (after ``before`` rows) appended to the columns, a key's column by key (a new key's
    column starting blank, a key a row lacks blank on that row), in the order the keys first appear."""
    for key in dict.fromkeys(itertools.chain.from_iterable(objects)):
        col = columns.get(key)
        if col is None:
            col = columns[key] = [""] * before
        col.extend([_cell(v) for v in map(dict.get, objects, itertools.repeat(key))])
    for col in columns.values():  # keys these rows lack
        col.extend([""] * (before + len(objects) - len(col)))
