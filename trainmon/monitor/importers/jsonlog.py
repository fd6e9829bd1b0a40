"""JSON-lines logs of fine-tuning frameworks: LLaMA-Factory ``trainer_log.jsonl`` and ms-swift ``logging.jsonl``.

Both frameworks run the Hugging Face ``Trainer`` and copy each ``log_history`` entry into one JSON
line of their own, adding progress fields. So the numbers mean what they mean in
``trainer_state.json`` (see :mod:`trainmon.monitor.importers.hf`): the step is the optimizer step
as logged, kept as is; with a logging interval > 1 the loss is the mean over the window; the LR is
kept as logged (HF logs the scheduler's value after the step, ``schedule(step - 1)``: nothing is
shifted, the detector infers the schedule from the trace as it does for HF). What differs is the
framing, and that is what this module reads:

LLaMA-Factory (``LogCallback``), one line per ``on_log``:

* ``current_steps`` / ``total_steps`` are the step and the planned length; ``loss``, ``lr``
  (``learning_rate`` in older versions), ``epoch``, ``elapsed_time`` (``str(timedelta)``:
  ``6:48:06``, ``3 days, 17:51:32``); newer versions add ``throughput`` and the cumulative
  ``total_tokens`` (tokens per step are its difference, as for HF's ``num_input_tokens_seen``).
* A line with ``eval_loss`` is an evaluation and carries the step of the train line before it;
  the line written when ``train()`` returns has no loss at all and repeats the last step. Neither
  is a training step, so neither can look like the step going back (a resume): only training
  lines drive the step sequence.
* Reward-model runs add ``accuracy`` (share of pairs ranked right); ``predict_loss`` lines come
  from a prediction after training. Neither has a place in a step event: named in
  ``ignored_keys``.

ms-swift (``logging.jsonl``), one line per ``on_log``:

* ``"global_step/max_steps": "1/2353"`` (Megatron-swift: ``"iteration": "1/2353"``) gives the step
  and the planned length; ``loss``, ``grad_norm``, ``learning_rate`` (rounded to 8 decimals),
  ``elapsed_time`` as ``1h 13m 46s``, ``train_speed(s/it)`` (older: ``train_speed(iter/s)``), the
  mean step time since the start; ``eval_*`` lines are evaluations; a line with
  ``train_runtime`` closes a finished run.
* ms-swift 2.x rows carry the step as a plain integer ``global_step`` and no ``elapsed_time`` or
  planned length (``{"loss": .., "acc": .., "grad_norm": .., "learning_rate": .., "train_speed(iter/s)":
  .., "epoch": .., "global_step": 5}``); the ``train_speed`` key is what makes them ms-swift's rather
  than another trainer's JSON lines. ``logging_first_step`` gives a row at step 1, then one every
  ``logging_steps``.
* The last line can be one JSON object that repeats the whole ``log_history`` (hundreds of KB,
  megabytes for long runs). Its history is the lines above again, so it is never imported; only
  its top-level scalars before ``log_history`` (``global_step``, the best checkpoint ...) are read,
  from a bounded prefix of the line: a line is never held in memory beyond ``_LINE_LIMIT``.

Time: both print the elapsed time since ``train()`` started, whole seconds, no wall clock.
:class:`~trainmon.monitor.importers.common.LogMeta` has no start time and ``TrainPoint.time`` is
wall time, so the run keeps the synthetic clock every clock-less import has (flagged
``synthetic_time``). The elapsed time still gives real durations: ``step_time`` is the elapsed
time between two training lines over the steps between them (the mean over the logging window,
evaluation time excluded by measuring from the evaluation line), and evaluations without
``eval_runtime`` get the time since their train line as duration. Whole seconds are too coarse
for steps a second or two apart, so ``step_time`` is left out (and said so) when the logging
windows are under ten clock ticks; ms-swift's ``train_speed`` (elapsed / steps done, 6 decimals)
gives the elapsed time to milliseconds when it agrees with the printed one, and is used then.

Step base: the step printed is the number of optimizer steps done (HF's ``global_step``), 1 after
the first step: ``step_base`` 1, so a log of steps 1..N covers N steps. A logged loss is the mean over
the logging interval (``LogMeta.loss_mean_over``).

Several eval sets: HF's Trainer given a dict of eval datasets logs one line per set (``eval_squad_loss``,
``eval_squad_accuracy``); the lines of one step are one evaluation: the first set's loss is the eval
loss, the other sets ride in its metrics as ``SET/loss`` and ``SET/METRIC`` (see
:func:`~trainmon.monitor.importers.structure.eval_sets`).

Duplicate writers: two processes that both think they are the logging process (the local rank 0 of
two nodes sharing an output folder) append every line twice, a second or two apart, with the same
training values and their own timings (``train_speed``, ``elapsed_time``, ``eval_runtime``). A line
whose step was already read with the same values (loss, grad norm, LR, epoch; an evaluation's loss
and metrics) is such a copy: read once, and said in one note, not taken for a restart. A restart
needs evidence of a restart: the step going back *and* different values at the steps logged again.
With two writers the elapsed time interleaves two clocks a second or two apart, so it must go back by
more than their offset (measured on the copies) to be a sign of a resume.

Resumes: the step going back with new values is a restart (handled by ``build_events``); the step
going on while ``elapsed_time`` (reset by a new ``train()`` call) or ``epoch`` goes back is a resume
from a checkpoint, marked like HF's epoch reset.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    ResumeMark,
    TrainPoint,
    lr_values,
    to_count,
    to_float,
)
from trainmon.monitor.importers.structure import eval_point_values, eval_sets, logging_interval

__all__ = [
    "looks_like_llamafactory",
    "looks_like_ms_swift",
    "parse_duration",
    "parse_llamafactory",
    "parse_ms_swift",
]

log = logging.getLogger("trainmon.import")

_LINE_LIMIT = 64 * 1024
"""Characters of a line kept: rows are well under 1 KB; longer lines are summary objects (read
from this prefix, the rest skipped unread into memory) or damage."""
_WARN_LINES = 10
"""Damaged lines reported one by one; further ones are only counted (one summary warning)."""
_MIN_TICKS = 10
"""A logging window must span this many clock ticks for its step_time to be kept (1 s clock: 10 s)."""
_BACK_TOLERANCE = 1.5
"""Seconds the elapsed time may go back (rounding of two prints) before it counts as a restart."""

_LF_STEP = "current_steps"
_LF_KNOWN = {
    "current_steps",
    "total_steps",
    "loss",
    "lr",
    "learning_rate",
    "grad_norm",
    "epoch",
    "percentage",
    "elapsed_time",
    "remaining_time",
    "throughput",
    "total_tokens",
}
_SWIFT_STEP_KEYS = ("global_step/max_steps", "iteration")
_SWIFT_KNOWN = {
    *_SWIFT_STEP_KEYS,
    "global_step",
    "loss",
    "grad_norm",
    "learning_rate",
    "lr",
    "epoch",
    "percentage",
    "elapsed_time",
    "remaining_time",
    "train_speed(s/it)",
    "train_speed(iter/s)",
    "elapsed_time_per_iteration",
    "num_input_tokens_seen",
}
_EVAL_NOT_METRICS = {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
_COPY_LAG = 2
"""A second writer's copy repeats one of this many latest training steps (the writers are a second or
two apart); a step repeated from further back is a replay: a restart."""
_SWIFT_SPEED = "train_speed("
_STEP_OF = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_CLOCK = re.compile(r"^(?:(\d+)\s+days?,\s*)?(\d+):(\d{1,2}):(\d{1,2}(?:\.\d+)?)$")
_UNITS = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|m|s)(?![a-z])")
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


# --- detection ---------------------------------------------------------------------------------


def _first_object(head: str) -> dict[str, Any] | None:
    """The first JSON object among the first non-empty lines of ``head``; None if a line is not one.

    Only whole lines are judged: a line cut by the end of ``head`` is not evidence either way.
    """
    lines = head.splitlines()
    if lines and not head.endswith(("\n", "\r")):
        lines = lines[:-1] if len(lines) > 1 else lines
    for line in lines[:5]:
        line = line.strip().lstrip("\ufeff")
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None
    return None


def looks_like_llamafactory(head: str) -> bool:
    """A JSON line with ``current_steps`` and ``total_steps``: LLaMA-Factory's ``LogCallback`` row.

    Those two names are LLaMA-Factory's own (HF calls them ``step`` / ``max_steps``), so they tell
    its log apart from any other JSON-lines file at the first line.
    """
    obj = _first_object(head)
    return obj is not None and _LF_STEP in obj and "total_steps" in obj


def looks_like_ms_swift(head: str) -> bool:
    """A JSON line whose ``global_step/max_steps`` (or Megatron-swift ``iteration``) is ``"N/M"``, or an
    ms-swift 2.x row: an integer ``global_step`` beside ms-swift's own ``train_speed(...)`` key."""
    obj = _first_object(head)
    if obj is None:
        return False
    if any(isinstance(obj.get(k), str) and _STEP_OF.match(obj[k]) for k in _SWIFT_STEP_KEYS):
        return True
    return _swift2_step(obj) is not None and any(k.startswith(_SWIFT_SPEED) for k in obj)


# --- reading -----------------------------------------------------------------------------------


def parse_duration(text: Any) -> float | None:
    """Seconds in a printed duration: ``6:48:06``, ``3 days, 17:51:32`` (``str(timedelta)``,
    LLaMA-Factory) or ``1h 13m 46s`` / ``6s`` / ``1d 2h`` (ms-swift); None for anything else."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text) if math.isfinite(text) and text >= 0 else None
    if not isinstance(text, str):
        return None
    s = text.strip()
    m = _CLOCK.match(s)
    if m:
        days, h, mi, sec = m.groups()
        return int(days or 0) * 86400.0 + int(h) * 3600.0 + int(mi) * 60.0 + float(sec)
    parts = _UNITS.findall(s)
    if parts and _UNITS.sub("", s).strip() == "":
        return sum(float(v) * _UNIT_SECONDS[u] for v, u in parts)
    return None


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """``(line number, stripped text, whole)`` of each line; a line longer than ``_LINE_LIMIT`` is
    given as its prefix (``whole`` False) and the rest is skipped in bounded chunks."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for n in itertools.count(1):
            line = f.readline(_LINE_LIMIT)
            if not line:
                return
            whole = line.endswith("\n") or len(line) < _LINE_LIMIT
            if not whole:
                while True:
                    rest = f.readline(_LINE_LIMIT)
                    if not rest or rest.endswith("\n"):
                        break
            yield n, line.strip(), whole


def _top_level_before_history(text: str) -> dict[str, Any]:
    """The top-level ``key: value`` pairs of a JSON object up to its ``log_history`` key.

    Walks the object with ``raw_decode`` instead of parsing it, so a summary object's repeated
    history is never decoded, and a prefix of the line is enough.
    """
    dec = json.JSONDecoder()
    out: dict[str, Any] = {}
    pos = text.find("{") + 1
    if pos <= 0:
        return out
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "}":
            break
        try:
            key, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if not isinstance(key, str) or key == "log_history":
            break
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text) or text[pos] != ":":
            break
        pos += 1
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        out[key] = value
    return out


class _Damage:
    """Counts damaged lines; warns for the first few only, so a bad file gives a few lines, not thousands."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0

    def __call__(self, n: int, why: str) -> None:
        self.count += 1
        if self.count <= _WARN_LINES:
            log.warning("%s: line %d %s; skipped", self.path, n, why)

    def finish(self) -> None:
        if self.count > _WARN_LINES:
            log.warning(
                "%s: %d damaged lines skipped in all (the first %d reported)", self.path, self.count, _WARN_LINES
            )


@dataclass
class _Row:
    """One line, reduced to what both formats share; ``kind`` is train, eval, end or other."""

    n: int
    kind: str
    step: int
    planned: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: list[float] | None = None
    epoch: float | None = None
    elapsed: float | None = None
    speed: tuple[str, float] | None = None
    """``("s/it", x)`` or ``("iter/s", x)``: ms-swift's mean speed since the start."""
    step_time: float | None = None
    tokens_seen: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    eval_runtime: float | None = None
    runtime: float | None = None
    eval_set: str | None = None
    """The named evaluation set of an eval line (HF's ``eval_{name}_loss`` for a dict of eval datasets)."""


def _eval_metrics(entry: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, float]:
    out = {}
    for k, v in entry.items():
        x = to_float(v)
        if x is None:
            continue
        if k.startswith("eval_") and k not in _EVAL_NOT_METRICS:
            out[k.removeprefix("eval_")] = x
        elif k in extra:
            out[k] = x
    return out


def _named_eval(row: _Row, obj: dict[str, Any]) -> bool:
    """An evaluation of a named set (``eval_squad_loss``, ``eval_squad_accuracy``: HF's Trainer with a dict
    of eval datasets logs one line per set): read into ``row``, the set named; False when there is none."""
    keys = [k for k in obj if k.startswith("eval_") and to_float(obj[k]) is not None]
    sets = [st for st in eval_sets(keys) if st.name]
    if not sets:
        return False
    loss, metrics = eval_point_values(sets, lambda k: to_float(obj.get(k)))
    if loss is None:
        return False
    row.kind, row.loss, row.metrics, row.eval_set = "eval", loss, metrics, sets[0].name
    row.eval_runtime = next(
        (x for k in keys if k.endswith("_runtime") and (x := to_float(obj.get(k))) is not None), None
    )
    return True


def _objects(path: Path, damage: _Damage, summaries: list[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict]]:
    """The JSON objects of the file, line by line; summary objects (a ``log_history`` inside) go to
    ``summaries`` as their top-level scalars instead."""
    for n, text, whole in _lines(path):
        if not text:
            continue
        if '"log_history"' in text:
            summaries.append((n, _top_level_before_history(text)))
            continue
        if not whole:
            damage(n, f"is longer than {_LINE_LIMIT} characters and not a summary object")
            continue
        try:
            obj = json.loads(text)
        except ValueError as exc:
            damage(n, f"is not JSON ({exc.msg})")
            continue
        if not isinstance(obj, dict):
            damage(n, "is not a JSON object")
            continue
        yield n, obj


def _lf_rows(path: Path, damage: _Damage, ignored: set[str]) -> Iterator[_Row]:
    summaries: list[tuple[int, dict[str, Any]]] = []
    for n, obj in _objects(path, damage, summaries):
        step = to_count(obj.get(_LF_STEP))
        if step is None:
            damage(n, f"has no usable {_LF_STEP}")
            continue
        row = _Row(
            n=n,
            kind="other",
            step=step,
            planned=to_count(obj.get("total_steps")) or None,
            epoch=to_float(obj.get("epoch")),
            elapsed=parse_duration(obj.get("elapsed_time")),
        )
        loss = to_float(obj.get("loss"))
        eval_loss = to_float(obj.get("eval_loss"))
        norm = to_float(obj.get("grad_norm"))
        if eval_loss is not None:
            row.kind, row.loss = "eval", eval_loss
            row.metrics = _eval_metrics(obj, extra=("accuracy",))
            row.eval_runtime = to_float(obj.get("eval_runtime"))
        elif loss is not None or norm is not None:
            row.kind, row.loss, row.grad_norm = "train", loss, norm
            row.lr = lr_values(obj, ("lr", "learning_rate"))
            row.tokens_seen = to_float(obj.get("total_tokens"))
            ignored.update(k for k in obj if k not in _LF_KNOWN and obj[k] is not None)
        elif _named_eval(row, obj):
            pass
        elif all(to_float(obj.get(k)) is None for k in ("predict_loss", "reward")):
            row.kind = "end"  # the line written when train() returns: no numbers of its own
        yield row


def _swift2_step(obj: dict[str, Any]) -> int | None:
    """ms-swift 2.x: the step as a plain integer ``global_step`` (no planned length on the row)."""
    v = obj.get("global_step")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _swift_step(obj: dict[str, Any]) -> tuple[int, int | None] | None:
    for key in _SWIFT_STEP_KEYS:
        v = obj.get(key)
        if isinstance(v, str) and (m := _STEP_OF.match(v)):
            return int(m.group(1)), int(m.group(2))
    step = _swift2_step(obj)
    return (step, None) if step is not None else None


def _swift_rows(path: Path, damage: _Damage, ignored: set[str], header: dict[str, Any]) -> Iterator[_Row]:
    summaries: list[tuple[int, dict[str, Any]]] = []
    for n, obj in _objects(path, damage, summaries):
        pos = _swift_step(obj)
        if pos is None:
            damage(n, "has no usable global_step/max_steps")
            continue
        step, planned = pos
        speed = None
        if (x := to_float(obj.get("train_speed(s/it)"))) is not None and x > 0:
            speed = ("s/it", x)
        elif (x := to_float(obj.get("train_speed(iter/s)"))) is not None and x > 0:
            speed = ("iter/s", x)
        row = _Row(
            n=n,
            kind="other",
            step=step,
            planned=planned or None,
            epoch=to_float(obj.get("epoch")),
            elapsed=parse_duration(obj.get("elapsed_time")),
            speed=speed,
        )
        loss = to_float(obj.get("loss"))
        norm = to_float(obj.get("grad_norm"))
        if "train_runtime" in obj:
            row.kind, row.runtime = "end", to_float(obj.get("train_runtime"))
        elif (eval_loss := to_float(obj.get("eval_loss"))) is not None:
            row.kind, row.loss = "eval", eval_loss
            row.metrics = _eval_metrics(obj)
            row.eval_runtime = to_float(obj.get("eval_runtime"))
        elif loss is None and norm is None and _named_eval(row, obj):
            pass
        elif loss is not None or norm is not None:
            row.kind, row.loss, row.grad_norm = "train", loss, norm
            row.lr = lr_values(obj, ("learning_rate", "lr"))
            row.tokens_seen = to_float(obj.get("num_input_tokens_seen"))
            per_iter = to_float(obj.get("elapsed_time_per_iteration"))  # Megatron-swift: the step's own time
            row.step_time = per_iter if per_iter is not None and per_iter >= 0 else None
            ignored.update(k for k in obj if k not in _SWIFT_KNOWN and obj[k] is not None)
        yield row
    for _, top in summaries:
        header.update({k: v for k, v in top.items() if v is None or isinstance(v, (bool, int, float, str))})
    if summaries:
        header["_summary_lines"] = [n for n, _ in summaries]


# --- duplicate writers --------------------------------------------------------------------------


def _signature(r: _Row) -> tuple[Any, ...] | None:
    """What a second writer's copy of a line repeats exactly: the step and the training values, not
    the timings each process measures for itself (``train_speed``, ``elapsed_time``, ``eval_runtime``)."""
    if r.kind == "train":
        return ("train", r.step, r.loss, r.grad_norm, tuple(r.lr or ()), r.epoch, r.tokens_seen)
    if r.kind == "eval":
        return ("eval", r.step, r.eval_set, r.loss, tuple(sorted(r.metrics.items())))
    return None


@dataclass
class _Copies:
    """Lines dropped as a second writer's copies (see the module docstring)."""

    train: int = 0
    eval: int = 0
    train_steps: int = 0
    """Distinct training steps read (after dropping copies)."""
    first: int | None = None
    """Line number of the first copy."""
    clock_offset: float = 0.0
    """The largest difference between a line's elapsed time and its copy's: the two writers' clocks."""

    def note(self) -> str | None:
        if not self.train and not self.eval:
            return None
        what = f"{self.train} of {self.train_steps} training steps"
        if self.eval:
            what += f" and {self.eval} evaluation(s)"
        return (
            f"duplicate lines: {what} are logged twice with the same values and their own timings (first at line "
            f"{self.first}): two processes append to this one log (e.g. the rank 0 of two nodes sharing an output "
            "folder). Each step is read once; this is a logging defect, not a restart or a repeated step"
        )


def _drop_copies(rows: list[_Row]) -> tuple[list[_Row], _Copies]:
    """The rows without a second writer's copies: a train or eval line that repeats, with the same
    values, one of the last ``_COPY_LAG`` steps read (two writers a line or two apart). A step read
    again with *different* values, or after the log went further on (a replay from the start), is kept:
    a restart."""
    seen: dict[tuple[str, int, str | None], tuple[Any, ...]] = {}
    clock: dict[tuple[str, int, str | None], float | None] = {}
    recent: list[int] = []  # the last distinct training steps read, newest last
    copies = _Copies()
    out: list[_Row] = []
    for r in rows:
        sig = _signature(r)
        if sig is not None:
            key = (r.kind, r.step, r.eval_set)
            near = r.step in recent or (r.kind == "eval" and (not recent or r.step >= recent[0]))
            if near and seen.get(key) == sig:
                copies.train += r.kind == "train"
                copies.eval += r.kind == "eval"
                copies.first = r.n if copies.first is None else copies.first
                if r.elapsed is not None and (t0 := clock.get(key)) is not None:
                    copies.clock_offset = max(copies.clock_offset, abs(r.elapsed - t0))
                continue
            seen[key] = sig
            clock[key] = r.elapsed
            copies.train_steps += r.kind == "train"
            if r.kind == "train" and (not recent or recent[-1] != r.step):
                recent = [*recent, r.step][-_COPY_LAG:]
        out.append(r)
    return out, copies


# --- assembly ----------------------------------------------------------------------------------


def _precise_elapsed(rows: list[_Row]) -> list[float | None] | None:
    """Elapsed seconds from ms-swift's ``train_speed`` (elapsed / steps done since the start, 6
    decimals), when every row agrees with its printed whole-second elapsed time; else None.

    It assumes the run started at step 0; a resumed run (started later) disagrees and keeps the
    printed clock.
    """
    out: list[float | None] = []
    agreed = False
    for r in rows:
        if r.speed is None or r.step <= 0:
            out.append(None)
            continue
        unit, x = r.speed
        t = x * r.step if unit == "s/it" else r.step / x
        if r.elapsed is None or abs(t - r.elapsed) > _BACK_TOLERANCE:
            return None
        agreed = True
        out.append(t)
    return out if agreed else None


def _assemble(rows: list[_Row], *, clock_offset: float = 0.0) -> tuple[list[Item], dict[str, Any], list[str]]:
    """Items, config facts and notes shared by both formats (see the module docstring). ``clock_offset``:
    how far apart two writers' elapsed times are (the rows interleave both clocks), so the elapsed time
    must go back by more than that to be a sign of a resume."""
    precise = _precise_elapsed(rows)
    # Rows without train_speed (ms-swift's eval lines) keep their printed whole seconds; a window
    # is only timed between two readings of the same resolution (a 0.5 s rounding is a 30% error
    # on a 1.5 s step).
    exact = [p is not None for p in precise] if precise else [False] * len(rows)
    clock: list[float | None] = (
        [p if p is not None else r.elapsed for p, r in zip(precise, rows, strict=True)]
        if precise
        else [r.elapsed for r in rows]
    )
    tick = 0.01 if precise else 1.0

    # Whether the logging windows are long enough for the clock: decided for the whole file, so
    # step_time is not there on some windows and missing on others.
    windows = []
    prev_t: float | None = None
    prev_step: int | None = None
    for r, t in zip(rows, clock, strict=True):
        if r.kind != "train":
            continue
        if t is not None and prev_t is not None and prev_step is not None and r.step > prev_step and t >= prev_t:
            windows.append(t - prev_t)
        prev_t, prev_step = t, r.step
    use_clock = bool(windows) and statistics.median(windows) >= _MIN_TICKS * tick

    items: list[Item] = []
    prev_train: _Row | None = None
    prev_any: _Row | None = None
    prev_any_t: float | None = None
    latest_t: float | None = None
    prev_epoch: float | None = None
    prev_tokens: tuple[int, float] | None = None
    derived = False
    prev_any_exact = False
    primary_set: str | None = None  # the first named eval set: the run's eval loss
    sets_seen: dict[str, None] = {}
    pending_sets: dict[int, dict[str, float]] = {}  # other sets' numbers waiting for their step's primary eval
    for r, t, t_exact in zip(rows, clock, exact, strict=True):
        if r.kind == "train":
            if prev_train is not None and r.step <= prev_train.step:
                # A restart: build_events starts the new attempt; the baselines start over.
                prev_any = prev_any_t = latest_t = prev_epoch = prev_tokens = None
            elif prev_train is not None:
                why = None
                back = _BACK_TOLERANCE + 2 * clock_offset
                if t is not None and latest_t is not None and t < latest_t - back:
                    why = f"elapsed time went back from {latest_t:.0f} s to {t:.0f} s after step {prev_train.step}"
                elif r.epoch is not None and prev_epoch is not None and r.epoch < prev_epoch - 1e-9:
                    why = f"epoch went back from {prev_epoch:g} to {r.epoch:g} after step {prev_train.step}"
                if why:
                    items.append(ResumeMark(prev_train.step, why))
                    prev_any = prev_any_t = latest_t = None
            step_time = r.step_time
            if (
                step_time is None
                and use_clock
                and t is not None
                and prev_any is not None
                and prev_any_t is not None
                and prev_train is not None
                and r.step > prev_train.step
                and t >= prev_any_t
                and t_exact == prev_any_exact
            ):
                step_time = round((t - prev_any_t) / (r.step - prev_train.step), 6)
                derived = True
            tokens = None
            if r.tokens_seen is not None and r.tokens_seen > 0:
                if prev_tokens is not None and r.step > prev_tokens[0] and r.tokens_seen >= prev_tokens[1]:
                    tokens = round((r.tokens_seen - prev_tokens[1]) / (r.step - prev_tokens[0]))
                prev_tokens = (r.step, r.tokens_seen)
            items.append(
                TrainPoint(step=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr, tokens=tokens, step_time=step_time)
            )
            prev_train = r
            if r.epoch is not None:
                prev_epoch = r.epoch
        elif r.kind == "eval" and r.loss is not None:
            duration = r.eval_runtime
            if (
                duration is None
                and t is not None
                and prev_any is prev_train
                and prev_any is not None
                and prev_any.step == r.step
                and prev_any_t is not None
                and t - prev_any_t >= _MIN_TICKS * tick
            ):
                duration = t - prev_any_t
            if r.eval_set is not None:
                primary_set = primary_set or r.eval_set
                sets_seen.setdefault(r.eval_set, None)
            if r.eval_set is not None and r.eval_set != primary_set:
                # another set of the same evaluation: into the metrics of its step's eval, as SET/...
                extra = {f"{r.eval_set}/loss": r.loss, **{f"{r.eval_set}/{k}": v for k, v in r.metrics.items()}}
                at = next((it for it in reversed(items) if isinstance(it, EvalPoint) and it.step == r.step), None)
                if at is not None:
                    at.metrics.update(extra)
                else:
                    pending_sets.setdefault(r.step, {}).update(extra)
            else:
                point = EvalPoint(
                    r.step, r.loss, {**dict(r.metrics), **pending_sets.pop(r.step, {})}, duration=duration
                )
                items.append(point)
        if t is not None:
            prev_any, prev_any_t, prev_any_exact = r, t, t_exact
            latest_t = t if latest_t is None else max(latest_t, t)

    train_steps = [it.step for it in items if isinstance(it, TrainPoint)]
    config: dict[str, Any] = {}
    notes: list[str] = []
    if len(sets_seen) > 1:
        config["eval_sets"] = {name: {"primary": name == primary_set} for name in sets_seen}
        notes.append(
            f"{len(sets_seen)} evaluation sets ({', '.join(sets_seen)}), each with its own loss and metrics: the "
            f"eval loss is {primary_set}'s; the others are in each eval's metrics as SET/loss and SET/METRIC"
        )
    interval = logging_interval(train_steps)
    if interval:
        config["logging_steps"] = interval
        if interval > 1:
            notes.append(
                f"each logged loss is the mean over {interval} optimizer steps (logging interval), not one step's loss"
            )
    last_t = next((t for t in reversed(clock) if t is not None), None)
    if last_t is not None:
        config["elapsed_seconds"] = round(last_t, 3)
        config["elapsed_resolution_seconds"] = tick
    if derived:
        notes.append(
            "step_time is the logged elapsed time between two training lines over the steps between them "
            "(the mean over the logging window, evaluation time excluded)"
        )
    elif windows and not use_clock and not any(r.step_time is not None for r in rows):
        notes.append(
            f"no step_time: the log's elapsed time has a {tick:g} s resolution and its logging windows "
            f"are about {statistics.median(windows):.3g} s long, too short to time"
        )
    return items, config, notes


def _status(
    rows: list[_Row], items: list[Item], planned: int | None, final_step: int | None
) -> tuple[str | None, int | None]:
    """``finished`` when the closing line is there after the last training line or the step reached
    the planned length; ``interrupted`` when the log stops short of it; else None (unknown)."""
    last_train = next((i for i in range(len(rows) - 1, -1, -1) if rows[i].kind == "train"), None)
    ended = last_train is not None and any(r.kind == "end" for r in rows[last_train + 1 :])
    steps = [it.step for it in items if isinstance(it, TrainPoint)]
    last = steps[-1] if steps else None
    reached = max((s for s in (last, final_step) if s is not None), default=None)
    if ended or (planned and reached is not None and reached >= planned):
        return "finished", last
    if planned and last is not None:
        return "interrupted", last
    return None, last


def _finish(
    rows: list[_Row],
    path: Path,
    *,
    fmt: str,
    framework: str,
    ignored: set[str],
    damage: _Damage,
    final_step: int | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_notes: list[str] | None = None,
) -> tuple[list[Item], LogMeta]:
    damage.finish()
    if not rows and damage.count:
        raise ImportFormatError(f"{path}: no readable {fmt} line ({damage.count} damaged lines)")
    rows, copies = _drop_copies(rows)
    items, config, notes = _assemble(rows, clock_offset=copies.clock_offset)
    if (note := copies.note()) is not None:
        notes.append(note)
        config["duplicate_lines"] = {"train": copies.train, "eval": copies.eval}
    planned = next((r.planned for r in reversed(rows) if r.planned), None)
    end_steps = [r.step for r in rows if r.kind == "end"]
    if end_steps:
        final_step = max(end_steps + ([final_step] if final_step is not None else []))
    status, last = _status(rows, items, planned, final_step)
    if final_step is not None and last is not None and final_step != last:
        config["final_global_step"] = final_step
    if ignored:
        config["ignored_keys"] = sorted(ignored)
    config.update(extra_config or {})
    notes += extra_notes or []
    if status == "interrupted":
        notes.append(f"the log ends at step {last} of {planned} planned, with no closing line: a stopped run")
    if damage.count:
        notes.append(f"{damage.count} damaged lines could not be read and were skipped")
    return items, LogMeta(
        step_base=1,  # the step printed is the number of steps done (1 after the first)
        format=fmt,
        framework=framework,
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
        # HF logs the mean of the losses since its last log: a mean over the logging interval
        loss_mean_over=float(config["logging_steps"]) if config.get("logging_steps", 1) > 1 else None,
    )


def parse_llamafactory(path: Path) -> tuple[list[Item], LogMeta]:
    """Items and run facts of a LLaMA-Factory ``trainer_log.jsonl`` (see the module docstring)."""
    damage = _Damage(path)
    ignored: set[str] = set()
    rows = list(_lf_rows(path, damage, ignored))
    return _finish(rows, path, fmt="llamafactory_trainer_log", framework="llamafactory", ignored=ignored, damage=damage)


def parse_ms_swift(path: Path) -> tuple[list[Item], LogMeta]:
    """Items and run facts of an ms-swift ``logging.jsonl`` (see the module docstring)."""
    damage = _Damage(path)
    ignored: set[str] = set()
    header: dict[str, Any] = {}
    rows = list(_swift_rows(path, damage, ignored, header))
    summary_lines = header.pop("_summary_lines", [])
    config: dict[str, Any] = {}
    for key in ("model_parameter_info", "best_model_checkpoint", "last_model_checkpoint", "best_metric"):
        if header.get(key) is not None:
            v = header[key]
            config[key] = v[:200] if isinstance(v, str) else v
    runtime = next((r.runtime for r in reversed(rows) if r.kind == "end" and r.runtime is not None), None)
    if runtime is not None:
        config["train_runtime_seconds"] = runtime
    notes = []
    if summary_lines:
        lines = ", ".join(str(n) for n in summary_lines)
        notes.append(f"the closing summary object (line {lines}) repeats the log_history above: not imported again")
    lrs = [x for r in rows if r.kind == "train" and r.lr for x in r.lr]
    small = [x for x in lrs if 0 < abs(x) < 1e-5]
    if small and len(set(lrs)) >= 3 and all(abs(x * 1e8 - round(x * 1e8)) < 1e-6 for x in lrs):
        notes.append("learning_rate is printed rounded to 8 decimals: small LRs keep few significant digits")
    return _finish(
        rows,
        path,
        fmt="ms_swift_logging",
        framework="ms-swift",
        ignored=ignored,
        damage=damage,
        final_step=to_count(header.get("global_step")),
        extra_config=config,
        extra_notes=notes,
    )
