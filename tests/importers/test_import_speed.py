"""The import stage's shortcuts give exactly what the slow way gave (issue 24).

Speed is measured by ``bench/postmortem.py --foreign``; these tests hold the equivalences it rests on,
each against the old definition kept here: a CSV's lines cut into cells a chunk at a time equal the
csv module's records (blank rows skipped, malformed ones counted and named at their line), a table's
rows read column by column give the points its rows read one by one gave, and a step or eval event
built without ``validate_event`` is the event it returned, or fails with its error.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.bitwise import same
from trainmon.monitor.importers import csv as csv_importer
from trainmon.monitor.importers.common import (
    EvalPoint,
    Item,
    LogMeta,
    TrainPoint,
    _Emitter,
    lr_values,
    to_count,
    to_float,
)
from trainmon.monitor.importers.csv import Rows, _Series, _table_items
from trainmon.monitor.importers.structure import combine, eval_point_values, eval_sets, root_sum_squares
from trainmon.wire import Event, WireError, validate_event


def _outcome(build: Any) -> Any:
    try:
        return build()
    except (WireError, ValueError, OverflowError, TypeError) as exc:
        return type(exc), str(exc)


# --- a CSV's lines into cells -------------------------------------------------------------------

_SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _old_table_rows(path: Path, width: int) -> tuple[list[int], list[list[str]], int, list[str]]:
    """The csv module's records after the header, row by row, as the importer read them before."""
    lines: list[int] = []
    cols: list[list[str]] = [[] for _ in range(width)]
    bad, warned = 0, []
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        next(reader)
        for n, row in enumerate(reader, 2):
            if not row or not "".join(row).strip():
                continue
            if len(row) != width:
                bad += 1
                warned.append(f"line {n} has {len(row)} fields, the header {width}; skipped")
                continue
            lines.append(n)
            for col, cell in zip(cols, row, strict=True):
                col.append(cell)
    return lines, cols, bad, warned


_ANY_CELL = st.text(alphabet=st.sampled_from(list('01.5e-nai, "\t\u3000\u00a0x\n\r\x00')), max_size=6)
_PLAIN_CELL = st.one_of(
    st.sampled_from(["", " ", "nan", "1.5", "-2e3", "inf", "\u3000", "\x0c", "1_0"]),
    _ANY_CELL.map(lambda s: "".join(c for c in s if c not in '",\n\r')),
)


@st.composite
def _tables(draw: Any) -> tuple[bytes, int]:
    """A header of ``width`` columns and lines of every shape: rows, short and long ones, blank ones
    (empty, commas, spaces), quoted cells spanning lines when ``quoted``; any line ending."""
    width = draw(st.integers(1, 4))
    quoted = draw(st.booleans())
    lines = [",".join(f"c{j}" for j in range(width))]
    for _ in range(draw(st.integers(0, 14))):
        shape = draw(st.sampled_from(["row", "row", "row", "short", "long", "empty", "commas", "spaces"]))
        if shape == "empty":
            lines.append("")
        elif shape == "commas":
            lines.append("," * (width - 1))
        elif shape == "spaces":
            lines.append(" \t" + ", " * draw(st.integers(0, width)))
        else:
            n = width + {"row": 0, "short": -1, "long": 1}[shape]
            lines.append(",".join(draw(_ANY_CELL if quoted else _PLAIN_CELL) for _ in range(n)))
    end = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    return (end.join(lines) + draw(st.sampled_from(["", end]))).encode(), width


@_SETTINGS
@given(table=_tables(), chunk=st.integers(1, 5), block=st.integers(1, 40))
def test_lines_cut_into_cells_equal_the_csv_modules_records(
    table: tuple[bytes, int], chunk: int, block: int, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """Quote-free chunks cut at once, irregular ones line by line, the rest from the first quote by
    csv.reader: the same rows, line numbers, malformed count and warnings, whatever the chunk size."""
    raw, width = table
    path = tmp_path / "t.csv"
    path.write_bytes(raw)
    want_lines, want_cols, want_bad, want_warned = _old_table_rows(path, width)
    monkeypatch.setattr(csv_importer, "_CHUNK", chunk)
    monkeypatch.setattr(csv_importer, "_BLOCK", block)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "trainmon.import"), open(path, encoding="utf-8-sig", errors="replace") as f:
        next(csv.reader(f))
        rows, bad = csv_importer._table_rows(f, width, path)
    assert rows.lines == want_lines
    got_cols = [rows._numbers[j] if rows._text[j] is None else rows._text[j] for j in range(width)]
    assert list(map(len, got_cols)) == list(map(len, want_cols))
    assert all(map(_same_cell, itertools.chain(*got_cols), itertools.chain(*want_cols)))
    assert bad == want_bad
    assert [r.getMessage().removeprefix(f"{path}: ") for r in caplog.records] == want_warned


def _same_cell(got: str | float, cell: str) -> bool:
    """The cell's text, or (a chunk of rows of decimal numbers, read by pandas) the float Python reads of it."""
    return got == cell if type(got) is str else same(got, float(cell))


_DECIMAL = st.one_of(
    st.floats().map(repr).filter(lambda s: s not in ("nan", "inf", "-inf")),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["-0", "+0", "-0.0", "1e400", "-1e400", "1e-400", ".5", "5.", "00012", "1E5", "+1.5", " 7 "]),
    st.sampled_from(["9007199254740993", "2.2250738585072011e-308", "4.9406564584124654e-324", "\t3"]),
    st.sampled_from(["1.7976931348623159e308"]),
    st.text(alphabet=st.sampled_from(list("0123456789.eE+- ")), min_size=1, max_size=12),
)


@settings(max_examples=1000, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda w: st.tuples(st.just(w), st.lists(st.lists(_DECIMAL, min_size=w, max_size=w), min_size=1))
    )
)
@example((1, [[" +3E23"]]))  # pandas 3.1: 2.9999999999999997e+23
@example((1, [["+6686569887426516086e+164"]]))  # pandas 3.1: 6.686569887426515e+182
def test_rows_of_decimals_read_by_pandas_are_the_floats_python_reads(table: tuple[int, list[list[str]]]) -> None:
    """pandas reads each decimal as ``float`` does, bit for bit, or refuses the chunk (a cell ``float``
    refuses, a blank one), which is then cut into cells as text."""
    width, rows = table
    joined = "".join(",".join(row) + "\n" for row in rows)
    got = csv_importer._number_columns(joined, width, len(rows))
    try:
        want = [[float(row[j]) for row in rows] for j in range(width)]
    except ValueError:
        assert got is None
        return
    if joined.count("+") != joined.count("e+") + joined.count("E+"):
        assert got is None  # a plus sign before a number, which pandas may misread: cut as text, read by float
        return
    assert got is not None  # every row a row of decimals: read at C speed
    assert same(got, want)


@pytest.mark.parametrize("cell", ["True", "false", "nan", "-nan", "inf", "Infinity", "", " ", "1_0", "NA", "0x1"])
def test_a_chunk_with_a_cell_that_is_not_a_decimal_is_cut_as_text(cell: str, tmp_path: Path) -> None:
    """pandas would read ``True`` as 1.0, a blank cell as NaN: such a chunk is read as text, each cell by
    ``to_float`` (a boolean is not a number, a blank cell is missing)."""
    assert csv_importer._number_columns(f"1,{cell}\n2,{cell}\n", 2, 2) is None
    path = tmp_path / "t.csv"
    path.write_text(f"_step,train/loss,train/grad_norm\n0,1,{cell}\n1,1,{cell}\n2,1,2.5\n")
    items, _ = csv_importer.parse_csv(path)
    assert same([p.grad_norm for p in items if isinstance(p, TrainPoint)], [to_float(cell), to_float(cell), 2.5])


def test_an_overlong_field_is_refused_as_the_csv_module_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("_step,loss\n0,1\n1," + "1" * (csv.field_size_limit() + 1) + "\n")
    with pytest.raises(csv.Error, match="field larger than field limit"):
        csv_importer.parse_csv(path)


# --- a table's rows into points -----------------------------------------------------------------


def _old_table_items(rows: Rows, s: _Series) -> tuple[list[Item], int]:
    """The importer's row loop before it read columns (``_parse_table`` at a830002), with the rule it gained
    since: a step or token count no step or count can be (NaN, inf, negative, past 2**53) is not there, where
    it raised before (``test_hostile_cells.py``)."""
    column, cols = rows.column, s.fields
    items: list[Item] = []
    last: TrainPoint | None = None
    bad = 0
    field_cols = [(fld, column(i)) for fld, i in cols.items()]
    loss_cols, signed_cols = [column(j) for j in s.loss], [column(j) for j in s.signed]
    gn_cols, lr_cols = [column(j) for j in s.grad_norm], [column(j) for j in s.lr]
    metric_values = [(column(j), name) for j, name in s.metrics.items()]
    for r, _n in enumerate(rows.lines):
        vals: dict[str, float | None] = {fld: col[r] for fld, col in field_cols}
        step_v = vals.get("step")
        if step_v is None or not 0 <= step_v <= 2**53:
            if any(not rows.blank(i, r) for fld, i in cols.items() if fld != "step"):
                bad += 1
            continue
        step = int(step_v)
        t = vals.get("time")
        if s.eval_sets:
            eval_loss, metrics = eval_point_values(s.eval_sets, lambda name, r=r: column(s.by_name[name])[r])
            if eval_loss is not None:
                items.append(EvalPoint(step, eval_loss, metrics, time=t))
        elif vals.get("eval_loss") is not None:
            metrics = {name: x for col, name in metric_values if (x := col[r]) is not None}
            items.append(EvalPoint(step, vals["eval_loss"], metrics, time=t))  # type: ignore[arg-type]
        terms = [col[r] for col in loss_cols]
        signed = [col[r] for col in signed_cols]
        norms = [col[r] for col in gn_cols]
        lrs = [col[r] for col in lr_cols]
        train: dict[str, Any] = {k: vals.get(k) for k in ("tokens", "step_time") if vals.get(k) is not None}
        if "tokens" in train and not 0 <= train["tokens"] <= 2**53:
            del train["tokens"]
        if (loss := combine(terms, signed)) is not None:
            train["loss"] = loss
        if (norm := norms[0] if len(norms) == 1 else root_sum_squares(norms)) is not None:
            train["grad_norm"] = norm
        if lrs and all(x is not None for x in lrs):
            train["lr"] = lrs
        if not train and all(x is None for x in (*terms, *signed)):
            continue
        if last is not None and last.step == step and items and items[-1] is last:
            point = last
        else:
            point = TrainPoint(step=step, time=t)
            items.append(point)
        for k, v in train.items():
            if k == "tokens":
                point.tokens = round(v)
            else:
                setattr(point, k, v)
        last = point
    return items, bad


_VALUE = st.sampled_from(["", " ", "nan", "-nan", "inf", "-inf", "0", "-0.0", "1.5", "2", "1e300", "x", "3.25"])
_STEP = st.sampled_from(["", "-1", "nan", "inf", "1e300", "0", "1", "1", "2", "2", "3", "7.0", "4.5", "x"])
# every field a column may feed, with the other columns a table may have
_COLUMNS = ["step", "loss_a", "loss_b", "signed", "gn_a", "gn_b", "lr0", "lr1", "eval_loss", "acc", "time", "tokens"]
_COLUMNS += ["step_time", "eval_x_loss", "eval_y_loss", "eval_y_acc"]


@st.composite
def _series_tables(draw: Any) -> tuple[Rows, _Series]:
    n = draw(st.integers(0, 25))
    text = [[draw(_STEP) for _ in range(n)]] + [[draw(_VALUE) for _ in range(n)] for _ in _COLUMNS[1:]]
    rows = Rows(list(range(2, n + 2)), text)  # type: ignore[arg-type]
    idx = {c: j for j, c in enumerate(_COLUMNS)}
    fields = {"step": 0}
    for fld in draw(st.sets(st.sampled_from(["time", "tokens", "step_time", "eval_loss"]))):
        fields[fld] = idx[fld]
    sets = eval_sets(["eval_x_loss", "eval_y_loss", "eval_y_acc"]) if draw(st.booleans()) else []
    return rows, _Series(
        fields=fields,
        loss=draw(st.sampled_from([[], [1], [1, 2]])),
        signed=draw(st.sampled_from([[], [3]])),
        grad_norm=draw(st.sampled_from([[], [4], [4, 5]])),
        lr=draw(st.sampled_from([[], [6], [6, 7]])),
        metrics={9: "acc"} if "eval_loss" in fields else {},
        eval_sets=sets,
        by_name=idx,
    )


@settings(max_examples=500, deadline=None)
@given(_series_tables())
def test_rows_read_column_by_column_give_the_points_of_the_rows_read_one_by_one(table: tuple[Rows, _Series]) -> None:
    """Blank, text and non-finite cells, several loss terms and norms, a left-out series, LR groups, repeated
    steps (merged), evals named or by set: the same points, field by field and bit by bit."""
    rows, series = table
    want = _outcome(lambda: _old_table_items(Rows(rows.lines, list(rows._text)), series))
    got = _outcome(lambda: _table_items(Path("t.csv"), rows, series))
    assert same(got, want)  # a non-finite token count fails as it did (round(inf))


# --- points into events -------------------------------------------------------------------------


def _old_wire_float(x: float) -> float | str:
    if math.isfinite(x):
        return float(x)
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _old_step(em: _Emitter, p: TrainPoint, t: float) -> Event:
    """A step event as built before: wire-encoded fields through ``validate_event``; a token count the wire
    cannot hold is left out (it failed the whole log before: ``test_hostile_cells.py``)."""
    fields: dict[str, Any] = {"step": p.step}
    if p.loss is not None:
        fields["loss"] = _old_wire_float(p.loss)
    if p.grad_norm is not None:
        fields["grad_norm"] = _old_wire_float(p.grad_norm)
    if p.lr:
        fields["lr"] = [_old_wire_float(x) for x in p.lr]
    if p.tokens is not None and 0 <= p.tokens <= 2**53:
        fields["tokens"] = int(p.tokens)
    if p.step_time is not None and math.isfinite(p.step_time) and p.step_time >= 0:
        fields["step_time"] = float(p.step_time)
    if p.loss_scale is not None:
        fields["loss_scale"] = _old_wire_float(p.loss_scale)
    if p.skipped is not None:
        fields["skipped"] = bool(p.skipped)
    return _old_event(em, "step", t, fields)


def _old_eval(em: _Emitter, p: EvalPoint, t: float) -> Event:
    fields: dict[str, Any] = {"step": p.step, "loss": _old_wire_float(p.loss)}
    metrics = {k: v for k, v in p.metrics.items() if v is not None and math.isfinite(v)}
    if metrics:
        fields["metrics"] = metrics
    if p.duration is not None and math.isfinite(p.duration) and p.duration >= 0:
        fields["duration"] = float(p.duration)
    return _old_event(em, "eval", t, fields)


def _old_event(em: _Emitter, kind: str, t: float, fields: dict[str, Any]) -> Event:
    raw = {"kind": kind, "run": em.run, "rank": 0, "host": "imported", "stream": em.stream, "seq": em.seq}
    return validate_event({**raw, "time": t, "fields": fields}, f"{em.run} {kind}")


_FLOAT = st.one_of(
    st.floats(),
    st.sampled_from([-0.0, math.nan, -math.nan, math.inf, -math.inf, 2.0**53, 1e308]),
    st.integers(-3, 2**54),
)
_COUNT = st.one_of(st.integers(0, 2**53 + 2), st.sampled_from([-1, 2.0, 2.5, 2.0**60, True]))
_TIME = st.one_of(st.floats(0, 2.0**32), st.sampled_from([-1.0, 2.0**32, 2.0**32 + 1, math.nan, math.inf, 1e9]))


@settings(max_examples=1500, deadline=None)
@given(
    st.builds(
        TrainPoint,
        step=_COUNT,
        loss=st.none() | _FLOAT,
        grad_norm=st.none() | _FLOAT,
        lr=st.none() | st.lists(_FLOAT, max_size=3),
        tokens=st.none() | _COUNT | _FLOAT,
        step_time=st.none() | _FLOAT,
        loss_scale=st.none() | _FLOAT,
        skipped=st.none() | st.booleans(),
    ),
    _TIME,
)
def test_a_step_event_is_what_validate_event_made_of_it(p: TrainPoint, t: float) -> None:
    em = _Emitter("run-1", "digest", LogMeta(format="csv", framework="csv"), {})
    want = _outcome(lambda: _old_step(em, p, t))
    got = _outcome(lambda: em.step(p, t))
    assert same(got, want), (got, want)
    assert em.seq == (1 if isinstance(got, Event) else em.seq)


@settings(max_examples=1000, deadline=None)
@given(
    st.builds(
        EvalPoint,
        step=_COUNT,
        loss=_FLOAT,
        metrics=st.dictionaries(
            st.sampled_from(["acc", "wer", "k" * 257]), st.one_of(_FLOAT, st.booleans(), st.just(None)), max_size=3
        ),
        duration=st.none() | _FLOAT,
    ),
    _TIME,
)
def test_an_eval_event_is_what_validate_event_made_of_it(p: EvalPoint, t: float) -> None:
    em = _Emitter("run-1", "digest", LogMeta(format="csv", framework="csv"), {})
    want = _outcome(lambda: _old_eval(em, p, t))
    got = _outcome(lambda: em.eval(p, t))
    assert same(got, want), (got, want)


# --- a log's numbers ----------------------------------------------------------------------------


def _old_to_count(value: Any) -> int | None:
    """``to_count`` as it was: every value through ``to_float``; a count past 2**53 is none (the wire cannot
    hold it: ``test_hostile_cells.py``)."""
    x = to_float(value)
    if x is None or not math.isfinite(x) or x < 0 or x > 2**53:
        return None
    return int(x)


def _old_lr_values(entry: dict[str, Any], keys: tuple[str, ...]) -> list[float] | None:
    for key in keys:
        v = entry.get(key)
        if isinstance(v, list):
            vals = [to_float(x) for x in v]
            if vals and all(x is not None for x in vals):
                return vals  # type: ignore[return-value]
        x = to_float(v)
        if x is not None:
            return [x]
    return None


_LOGGED = st.one_of(
    _FLOAT,
    st.integers(-(2**60), 2**60),
    st.sampled_from([2**53 - 1, 2**53, 2**53 + 1, -1, 0, True, False, None, "12", " 7.0 ", "nan", "", "x", [1.0]]),
)


@settings(max_examples=1500, deadline=None)
@given(_LOGGED)
def test_a_count_is_what_to_float_made_of_it(value: Any) -> None:
    assert same(to_count(value), _old_to_count(value))


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.sampled_from(["learning_rate", "lr", "x"]), _LOGGED | st.lists(_LOGGED, max_size=3)))
def test_learning_rates_are_what_to_float_made_of_them(entry: dict[str, Any]) -> None:
    assert same(lr_values(entry, ("learning_rate", "lr")), _old_lr_values(entry, ("learning_rate", "lr")))
