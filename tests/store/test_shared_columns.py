"""A column that holds one object in every row of a batch (an import's run, rank and attempt, given by the collector
as one object) is bound once per INSERT, not once per row; a column of equal but distinct values (1 and 1.0, 0.0 and
-0.0, copies) is bound row by row, as each is stored differently. Either way the rows stored are those SQLAlchemy's
own INSERT of the full rows stores, value for value, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import event, text

from trainmon.monitor.store.storage import Storage, steps


def _stored(store: Storage) -> list[tuple]:
    columns = ["run", "rank", "attempt", "step", "time", "loss", "lr", "lrs", "tokens"]
    shown = ", ".join(f"quote({c})" if store.dialect == "sqlite" else f"{c}::text" for c in columns)
    with store.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT {shown} FROM steps ORDER BY run, rank, attempt, step"))]


def _reference(store: Storage, columns: dict[str, list[Any]]) -> None:
    if store.dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    rows = [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]
    with store.begin() as conn:
        conn.execute(insert(steps).on_conflict_do_nothing(), rows)


def _batches(count: int) -> list[dict[str, list[Any]]]:
    run, lrs, nan = "shared-run", [3e-4], math.nan
    return [
        {  # run, rank, attempt, lr, lrs and a NaN loss: one object each, in every row
            "run": [run] * count,
            "rank": [1] * count,
            "attempt": [0] * count,
            "step": list(range(count)),
            "time": [float(i) for i in range(count)],
            "loss": [nan] * count,
            "lr": [lrs[0]] * count,
            "lrs": [lrs] * count,
            "tokens": [None] * count,
        },
        {  # equal values of other types or signs, and equal copies: bound row by row
            "run": [run + "-2" if i % 2 else "".join([run, "-2"]) for i in range(count)],
            "rank": [1] * count,
            "attempt": [0] * count,
            "step": list(range(count)),
            "time": [[0.0, -0.0][i % 2] for i in range(count)],
            "loss": [[1, 1.0][i % 2] for i in range(count)],
            "lr": [None] * count,
            "lrs": [[1e-4] for _ in range(count)],  # equal lists, each its own
            "tokens": [2**40 + i - i for i in range(count)],  # equal ints, each its own
        },
    ]


def test_shared_and_row_by_row_columns_store_what_sqlalchemy_stores(store: Storage, tmp_path: Any) -> None:
    reference = Storage(str(tmp_path / "ref.sqlite")) if store.dialect == "sqlite" else None
    if reference is None:  # PostgreSQL: the reference in the same database, under other run names
        for columns in _batches(300):
            renamed = {**columns, "run": ["ref:" + r for r in columns["run"]]}
            _reference(store, renamed)
            with store.begin() as conn:
                store.insert_ignore(conn, steps, columns)
        rows = _stored(store)
        ours = [r for r in rows if not str(r[0]).startswith("ref:")]
        theirs = [(r[0].removeprefix("ref:"), *r[1:]) for r in rows if str(r[0]).startswith("ref:")]
        assert ours == theirs and len(ours) == 600
        return
    for columns in _batches(300):
        _reference(reference, columns)
        with store.begin() as conn:
            store.insert_ignore(conn, steps, columns)
    assert _stored(store) == _stored(reference)
    assert len(_stored(store)) == 600
    reference.close()


def test_a_shared_column_is_bound_once_a_statement() -> None:
    """An imported batch's steps: run, rank and attempt bound once for a statement's rows (SQLite: 3 + 166 x 6
    values, where binding them in every row took 111 x 9)."""
    store = Storage("sqlite://")
    bound: list[int] = []

    def count(conn: Any, cursor: Any, sql: str, parameters: Any, context: Any, executemany: bool) -> None:
        bound.extend(len(p) for p in (parameters if executemany else [parameters]))

    event.listen(store.engine, "before_cursor_execute", count)
    n, run = 1000, "imported"
    columns = {
        "run": [run] * n,
        "rank": [0] * n,
        "attempt": [0] * n,
        "step": list(range(n)),
        "time": [float(i) for i in range(n)],
        "loss": [2.0 + i for i in range(n)],
        "grad_norm": [1.0 / (i + 1) for i in range(n)],
        "lr": [1e-4 * i for i in range(n)],
        "lrs": [[1e-4 * i] for i in range(n)],
    }
    with store.begin() as conn:
        store.insert_ignore(conn, steps, columns)
    assert bound == [3 + 166 * 6] * 6 + [3 + 6] * (n - 6 * 166)
    with store.connect() as conn:
        stored = list(conn.execute(text("SELECT run, rank, attempt, step, lrs FROM steps ORDER BY rowid")))
    assert stored == [(run, 0, 0, i, f"[{1e-4 * i!r}]") for i in range(n)]
