"""Plain-text training logs of llm.c and nanoGPT-style trainers, read line by line.

Line shapes recognised (anything else is ignored, so interleaved prints do not break a read):

* llm.c ``main.log``: ``s:N trl:X`` (train loss), newer ``s:N trl:X lr:Y norm:Z``,
  ``s:N tel:X`` (validation loss), ``s:N eval:X`` (HellaSwag accuracy, kept as an eval metric).
* llm.c and build-nanogpt stdout: ``step N[/M] | loss X | lr Y | norm Z | dt Tms | tok/sec R``
  (also ``train loss X``, ``(T ms | R tok/s)``); ``/M`` gives the planned steps; llm.c's ``val loss X``
  lines are evals of the steps printed before them. llm.c's stdout
  starts with a parameter table (``| LR scheduler | cosine |``, ``| learning rate (LR) | 6e-04 |``,
  ``| warmup iterations | 700 |``, ``| final LR fraction | 0 |``): its schedule is declared
  (``run_start.config.declared_schedule``), and its step lines print step + 1 (``step_base`` 1).
  The LR printed beside a step is the one that step ran at; llm.c's warmup counts the step being
  taken (``max_lr * (step + 1) / warmup``, ``lr_warmup_offset`` 1, in ``main.log`` too), its decay does not.
* build-nanogpt ``log.txt``: ``N train X``, ``N val X``, ``N hella X``.
* nanoGPT ``train.py``: ``iter N: loss X, time Tms, mfu P%`` and ``step N: train loss X, val loss Y``.

Step durations (``dt``, ``time``) become ``step_time`` and drive the synthetic clock; tokens per
step are ``tok/sec x dt`` when both are printed (rounded: the log prints them rounded). A line
that matches a shape but carries a damaged number is skipped and counted.

Trainers with a stdout of their own are read by their own module. The format is recognised by its
lines wherever they are (:func:`sniff_textlog`): a SLURM job's shell trace and argument dump, or a
terminal's progress bars, can push the first step line megabytes into the file, so the file is
scanned in bounded pieces (:func:`trainmon.monitor.importers.terminal.text_chunks`), terminal control
sequences removed before judging and before parsing. The first piece holding a recognised line
decides; within a piece a trainer's own stdout outranks the generic shapes above (its preamble
could hold a line that looks like one of them):

* Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | ... | lm loss: X | ...``: :mod:`.megatron`
  (real step times, several runs in one file split into runs).
* nanochat ``step 00042 (0.20%) | loss: X | lrm: ... | dt: Tms | ...``: :mod:`.nanochat`.
* modded-nanogpt record logs (the training script, then ``step:N/M train_loss:X train_time:Tms``):
  :mod:`.modded_nanogpt`.
* MiniMind ``Epoch:[e/E](s/S), loss: X, ..., lr: Y, ...``: :mod:`.minimind`.

Whatever the format, a SLURM cancellation line (``slurmstepd: error: *** JOB N ON node CANCELLED AT
... DUE TO TIME LIMIT ***``) after the last step is how the run ended: ``interrupted``, with a note
saying the scheduler stopped it (and why), not a failure of the training.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    TrainPoint,
    apply_scheduler_end,
    read_scheduler_end,
    to_float,
)
from trainmon.monitor.importers.deepspeed import looks_like_deepspeed, parse_deepspeed
from trainmon.monitor.importers.megatron import looks_like_megatron, parse_megatron
from trainmon.monitor.importers.minimind import looks_like_minimind, parse_minimind
from trainmon.monitor.importers.modded_nanogpt import looks_like_modded_nanogpt, parse_modded_nanogpt
from trainmon.monitor.importers.nanochat import looks_like_nanochat, parse_nanochat
from trainmon.monitor.importers.terminal import clean_text, terminal_lines, text_chunks
from trainmon.monitor.importers.torchtitan import looks_like_torchtitan, parse_torchtitan
from trainmon.schedules import Schedule

__all__ = ["looks_like_textlog", "parse_textlog", "sniff_textlog"]

log = logging.getLogger("trainmon.import")

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|NaN|Inf|-nan|-inf)"

_LLMC = re.compile(r"^s:(\d+)\s+(trl|tel|eval):(\S+)(.*)$")
_LLMC_KV = re.compile(r"(\w+):(\S+)")
_LLMC_ROW = re.compile(r"^\|\s*([^|]*?[^|\s])\s*\|\s*([^|]*?)\s*\|$")  # | LR scheduler | cosine |
# llm.c's stdout prints its validation loss alone on a line, after the step line of the steps it follows
_LLMC_VAL = re.compile(r"^val loss\s+(" + _NUM + r")$")
_BUILD = re.compile(r"^(\d+)\s+(train|val|hella)\s+(\S+)\s*$")
_PIPE = re.compile(r"^step\s+(\d+)(?:\s*/\s*(\d+))?\s*[:|]\s*(.*)$")
_ITER = re.compile(r"^iter\s+(\d+):\s*loss\s+(\S+?),\s*time\s+(" + _NUM + r")\s*ms(.*)$")
_NANO_EVAL = re.compile(r"^step\s+(\d+):\s*train loss\s+(\S+?),\s*val loss\s+(\S+?)\s*$")
_PIPE_PARTS = {
    "loss": re.compile(r"^(?:train\s+)?loss[:\s]\s*(" + _NUM + r")$"),
    "val_loss": re.compile(r"^val(?:idation)?\s+loss[:\s]\s*(" + _NUM + r")$"),
    "lr": re.compile(r"^lr[:\s]\s*(" + _NUM + r")$"),
    "norm": re.compile(r"^(?:grad\s+)?norm[:\s]\s*(" + _NUM + r")$"),
    "dt_ms": re.compile(r"^(?:dt[:\s]\s*)?(" + _NUM + r")\s*ms$"),
    "dt_s": re.compile(r"^dt[:\s]\s*(" + _NUM + r")\s*s$"),
    "tok_s": re.compile(r"^(?:tok/sec[:\s]\s*(" + _NUM + r")|(" + _NUM + r")\s*tok/s)$"),
}


def _kind(line: str) -> str | None:
    if _LLMC.match(line):
        return "llmc_main_log"
    if _BUILD.match(line):
        return "nanogpt_build_log"
    if _ITER.match(line) or _NANO_EVAL.match(line):
        return "nanogpt_stdout"
    if _PIPE.match(line) and "|" in line:
        return "step_pipe_log"
    return None


# Trainer stdouts read by their own module: (name, detector on a piece of cleaned text, parser).
# Checked in this order, before the generic shapes: a modded-nanogpt record's script or a Megatron
# preamble could hold a line that looks like one of them. A new format is one more row.
_DIALECTS = (
    ("modded_nanogpt", looks_like_modded_nanogpt, parse_modded_nanogpt),
    ("megatron", looks_like_megatron, parse_megatron),
    ("nanochat", looks_like_nanochat, parse_nanochat),
    ("minimind", looks_like_minimind, parse_minimind),
    ("deepspeed", looks_like_deepspeed, parse_deepspeed),  # after megatron: Megatron-DeepSpeed prints both
    ("torchtitan", looks_like_torchtitan, parse_torchtitan),
)
_GENERIC = "generic"


def _shape(text: str) -> str | None:
    """The dialect whose lines ``text`` holds, else ``"generic"`` for a generic step line, else None."""
    dialect = next((name for name, looks, _ in _DIALECTS if looks(text)), None)
    if dialect is not None:
        return dialect
    return _GENERIC if any(_kind(ln.strip()) for ln in text.splitlines()) else None


def looks_like_textlog(head: str) -> bool:
    """``head`` (any piece of a file's text) holds a line of a recognised shape or trainer stdout."""
    return _shape(clean_text(head)) is not None


def sniff_textlog(path: Path) -> str | None:
    """Which text log ``path`` is (a dialect's name or ``"generic"``), judged by its lines wherever
    they are in the file (bounded pieces, :func:`~trainmon.monitor.importers.terminal.text_chunks`);
    None when no piece holds a recognised line."""
    for piece in text_chunks(path):
        shape = _shape(piece)
        if shape is not None:
            return shape
    return None


def parse_textlog(path: Path) -> tuple[list[Item], LogMeta]:
    dialect = sniff_textlog(path)
    parse = next((p for name, _, p in _DIALECTS if name == dialect), _parse_generic)
    items, meta = parse(path)
    end = read_scheduler_end(path)  # a SLURM cancellation is how the run ended, whatever printed the log
    if end is not None:
        apply_scheduler_end(items, meta, end)
    return items, meta


def _parse_generic(path: Path) -> tuple[list[Item], LogMeta]:
    items: list[Item] = []
    kinds: dict[str, int] = {}
    planned: int | None = None
    bad = 0
    pending_eval: dict[int, EvalPoint] = {}  # llm.c prints tel and eval for the same step
    hella: dict[int, float] = {}
    last_train: TrainPoint | None = None
    header: dict[str, str] = {}  # llm.c's parameter table, printed before the first step
    for n, line in terminal_lines(path):
        kind = _kind(line)
        if kind is None:
            val = _LLMC_VAL.match(line)
            if val is not None:
                items.append(EvalPoint(last_train.step if last_train is not None else 0, float(val.group(1))))
                continue
            row = _LLMC_ROW.match(line) if not kinds else None
            if row is not None:
                header.setdefault(row.group(1), row.group(2))
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
        try:
            point = _parse_line(line, kind, pending_eval, hella)
        except ValueError as exc:
            bad += 1
            log.warning("%s: line %d: %s; skipped", path, n, exc)
            continue
        if point is None:
            continue
        if isinstance(point, tuple):  # (TrainPoint, planned total) from a pipe line
            point, total = point
            planned = total or planned
        if isinstance(point, TrainPoint) and last_train is not None and point.step == last_train.step:
            # the same step printed twice (two log shapes in one file): fill in what was missing
            for k in ("loss", "grad_norm", "lr", "tokens", "step_time"):
                if getattr(last_train, k) is None:
                    setattr(last_train, k, getattr(point, k))
            continue
        items.append(point)
        if isinstance(point, TrainPoint):
            last_train = point
    if not kinds:
        raise ImportFormatError(f"{path}: no llm.c or nanoGPT log lines found")
    for step, acc in hella.items():  # accuracies whose step had no validation loss line
        ev = pending_eval.get(step)
        if ev is not None:
            ev.metrics.setdefault("hellaswag_acc", acc)
    fmt = max(kinds, key=lambda k: kinds[k])
    framework = "llm.c" if fmt == "llmc_main_log" else "nanogpt"
    notes = [f"{bad} damaged log lines skipped"] if bad else []
    llmc_stdout = "LR scheduler" in header or "learning rate (LR)" in header
    meta = LogMeta(
        format=fmt,
        framework="llm.c" if llmc_stdout else framework,
        planned_steps=planned,
        notes=notes,
        step_base=1 if llmc_stdout and fmt == "step_pipe_log" else 0,  # llm.c prints step + 1
        lr_warmup_offset=1 if framework == "llm.c" or llmc_stdout else 0,  # llm.c: max_lr * (step + 1) / warmup
    )
    meta.config["line_shapes"] = kinds
    if llmc_stdout:
        _llmc_schedule(header, meta)
    return items, meta


def _llmc_schedule(header: dict[str, str], meta: LogMeta) -> None:
    """The LR schedule llm.c's parameter table declares, for the detector to check the logged LR against.

    llm.c's cosine and linear schedules are trainmon's (warmup ``lr * (step + 1) / warmup``, then the
    decay to ``final LR fraction`` over ``train_num_batches``); its constant has no warmup. Its wsd
    decays as 1 - sqrt, which trainmon's wsd does not: that one is recorded, not declared.
    """
    name = header.get("LR scheduler", "cosine" if "final LR fraction" in header else "")
    lr = to_float(header.get("learning rate (LR)", ""))
    warmup = to_float(header.get("warmup iterations", "0"))
    frac = to_float(header.get("final LR fraction", "1"))
    total = to_float(header.get("train_num_batches", "")) or meta.planned_steps
    args = {"scheduler": name, "learning_rate": lr, "warmup_iterations": warmup, "final_lr_fraction": frac}
    meta.config["lr_schedule_args"] = {**args, "train_num_batches": total}
    if name not in ("cosine", "linear", "constant") or lr is None or warmup is None or frac is None or not total:
        return
    try:
        if name == "constant":
            schedule = Schedule("constant", lr, int(total), 0)
        else:
            schedule = Schedule(name, lr, int(total), min(int(warmup), int(total)), frac)
    except ValueError as exc:
        meta.notes.append(f"the header's LR schedule is not usable ({exc}): the detector infers it")
        return
    meta.config["declared_schedule"] = schedule.to_dict()
    meta.planned_steps = meta.planned_steps or int(total)


def _num(s: str, what: str) -> float:
    x = to_float(s)
    if x is None:
        raise ValueError(f"{what} {s!r} is not a number")
    return x


def _eval_or_hellaswag(
    step: int, is_eval: bool, value: float, pending_eval: dict[int, EvalPoint], hella: dict[int, float]
) -> EvalPoint | None:
    """llm.c and build-nanogpt log the eval loss and the HellaSwag accuracy of a step on separate
    lines, in either order: join them into one eval point."""
    if is_eval:
        ev = EvalPoint(step, value)
        if step in hella:
            ev.metrics["hellaswag_acc"] = hella.pop(step)
        pending_eval[step] = ev
        return ev
    ev = pending_eval.get(step)
    if ev is not None:
        ev.metrics["hellaswag_acc"] = value
    else:
        hella[step] = value
    return None


def _parse_line(
    line: str, kind: str, pending_eval: dict[int, EvalPoint], hella: dict[int, float]
) -> Item | tuple[TrainPoint, int | None] | None:
    if kind == "llmc_main_log":
        m = _LLMC.match(line)
        assert m is not None
        step, tag, value = int(m.group(1)), m.group(2), _num(m.group(3), m.group(2))
        if tag == "trl":
            kv = dict(_LLMC_KV.findall(m.group(4)))
            lr = to_float(kv["lr"]) if "lr" in kv else None
            norm = to_float(kv["norm"]) if "norm" in kv else None
            return TrainPoint(step=step, loss=value, lr=[lr] if lr is not None else None, grad_norm=norm)
        return _eval_or_hellaswag(step, tag == "tel", value, pending_eval, hella)
    if kind == "nanogpt_build_log":
        m = _BUILD.match(line)
        assert m is not None
        step, tag, value = int(m.group(1)), m.group(2), _num(m.group(3), m.group(2))
        if tag == "train":
            return TrainPoint(step=step, loss=value)
        return _eval_or_hellaswag(step, tag == "val", value, pending_eval, hella)
    if kind == "nanogpt_stdout":
        m = _ITER.match(line)
        if m is not None:
            ms = _num(m.group(3), "time")
            return TrainPoint(step=int(m.group(1)), loss=_num(m.group(2), "loss"), step_time=ms / 1000.0)
        m = _NANO_EVAL.match(line)
        assert m is not None
        ev = EvalPoint(int(m.group(1)), _num(m.group(3), "val loss"), {"train_loss": _num(m.group(2), "train loss")})
        return ev
    m = _PIPE.match(line)
    assert m is not None
    step = int(m.group(1))
    total = int(m.group(2)) if m.group(2) else None
    vals: dict[str, float] = {}
    for part in m.group(3).split("|"):
        part = part.strip().strip("()").strip()
        for sub in re.split(r"\s*\(\s*|\s*\)\s*", part):  # "1286.05 ms (407672 tok/s)"
            sub = sub.strip()
            for name, rx in _PIPE_PARTS.items():
                pm = rx.match(sub)
                if pm is not None:
                    vals[name] = float(next(g for g in pm.groups() if g is not None))
                    break
    if "val_loss" in vals and "loss" not in vals:
        return EvalPoint(step, vals["val_loss"])
    if "loss" not in vals and "norm" not in vals:
        raise ValueError("a step line without a loss")
    dt = vals["dt_ms"] / 1000.0 if "dt_ms" in vals else vals.get("dt_s")
    tokens = None
    if dt is not None and "tok_s" in vals and math.isfinite(vals["tok_s"]) and dt > 0:
        tokens = round(vals["tok_s"] * dt)
    point = TrainPoint(
        step=step,
        loss=vals.get("loss"),
        grad_norm=vals.get("norm"),
        lr=[vals["lr"]] if "lr" in vals else None,
        tokens=tokens,
        step_time=dt,
    )
    return point, (total if total else None)
