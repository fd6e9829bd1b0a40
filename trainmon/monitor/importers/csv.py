"""CSV metric tables: W&B exports, Lightning's ``metrics.csv``, anything with a step column.

Columns are mapped to wire fields by name. The default mapping knows the common spellings
(``_step``/``step``/``global_step``/``trainer/global_step``/``train/global_step``, the last two before W&B's
``_step``, which counts log calls; ``train/loss``/``train_loss_step``/
``loss``; ``train/grad_norm``; ``train/learning_rate``/``lr-AdamW``; ``eval/loss``/``val_loss``;
``_timestamp``) and a user mapping (``--map loss=train_loss,step=_step``) overrides it field by
field. Without a known name the loss, the grad norm and the LR param groups are recognised by
structure (:mod:`trainmon.monitor.importers.structure`): a total of loss terms (``mean_loss``) or their
sum, never a signed objective or an RL run's policy/value/entropy terms (said in a note, their NaNs
still counted), per-part grad norms as a root sum of squares, ``x/lr0``..``x/lr2`` as param groups. The
series used is named in ``column_mapping`` (and ``loss_series``).

Values are data: a ``nan``/``inf`` cell is a non-finite value (read, not skipped: it is what the
``nan_inf`` rule needs), ``0`` is zero, a blank cell is missing (never 0), so a row's sum of loss
terms is there only when every term is (or NaN when one is not finite).

Step base: ``_step`` (W&B's log-call counter), Lightning's ``step`` and ``trainer/global_step`` count
from 0; HF's ``train/global_step``/``global_step`` are the steps done (base 1). Any other step column
states nothing, so the base is inferred from the steps (a log with a step 0 counts from 0; one whose
first step is one logging interval in, or 1 then multiples of the interval, counts from 1: steps
1..N cover N steps) and the reason is kept in ``step_base_from``. Each row is one logged value
(W&B and Lightning log the value of that step, or the trainer's own running mean: not re-averaged;
HF's W&B callback logs the mean over its logging interval, stated as ``loss_mean_over``).

Several runs in one file: a W&B panel export prefixes every column with the run name
(``myrun - train/loss``) and adds ``__MIN``/``__MAX`` columns (ignored). One run's prefix is dropped;
the columns of several runs are imported as several runs (one ``RunMark`` each, analysed apart),
never the first run alone; ``--map loss="RUN - train/loss"`` picks one run by naming its column.

Lightning's ``CSVLogger`` writes sparse rows: the step's loss, the LR monitor, validation and
epoch aggregates land in separate rows that share a ``step``. A row with any training field is
a training point, adjacent rows of the same step are merged, a row with a validation loss is an
eval (with the task metrics that share its prefix: ``val_acc`` beside ``val_loss``); epoch
aggregates (``train_loss_epoch``) are not step losses and are ignored. Lightning's ``step`` is the
0-based global step, kept as is.

A malformed row (wrong column count, text where a number belongs) is skipped with a warning.
"""

from __future__ import annotations

import csv
import io
import itertools
import logging
import math
import operator
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    RunMark,
    TrainPoint,
    eval_metric_names,
    gc_paused,
    to_float,
)
from trainmon.monitor.importers.structure import (
    EvalSet,
    LossChoice,
    choose_grad_norm,
    choose_loss,
    combine,
    eval_point_values,
    eval_sets,
    eval_sets_facts,
    eval_sets_notes,
    infer_step_base,
    logging_interval,
    loss_like,
    lr_groups,
    root_sum_squares,
)
from trainmon.wire import MAX_INT

__all__ = ["DEFAULT_COLUMNS", "FIELDS", "Rows", "looks_like_csv", "parse_csv", "parse_mapping", "parse_table"]

log = logging.getLogger("trainmon.import")

FIELDS = ("step", "loss", "grad_norm", "lr", "eval_loss", "time", "tokens", "step_time")

# Candidates per field, lower-cased, most specific first.
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    # HF's W&B callback logs its global step as train/global_step; _step only counts wandb.log calls
    # the epoch last: a table of one row per epoch (Keras' CSVLogger, Ultralytics' results.csv) has no other
    "step": ("trainer/global_step", "train/global_step", "global_step", "_step", "step", "iter", "iteration", "epoch"),
    "loss": (
        "train/loss",
        "train/loss_step",
        "train_loss_step",
        "train_loss",
        "training_loss",
        "loss/train",
        "loss_step",
        "loss",
    ),
    "grad_norm": ("train/grad_norm", "grad_norm", "train/gradient_norm", "gradient_norm", "grad_norm/total", "norm"),
    "lr": ("train/learning_rate", "train/lr", "learning_rate", "lr", "lr-adamw", "lr-adam", "lr-sgd"),
    "eval_loss": (
        "eval/loss",
        "val/loss",
        "val_loss",
        "val_loss_epoch",
        "eval_loss",
        "validation/loss",
        "valid/loss",
        "loss/val",
    ),
    "time": ("_timestamp", "timestamp", "wall_time", "time"),
    "tokens": ("train/tokens", "tokens"),
    "step_time": ("step_time", "train/step_time", "perf/step_time"),
}

_WANDB_PREFIX = re.compile(r"^.+? - (.+)$")
_HF_STEPS = ("train/global_step", "global_step")
"""HF's global_step (its W&B callback logs it as train/global_step): the steps done, and the loss logged at
it is the mean over the logging interval."""
_WANDB_RUN = re.compile(r"^(?P<run>.+?) - (?P<col>.+)$")


def looks_like_csv(head: str, named_csv: bool = False) -> bool:
    """A header line of comma-separated names; one of them a step column we know, unless the file
    is named ``.csv`` or a column mapping was given (``named_csv``): then any header will do."""
    first = head.splitlines()[0] if head else ""
    if "," not in first:
        return False
    names = [_clean(c) for c in next(csv.reader([first]))]
    if len(names) < 2 or any(to_float(c) is not None for c in names):
        return False  # a data line, not a header
    cols = {c.lower() for c in names}
    return named_csv or any(c in cols for c in DEFAULT_COLUMNS["step"])


def parse_mapping(spec: str | dict[str, str] | None) -> dict[str, str]:
    """``"loss=train_loss,step=_step"`` -> ``{"loss": "train_loss", "step": "_step"}``; names checked."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        pairs = list(spec.items())
    else:
        pairs = []
        for part in spec.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"--map: expected FIELD=COLUMN, got {part.strip()!r}")
            k, v = part.split("=", 1)
            pairs.append((k.strip(), v.strip()))
    out = {}
    for k, v in pairs:
        if k not in FIELDS:
            raise ValueError(f"--map: unknown field {k!r}, expected one of {', '.join(FIELDS)}")
        out[k] = v
    return out


def _clean(col: str) -> str:
    """A W&B panel-export column without its run-name prefix."""
    col = col.strip()
    m = _WANDB_PREFIX.match(col)
    return m.group(1) if m else col


def _resolve(header: list[str], user: dict[str, str]) -> dict[str, int]:
    """Column index per field: the user's names first, then the default candidates."""
    cleaned = [_clean(c) for c in header]
    usable = [(i, c) for i, c in enumerate(cleaned) if not c.endswith(("__MIN", "__MAX"))]
    exact = {c: i for i, c in reversed(usable)}
    lower = {c.lower(): i for i, c in reversed(usable)}
    out: dict[str, int] = {}
    for fld, name in user.items():
        idx = exact.get(name, exact.get(_clean(name), lower.get(name.lower())))
        if idx is None:
            raise ImportFormatError(f"--map {fld}={name}: no such column; the columns are {header}")
        out[fld] = idx
    taken = set(out.values())
    for fld, cands in DEFAULT_COLUMNS.items():
        if fld in out:
            continue
        for c in cands:
            idx = lower.get(c)
            if idx is not None and idx not in taken:
                out[fld] = idx
                taken.add(idx)
                break
        else:
            if fld == "lr":
                idx = next((i for c, i in lower.items() if c.startswith("lr-") and i not in taken), None)
                if idx is not None:
                    out[fld] = idx
                    taken.add(idx)
    return out


def _eval_metric_columns(header: list[str], cols: dict[str, int]) -> dict[int, str]:
    """The task metrics beside the eval loss (``eval/accuracy``, ``val_acc``): column index -> metric
    name, among the columns no field took (W&B's ``__MIN``/``__MAX`` companions left out)."""
    i = cols.get("eval_loss")
    if i is None:
        return {}
    taken = set(cols.values())
    names = {_clean(c): j for j, c in enumerate(header) if j not in taken and not c.endswith(("__MIN", "__MAX"))}
    return {names[n]: metric for n, metric in eval_metric_names(names, _clean(header[i])).items()}


class Rows:
    """The well-formed data rows of a table, held column by column.

    A million rows held as lists of cells took 400 MiB, most of it the cells' strings: a column
    read as numbers keeps its numbers only when every cell was one (its text says nothing more:
    no cell of it is blank), so a metric table's text is let go as its columns are read.
    """

    def __init__(
        self,
        lines: list[int],
        text: list[list[str] | None] | list[list[str | float] | None],
        numbers: dict[int, list[float | None]] | None = None,
    ) -> None:
        """``numbers``: the columns read already (a table whose every block pandas read is all floats)."""
        self.lines = lines  # each row's line number in the file
        self._text = text  # each column's cells (text, or floats read already); None once all read as numbers
        self._numbers = numbers or {}

    def column(self, j: int) -> list[float | None]:
        """Column ``j`` as ``to_float`` reads each cell, read once."""
        col = self._numbers.get(j)
        if col is None:
            col, every = _column_floats(self._text[j])  # type: ignore[arg-type]
            self._numbers[j] = col
            if every:
                self._text[j] = None
        return col

    def given(self, j: int) -> np.ndarray:
        """Which rows hold a value in column ``j``: every row of a column whose every cell is a number (asked
        of each cell, 0.02 s a million rows, only when one was not)."""
        col = self.column(j)
        return np.ones(len(col), dtype=bool) if self._text[j] is None else _given(col)

    def values(self, j: int) -> list[float]:
        """Column ``j``'s values without its missing ones (the column itself when none is missing)."""
        col = self.column(j)
        if self._text[j] is None:  # every cell a number
            return col  # type: ignore[return-value]
        return [x for x in col if x is not None]

    def blank(self, j: int, r: int) -> bool:
        """Row ``r``'s cell of column ``j`` is empty or spaces."""
        cells = self._text[j]
        return cells is not None and type(cell := cells[r]) is str and not cell.strip()

    def select(self, keep: list[int]) -> Rows:
        """The rows with the columns ``keep`` only (one run's columns of a panel export)."""
        return Rows(
            self.lines,
            [self._text[i] for i in keep],
            {k: self._numbers[i] for k, i in enumerate(keep) if i in self._numbers},
        )


_BLOCK = 1 << 20
"""Characters of whole lines read at a time: the file is never held whole, nor as one list per row."""
_CHUNK = 65536
"""Rows of cells gathered before they go into their columns, on the row-by-row path."""


def _table_rows(f: TextIO, width: int, path: Path) -> tuple[Rows, int]:
    """The well-formed data rows after the header; malformed ones skipped with a warning.

    The csv module's reading, at C speed where it has nothing to do, a block of whole lines at a time
    (universal newlines already made every line end ``\n``). A block of rows of decimal numbers (the usual
    metric table) is read by pandas' C parser (:func:`_number_columns`); a line of a block without a quote
    character is its cells joined by commas, so a block of such lines is cut with one ``str.split``. From the
    first block holding a quote (a quoted cell may hold a comma or span lines) or a line longer than the csv
    module's field limit (it refuses the field), the rest of the file is read by ``csv.reader``, as it always
    was; a block with a blank or malformed line is read row by row.
    """
    line_numbers: list[int] = []
    text: list[list[str] | list[str | float]] = [[] for _ in range(width)]
    cut = False  # a block was cut into cells as text (not read by pandas)
    bad = 0
    n = 2  # the next record's number in the file (the header is 1)
    while block := f.read(_BLOCK):
        if not block.endswith("\n"):
            block += f.readline()  # the rest of its last line
        count = block.count("\n") + (not block.endswith("\n"))  # the last line of a file may have no end
        columns = _number_columns(block, width, count)
        if columns is None:
            cut = True
            lines = _lines(block)
            if '"' in block or max(map(len, lines)) > csv.field_size_limit():
                rows: Iterable[list[str]] = csv.reader(itertools.chain(lines, f))
            else:
                if set(map(str.count, lines, itertools.repeat(","))) == {width - 1}:  # every line a row
                    columns = _plain_columns(block, width)
                rows = [line.removesuffix("\n").split(",") for line in lines] if columns is None else []
        if columns is not None:
            line_numbers.extend(range(n, n + count))
            n += count
            for col, cells_j in zip(text, columns, strict=True):
                col.extend(cells_j)  # type: ignore[arg-type]
            continue
        cells = []
        for row in rows:  # row by row: blank rows skipped, malformed ones counted and named
            num, n = n, n + 1
            if not row or not "".join(row).strip():  # every cell empty or spaces
                continue
            if len(row) != width:
                bad += 1
                log.warning("%s: line %d has %d fields, the header %d; skipped", path, num, len(row), width)
                continue
            line_numbers.append(num)
            cells += row
            if len(cells) >= _CHUNK * width:
                _into_columns(cells, text)
                cells = []
        _into_columns(cells, text)
    if cut:
        return Rows(line_numbers, list(text)), bad
    # every cell a float already: read as they are (``float`` of each took 0.04 s of a million rows' four columns)
    return Rows(line_numbers, [None] * width, dict(enumerate(text))), bad  # type: ignore[arg-type]


def _lines(block: str) -> list[str]:
    """A block's lines as iterating the file gives them: each with its ``\n``, the file's last one maybe not."""
    lines = [line + "\n" for line in block.split("\n")]
    last = lines.pop()
    if last != "\n":
        lines.append(last.removesuffix("\n"))
    return lines


_DECIMAL_BYTES = b"0123456789.eE+-, \t\n"
"""The bytes of rows of decimal numbers. Any other (a letter: ``nan``, ``inf``, ``True``, text, a quote) sends
the lines to be cut as text; so does a blank cell, whose empty text pandas refuses as a number."""
_PANDAS_EXACT = (
    {} if tuple(map(int, re.findall(r"\d+", pandas.__version__)[:2])) >= (3, 1) else {"float_precision": "round_trip"}
)
"""pandas reads a decimal as Python's ``float`` does (correctly rounded) from 3.1 on, with its round-trip
converter (Python's own) before; but for a number with a plus sign, which ``_number_columns`` leaves to ``float``."""


def _number_columns(block: str, width: int, count: int) -> list[list[float]] | None:
    """The columns of a block of ``count`` lines that are all rows of ``width`` decimal numbers (the usual
    metric table), read by pandas' C parser: each cell the float Python's ``float`` reads of it (signed zeros,
    ``1e400`` as inf, spaces around it). None for lines that are not all such rows (a blank cell, ``nan``,
    text, a line of another number of cells or longer than the csv module's field limit), to be cut into
    cells as text: pandas refuses any cell that is not a decimal, and a row of digits is never taken for a
    boolean, a date or a missing value (``true_values``, ``na_filter``)."""
    data = block.encode()
    if data.translate(None, _DECIMAL_BYTES):  # a byte that is not one of them is left
        return None
    # the bytes as an array, each question asked of them at numpy's speed: four ``bytes.count`` passes over a
    # million rows took 0.25 s, these 0.03 s
    codes = np.frombuffer(data, dtype=np.uint8)
    if b"+" in data and not _exponent_signs(codes):
        # a plus sign before a number, which pandas 3.1 may read a rounding off: " +3E23" as 2.9999999999999997e+23
        # and "+6686569887426516086e+164" as 6.686569887426515e+182 (``float``: 3e+23, 6.686569887426516e+182)
        return None
    # as many commas as rows of width cells hold: a short line would need a long one, which pandas refuses
    if np.count_nonzero(codes == ord(",")) != (width - 1) * count or _longest_line(codes) > csv.field_size_limit():
        return None
    try:
        frame = pandas.read_csv(
            io.BytesIO(data),
            header=None,
            names=list(range(width)),
            index_col=False,
            dtype=float,
            na_filter=False,
            true_values=[],
            false_values=[],
            skip_blank_lines=False,
            engine="c",
            **_PANDAS_EXACT,  # type: ignore[arg-type]
        )
    except ValueError:
        return None
    return [frame[j].tolist() for j in range(width)] if len(frame) == count else None


def _exponent_signs(codes: np.ndarray) -> bool:
    """Every plus sign of the bytes ``codes`` (there is one) is an exponent's: right after an ``e`` or ``E``."""
    at = np.flatnonzero(codes == ord("+"))
    return bool(at[0] > 0) and bool(np.isin(codes[at - 1], (ord("e"), ord("E"))).all())


def _longest_line(codes: np.ndarray) -> int:
    """The length of the longest line of the bytes ``codes`` with its ``\\n`` (a last line without one: as if it
    had it)."""
    ends = np.flatnonzero(codes == ord("\n"))
    return int(np.diff(ends, prepend=-1, append=len(codes)).max())


def _plain_columns(joined: str, width: int) -> list[list[str]] | None:
    """The cells of quote-free lines of ``width`` cells each, column by column, when no line is a blank row
    (the usual table); None when one is, for the lines to be read one by one."""
    cells = joined.removesuffix("\n").replace("\n", ",").split(",")
    # a blank row's cells are all blank, its first one too: none is blank when no first cell is
    return [cells[j::width] for j in range(width)] if all(map(str.strip, cells[::width])) else None


def _into_columns(cells: list[str], text: list[list[str]]) -> None:
    """Rows of cells, one after the other, appended to the columns they belong to."""
    width = len(text)
    for j, col in enumerate(text):
        col.extend(cells[j::width])


def _panel_runs(header: list[str], user: dict[str, str]) -> dict[str, list[int]]:
    """A W&B panel export's runs: run name -> its column indices (``RUN - metric``, ``__MIN``/``__MAX`` too).
    A user mapping that names one run's column (``loss=RUN - train/loss``) keeps that run only."""
    runs: dict[str, list[int]] = {}
    for i, c in enumerate(header):
        m = _WANDB_RUN.match(c.strip())
        if m:
            runs.setdefault(m["run"], []).append(i)
    picked = {m["run"] for v in user.values() if (m := _WANDB_RUN.match(v.strip())) and m["run"] in runs}
    return {r: cols for r, cols in runs.items() if r in picked} if picked else runs


@gc_paused
def parse_csv(path: Path, mapping: dict[str, str] | None = None) -> tuple[list[Item], LogMeta]:
    # Read line by line from the file (universal newlines, as read_text): a million-row file held as
    # one string and again in a StringIO's buffer took 250 MiB before the first row was parsed.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        try:
            header = next(csv.reader(f))  # reads the header's line(s) only
        except StopIteration:
            raise ImportFormatError(f"{path}: empty CSV file") from None
        rows, bad = _table_rows(f, len(header), path)
    items, meta = parse_table(path, header, rows, mapping or {})
    if bad:
        meta.notes.insert(0, f"{bad} malformed rows skipped")
    return items, meta


def parse_table(path: Path, header: list[str], rows: Rows, user: dict[str, str]) -> tuple[list[Item], LogMeta]:
    """The items of a table's rows, however the table was written (a CSV file, JSON lines of metrics:
    :mod:`trainmon.monitor.importers.json_table`), by the rules of the module docstring."""
    runs = _panel_runs(header, user)
    notes: list[str] = []
    if len(runs) <= 1:
        items, table = _parse_table(path, header, rows, user)
        config = table.config
        notes += table.notes
    else:
        # Several runs side by side: each is analysed as its own run, never the first one alone.
        prefixed = {i for cols in runs.values() for i in cols}
        shared = [i for i in range(len(header)) if i not in prefixed and not _WANDB_RUN.match(header[i].strip())]
        items = []
        table = None
        for name, cols in runs.items():
            keep = shared + cols
            sub_header = [header[i] for i in keep]
            sub_rows = rows.select(keep)
            try:
                its, table_r = _parse_table(path, sub_header, sub_rows, {k: _clean(v) for k, v in user.items()})
            except ImportFormatError as exc:
                log.warning("%s: run %r of the panel export has no training series (%s); left out", path, name, exc)
                continue
            items.append(
                RunMark(
                    label=name,
                    reason=f"W&B panel export: the columns of {len(runs)} runs side by side ('RUN - metric')",
                    config=table_r.config,
                    notes=table_r.notes,
                )
            )
            items.extend(its)
            table = table or table_r
        if table is None:
            raise ImportFormatError(f"{path}: none of the {len(runs)} runs of this panel export has a training series")
        config = {}
        notes.append(
            f"W&B panel export of {len(runs)} runs ({', '.join(runs)}): each run is imported and analysed on its own"
        )
    meta = LogMeta(
        format=table.fmt,
        framework=table.framework,
        config=config,
        notes=notes,
        step_base=table.step_base,
        loss_mean_over=table.loss_mean_over,
    )
    return items, meta


@dataclass
class _Table:
    fmt: str
    framework: str
    step_base: int
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loss_mean_over: float | None = None


def _parse_table(path: Path, header: list[str], rows: Rows, user: dict[str, str]) -> tuple[list[Item], _Table]:
    """One run's items from a table whose columns are that run's (see the module docstring)."""
    cols = _resolve(header, user)
    if "step" not in cols:
        raise ImportFormatError(
            f"{path}: no step column among {header}; name it with --map step=COLUMN "
            f"(known: {', '.join(DEFAULT_COLUMNS['step'])})"
        )
    names = {i: _clean(c) for i, c in enumerate(header) if not c.strip().endswith(("__MIN", "__MAX"))}
    by_name = {v: i for i, v in reversed(list(names.items()))}
    taken = set(cols.values())

    def values(name: str) -> list[float]:
        return rows.values(by_name[name])

    named = names[cols["loss"]] if "loss" in cols else None
    if "loss" in user:
        choice = LossChoice(terms=[named], how="named") if named is not None else LossChoice()
    else:
        free = [c for i, c in names.items() if i not in taken]
        choice = choose_loss(
            named, free, {c: values(c) for c in ([named] if named else []) + free if loss_like(c) or c == named}
        )
    loss_idx = [by_name[c] for c in choice.terms]
    signed_idx = [by_name[c] for c in choice.signed]
    gn_named = names[cols["grad_norm"]] if "grad_norm" in cols else None
    gn_names, gn_how = choose_grad_norm(gn_named, [c for i, c in names.items() if i not in taken])
    gn_idx = [by_name[c] for c in gn_names]
    lr_idx = (
        [cols["lr"]] if "lr" in cols else [by_name[c] for c in lr_groups(c for i, c in names.items() if i not in taken)]
    )
    if not (loss_idx or signed_idx or gn_idx):
        raise ImportFormatError(
            f"{path}: no training-loss column among {header}; name it with --map loss=COLUMN "
            f"(known: {', '.join(DEFAULT_COLUMNS['loss'])}, or any column with 'loss' in its name)"
        )
    metric_cols = _eval_metric_columns(header, cols)
    sets = [] if "eval_loss" in user else eval_sets(names.values())
    if not (len(sets) > 1 or ("eval_loss" not in cols and sets)):
        sets = []  # one named eval: read by name, with the metrics beside it
    lightning = "epoch" in {h.strip() for h in header} and any(h.strip().endswith(("_step", "_epoch")) for h in header)
    series = _Series(cols, loss_idx, signed_idx, gn_idx, lr_idx, metric_cols, sets, by_name)
    items, bad = _table_items(path, rows, series)
    fmt = "lightning_csv" if lightning else "csv"
    mapping = {fld: header[i] for fld, i in cols.items()}
    if choice.terms:
        mapping["loss"] = " + ".join(header[j] for j in loss_idx)
    else:
        mapping.pop("loss", None)
    if gn_idx:
        mapping["grad_norm"] = (
            header[gn_idx[0]] if len(gn_idx) == 1 else "rss(" + ", ".join(header[j] for j in gn_idx) + ")"
        )
    if lr_idx:
        mapping["lr"] = header[lr_idx[0]] if len(lr_idx) == 1 else [header[j] for j in lr_idx]  # type: ignore[assignment]
    config: dict[str, Any] = {"column_mapping": mapping}
    notes = [f"{bad} rows without a usable step skipped"] if bad else []
    if choice.how not in ("named", ""):
        config["loss_series"] = choice.facts()
    notes += choice.notes()
    if len(gn_idx) > 1:
        config["grad_norm_series"] = {"how": gn_how, "terms": [header[j] for j in gn_idx]}
        notes.append(f"the grad norm is the {gn_how} ({len(gn_idx)} columns; no total grad norm is logged)")
    if len(lr_idx) > 1:
        notes.append(f"{len(lr_idx)} learning rates, one per param group ({', '.join(header[j] for j in lr_idx)})")
    if sets:
        mapping.pop("eval_loss", None)
        mapping["eval_loss"] = " + ".join(sets[0].loss)
        config["eval_sets"] = eval_sets_facts(sets)
        notes += eval_sets_notes(sets)
    base, why = _step_base(names[cols["step"]], lightning, items)
    config["step_base_from"] = why
    mean_over = None
    if names[cols["step"]].lower() in _HF_STEPS and len(train_steps := _train_steps(items)) > 1:
        mean_over = _mean_over(train_steps)
    return items, _Table(fmt, "lightning" if lightning else "csv", base, config, notes, mean_over)


def _mean_over(train_steps: list[int]) -> float | None:
    """The steps HF's logged loss is the mean over: its logging interval, None when it is 1."""
    interval = logging_interval(train_steps)
    return float(interval) if interval is not None and interval > 1 else None


@dataclass
class _Series:
    """Which columns make each field of a run's points (column indices)."""

    fields: dict[str, int]
    """The columns of the named fields (:data:`FIELDS`)."""
    loss: list[int]
    """The loss terms, summed."""
    signed: list[int]
    """Loss-like series left out of the loss: only their non-finite values count."""
    grad_norm: list[int]
    """The grad norm, or the per-part norms of a root sum of squares."""
    lr: list[int]
    """One learning rate per param group."""
    metrics: dict[int, str]
    """The task metrics beside a named eval loss: column -> metric name."""
    eval_sets: list[EvalSet]
    """Several eval sets, read by name (none: the named eval loss and its metrics)."""
    by_name: dict[str, int]


def _table_items(path: Path, rows: Rows, series: _Series) -> tuple[list[Item], int]:
    """The points of a table's rows, and how many rows had no usable step.

    A row is a training point when it holds any training field, merged into the previous point when
    that is the same step's (Lightning's sparse rows), and an eval when it holds an eval loss. Every
    rule is asked of whole columns (numpy masks: which steps are usable, which rows hold what, which
    rows merge), the points of a million rows are then made by one ``map`` each; only the rows that
    are not the usual row (a step no step can be, an eval, a merged row) are walked one by one."""
    cols, sets, by_name = series.fields, series.eval_sets, series.by_name
    column = rows.column
    count = len(rows.lines)

    none: list[Any] = [None] * count  # the one column of every field the table lacks
    nothing = np.zeros(count, dtype=bool)

    def field_column(fld: str) -> list[float | None]:
        return column(cols[fld]) if fld in cols else none

    def field_given(fld: str) -> np.ndarray:
        return rows.given(cols[fld]) if fld in cols else nothing

    def given_each(js: list[int]) -> np.ndarray:  # the rows with a value in each of the columns js
        return np.logical_and.reduce([rows.given(j) for j in js]) if js else nothing

    step_col = column(cols["step"])
    step_arr = _floats(step_col)
    usable = (step_arr >= 0) & (step_arr <= MAX_INT)  # NaN (a blank, text) and inf fail it too
    bad = 0
    for r in np.flatnonzero(~usable).tolist():
        if any(not rows.blank(i, r) for fld, i in cols.items() if fld != "step"):
            bad += 1
            log.warning("%s: line %d has no usable step; skipped", path, rows.lines[r])
    times = field_column("time")
    # without its columns a field is missing on every row (combine, root_sum_squares of nothing: None)
    losses, has_loss = _losses([column(j) for j in series.loss], [column(j) for j in series.signed], count)
    losses = losses or none
    gn_cols = [column(j) for j in series.grad_norm]
    if len(gn_cols) == 1:
        norms, has_norm = gn_cols[0], rows.given(series.grad_norm[0])
    else:
        norms = list(map(root_sum_squares, zip(*gn_cols, strict=True))) or none
        has_norm = _given(norms) if gn_cols else nothing
    lrs = _lr_lists([column(j) for j in series.lr]) or none
    tokens = _counts(column(cols["tokens"])) if "tokens" in cols else none
    step_times = field_column("step_time")
    has_tokens = _given(tokens) if "tokens" in cols else nothing
    train = has_loss | has_norm | given_each(series.lr) | has_tokens | field_given("step_time")
    for j in series.loss + series.signed:  # a loss term's cell alone makes a training row
        train |= rows.given(j)
    evals = usable & (given_each([by_name[n] for n in sets[0].loss]) if sets else field_given("eval_loss"))
    train &= usable

    # the rows that make items, in order: a training row merges into the previous one's point when that
    # row trained at the same step and neither row is an eval (an eval's point comes between them)
    made = np.flatnonzero(train | evals)
    t_made, e_made = train[made], evals[made]
    steps = step_arr[made].astype(np.int64)  # int() of each step: truncated
    merged = np.zeros(len(made), dtype=bool)
    merged[1:] = t_made[1:] & ~e_made[1:] & t_made[:-1] & (steps[1:] == steps[:-1])
    new = np.flatnonzero(t_made & ~merged)
    at = made[new]
    # TrainPoint's fields after the step, in its order; the last ones the table lacks are left to their default,
    # None (a million points made of 4 arguments took 0.20 s, of 7 0.23 s)
    point_fields = [losses, norms, lrs, tokens, step_times, times]
    while point_fields and point_fields[-1] is none:
        point_fields.pop()
    points = list(map(TrainPoint, steps[new].tolist(), *(_pick(v, at) for v in point_fields)))
    if merged.any():  # laid over the point it merges into: what the row holds
        owner = np.maximum.accumulate(np.where(t_made & ~merged, np.arange(len(made)), 0))
        point_of = dict(zip(new.tolist(), points, strict=True))
        for k in np.flatnonzero(merged).tolist():
            p, r = point_of[int(owner[k])], int(made[k])
            if (n := tokens[r]) is not None:
                p.tokens = n
            if (x := step_times[r]) is not None:
                p.step_time = x
            if (x := losses[r]) is not None:
                p.loss = x
            if (x := norms[r]) is not None:
                p.grad_norm = x
            if (lr := lrs[r]) is not None:
                p.lr = lr
    where = np.flatnonzero(e_made)
    if not len(where):
        return points, bad  # type: ignore[return-value]
    eval_points: list[Item] = []
    eval_losses = field_column("eval_loss")
    metric_values = [(column(j), name) for j, name in series.metrics.items()]
    for k in where.tolist():
        r = int(made[k])
        if sets:
            eval_loss, metrics = eval_point_values(sets, lambda name, r=r: column(by_name[name])[r])
        else:
            eval_loss = eval_losses[r]
            metrics = {name: x for col, name in metric_values if (x := col[r]) is not None}
        eval_points.append(EvalPoint(int(steps[k]), eval_loss, metrics, time=times[r]))  # type: ignore[arg-type]
    # each row's eval before its training point
    order = np.argsort(np.concatenate([2 * where, 2 * new + 1]), kind="stable")
    both = eval_points + points
    return list(map(both.__getitem__, order.tolist())), bad


def _floats(values: list[float | None]) -> np.ndarray:
    """A column's values as an array, a missing one NaN (a mask's input, never a value read back)."""
    return np.array(values, dtype=float)


def _given(values: list[Any]) -> np.ndarray:
    """Which rows hold a value (not None)."""
    return np.fromiter(map(operator.is_not, values, itertools.repeat(None)), dtype=bool, count=len(values))


def _pick(values: list[Any], at: np.ndarray) -> list[Any]:
    """The values of the rows ``at`` (ascending); the list itself when they are all its rows."""
    return values if len(at) == len(values) else list(map(values.__getitem__, at.tolist()))


def _losses(
    terms: list[list[float | None]], signed: list[list[float | None]], count: int
) -> tuple[list[float | None], np.ndarray]:
    """Each row's loss by ``structure.combine`` (no rows without columns), and which rows have one. A row whose
    values are all there and finite (the usual row) is the sum combine would make, ``math.fsum`` of its terms,
    asked of them all at C speed: of one term, the term itself (but a -0.0, which ``fsum`` makes 0.0), so a
    million rows' sums of one term (0.07 s) are the column as it is."""
    if not terms and not signed:
        return [], np.zeros(count, dtype=bool)
    arrays = [_floats(c) for c in terms + signed]
    plain = np.logical_and.reduce([np.isfinite(a) for a in arrays])
    term_rows = _row_values(terms, count)
    if terms and plain.all():
        if len(terms) == 1 and not np.signbit(arrays[0][arrays[0] == 0]).any():
            return terms[0], plain
        return list(map(math.fsum, term_rows)), plain
    losses = [
        math.fsum(t) if p and terms else combine(t, s)  # type: ignore[arg-type]
        for t, s, p in zip(term_rows, _row_values(signed, count), plain.tolist(), strict=True)
    ]
    return losses, _given(losses)


def _counts(values: list[float | None]) -> list[int | None]:
    """A token count column's counts: a cell no count can be (NaN, inf, negative, past 2**53) is not there,
    so a corrupt cell does not fail the log; a count is the cell rounded."""
    arr = _floats(values)
    ok = (arr >= 0) & (arr <= MAX_INT)
    if ok.all():
        return list(map(round, values))  # type: ignore[arg-type]
    counts = iter(map(round, _pick(values, np.flatnonzero(ok))))  # type: ignore[arg-type]
    return [next(counts) if k else None for k in ok.tolist()]


def _row_values(cols: list[list[float | None]], count: int) -> Iterable[tuple[float | None, ...]]:
    """The values of the columns ``cols``, one tuple per row (empty tuples without columns)."""
    return zip(*cols, strict=True) if cols else itertools.repeat((), count)


def _lr_lists(lr_cols: list[list[float | None]]) -> list[list[float | None] | None]:
    """Each row's learning rates, one per param group, or None when one of them is missing (no rows
    without columns)."""
    if not lr_cols:
        return []
    if len(lr_cols) == 1:
        return [None if x is None else [x] for x in lr_cols[0]]
    return [None if None in row else list(row) for row in zip(*lr_cols, strict=True)]


def _column_floats(cells: list[str]) -> tuple[list[float | None], bool]:
    """``to_float`` of every cell, and whether every cell is a number. A column of numbers only (the
    usual case) converts at C speed: ``float`` strips whitespace as ``to_float`` does, and a blank or
    text cell makes it fall back; so does a column of numbers and empty cells (Lightning's rows each hold
    some of the fields), its empty cells None: a 110k-row metrics.csv's columns took 0.12 s read by ``to_float``
    cell by cell, 0.07 s so. A cell of another type (a JSON table's ``true``) is asked by ``to_float``."""
    try:
        return list(map(float, cells)), True
    except ValueError:
        pass
    if set(map(type, cells)) <= {str, float}:
        filled = list(itertools.compress(range(len(cells)), map(operator.ne, cells, itertools.repeat(""))))
        try:
            values = list(map(float, map(cells.__getitem__, filled)))
        except ValueError:  # a cell of spaces or text
            pass
        else:
            col: list[float | None] = [None] * len(cells)
            deque(map(col.__setitem__, filled, values), maxlen=0)
            return col, False
    return [to_float(c) for c in cells], False


def _step_base(step_col: str, lightning: bool, items: list[Item]) -> tuple[int, str]:
    """The step base of the step column: stated by its convention where it has one, else inferred from
    the training steps (read only then: a million of them)."""
    low = step_col.lower()
    if lightning or low in ("_step", "trainer/global_step"):
        return 0, f"{step_col} counts from 0 (W&B's log-call counter, Lightning's global step)"
    if low in _HF_STEPS:
        return 1, f"{step_col} is HF's global_step: the steps done, counted from 1"
    return infer_step_base(_train_steps(items))


def _train_steps(items: list[Item]) -> list[int]:
    return [it.step for it in items if isinstance(it, TrainPoint)]
