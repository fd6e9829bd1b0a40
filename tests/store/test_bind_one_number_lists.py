"""A JSON column of lists that hold one number each (a step's learning rates under one param group: most imported
steps) is bound as its processor binds each cell, every number's text included: ints, floats SQLite's JSON text
writes in exponent form, non-finite ones, and columns whose lists hold one number or more. And ``insert_ignore``,
which asks a column's first cell before it counts its Nones, of no rows at all."""

from __future__ import annotations

import math
import random

from trainmon.monitor.store.storage import Storage, steps

_NUMBERS = [0, 7, -3, 2**70, 1e-05, 1.5e-08, 3e-4, 1e16, 1e22, -0.0, 0.1, 5e-324, math.nan, math.inf, -math.inf]


def test_lists_of_one_number_are_bound_as_each_cell_alone() -> None:
    storage = Storage("sqlite://")
    binder, process = storage._binder(steps.c.lrs), storage._bind_processor(steps.c.lrs)
    assert binder is not None and process is not None
    rng = random.Random(7)
    columns = [[[n] for n in _NUMBERS]]
    columns += [[[rng.choice([*_NUMBERS, rng.random(), rng.uniform(-1e9, 1e9)])] for _ in range(40)] for _ in range(50)]
    columns += [[[1e-05], [2.0, 3.0], [4]], [[1.0, 2.0]] * 3, [[1]]]  # a list of two among lists of one
    for cells in columns:
        assert binder(cells) == [process(c) for c in cells], cells


def test_no_rows_store_nothing() -> None:
    storage = Storage("sqlite://")
    with storage.begin() as conn:
        storage.insert_ignore(conn, steps, {"run": [], "rank": [], "attempt": [], "step": [], "time": [], "loss": []})
    with storage.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM steps").scalar() == 0
