"""modded-nanogpt record logs (``records/*/<uuid>.txt``, ``logs/<uuid>.txt``).

The file is what ``train_gpt.py`` writes: a ``====`` line, the whole training script, a ``====``
line, the PyTorch version and an ``nvidia-smi`` dump, another ``====`` line, then the log:

* ``step:N/M train_loss:X train_time:Tms step_avg:Sms [tokens_seen:N]``: one training step. The
  step printed is ``step + 1``, the number of steps done (``step_base`` 1); ``M`` is the planned
  length. ``train_loss`` is one step's loss (rank 0's, not averaged over ranks or steps).
  ``train_time`` is the cumulative training time (the script pauses the timer during validation,
  and zeroes it after the first 10 warm-up steps, so it restarts there by design: that is not a
  resume, and ``step_avg`` is ``nan`` until the timer has counted a step). Step times are its
  increments, except across a restart, where the increment is not a step's duration (the timer was
  zeroed somewhere inside the step): that step has no step time. The clock is the ``nvidia-smi``
  banner's date plus the cumulative train time (validation pauses are not in it).
* ``tokens_seen`` is the cumulative count of training tokens, printed to three digits
  (``2.62e+05``): the tokens of one step are the slope of that count over the step (a least-squares
  fit, exact to well under the print's resolution) when the count grows in proportion to the step,
  which is how the script counts (a constant batch); the script's batch size times sequence length
  otherwise.
* ``step:N/M val_loss:X train_time:Tms step_avg:Sms``: a validation.

The script is skipped as a block (everything up to the ``====`` line that closes it), so its
``print(f"step:{step}/...")`` lines are never read as log lines. The script's
``Hyperparameters`` (``num_iterations``, ``warmup_iters``, ``warmdown_iters``, ``learning_rate``,
batch size, sequence length) are kept in the config (evaluated when plain arithmetic); tokens per step are
``batch_size x sequence_length`` when both are plain arithmetic. No LR or gradient norm is logged.
Tokens are the whole job's (the world size is not printed, so the run counts as one rank).

A record is one launch of one run, written by rank 0 alone: no resume, duplicate writer or second
run is expected in it (a step counter going back would still start a new attempt in
:func:`~trainmon.monitor.importers.common.build_events`).
"""

from __future__ import annotations

import ast
import calendar
import contextlib
import logging
import math
import operator
import re
import time
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import EvalPoint, ImportFormatError, Item, LogMeta, TrainPoint, to_float
from trainmon.monitor.importers.textclock import Segment, lay_out

__all__ = ["looks_like_modded_nanogpt", "parse_modded_nanogpt"]

log = logging.getLogger("trainmon.import")

_RULE = re.compile(r"^={20,}\s*$")
_LINE = re.compile(
    r"^step:(\d+)/(\d+)\s+(train_loss|val_loss):(\S+)(?:\s+train_time:([-+\d.eE]+|nan)ms)?(?:\s+step_avg:(\S+?)ms)?"
    r"(?:\s+tokens_seen:(\S+))?"
)
_SMI_DATE = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)\s+[A-Z][a-z]{2}\s+\d{1,2}\s+\d\d:\d\d:\d\d\s+\d{4}$")
_HYPER = re.compile(r"^\s+(\w+)\s*:\s*[\w\[\], ]+?\s*=\s*([^#]+?)\s*(?:#.*)?$")
_END = re.compile(r"^peak memory", re.IGNORECASE)
_KEEP = (
    "num_iterations",
    "warmup_iters",
    "warmdown_iters",
    "cooldown_frac",
    "learning_rate",
    "batch_size",
    "device_batch_size",
    "sequence_length",
    "train_seq_len",
    "val_loss_every",
    "weight_decay",
)


def looks_like_modded_nanogpt(head: str) -> bool:
    """A ``step:N/M train_loss:`` line, or the record header: a ``====`` rule then a script that
    prints such lines (the log itself may start past the first 64 KiB)."""
    lines = head.splitlines()
    if any(_LINE.match(ln.strip()) for ln in lines):
        return True
    first = next((ln for ln in lines if ln.strip()), "")
    return bool(_RULE.match(first)) and ("step:{step" in head or "step:{" in head) and "train_loss" in head


def _arith(text: str) -> float | None:
    """A plain arithmetic expression (``2*10172``, ``0.0036 / 2``); None for anything else."""
    ops = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Pow: operator.pow,
    }

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return ops[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            x = ev(node.operand)
            return -x if isinstance(node.op, ast.USub) else x
        raise ValueError("not arithmetic")

    if len(text) > 80:
        return None
    try:
        return ev(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def parse_modded_nanogpt(path: Path) -> tuple[list[Item], LogMeta]:
    items: list[Item] = []
    seg = Segment(anchor=None)
    hyper: dict[str, str] = {}
    in_script = False
    seen_text = False
    planned: int | None = None
    offset = 0.0  # train_time restarts after the warm-up steps: what it had counted before
    prev_ms: float | None = None  # train_time of the last line that printed one, and its step
    ms_step: int | None = None
    prev_step: int | None = None
    resets = 0
    seen: list[tuple[int, float]] = []  # (step, tokens_seen)
    ended = False
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not seen_text:
                if not line.strip():
                    continue
                seen_text = True
                if _RULE.match(line):
                    in_script = True
                    continue
            if in_script:
                if _RULE.match(line):
                    in_script = False
                    continue
                m = _HYPER.match(line)
                if m is not None and m.group(1) in _KEEP:
                    hyper.setdefault(m.group(1), m.group(2))
                continue
            s = line.strip()
            if not s:
                continue
            m = _LINE.match(s)
            if m is None:
                if _SMI_DATE.match(s) and seg.anchor is None:
                    with contextlib.suppress(ValueError):
                        seg.anchor = float(calendar.timegm(time.strptime(s, "%a %b %d %H:%M:%S %Y")))
                elif prev_step is not None and _END.match(s):
                    ended = True
                continue
            step, total, tag = int(m.group(1)), int(m.group(2)), m.group(3)
            value = to_float(m.group(4))
            if value is None:
                bad += 1
                log.warning("%s: line %d: %s %r is not a number; skipped", path, n, tag, m.group(4))
                continue
            planned = total or planned
            ms = to_float(m.group(5))
            t: float | None = None
            step_time = None
            if ms is not None and math.isfinite(ms):
                reset = prev_ms is not None and ms < prev_ms
                if reset:
                    offset += prev_ms  # the timer was zeroed (after the warm-up steps)
                    resets += 1
                    prev_ms = None  # the increment across the restart is not a step's duration
                if tag == "train_loss" and prev_ms is not None and ms_step is not None and step > ms_step:
                    step_time = (ms - prev_ms) / 1000.0 / (step - ms_step)
                t = (offset + ms) / 1000.0
                prev_ms, ms_step = ms, step
            if tag == "val_loss":
                ev = EvalPoint(step, value, time=t)
                items.append(ev)
                seg.points.append(ev)
                continue
            if tag == "train_loss" and (x := to_float(m.group(7))) is not None and math.isfinite(x):
                seen.append((step, x))
            point = TrainPoint(step=step, loss=value, step_time=step_time, time=t)
            items.append(point)
            seg.points.append(point)
            prev_step = step
    if prev_step is None:
        raise ImportFormatError(f"{path}: no modded-nanogpt step:N/M train_loss lines found")
    tokens = _tokens_seen_slope(seen)
    tokens_source = "the slope of tokens_seen" if tokens is not None else None
    if tokens is None:
        tokens = _tokens(hyper)
        tokens_source = "batch_size x sequence_length of the script" if tokens is not None else None
    if tokens is not None:
        for it in items:
            if isinstance(it, TrainPoint):
                it.tokens = tokens
    time_source = lay_out([seg], path, "cumulative train_time (validation pauses excluded)")
    status = None
    if (planned and prev_step >= planned) or ended:
        status = "finished"
    elif planned:
        status = "interrupted"
    notes = []
    if resets:
        notes.append(
            f"train_time restarted {resets} time(s) (the script zeroes it after its warm-up steps): "
            "not a resume, the clock carries on"
        )
    if bad:
        notes.append(f"{bad} damaged log lines skipped")
    config: dict[str, Any] = {"time_source": time_source}
    if hyper:
        config["script_hyperparameters"] = {k: _literal(v) for k, v in hyper.items()}
    if tokens is not None:
        config["tokens_per_step"] = tokens
        config["tokens_per_step_from"] = tokens_source
    return items, LogMeta(
        step_base=1,  # the step printed is the number of steps done (1 after the first)
        format="modded_nanogpt_log",
        framework="modded-nanogpt",
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
    )


def _literal(text: str) -> Any:
    """A hyperparameter as a number when it is plain arithmetic (``2*10172`` -> 20344), else as written."""
    x = _arith(text)
    if x is None:
        return text
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)


def _tokens_seen_slope(seen: list[tuple[int, float]]) -> int | None:
    """Tokens per step from the cumulative ``tokens_seen`` (three printed digits): the least-squares
    slope through the origin, when every value is within 1 % of it times its step (a constant batch;
    the print's own rounding is at most 0.5 %); None otherwise (the count is not a constant batch)."""
    steps = [(s, x) for s, x in seen if s > 0 and x > 0]
    if not steps:
        return None
    slope = sum(s * x for s, x in steps) / sum(s * s for s, _ in steps)
    if slope <= 0 or any(abs(x - slope * s) > 0.01 * slope * s for s, x in steps):
        return None
    return round(slope)


def _tokens(hyper: dict[str, str]) -> int | None:
    batch = _arith(hyper["batch_size"]) if "batch_size" in hyper else None
    seq = _arith(hyper["sequence_length"]) if "sequence_length" in hyper else None
    if batch is None or seq is None or batch <= 0 or seq <= 0:
        return None
    return round(batch * seq)
