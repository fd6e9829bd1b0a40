"""Where the collector keeps everything: SQLite by default, PostgreSQL past one machine.

The schema is SQLAlchemy Core, sized for the whole product from the start: runs, producer
streams (one per process and rank, which is how attempts are counted), steps keyed by
(run, rank, attempt, step), evals, checkpoints, resumes, health samples, per-layer statistics
and anomalies. Steps repeat across attempts when a run resumes from an older checkpoint, so
``attempt`` is part of every per-step key.

The schema is versioned with Alembic (``monitor/store/migrations``): opening a store upgrades it.

SQLite stores NaN as NULL, and a NaN loss is data, so floats go through :class:`Real`, which
keeps NaN as the text ``'NaN'`` on SQLite (PostgreSQL has a native NaN).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import operator
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.types import TypeDecorator

from trainmon.wire import WireError, decode_float, encode_float

log = logging.getLogger("trainmon.storage")
_CHECKPOINT_SECONDS = 1.0
_MAX_PLANS = 256  # compiled INSERTs kept (insert_ignore): one per table and set of columns a batch fills
# Values bound by one multi-row INSERT: SQLite's limit before 3.32 (32,766 since), PostgreSQL's is 65,535. Rows
# beyond ~50 per statement no longer make an insert cheaper.
_MAX_VARIABLES = 999

__all__ = [
    "PHASE_COLUMNS",
    "PRECURSOR_FIELDS",
    "STEP_FIELDS",
    "Repeated",
    "Storage",
    "anomalies",
    "checkpoints",
    "evals",
    "health",
    "layer_stats",
    "metadata",
    "resumes",
    "runs",
    "steps",
    "streams",
]


class _UnprocessedFloat(Float):
    def bind_processor(self, dialect: Any) -> None:
        return None  # Float's processor would turn the 'NaN' marker back into a float


class Real(TypeDecorator):
    """A float column that round-trips NaN on SQLite."""

    impl = _UnprocessedFloat(precision=53)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if value is not None and dialect.name == "sqlite" and math.isnan(value):
            return "NaN"
        return value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if value == "NaN":
            return math.nan
        return value


def _nan_marker(value: Any) -> Any:
    return "NaN" if value != value else value  # only NaN differs from itself


def _nan_markers(cells: list[Any]) -> list[Any]:
    """A Real column's cells as bound on SQLite: each through :func:`_nan_marker`. Most columns hold no NaN, and
    are bound as they are: :func:`_no_nan` asks the whole column at C speed first."""
    if _no_nan(cells):
        return cells
    return list(map(_nan_marker, cells))


def _no_nan(cells: list[Any]) -> bool:
    """Whether no cell is NaN. A finite sum proves it (a NaN makes any sum NaN), in a third of the time it takes to
    compare each cell with itself (only NaN is unequal to itself), which answers where the sum cannot: a column
    with a None or an infinity."""
    try:
        if math.isfinite(sum(cells)):
            return True
    except (TypeError, OverflowError):  # a None among the numbers, an int past a float
        pass
    return all(map(operator.eq, cells, cells))


_NUMBERS = frozenset({int, float})
# json.dumps's own encoder without its check for cycles (lists of numbers hold none): the same text, 10% sooner.
_NUMBER_LISTS = json.JSONEncoder(check_circular=False)


def _json_texts(process: Callable[[Any], Any], cells: list[Any]) -> list[Any]:
    """A JSON column's cells as bound on SQLite, where ``process`` (SQLAlchemy's) binds a value as its
    ``json.dumps``. A column of non-empty lists of plain numbers (a step's learning rates, one list per step) is
    encoded by one ``json.dumps`` of the column and cut between its lists (a number's text holds no bracket,
    comma nor line break): the same texts, without a million calls through SQLAlchemy's wrapper and the
    encoder's. Where each list holds one number (one param group, as mostly), the ``, `` between the lists are
    the only ones, and the cut needs no marking first. A column of None (the ``lrs`` of a run of one param group,
    ``ingest._other_groups``) is JSON's ``null`` in every row, made once."""
    if cells.count(None) == len(cells):
        return [process(None)] * len(cells)
    lists = set(map(type, cells)) == {list} and all(cells)
    if lists and set(map(type, itertools.chain.from_iterable(cells))) <= _NUMBERS:
        text = _NUMBER_LISTS.encode(cells)[1:-1]
        texts = text.split(", ")  # one a cell where each list holds one number, more where a list holds more
        return texts if len(texts) == len(cells) else text.replace("], [", "]\n[").split("\n")
    return _each(process, cells)


def _each(process: Callable[[Any], Any], cells: list[Any]) -> list[Any]:
    return list(map(process, cells))


_Binder = Callable[[list[Any]], list[Any]]


class _Statement(NamedTuple):
    sql: str
    names: tuple[str, ...] | None  # its parameters' names: the shared columns', then row after row (None: positional)


class _InsertPlan:
    """How ``Storage.insert_ignore`` stores rows of one set of columns: by statements of ``rows`` rows, the rows
    past the last whole one by a statement of one row each, each statement compiled when first needed (one of
    ``_MAX_VARIABLES`` values takes SQLAlchemy 30 ms; a batch of a few rows never needs it). A column ``shared``
    holds one object in every row of the batch: each statement binds it once, for all its rows."""

    __slots__ = ("binders", "order", "rows", "shared", "shared_binders", "statements")

    def __init__(
        self,
        order: tuple[str, ...],
        binders: list[_Binder | None],
        shared: tuple[str, ...],
        shared_binders: list[_Binder | None],
    ) -> None:
        self.order = order  # the columns bound in each row, in the statements' order
        self.binders = binders  # each column's (None: bound as it is)
        self.shared = shared  # the columns bound once a statement, in the table's order
        self.shared_binders = shared_binders
        self.rows = max(1, (_MAX_VARIABLES - len(shared)) // len(order))
        self.statements: dict[int, _Statement] = {}  # by its number of rows


class Repeated(list[Any]):
    """A column that holds one object in each of its rows, made so by its maker: ``insert_ignore`` binds it once a
    statement without asking each cell whether it is that object (an imported batch's run, rank, attempt and
    ``lrs``: 4 of its 9 columns, whose cells asked one by one cost 0.06-0.09 s of a million steps' ingest)."""

    __slots__ = ()

    def __init__(self, value: Any, count: int) -> None:
        super().__init__(itertools.repeat(value, count))


def _one_object(cells: list[Any]) -> bool:
    """Whether every cell is the same object (bound alike whatever its type: not merely equal, as 1 and 1.0 or
    0.0 and -0.0 are): a batch's run, rank and attempt, given by the collector as one object for its rows
    (``Repeated`` where it knows, without a look at each cell)."""
    if type(cells) is Repeated:
        return True
    first = cells[0]
    return cells[-1] is first and all(map(operator.is_, cells, itertools.repeat(first)))


metadata = MetaData()

runs = Table(
    "runs",
    metadata,
    Column("run", String(128), primary_key=True),
    Column("created_at", Real, nullable=False),
    Column("updated_at", Real, nullable=False),
    Column("status", String(16), nullable=False),  # running, finished, failed, interrupted
    Column("world_size", Integer),
    Column("planned_steps", BigInteger),
    Column("vocab_size", Integer),
    Column("config", JSON),
    Column("schedule", JSON),
    Column("meta", JSON),  # the other run_start fields of rank 0's latest attempt
)

streams = Table(
    "streams",
    metadata,
    Column("stream", String(64), primary_key=True),
    Column("run", String(128), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("host", String(255), nullable=False),
    Column("started_at", Real, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("last_time", Real, nullable=False),
    Column("events", BigInteger, nullable=False),
    Column("missing", BigInteger, nullable=False),  # seq gaps: events the producer dropped
    Column("received", JSON),  # stored seqs as [first, last] ranges (collector.seqs); NULL: all up to last_seq
    # collector clock - producer clock, estimated (core.clock); started_at and last_time are on the collector's clock
    Column("clock_offset", Real),
    Column("start", JSON),  # this stream's run_start fields
    Column("end_status", String(16)),
    Column("end_step", BigInteger),
    Column("end_error", Text),
    Column("dropped_events", BigInteger),
    # The step fields (wire names) some stored step of the stream holds, sorted; NULL: not known (stored before
    # revision 0005), readers scan the steps then. What a reader asks before a pass over every step.
    Column("step_fields", JSON),
    Index("ix_streams_run_rank", "run", "rank"),
)

STEP_FIELDS = (  # step event fields stored in columns of the same name
    "loss",
    "grad_norm",
    "grad_norm_clipped",
    "clip_coef",
    "loss_scale",
    "skipped",
    "tokens",
    "samples",
    "micro_batches",
    "scheduler_steps",
    "step_time",
    "mem_allocated_bytes",
    "mem_peak_bytes",
    "batch_fingerprint",
    "update_ratio",
)

PHASE_COLUMNS = ("data", "forward", "backward", "comm", "optimizer", "checkpoint", "eval", "other")


def _step_key() -> list[Column]:
    return [
        Column("run", String(128), primary_key=True),
        Column("rank", Integer, primary_key=True),
        Column("attempt", Integer, primary_key=True),
        Column("step", BigInteger, primary_key=True),
        Column("time", Real, nullable=False),
    ]


steps = Table(
    "steps",
    metadata,
    *_step_key(),
    Column("loss", Real),
    Column("grad_norm", Real),
    Column("grad_norm_clipped", Real),
    Column("clip_coef", Real),
    Column("lr", Real),  # first param group, the one dashboards show
    Column("lrs", JSON),  # every param group
    Column("loss_scale", Real),
    Column("skipped", Boolean),
    Column("tokens", BigInteger),
    Column("samples", BigInteger),
    Column("micro_batches", Integer),
    Column("scheduler_steps", Integer),
    Column("step_time", Real),
    *[Column(f"phase_{p}", Real) for p in PHASE_COLUMNS],
    Column("mem_allocated_bytes", BigInteger),
    Column("mem_peak_bytes", BigInteger),
    Column("batch_fingerprint", String(64)),
    Column("update_ratio", Real),
)

PRECURSOR_FIELDS = (  # sampled step fields kept in layer_stats.precursors, as sent (issue 28)
    "attn_logit_max",
    "attn_entropy",
    "linear_out_rms",
    "group_update_ratio",
    "adam_eps_frac",
    "output_logz",
    "output_logit_max",
)

# Second-level, sampled rows: a row may hold per-parameter grad norms, precursors or both (SQL NULL for
# the one it lacks: ``none_as_null``, where a plain JSON column would store the JSON ``null``).
layer_stats = Table(
    "layer_stats",
    metadata,
    *_step_key(),
    Column("grad_norms", JSON(none_as_null=True)),
    Column("precursors", JSON(none_as_null=True)),  # {step field: value or map}, PRECURSOR_FIELDS
)

evals = Table(
    "evals",
    metadata,
    *_step_key(),
    Column("loss", Real),
    Column("metrics", JSON),
    Column("duration", Real),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    *_step_key(),
    Column("path", Text),
    Column("duration", Real),
    Column("bytes", BigInteger),
    Column("fingerprint", JSON),
)

resumes = Table(
    "resumes",
    metadata,
    *_step_key(),
    Column("path", Text),
    Column("duration", Real),
    Column("fingerprint", JSON),
)

health = Table(
    "health",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run", String(128), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("host", String(255), nullable=False),
    Column("time", Real, nullable=False),
    Column("data", JSON, nullable=False),
    Index("ix_health_run_time", "run", "time"),
)

anomalies = Table(
    "anomalies",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run", String(128), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("rank", Integer, nullable=False),  # -1: the run as a whole
    Column("severity", String(16), nullable=False),  # info, warning, critical
    Column("status", String(16), nullable=False),  # open, resolved
    Column("first_step", BigInteger),
    Column("last_step", BigInteger),
    Column("opened_at", Real, nullable=False),
    Column("updated_at", Real, nullable=False),
    Column("resolved_at", Real),
    Column("message", Text, nullable=False),
    Column("hint", Text, nullable=False),
    Column("evidence", JSON),
    Index("ix_anomalies_run", "run", "kind", "rank", "status"),
)


def database_url(path_or_url: str, *, create: bool = True) -> str:
    """Accept a file path (SQLite) or any SQLAlchemy URL. ``create=False``: a SQLite file must exist
    already (reading commands must never leave an empty store behind a typo)."""
    if "://" in path_or_url:
        return path_or_url
    path = Path(path_or_url).expanduser()
    if not create and not path.is_file():
        raise FileNotFoundError(f"no store at {path} (a SQLite file); give the collector's --db, or --url")
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


_FLOAT_TAG = "$float"
"""The one key of the JSON object that stands for a non-finite float in PostgreSQL's JSON cells (its value the
wire format's marker: ``encode_float``)."""


def _json_text(value: Any) -> str:
    """A JSON cell's text for PostgreSQL, which has no NaN or infinity: Python writes the bare tokens ``NaN`` and
    ``Infinity``, which the server refuses, and with them the whole statement (a batch of steps whose learning rates,
    several param groups, held one NaN). A non-finite float is written as ``{"$float": "NaN"}`` ("Infinity",
    "-Infinity"), read back as the float by :func:`_json_value`: an object no producer sends, where the wire's marker
    strings would turn a logged string into a number. SQLite stores and reads Python's tokens as they are."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: rare, so looked for only then
        return json.dumps(_tagged(value), allow_nan=False)


def _tagged(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: encode_float(value)}
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tagged(v) for v in value]
    return value


def _json_value(text: str | bytes) -> Any:
    """A PostgreSQL JSON cell's value, its tagged non-finite floats floats again (:func:`_json_text`)."""
    return json.loads(text, object_hook=_untagged)


def _untagged(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and isinstance(marker := obj.get(_FLOAT_TAG), str):
        try:
            return decode_float(marker)
        except WireError:  # not a marker: an object a run logged
            return obj
    return obj


class Storage:
    """The collector's database: schema creation and transactions.

    SQLite runs in WAL mode with ``synchronous=FULL``: a committed batch survives a crash of
    the collector or of the machine, which is what lets ingest acknowledge only after commit.
    """

    def __init__(self, path_or_url: str, *, background_checkpoint: bool = False, create: bool = True) -> None:
        self.url = database_url(path_or_url, create=create)
        postgres = self.url.startswith("postgresql")
        self.engine: Engine = create_engine(
            self.url, **({"json_serializer": _json_text, "json_deserializer": _json_value} if postgres else {})
        )
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if self.engine.dialect.name == "sqlite":
            # A long-lived writer (the collector) checkpoints the WAL on a thread of its own: SQLite copies
            # the pages without holding the GIL, so that work moves off the ingest thread onto another core.
            background = background_checkpoint and self.url != "sqlite://"
            event.listen(self.engine, "connect", functools.partial(_sqlite_pragmas, autocheckpoint=not background))
            if background:
                self._checkpointer = threading.Thread(target=self._checkpoint_forever, name="trainmon-checkpoint")
                self._checkpointer.daemon = True
        self._positional = self.engine.dialect.positional  # qmark (SQLite) or named (psycopg) parameters
        self._inserts: dict[tuple[str, tuple[str, ...]], _InsertPlan] = {}
        self._omit: dict[str, frozenset[str]] = {}  # per table: see _omissible
        if self.url == "sqlite://":
            metadata.create_all(self.engine)  # in memory, gone at exit: no history to migrate
        else:
            migrate(self.engine)
        if self._checkpointer is not None:
            self._checkpointer.start()

    def _checkpoint_forever(self) -> None:
        while not self._stop.wait(_CHECKPOINT_SECONDS):
            self._checkpoint("PASSIVE")  # never blocks the writer; whatever readers still need stays

    def _checkpoint(self, mode: str) -> None:
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql(f"PRAGMA wal_checkpoint({mode})")
        except Exception:  # the WAL just grows until the next one succeeds
            log.exception("WAL checkpoint failed; will retry")

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def insert_ignore(self, conn: Connection, table: Table, columns: dict[str, list[Any]]) -> None:
        """INSERT rows given column by column (column -> its value in each row, every list as long; a column not
        given is left out of the statement), skipping those whose key exists: replays and retries store nothing twice.

        Column by column, as the collector builds them: a column None in every row is left out of the statement
        where that stores the same NULL (most of a step's 30 columns in an imported log: binding them was three
        quarters of SQLite's time), each other one goes through its type's bind processor a column at a time
        (``_binder``). The rows go in, in their order, as INSERTs of as many rows as ``_MAX_VARIABLES`` values
        allow (the last few one row each): SQLite runs one statement per hundred rows of an imported log instead of
        one per row (half its time there), and their parameters are cut from the columns at C speed.
        The statements are compiled once per (table, columns): SQLAlchemy's per-row parameter handling costs more
        than the insert itself at ingest rates.
        """
        omissible = self._omissible(table)
        count = len(next(iter(columns.values())))
        if not count:
            return
        kept = {  # a cell not None keeps its column: most columns answer by their first, without a scan
            name: cells
            for name, cells in sorted(columns.items())
            if name not in omissible or cells[0] is not None or cells.count(None) < count
        }
        # Bound once a statement: SQLite binds a row's 9 values of an imported step 15% sooner as 6 (an import's
        # 1M steps: 0.77 -> 0.64 s). Only where some column varies: the rows of a batch are never cut to one.
        shared = tuple(name for name, cells in kept.items() if count > 1 and _one_object(cells))
        if len(shared) == len(kept):
            shared = ()
        key = (table.name, tuple(kept), shared)
        plan = self._inserts.get(key)
        if plan is None:
            if len(self._inserts) >= _MAX_PLANS:  # the columns follow what producers send: keep the cache bounded
                self._inserts.clear()
            # As SQLAlchemy lists an INSERT's columns: in the table's order.
            order = tuple(c.name for c in table.c if c.name in kept and c.name not in shared)
            common = tuple(c.name for c in table.c if c.name in shared)
            binders = [self._binder(table.c[n]) for n in order]
            plan = _InsertPlan(order, binders, common, [self._binder(table.c[n]) for n in common])
            self._inserts[key] = plan
        once = tuple(
            kept[name][0] if bind is None else bind(kept[name][:1])[0]
            for name, bind in zip(plan.shared, plan.shared_binders, strict=True)
        )
        width = len(plan.order)
        values: list[Any] = [None] * (count * width)  # row after row, each in the statements' column order
        for i, (name, bind) in enumerate(zip(plan.order, plan.binders, strict=True)):
            values[i::width] = kept[name] if bind is None else bind(kept[name])
        flat = tuple(values)  # its slices, after the shared values, are the tuples the driver takes
        whole = (count - count % plan.rows) * width
        for rows, start, stop in ((plan.rows, 0, whole), (1, whole, len(flat))):
            if start == stop:
                continue
            statement = plan.statements.get(rows)
            if statement is None:
                statement = plan.statements[rows] = self._compile_insert(table, plan, rows)
            step = rows * width
            params: list[Any] = [once + flat[i : i + step] for i in range(start, stop, step)]
            if statement.names is not None:
                params = [dict(zip(statement.names, p, strict=True)) for p in params]
            conn.exec_driver_sql(statement.sql, params)

    def _compile_insert(self, table: Table, plan: _InsertPlan, rows: int) -> _Statement:
        """An INSERT of ``rows`` rows of the plan's columns that skips an existing key. Its parameters are the
        shared columns' values, then the rows' values one after the other: positional (SQLite's numbered ``?N``,
        so that each shared value is bound once), or (PostgreSQL) named as SQLAlchemy names a multi-row INSERT's
        (``<column>_m<row>``, a shared column's ``<column>_shared``). SQLite's is SQLAlchemy's INSERT of two rows
        with its second row's text repeated: compiled whole, the 199 rows of an imported step batch's cost
        SQLAlchemy 0.045 s of a post-mortem, the rest of its import's ingest 1.9 s."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        row = {**dict.fromkeys(plan.order), **{name: bindparam(f"{name}_shared") for name in plan.shared}}
        compiled_rows = 2 if self._positional else rows
        statement = insert(table).values([row] * compiled_rows).on_conflict_do_nothing()
        compiled = statement.compile(dialect=self.engine.dialect)
        names = (
            *(f"{name}_shared" for name in plan.shared),
            *(f"{name}_m{r}" for r in range(rows) for name in plan.order),
        )
        if not self._positional:
            if set(compiled.params) != set(names) or len(compiled.params) != len(names):
                raise RuntimeError(f"SQLAlchemy's INSERT of {table.name} binds {tuple(compiled.params)[:9]}")
            return _Statement(str(compiled), names)
        columns = [c.name for c in table.c if c.name in plan.order or c.name in plan.shared]
        width = len(columns)

        def bound(count: int) -> tuple[str, ...]:  # the parameters as SQLAlchemy orders those of ``count`` rows
            return tuple(f"{c}_shared" if c in plan.shared else f"{c}_m{r}" for r in range(count) for c in columns)

        sql = str(compiled).split("?")  # the text before the first parameter, then the text after each
        within, between = sql[1:width], sql[width]  # after each of a row's parameters but its last; between rows
        if (
            tuple(compiled.positiontup or ()) != bound(2)
            or len(sql) != 2 * width + 1
            or sql[width + 1 : 2 * width] != within
        ):
            raise RuntimeError(f"SQLAlchemy's INSERT of {table.name} binds {tuple(compiled.positiontup or ())[:9]}")
        texts = [*within, between] * (rows - 1) + [*within, sql[-1]]
        number = {name: i for i, name in enumerate(names, start=1)}  # each parameter's place in the values
        numbered = "".join(f"?{number[name]}{text}" for name, text in zip(bound(rows), texts, strict=True))
        return _Statement(sql[0] + numbered, None)

    def _binder(self, column: Column[Any]) -> _Binder | None:
        """How a column's cells are bound, the whole column at once (None: as they are)."""
        process = self._bind_processor(column)
        if process is None:
            return None
        if process is _nan_marker:
            return _nan_markers
        if isinstance(column.type, JSON) and self.dialect == "sqlite" and self.engine.dialect._json_serializer is None:
            return functools.partial(_json_texts, process)
        return functools.partial(_each, process)

    def _bind_processor(self, column: Column[Any]) -> Callable[[Any], Any] | None:
        """How a value of ``column`` is bound (None: as it is). Real's on SQLite is its NaN marker as one
        plain call instead of TypeDecorator's two."""
        if isinstance(column.type, Real) and self.dialect == "sqlite":
            return _nan_marker
        dialect = self.engine.dialect
        return column.type.dialect_impl(dialect).bind_processor(dialect)

    def _omissible(self, table: Table) -> frozenset[str]:
        """The columns an INSERT may leave out to store what binding None stores: those without a default
        whose None binds as SQL NULL (not a plain JSON column: it stores None as the JSON text ``null``). Only
        nullable ones: a key column holds no None to look for (and a None there fails alike, bound or left out)."""
        omissible = self._omit.get(table.name)
        if omissible is None:
            omissible = self._omit[table.name] = frozenset(
                c.name
                for c in table.c
                if c.nullable
                and c.default is None
                and c.server_default is None
                and ((f := self._bind_processor(c)) is None or f(None) is None)
            )
        return omissible

    def ping(self) -> None:
        """One round trip to the database; raises what the driver raises when it cannot answer."""
        with self.connect() as conn:
            conn.execute(text("SELECT 1"))

    def run_ids(self) -> list[str]:
        with self.connect() as conn:
            return [r.run for r in conn.execute(select(runs.c.run).order_by(runs.c.created_at))]

    def close(self) -> None:
        if self._checkpointer is not None:
            self._stop.set()
            self._checkpointer.join(30)
            self._checkpoint("TRUNCATE")
        self.engine.dispose()


_MIGRATION_LOCK = 0x7472_6D6F_6E  # "trmon": the advisory lock a migration holds, until its transaction ends


def migrate(engine: Engine) -> None:
    """Bring the schema to the latest revision (Alembic), so an upgrade never needs a wipe."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Collectors that open one database at once (one per node group) take turns: the first migrates,
            # the others find the schema at head. Without it two raced to create alembic_version and one failed.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


def _sqlite_pragmas(dbapi_conn: Any, _record: Any, autocheckpoint: bool = True) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=10000")
    # 64 MiB of page cache (default 2 MiB): a thousand ranks insert into a thousand places of the steps
    # index; with the default, every commit re-reads those leaf pages from the OS.
    cur.execute("PRAGMA cache_size=-65536")
    if not autocheckpoint:
        cur.execute("PRAGMA wal_autocheckpoint=0")
    cur.close()
