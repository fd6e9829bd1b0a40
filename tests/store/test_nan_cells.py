"""A Real column is bound as it is unless a cell is NaN (``storage._no_nan``): asked first of the column's sum,
which is finite only where no cell is NaN, then, where the sum cannot answer (a None, an infinity, a sum past the
largest float, an int past any float), cell by cell. Each answer is checked against the cell-by-cell one over
hostile columns."""

from __future__ import annotations

import math
import random
import sys
from typing import Any

from trainmon.monitor.store.storage import _nan_marker, _nan_markers, _no_nan

_CELLS: list[Any] = [
    0.0,
    -0.0,
    1.5,
    -3,
    7,
    True,
    sys.float_info.max,
    -sys.float_info.max,
    5e-324,
    math.inf,
    -math.inf,
    math.nan,
    -math.nan,
    None,
    10**400,
]


def _columns() -> list[list[Any]]:
    rng = random.Random(3)
    columns = [[c] for c in _CELLS]
    columns += [[a, b] for a in _CELLS for b in _CELLS]
    columns += [[sys.float_info.max] * 3, [math.inf, -math.inf], [1e308, 1e308, -1e308], [10**400, 1.0]]
    for _ in range(300):
        columns.append(
            [rng.choice([*_CELLS, rng.random(), rng.uniform(-1e300, 1e300)]) for _ in range(rng.randint(1, 40))]
        )
    return columns


def test_no_nan_answers_as_each_cell_would() -> None:
    for cells in _columns():
        assert _no_nan(cells) == all(c == c for c in cells), cells


def test_a_column_is_bound_as_each_cell_would_be() -> None:
    for cells in _columns():
        assert _nan_markers(cells) == list(map(_nan_marker, cells)), cells
