"""JSON lines of metrics gathered column by column give the table the row-by-row reading gave (issue 24).

The reference is the importer's reading before (at 2e957c3): each row's cells appended one by one, a float
cell written by ``repr`` and read back by ``float``. Keys first seen late, keys a row lacks, nested records,
non-finite and huge numbers, text, lists and booleans, damaged lines, any block size: the same points, field
by field and bit by bit, and the same notes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bitwise import same
from trainmon.fingerprint import flatten
from trainmon.monitor.importers import json_table
from trainmon.monitor.importers.common import Item, LogMeta, TrainPoint
from trainmon.monitor.importers.csv import Rows, parse_table


def _old_cell(value: Any) -> str:
    if value is None:
        return ""
    if type(value) is float or type(value) is int:
        return repr(value)
    if isinstance(value, str):
        return value.replace("\n", " ")
    return "-"


def _old_parse(path: Path) -> tuple[list[Item], LogMeta]:
    columns: dict[str, list[str]] = {}
    lines: list[int] = []
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
                continue
            r = len(lines)
            lines.append(n)
            for key, value in flatten(obj, "/").items():
                col = columns.get(key)
                if col is None:
                    col = columns[key] = [""] * r
                elif len(col) < r:
                    col.extend([""] * (r - len(col)))
                col.append(_old_cell(value))
    for col in columns.values():
        col.extend([""] * (len(lines) - len(col)))
    items, meta = parse_table(path, list(columns), Rows(lines, list(columns.values())), {})
    meta.format = "json_table"
    if bad:
        meta.notes.insert(0, f"{bad} lines that are not JSON objects skipped")
    return items, meta


_NUMBER = st.one_of(
    st.floats(),
    st.integers(-(2**60), 2**1100),
    st.sampled_from([-0.0, 0.0, math.nan, math.inf, -math.inf, 2.0**53 + 2, 1e308]),
)
_VALUE = st.one_of(_NUMBER, st.none(), st.booleans(), st.sampled_from(["", " ", "nan", "x\ny", "1.5"]), st.just([1]))
_KEYS = ["step", "loss", "train/loss", "lr", "grad_norm", "eval/loss", "eval/acc", "tokens", "time", "x"]


@st.composite
def _lines(draw: Any) -> str:
    out = []
    for _ in range(draw(st.integers(0, 30))):
        shape = draw(st.sampled_from(["row", "row", "row", "row", "nested", "blank", "damaged", "list"]))
        if shape == "blank":
            out.append(draw(st.sampled_from(["", "  "])))
        elif shape == "damaged":
            out.append(draw(st.sampled_from(['{"step": 1', "[1, 2]", "7", "null", '"x"'])))
        else:
            row = {"step": draw(st.one_of(st.integers(-2, 40), _NUMBER))}
            row.update({k: draw(_VALUE) for k in draw(st.lists(st.sampled_from(_KEYS[1:]), max_size=6))})
            if shape == "nested":
                row["train"] = {"loss": draw(_VALUE), "inner": {"lr": draw(_VALUE)}}
            out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def _outcome(parse: Any) -> Any:
    try:
        items, meta = parse()
    except ValueError as exc:
        return type(exc), str(exc)
    return items, (meta.format, meta.framework, meta.config, meta.notes, meta.step_base, meta.loss_mean_over)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_lines(), block=st.integers(1, 7))
def test_rows_gathered_column_by_column_are_the_table_read_row_by_row(
    text: str, block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    monkeypatch.setattr(json_table, "_BLOCK", block)
    logging.disable(logging.CRITICAL)
    try:
        want = _outcome(lambda: _old_parse(path))
        got = _outcome(lambda: json_table.parse_json_table(path))
    finally:
        logging.disable(logging.NOTSET)
    assert same(got, want) if not isinstance(want[0], type) else got == want


def test_a_float_cell_is_kept_as_the_float(tmp_path: Path) -> None:
    """A float is its own cell (no repr and float again): -0.0, a huge int as its decimal, NaN a value."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": -0.0, "tokens": 1e400}\n{"step": 1, "loss": NaN, "tokens": 12}\n')
    items, _ = json_table.parse_json_table(path)
    points = [p for p in items if isinstance(p, TrainPoint)]
    assert same([p.loss for p in points], [0.0, math.nan]) and [p.tokens for p in points] == [None, 12]
