"""``Storage.insert_ignore`` binds a column at a time: each binder equals its type's bind processor applied
cell by cell (a Real column's NaN marker, a JSON column's text), on random and adversarial columns."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from trainmon.monitor.store.storage import Storage, evals, layer_stats, steps

_FLOATS = [0.0, -0.0, 1e-8, 3e-4, 2.5, -7.0, 1e300, 5e-324, math.nan, math.inf, -math.inf]


def _cell(rng: random.Random) -> Any:
    """A list of numbers mostly; sometimes what a JSON column may also hold."""
    roll = rng.random()
    if roll < 0.03:
        return None
    if roll < 0.05:
        return []
    if roll < 0.07:
        return [True, 1.0]  # a bool prints as JSON true, not as a number
    if roll < 0.09:
        return {"a": [1.0, 2.0]}
    if roll < 0.1:
        return ["], [", 1.0]  # the separator inside a string
    return [rng.choice([*_FLOATS, rng.random(), rng.randint(-(2**70), 2**70)]) for _ in range(rng.randint(1, 4))]


def _columns(seed: int) -> list[list[Any]]:
    rng = random.Random(seed)
    plain = [[[rng.choice([*_FLOATS, rng.random()])] for _ in range(rng.randint(1, 50))] for _ in range(20)]
    mixed = [[_cell(rng) for _ in range(rng.randint(1, 50))] for _ in range(60)]
    return plain + mixed + [[[1.0]], [[1, 2, 3]], [None], [[]], [[1.0], None], [[2**64, -(2**64), 0]]]


@pytest.mark.parametrize("column", [steps.c.lrs, layer_stats.c.grad_norms, evals.c.metrics])
def test_a_json_column_is_bound_as_its_processor_binds_each_cell(column: Any) -> None:
    storage = Storage("sqlite://")
    binder, process = storage._binder(column), storage._bind_processor(column)
    assert binder is not None and process is not None
    for seed in range(5):
        for cells in _columns(seed):
            assert binder(list(cells)) == [process(c) for c in cells], cells


def test_a_real_column_is_bound_as_its_processor_binds_each_cell() -> None:
    storage = Storage("sqlite://")
    binder, process = storage._binder(steps.c.loss), storage._bind_processor(steps.c.loss)
    assert binder is not None and process is not None
    rng = random.Random(3)
    columns = [[rng.choice([*_FLOATS, None, 4, 0]) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for cells in [*columns, [math.nan], [None], [1.0, float("nan")]]:
        bound = binder(list(cells))
        expected = [process(c) for c in cells]
        assert [repr(x) for x in bound] == [repr(x) for x in expected], cells  # -0.0 stays -0.0, NaN its marker
