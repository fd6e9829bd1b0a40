"""The collector's bulk insert stores what SQLAlchemy's own INSERT of full rows stores, value for value.

``Storage.insert_ignore`` takes rows column by column, binds a column at a time, leaves out a column that is
None in every row, and takes the steps' columns built from their fields with only the columns some step has
(``ingest._step_columns``); the reference here is the rows as they were built before (every column, looked up
field by field, one row per step) inserted by SQLAlchemy Core with its own bind processing. Compared as each
database prints the stored value (SQLite's ``quote``, PostgreSQL's text), so a NaN marker, a JSON ``null`` or an
integer stored as a real would show.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table, text

import trainmon.monitor.collector.ingest as ingest
from tests.postgres import create_database
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.importers.store import import_log
from trainmon.monitor.store.storage import (
    PHASE_COLUMNS,
    PRECURSOR_FIELDS,
    STEP_FIELDS,
    Storage,
    checkpoints,
    evals,
    health,
    layer_stats,
    resumes,
    steps,
)
from trainmon.wire import EVENT_KINDS, PHASES, Event, Field, json_safe, validate_event

_TABLES = (steps, layer_stats, evals, checkpoints, resumes, health)
_NUMBERS = [0.5, -0.0, 1e-12, 3.0, 1e300, math.nan, math.inf, -math.inf, 7]
_USUAL = ("loss", "lr")  # fields most steps have
_MARKERS = {math.nan: "NaN", math.inf: "Infinity", -math.inf: "-Infinity"}


def _reference_step_row(ev: Event, attempt: int) -> dict[str, Any]:
    """The step row as it was built before: every column, each looked up in the fields."""
    f = ev.fields
    lrs = f.get("lr")
    phases = f.get("phases") or {}
    row = {"run": ev.run, "rank": ev.rank, "attempt": attempt, "step": f["step"], "time": ev.time}
    for name in STEP_FIELDS:
        row[name] = f.get(name)
    row["lr"] = lrs[0] if lrs else None
    one_group = lrs is not None and len(lrs) == 1 and type(lrs[0]) is float and str(lrs[0]) != "-0.0"
    row["lrs"] = None if one_group else lrs  # one group's rate is the lr column's (ingest._other_groups)
    for p in PHASE_COLUMNS:
        row[f"phase_{p}"] = phases.get(p)
    return row


def _reference_layer_row(ev: Event, attempt: int) -> dict[str, Any] | None:
    f = ev.fields
    precursors = {k: f[k] for k in PRECURSOR_FIELDS if k in f}
    if not f.get("layer_grad_norms") and not precursors:
        return None
    key = {"run": ev.run, "rank": ev.rank, "attempt": attempt, "step": f["step"], "time": ev.time}
    return {**key, "grad_norms": f.get("layer_grad_norms") or None, "precursors": json_safe(precursors) or None}


def _reference_step_columns(events: list[Event], attempts: list[int], *_: Any) -> dict[str, list[Any]]:
    """The steps' rows as they were built before, one full row per step, handed over column by column."""
    rows = [_reference_step_row(ev, attempt) for ev, attempt in zip(events, attempts, strict=True)]
    return {name: [row[name] for row in rows] for name in rows[0]}


def _sqlalchemy_insert(storage: Storage) -> Any:
    """``insert_ignore`` as SQLAlchemy Core does it, of the full rows: the reference."""

    def insert(conn: Any, table: Table, columns: dict[str, list[Any]]) -> None:
        if storage.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        rows = [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]
        conn.execute(dialect_insert(table).on_conflict_do_nothing(), rows)

    return insert


def _stored(storage: Storage, table: Table) -> list[tuple]:
    """Every row as the database prints its values, without the health table's own id."""
    columns = [c.name for c in table.c if c.name != "id"]
    if storage.dialect == "sqlite":
        shown = ", ".join(f'quote("{c}")' for c in columns)
    else:
        shown = ", ".join(f'"{c}"::text' for c in columns)
    order = ", ".join(f'"{c}"' for c in columns[:5])
    with storage.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT {shown} FROM {table.name} ORDER BY {order}"))]


def _value(rng: random.Random, spec: Field) -> Any:
    """A wire value of a field's type, non-finite (as a float or the wire's marker) where it may be."""
    kind = spec.type
    if kind == "float":
        v = rng.choice(_NUMBERS if spec.nonfinite else [n for n in _NUMBERS if math.isfinite(n)])
        return _MARKERS.get(v, v) if rng.random() < 0.5 else v
    if kind == "int":
        return rng.choice([0, 1, 4096, 2**31 - 1])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "str":
        return rng.choice(["a", "ckpt/step-10", "é"])
    if kind == "float_list":
        return [rng.choice([1e-4, 3e-5, 0.0, 2]) for _ in range(rng.randint(0, 3))]
    if kind == "float_map":
        return {f"g{i}": rng.choice([0.5, 2.0, "NaN"]) for i in range(rng.randint(0, 3))}
    if kind == "phases":
        return {p: rng.choice([0.0, 0.25, 1.5]) for p in rng.sample(PHASES, rng.randint(0, len(PHASES)))}
    return {"k": [1, 2.5, None], "s": "x"}  # json


def _events(seed: int, n: int = 300) -> list[Event]:
    """Two ranks' events, steps with every mix of fields (some sampled), and every other stored kind."""
    rng = random.Random(seed)
    out = []
    seq = {0: 0, 1: 0}
    for i in range(n):
        rank = rng.randint(0, 1)
        kind = rng.choices(["step", "eval", "checkpoint", "resume", "health"], [20, 1, 1, 1, 1])[0]
        specs = EVENT_KINDS[kind]
        fields = {
            name: _value(rng, spec)
            for name, spec in specs.items()
            if name not in ("step", "gpus")
            and (spec.required or rng.random() < (0.9 if name in ("loss", "lr") else 0.3))
        }
        if kind != "health":
            fields["step"] = i
        seq[rank] += 1
        raw = {"kind": kind, "run": "r", "rank": rank, "host": "h", "stream": f"s{rank}", "seq": seq[rank]}
        out.append(validate_event({**raw, "time": 1000.0 + i, "fields": fields}))
    return out


def _ingest(storage: Storage, events: list[Event], batch: int) -> None:
    ingestor = Ingestor(storage, Engine(storage, CollectorConfig().detectors, detectors=()), LiveState())
    for i in range(0, len(events), batch):
        ingestor.ingest(events[i : i + batch])


def _reference(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "_step_columns", _reference_step_columns)
    monkeypatch.setattr(ingest, "_layer_row", _reference_layer_row)
    monkeypatch.setattr(storage, "insert_ignore", _sqlalchemy_insert(storage))


def _twin(store: Storage, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A second, empty store of the same database kind."""
    if store.dialect == "sqlite":
        return Storage(str(tmp_path / "twin.sqlite"))
    return Storage(create_database(request.getfixturevalue("postgres_server")))


@pytest.mark.parametrize(("seed", "batch"), [(1, 37), (2, 37), (3, 300)])
def test_every_table_holds_what_sqlalchemys_insert_of_full_rows_stores(
    store: Storage,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    batch: int,
) -> None:
    """Batches of one rank and of both, each with a mix of fields; of 300 events: more rows than one INSERT
    statement holds, and the ranks' events interleaved."""
    events = _events(seed)
    _ingest(store, events, batch=batch)
    reference = _twin(store, request, tmp_path)
    _reference(reference, monkeypatch)
    _ingest(reference, events, batch=batch)
    for table in _TABLES:
        assert _stored(store, table) == _stored(reference, table), table.name
    assert len(_stored(store, steps)) > 200 and len(_stored(store, layer_stats)) > 20
    reference.close()


def test_an_imported_csv_stores_the_same_steps_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "history.csv"
    rows = ["_step,train/loss,train/learning_rate,train/grad_norm"]
    rows += [f"{s},{2.0 + s / 7},{1e-4 * (s % 5)},{'nan' if s % 11 == 3 else s / 3}" for s in range(500)]
    rows += ["500,,1e-4,", "501,inf,,0.5"]  # empty cells: fields the step does not have
    log.write_text("\n".join(rows) + "\n")
    new, ref = Storage(str(tmp_path / "new.sqlite")), Storage(str(tmp_path / "ref.sqlite"))
    import_log(log, new, run="r")
    _reference(ref, monkeypatch)
    import_log(log, ref, run="r")
    assert _stored(new, steps) == _stored(ref, steps)
    assert len(_stored(new, steps)) == 502


def test_a_replayed_row_is_skipped_whatever_columns_it_fills(store: Storage) -> None:
    key = {"run": "r", "rank": 0, "attempt": 0, "time": 1.0}
    with store.begin() as conn:
        store.insert_ignore(conn, steps, _one({**key, "step": 1, "loss": 2.0, "lrs": None}))
        store.insert_ignore(conn, steps, _one({**key, "step": 1, "loss": 9.0, "grad_norm": 1.0, "lrs": [1.0]}))
    ((loss, grad_norm, lrs),) = _stored_values(store, "loss, grad_norm, lrs")
    assert (float(loss), grad_norm, lrs) == (2.0, None, "null")  # the first row's: a JSON null, not SQL NULL


def test_rows_of_one_key_within_one_statement_keep_the_first(store: Storage) -> None:
    """A batch spans several multi-row statements and the single-row one after them; a key repeated in it,
    within one statement or across them, keeps its first row, as one row at a time would."""
    count = 1000  # several multi-row statements (run, rank, attempt and lr bound once each), then 1 row each
    columns = {
        "run": ["r"] * count,
        "rank": [0] * count,
        "attempt": [0] * count,
        "step": [i % 300 if i % 7 else 5 for i in range(count)],
        "time": [float(i) for i in range(count)],
        "loss": [i * 0.5 if i % 13 else math.nan for i in range(count)],
        "grad_norm": [None if i % 3 else 1.0 / (i + 1) for i in range(count)],
        "lr": [1e-4] * count,
        "lrs": [[1e-4, float(i)] for i in range(count)],
    }
    with store.begin() as conn:
        store.insert_ignore(conn, steps, columns)
    first: dict[int, int] = {}
    for i, step in enumerate(columns["step"]):
        first.setdefault(step, i)
    with store.connect() as conn:
        stored = sorted(conn.execute(text("SELECT step, time FROM steps")))
    assert stored == sorted((step, float(i)) for step, i in first.items())


def test_many_sets_of_columns_are_each_stored_right(store: Storage) -> None:
    """Producers choose which fields they send: each set of columns gets a statement of its own, and the
    cache of them stays bounded."""
    optional = [n for n in STEP_FIELDS if n != "batch_fingerprint"]
    rng = random.Random(0)
    with store.begin() as conn:
        for step in range(300):
            filled = rng.sample(optional, rng.randint(0, 5))
            row = {"run": "r", "rank": 0, "attempt": 0, "step": step, "time": 1.0, "lrs": None}
            store.insert_ignore(conn, steps, _one({**row, **{n: 1 for n in filled}}))
            assert len(store._inserts) <= 256
    assert len(_stored(store, steps)) == 300


def _one(row: dict[str, Any]) -> dict[str, list[Any]]:
    """One row, column by column."""
    return {name: [value] for name, value in row.items()}


def _stored_values(store: Storage, columns: str) -> list[tuple]:
    cast = "" if store.dialect == "sqlite" else "::text"
    shown = ", ".join(f"{c.strip()}{cast}" if c.strip() == "lrs" else c for c in columns.split(","))
    with store.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT {shown} FROM steps"))]
