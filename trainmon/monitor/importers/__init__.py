"""Turn logs on disk into wire-format events, so stored and imported runs share one analysis.

``read_events(path)`` is the one entry point. The format is detected from the content (the
extension only breaks ties), one module per format:

========================  =======================================================
trainmon JSONL            ``jsonl``: one wire event per line (spool, ``file://``)
HF ``trainer_state.json`` ``hf``: the Trainer's ``log_history``
LLaMA-Factory, ms-swift   ``jsonlog``: ``trainer_log.jsonl``, ``logging.jsonl``
TensorBoard event files   ``tensorboard``: scalars, read without TensorBoard
CSV                       ``csv``: W&B exports, Lightning ``metrics.csv``
JSON lines of metrics     ``json_table``: W&B's run history, a loop's ``metrics.jsonl``
                          (the CSV table rules, over objects instead of lines)
text logs                 ``textlog``: llm.c and nanoGPT (``s:N trl:X``, ``step N | loss X``),
                          Megatron-LM / DeepSpeed stdout (``megatron``), nanochat,
                          modded-nanogpt records, MiniMind, DeepSpeed(-Chat) (``deepspeed``)
========================  =======================================================

Foreign formats go through :func:`trainmon.monitor.importers.common.build_events`, which makes the
``run_start`` (with ``config.imported_from``, ``format``, ``synthetic_time`` and
``missing_signals``), the steps, evals and a ``run_end``. A folder is read as a folder of
trainmon JSONL files (one per rank, merged by time), a spool folder (``…/spool/RUN/rankN``: its
segments are one rank's stream, read in the order they were written), a run's spool folder
(``…/spool/RUN``: its rank folders, merged by time) or a folder of TensorBoard event files.

Structured formats (JSON, JSON lines, CSV, TFRecord) are judged by the first 64 KiB: their first
record says what they are. A text log is judged by its lines wherever they are: a SLURM job's shell
trace and argument dump, or a terminal's progress bars, can push the first step line a megabyte
into the file, so when the head shows none the file is scanned further in bounded pieces (the
first 8 MiB, then pieces spread over the rest; :mod:`.terminal`), with terminal control sequences
removed before judging. A file is called binary only on binary evidence (NUL bytes, or many bytes
that are not UTF-8 once escapes are removed), never for the escape codes of its first kilobytes.

A file no reader recognises fails at detection with one line naming the formats tried and what
the file starts with, before any reader runs: a JSON-lines log of a format we do not read must
not reach the trainmon JSONL reader and be rejected there line by line.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from trainmon.monitor.importers.common import ImportFormatError, build_events, file_digest, mtime_of, run_id_from_path
from trainmon.monitor.importers.csv import looks_like_csv, parse_csv, parse_mapping
from trainmon.monitor.importers.hf import looks_like_hf, parse_hf
from trainmon.monitor.importers.json_table import looks_like_json_table, parse_json_table
from trainmon.monitor.importers.jsonl import read_jsonl
from trainmon.monitor.importers.jsonlog import (
    looks_like_llamafactory,
    looks_like_ms_swift,
    parse_llamafactory,
    parse_ms_swift,
)
from trainmon.monitor.importers.tensorboard import is_event_file, looks_like_tfrecord, parse_tensorboard
from trainmon.monitor.importers.terminal import binary_evidence, clean_text
from trainmon.monitor.importers.textlog import looks_like_textlog, parse_textlog, sniff_textlog
from trainmon.wire import RUN_ID_PATTERN, Event

__all__ = ["FORMATS", "ImportFormatError", "detect_format", "log_files", "parse_mapping", "read_events"]

FORMATS = (
    "jsonl",
    "hf_trainer_state",
    "llamafactory_trainer_log",
    "ms_swift_logging",
    "tensorboard",
    "csv",
    "textlog",
    "json_table",
)

# What each format is, for the error that says none of them matched.
_TRIED = (
    "trainmon JSONL",
    "HF trainer_state.json",
    "LLaMA-Factory trainer_log.jsonl",
    "ms-swift logging.jsonl",
    "TensorBoard event file",
    "CSV with a step column",
    "JSON lines of metrics with a step key",
    "text log (llm.c, nanoGPT, Megatron-LM, nanochat, modded-nanogpt, MiniMind, DeepSpeed)",
)

_HEAD = 64 * 1024
_SEGMENT = re.compile(r"\d{20}-\d+\.jsonl")  # a spool segment: creation time in ns, then the pid
_SHOWN = 120  # characters of a line quoted in the error


def _head_objects(head: str) -> list[object]:
    """The first (up to five) non-empty whole lines of ``head``, each JSON-decoded or None."""
    lines = head.splitlines()
    if len(lines) > 1 and not head.endswith(("\n", "\r")):
        lines = lines[:-1]  # cut by the end of the head: judge whole lines only
    out: list[object] = []
    for line in lines:
        line = line.strip().lstrip("\ufeff")
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)
        if len(out) == 5:
            break
    return out


def _is_wire(obj: object) -> bool:
    return isinstance(obj, dict) and "kind" in obj and "run" in obj and "fields" in obj


def _looks_like_jsonl(head: str) -> bool:
    """One of the first lines is a wire event (a damaged first line does not hide the others)."""
    return any(_is_wire(obj) for obj in _head_objects(head))


def _looks(head: str, raw: bytes) -> str:
    """What the file starts with, in a few words on one line: its JSON keys, or its first line
    (as a terminal showed it: escape codes removed)."""
    if binary_evidence(raw):
        return "binary data"
    head = clean_text(head)
    obj = next((o for o in _head_objects(head) if o is not None), None)
    if isinstance(obj, dict):
        keys = ", ".join(json.dumps(k) for k in list(obj)[:15]) + (", ..." if len(obj) > 15 else "")
        many = sum(isinstance(o, dict) for o in _head_objects(head)) > 1
        return f"{'JSON lines' if many else 'a JSON object'} with keys {keys}"
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    shown = first[:_SHOWN] + ("..." if len(first) > _SHOWN else "")
    return f"the line {shown!r}"


def _unrecognised(path: Path, head: str, raw: bytes) -> ImportFormatError:
    return ImportFormatError(
        f"{path}: unrecognised log format (tried {', '.join(_TRIED)}); the file starts with {_looks(head, raw)}"
    )


def detect_format(path: str | Path, *, csv_hint: bool = False) -> str:
    """The format of a file (one of ``FORMATS``), judged by its content.

    ``csv_hint`` (a column mapping was given) accepts a CSV whose step column has an unknown name;
    so does a ``.csv`` extension. Otherwise the extension is only a tie-breaker.

    Raises :class:`ImportFormatError` naming what was expected when nothing matches.
    """
    path = Path(path)
    if path.is_dir():
        if _jsonl_streams(path):
            return "jsonl"
        if _event_files(path):
            return "tensorboard"
        raise ImportFormatError(
            f"{path}: no *.jsonl or TensorBoard event files in this folder or its rank folders"
            " (a spool folder is empty once the collector has its events)"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEAD)
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not raw.strip():
        raise ImportFormatError(f"{path}: empty file")
    if looks_like_tfrecord(raw):
        return "tensorboard"
    head = raw.decode("utf-8", errors="replace")
    # Before HF: the JSON-lines logs end with a summary object holding log_history, which a short
    # log brings into the head.
    if looks_like_llamafactory(head):
        return "llamafactory_trainer_log"
    if looks_like_ms_swift(head):
        return "ms_swift_logging"
    if looks_like_hf(head):
        return "hf_trainer_state"
    if _looks_like_jsonl(head):
        return "jsonl"
    if looks_like_json_table(_head_objects(head), csv_hint):
        return "json_table"
    if looks_like_csv(head, csv_hint or path.suffix.lower() == ".csv"):
        return "csv"
    if looks_like_textlog(head):
        return "textlog"
    if is_event_file(path):
        return "tensorboard"  # damaged from its first record: let the reader say so
    if path.suffix == ".jsonl" and all(o is None for o in _head_objects(head)):
        # A damaged trainmon spool (no line decodes): the JSONL reader skips what it cannot read.
        # Decodable lines that are not wire events are another tool's JSONL: said here, in one line,
        # rather than by the reader rejecting every line.
        return "jsonl"
    if len(raw) == _HEAD and sniff_textlog(path) is not None:
        return "textlog"  # its training lines start past the head
    raise _unrecognised(path, head, raw)


def read_events(
    path: str | Path,
    *,
    run: str | None = None,
    mapping: str | dict[str, str] | None = None,
) -> Iterator[Event]:
    """Events of a log file or folder, in time order.

    ``run`` names the run (default: from the file name; trainmon JSONL keeps its own ids unless
    given). ``mapping`` overrides CSV column names (``"loss=train_loss,step=_step"``).
    A multi-rank JSONL folder is merged by time so cross-rank detectors (stragglers, hangs) see
    the ranks side by side, as the live collector does. Raises :class:`ImportFormatError` (a
    ``ValueError``) for an unknown or unreadable format; damaged lines or records inside a known
    format are skipped with a warning.
    """
    path = Path(path)
    if run is not None and not re.match(RUN_ID_PATTERN, run):
        raise ImportFormatError(f"run name {run!r} is not a valid run id (must match {RUN_ID_PATTERN})")
    fmt = detect_format(path, csv_hint=bool(mapping))
    if fmt == "jsonl":
        if path.is_dir():
            streams = [itertools.chain.from_iterable(map(read_jsonl, files)) for files in _jsonl_streams(path)]
            events = heapq.merge(*streams, key=lambda e: e.time)
        else:
            events = read_jsonl(path)
        return _renamed(events, run) if run else events
    if fmt == "tensorboard":
        files = _event_files(path) if path.is_dir() else [path]
        items, meta = parse_tensorboard(files)
        digest = "|".join(file_digest(f) for f in files)
        mtime = max((mtime_of(f) or 0.0) for f in files)
    else:
        hashing = _Hashing(path)
        if fmt == "hf_trainer_state":
            items, meta = parse_hf(path)
        elif fmt == "llamafactory_trainer_log":
            items, meta = parse_llamafactory(path)
        elif fmt == "ms_swift_logging":
            items, meta = parse_ms_swift(path)
        elif fmt == "csv":
            items, meta = parse_csv(path, parse_mapping(mapping))
        elif fmt == "json_table":
            items, meta = parse_json_table(path, parse_mapping(mapping))
        else:
            items, meta = parse_textlog(path)
        digest = hashing.result()
        mtime = mtime_of(path)
    name = run or run_id_from_path(path)
    return build_events(items, meta, run=name, source=path, digest=digest, mtime=mtime)


class _Hashing:
    """A file's :func:`file_digest`, hashed on a thread of its own while the caller parses the file: the reads and
    ``hashlib`` release the GIL, so the hash (0.08 s of a 67 MB log) costs the parse no time where a core is free."""

    def __init__(self, path: Path) -> None:
        self._digest: str | None = None
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(path,), name="trainmon-hash", daemon=True)
        self._thread.start()

    def _run(self, path: Path) -> None:
        try:
            self._digest = file_digest(path)
        except OSError as exc:
            self._error = exc

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest


def log_files(path: str | Path) -> list[Path]:
    """The files :func:`read_events` reads for ``path``: the file itself, or a folder's JSONL streams or TensorBoard
    event files (not what else the folder holds: a run folder's checkpoints are not its log)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    return [f for stream in _jsonl_streams(path) for f in stream] or _event_files(path)


def _event_files(folder: Path) -> list[Path]:
    """A folder's TensorBoard event files, in name order."""
    return sorted(p for p in folder.iterdir() if p.is_file() and is_event_file(p))


def _jsonl_streams(folder: Path, *, nested: bool = True) -> list[list[Path]]:
    """The JSONL event streams of a folder, each as the files to read one after the other.

    Spool segments (``<time_ns>-<pid>.jsonl``) are pieces of one rank's stream, in name order;
    other JSONL files are one stream each. A folder without JSONL files (``…/spool/RUN``) holds
    one folder per rank.
    """
    files = sorted(folder.glob("*.jsonl"))
    if files:
        return [files] if all(_SEGMENT.fullmatch(f.name) for f in files) else [[f] for f in files]
    if not nested:
        return []
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir())
    return [s for sub in subfolders for s in _jsonl_streams(sub, nested=False)]


def _renamed(events: Iterator[Event], run: str) -> Iterator[Event]:
    for ev in events:
        yield replace(ev, run=run)
