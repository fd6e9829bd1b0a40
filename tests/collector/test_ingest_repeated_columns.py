"""The steps' key columns the ingest gives ``insert_ignore`` as ``Repeated`` (one segment's steps: an import's
batch) store what the same values given as plain lists store, row for row; a group of segments of several streams
(the live collector's) gives plain lists, whose cells ``insert_ignore`` asks one by one."""

from __future__ import annotations

import itertools
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from trainmon.clock import aligned
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor, _extremes, _key_column, _segment
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Repeated, Storage, steps
from trainmon.wire import Event, validate_event


def _stored(store: Storage) -> list[tuple[Any, ...]]:
    columns = [c.name for c in steps.c]
    shown = ", ".join(f"quote({c})" for c in columns)
    with store.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT {shown} FROM steps ORDER BY run, rank, attempt, step"))]


def test_one_part_is_repeated_and_several_are_plain_lists() -> None:
    one = _key_column([("run", 3)])
    assert type(one) is Repeated and one == ["run"] * 3
    several = _key_column([("a", 2), ("b", 1), ("a", 1)])
    assert type(several) is list and several == ["a", "a", "b", "a"]


def test_repeated_columns_store_what_plain_lists_store() -> None:
    n, run, nan = 500, "repeated", math.nan
    varying = {
        "step": list(range(n)),
        "time": [float(i) for i in range(n)],
        "loss": [nan if i % 7 == 0 else 1.0 / (i + 1) for i in range(n)],
        "lr": [1e-4] * n,
    }
    stores = Storage("sqlite://"), Storage("sqlite://")
    for store, make in zip(stores, (Repeated, lambda v, c: [v] * c), strict=True):
        columns = {"run": make(run, n), "rank": make(3, n), "attempt": make(1, n), "lrs": make(None, n), **varying}
        with store.begin() as conn:
            store.insert_ignore(conn, steps, columns)
    assert _stored(stores[0]) == _stored(stores[1])
    assert len(_stored(stores[0])) == n


def _events(stream: str, run: str, rank: int, seqs: range, lrs: list[float]) -> list[Any]:
    return [
        validate_event(
            {
                "kind": "step",
                "run": run,
                "rank": rank,
                "host": "h",
                "stream": stream,
                "seq": seq,
                "time": 1000.0 + seq,
                "fields": {"step": seq, "loss": 2.0 - seq / 100, "lr": lrs},
            }
        )
        for seq in seqs
    ]


def test_an_imports_batch_and_a_live_group_store_the_same_steps() -> None:
    """The same steps, ingested as batches of one stream each (the keys ``Repeated``) and as one group of
    interleaved streams' segments (plain lists), store the same rows; a second param group's rates included."""
    parts = [("s0", "a", 0, [1e-3]), ("s1", "a", 1, [1e-3, 2e-3]), ("s2", "b", 0, [-0.0])]
    stores = []
    for by_stream in (True, False):
        store = Storage("sqlite://")
        ingestor = Ingestor(store, Engine(store, DetectorsConfig(), process=False), None)
        batches = [_events(stream, run, rank, range(1, 40), lrs) for stream, run, rank, lrs in parts]
        if by_stream:
            for batch in batches:
                ingestor.ingest(batch)
        else:
            mixed = [ev for i in range(0, 39, 13) for batch in batches for ev in batch[i : i + 13]]
            ingestor.ingest(mixed)
        stores.append(store)
    assert _stored(stores[0]) == _stored(stores[1])
    assert len(_stored(stores[0])) == 3 * 39


def _sqlalchemy_statement(store: Storage, table: Any, plan: Any, rows: int) -> str:
    """SQLAlchemy's own INSERT of ``rows`` rows, its parameters numbered as ``insert_ignore`` binds them: the
    statement ``_compile_insert`` gives, made the slow way."""
    from sqlalchemy import bindparam
    from sqlalchemy.dialects.sqlite import insert

    row = {**dict.fromkeys(plan.order), **{name: bindparam(f"{name}_shared") for name in plan.shared}}
    compiled = insert(table).values([row] * rows).on_conflict_do_nothing().compile(dialect=store.engine.dialect)
    names = (*(f"{n}_shared" for n in plan.shared), *(f"{n}_m{r}" for r in range(rows) for n in plan.order))
    number = {name: i for i, name in enumerate(names, start=1)}
    sql = str(compiled).split("?")
    bound = compiled.positiontup or ()
    return sql[0] + "".join(f"?{number[name]}{text}" for name, text in zip(bound, sql[1:], strict=True))


def test_a_statement_of_many_rows_is_sqlalchemys() -> None:
    from trainmon.monitor.store.storage import _InsertPlan, health, layer_stats

    store = Storage("sqlite://")
    cases = [
        (steps, ("step", "time", "loss", "grad_norm", "lr"), ("run", "rank", "attempt", "lrs")),
        (steps, ("run", "rank", "attempt", "step", "time", "loss", "grad_norm", "lr", "lrs"), ()),
        (steps, ("step",), ("run", "rank", "attempt", "time")),
        (health, ("run", "rank", "attempt", "host", "time", "data"), ()),
        (layer_stats, ("step", "time", "grad_norms"), ("run", "rank", "attempt", "precursors")),
    ]
    for table, order, shared in cases:
        plan = _InsertPlan(order, [None] * len(order), shared, [None] * len(shared))
        for rows in (1, 2, 3, 7, 199):
            assert store._compile_insert(table, plan, rows).sql == _sqlalchemy_statement(store, table, plan, rows)


_OFFSETS = st.sampled_from([None, 0.0, -0.0, 0.5, 3600.0, -7.25, math.nan]) | st.builds(float, st.just("nan"))


def _reference_extremes(times: list[float], offsets: list[Any]) -> tuple[float, float]:
    """The extremes as the ingest took them before a segment of one offset was asked at C speed: by each run of
    events of one offset."""
    extremes, stop = [], 0
    for offset, same in itertools.groupby(offsets):
        start, stop = stop, stop + len(list(same))
        extremes.append((aligned(max(times[start:stop]), offset), aligned(min(times[start:stop]), offset)))
    latest, earliest = extremes[0]
    for hi, lo in extremes[1:]:
        latest, earliest = max(latest, hi), min(earliest, lo)
    return latest, earliest


@given(st.lists(st.tuples(st.floats(0.0, 2e9, allow_nan=False), _OFFSETS), min_size=1, max_size=30))
@settings(max_examples=300, deadline=None)
def test_a_segments_extremes_are_those_by_runs_of_one_offset(times_and_offsets: list[tuple[float, Any]]) -> None:
    """Whether a segment's events share one offset or not (None, 0.0 and -0.0, one NaN object: equal offsets
    that ``itertools.groupby`` puts in one run; NaNs each their own object), its extremes are what the runs of one
    offset give, bit for bit."""
    times, offsets = (list(c) for c in zip(*times_and_offsets, strict=True))
    events = [
        Event("step", "r", 0, "h", "s", i, t, {"step": i}, clock_offset=o)
        for i, (t, o) in enumerate(zip(times, offsets, strict=True))
    ]
    assert repr(_extremes(_segment(events))) == repr(_reference_extremes(times, offsets))
