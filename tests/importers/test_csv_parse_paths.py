"""The CSV importer's column shortcuts give exactly what each row asked one by one gave (issue 24).

A column whose every cell is a number (read by pandas, or every cell read by ``float``) is given on every
row without asking each cell, and its values are the column itself; a loss of one finite term is that term
(``math.fsum`` of one term), but a -0.0, which ``fsum`` makes 0.0; the median gap of HF steps asked of an array
is the one sorted Python ints gave; a sparse column's numbers read at C speed are what ``to_float`` reads.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.bitwise import same
from trainmon.monitor.importers import csv as csv_importer
from trainmon.monitor.importers.common import to_float
from trainmon.monitor.importers.csv import Rows
from trainmon.monitor.importers.structure import combine

_FINITE = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 5e-324, -5e-324]))
_CELL = st.one_of(_FINITE.map(repr), st.sampled_from(["", " ", "nan", "-inf", "x", "-0.0", " 7 ", "1e400"]))


@settings(max_examples=500, deadline=None)
@given(st.lists(_FINITE, max_size=30))
@example([-0.0])
@example([0.0, -0.0, 1.5])
def test_a_loss_of_one_finite_term_is_the_fsum_of_that_term(col: list[float]) -> None:
    losses, has = csv_importer._losses([col], [], len(col))
    assert same(losses, [math.fsum((x,)) for x in col])
    assert has.tolist() == [True] * len(col)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.one_of(st.none(), _FINITE, st.sampled_from([math.nan, math.inf, -math.inf])), max_size=30),
    st.booleans(),
)
def test_a_loss_of_one_term_is_what_combine_made_of_each_row(col: list[float | None], signed: bool) -> None:
    """A missing or non-finite value anywhere (a left-out series' too): each row as ``combine`` makes it."""
    other = [1.0 if x is None else x for x in reversed(col)]
    losses, has = csv_importer._losses([col], [other] if signed else [], len(col))
    want = [combine([x], [y] if signed else []) for x, y in zip(col, other, strict=True)]
    assert same(losses, want)
    assert has.tolist() == [x is not None for x in want]


def _rows(cells: list[list[str]], numbers: bool) -> Rows:
    """The rows of text cells, or (``numbers``: a table pandas read) of the floats of cells ``float`` reads."""
    n = min(map(len, cells), default=0)
    text: list[Any] = [col[:n] for col in cells]
    if not numbers:
        return Rows(list(range(2, n + 2)), text)
    floats = {j: [float(c) for c in col] for j, col in enumerate(text) if _all_floats(col)}
    return Rows(list(range(2, n + 2)), [None if j in floats else col for j, col in enumerate(text)], floats)


def _all_floats(cells: list[str]) -> bool:
    try:
        list(map(float, cells))
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_CELL, max_size=12), min_size=1, max_size=4), st.booleans())
def test_given_rows_and_values_are_the_cells_that_hold_a_number(cells: list[list[str]], numbers: bool) -> None:
    rows = _rows(cells, numbers)
    for j in range(len(cells)):
        col = rows.column(j)
        assert rows.given(j).tolist() == [x is not None for x in col]
        assert same(rows.values(j), [x for x in col if x is not None])
        assert same(rows.select([j]).given(0).tolist(), [x is not None for x in col])


def _old_mean_over(train_steps: list[int]) -> float | None:
    """``_parse_table``'s rule before it asked an array (at 4c55103)."""
    gaps = sorted(b - a for a, b in itertools.pairwise(train_steps) if b > a)
    return float(gaps[len(gaps) // 2]) if gaps and gaps[len(gaps) // 2] > 1 else None


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**53), st.integers(0, 40)), min_size=2, max_size=40))
@example([0, 2**53])
@example([10, 20, 30, 40])
@example([5, 5, 4])
def test_the_steps_a_loss_is_the_mean_over_are_the_median_gap(steps: list[int]) -> None:
    assert same(csv_importer._mean_over(steps), _old_mean_over(steps))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(_CELL, _CELL, _FINITE, st.sampled_from(["", "", True, False, 3, -0.0, "-nan"])), max_size=30))
@example(["", "1.5", "", "-0.0"])
@example(["", "1.5", True])
def test_a_sparse_column_is_read_as_to_float_reads_each_cell(cells: list[Any]) -> None:
    """Numbers and empty cells (Lightning's sparse rows) read at C speed; a cell of spaces, text or another type
    (a JSON table's ``true``) as ``to_float`` reads it; a column ``float`` reads whole, as it always was."""
    try:
        want = list(map(float, cells)), True
    except ValueError:
        want = [to_float(c) for c in cells], False
    assert same(csv_importer._column_floats(cells), want)
