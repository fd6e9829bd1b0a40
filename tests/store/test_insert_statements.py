"""How ``Storage.insert_ignore`` cuts a batch into INSERTs: statements of as many rows as the database binds values,
then the rows left by statements of a power of two rows each, every statement SQLAlchemy's own INSERT of that many
rows, and the rows stored in their order whatever the count."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text

from trainmon.monitor.store.storage import Storage, steps

_ORDER = ("run", "rank", "attempt", "step", "time", "loss", "grad_norm", "lr", "lrs")


def _columns(count: int, first: int = 0) -> dict[str, list[Any]]:
    steps_ = range(first, first + count)
    return {
        "run": ["r"] * count,
        "rank": [0] * count,
        "attempt": [0] * count,
        "step": list(steps_),
        "time": [float(s) for s in steps_],
        "loss": [s * 0.5 for s in steps_],
        "grad_norm": [1.0 / (s + 1) for s in steps_],
        "lr": [1e-4] * count,
        "lrs": [[1e-4]] * count,
    }


def _statements(store: Storage) -> list[int]:
    """The rows of each INSERT the store runs from now on."""
    rows: list[int] = []

    def count(conn: Any, cursor: Any, sql: str, parameters: Any, context: Any, executemany: bool) -> None:
        if sql.startswith("INSERT INTO steps"):
            per = sql.count("), (") + 1
            rows.extend([per] * (len(parameters) if executemany else 1))

    event.listen(store.engine, "before_cursor_execute", count)
    return rows


def test_a_large_batch_takes_few_statements(store: Storage) -> None:
    """5,000 steps: whole statements of the most rows the database binds, then one of each power of two the rest
    holds (on SQLite 3,640 rows, 1,024, 256, 64 and 16: 5 statements, where statements of 111 rows and single rows
    for the rest took 50)."""
    statements = _statements(store)
    with store.begin() as conn:
        store.insert_ignore(conn, steps, _columns(5000))
    whole, rest = divmod(5000, store._variables // len(_ORDER))
    assert len(statements) == whole + rest.bit_count()
    assert sum(statements) == 5000
    assert statements == sorted(statements, reverse=True)
    if store.dialect == "sqlite":
        assert statements == [3640, 1024, 256, 64, 16]
    with store.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM steps")).scalar() == 5000


@pytest.mark.parametrize("count", [*range(0, 41), 97, 128, 255])
def test_every_count_stores_its_rows_in_order(count: int) -> None:
    """With statements of at most 6 rows (30 values of 5 columns), each count is cut into whole statements and
    powers of two; the rows are stored once each, in their order (SQLite's rowids)."""
    store = Storage("sqlite://")
    store._variables = 30
    columns = {k: v for k, v in _columns(count, first=1000).items() if k in ("run", "rank", "attempt", "step", "time")}
    with store.begin() as conn:
        store.insert_ignore(conn, steps, columns)
        store.insert_ignore(conn, steps, columns)  # all of them again: stored before, skipped
    with store.connect() as conn:
        stored = [tuple(r) for r in conn.execute(text("SELECT step, time FROM steps ORDER BY rowid"))]
    assert stored == list(zip(columns["step"], columns["time"], strict=True))


def test_the_statements_are_sqlalchemys(store: Storage) -> None:
    """The SQL made from the template of a set of columns is SQLAlchemy's own INSERT of that many rows."""
    template = store._template(steps, _ORDER)
    for rows in (1, 2, 3, 4, 9, 10, 11, 64, 111):
        assert template.sql(rows) == store._compile_insert(steps, _ORDER, rows), rows
