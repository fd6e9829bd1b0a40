"""Megatron-LM / Megatron-DeepSpeed stdout (and NeMo / Megatron-Bridge, which print the same lines).

What is read:

* Iteration lines, ``[stamp] iteration N/ M | consumed samples: ... | elapsed time per iteration
  (ms): T | learning rate: L | global batch size: B | lm loss: X | loss scale: S | grad norm: G |
  number of skipped iterations: K | number of nan iterations: Q |`` (fields in any order, unknown
  ones ignored, the leading timestamp of newer Megatron-LM optional). ``M`` is the planned
  length; ``T`` (the mean over the logging interval) is the step time and, summed over the
  interval from the last wall-clock time printed before training (Megatron's ``datetime:``
  lines, a logging prefix), the real clock. Tokens per step come from ``consumed tokens`` (or
  ``consumed samples`` x ``seq_length``). The main loss is ``lm loss`` (else the first ``... loss``
  key). Megatron leaves a loss out of the line when it averages to NaN (``avg > 0`` is false), so
  a line without a loss whose iterations were all counted as NaN comes through as a NaN loss.
  The skipped/NaN counters give ``skipped`` when they cover the whole interval, and file totals.
* Validation lines, ``validation loss at iteration N [on ...] | lm loss value: X | lm loss PPL: P |``
  and ``validation loss at the end of training for val data | ...`` (test-set lines are counted,
  not imported: they are not the validation curve).
* The argument dump (``---- arguments ----`` ... ``---- end of arguments ----``), or failing that the
  ``pretrain_*.py --flag value`` command line: ``train_iters`` (planned length), ``lr``, ``min_lr``,
  warmup and decay settings, ``log_interval``, batch and parallel sizes, precision. The schedule
  arguments go into the config as ``lr_schedule_args`` and are *not* declared as a trainmon
  schedule: Megatron's logged LR at iteration N is ``lr * N / warmup`` (the LR for the next
  update), one step off :class:`trainmon.schedules.Schedule`'s convention, which would make
  every warmup step look like drift. The detector infers the schedule from the logged LRs instead.

Values that are data, not errors. What the format prints when a feature is off is a placeholder,
dropped here so detectors never see it:

* ``loss scale: -1.0``: Megatron-DeepSpeed with the DeepSpeed engine on (``--deepspeed``) leaves the
  scaler to DeepSpeed and prints -1. A loss scale is a positive multiplier: a value <= 0 is never a
  scale, whatever printed it.
* ``grad norm: 0.000`` on every line of a run (the same code path: DeepSpeed clips, Megatron's norm
  stays 0): a norm that is exactly zero at every logged iteration while the loss moves is not a
  measurement. One zero among real norms is kept (it is data).
* bf16 and fp32 print a constant ``loss scale: 1.0``: there is no scaler to watch.
* A *static* fp16 scale (``--loss-scale 12``, ``loss_scale`` in the argument dump) is configuration,
  not the state of a dynamic scaler: kept once in the config (``static_loss_scale``), not per step.

The dynamic scaler starts high (``initial_loss_scale``, 2^32 by default) and halves on each overflow
until the gradients fit: the iterations it skips meanwhile are logged with ``number of skipped
iterations`` and, when every iteration of an interval was skipped, without ``lm loss`` and ``grad
norm``. Such a line is a *skipped* interval (``skipped``, no loss), not a NaN one: only ``number of
nan iterations`` covering the interval makes a NaN loss. A run whose every logged iteration was
skipped never applied an update: said in a note and in the config (``never_trained``).

How a run ended, read after its last iteration line: ``KeyboardInterrupt`` (Ctrl-C; the tracebacks
of every rank follow it, and whatever the unwinding raises) is a stop by hand, ``interrupted``, not a
crash; otherwise a Python traceback ending in an exception (``torch.OutOfMemoryError: ...``,
``RuntimeError: NCCL ...``) before the planned end is a crash, ``failed``, with the exception in the
config (``end_error``); C++ frames and teardown noise after ``[after training is done]`` are not. A
SLURM cancellation is read by :func:`~trainmon.monitor.importers.common.read_scheduler_end` for every
text log, and wins (a killed job's ranks print tracebacks too). Keys are read
with ``-`` and ``_`` as spaces (``lm-loss``, ``grad-norm``, ``learning-rate``: the TensorBoard tag
spellings some forks print), and ``iteration-time`` (seconds) when the millisecond field is absent.

Several runs in one file (a sweep script appending each launch's stdout): the iteration counter
starting over (going back to or before where the current run's log began) is a new run, not a
resume, and comes out as a separate run (:class:`~trainmon.monitor.importers.common.RunMark`),
labelled ``runK`` plus the text of a ``==== ... ====`` banner printed before it if any. The
counter going back to a later iteration is a resume from a checkpoint: a new attempt of the same
run, as everywhere else. Status: ``finished`` when a run reaches its planned iterations,
``interrupted`` when it stops short of them.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    RunMark,
    TrainPoint,
    pipe_fields,
)
from trainmon.monitor.importers.terminal import terminal_lines
from trainmon.monitor.importers.textclock import ISO_STAMP, Segment, iso_to_epoch, lay_out

__all__ = ["looks_like_megatron", "parse_megatron"]

log = logging.getLogger("trainmon.import")

_ITER = re.compile(
    r"(?:\[(?P<stamp>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]\s*)?"
    r"\biteration\s+(?P<it>\d+)\s*/\s*(?P<total>\d+)\s*\|(?P<rest>.*)$"
)
_VAL = re.compile(
    r"\bvalidation loss at (?:iteration\s+(?P<it>\d+)|the end of training for (?P<which>\w+) data)"
    r"(?P<suffix>[^|]*)\|(?P<rest>.*)$"
)
_ARGS_START = re.compile(r"^-{3,}\s*arguments\s*-{3,}$")
_ARGS_END = re.compile(r"^-{3,}\s*end of arguments\s*-{3,}$")
_ARG = re.compile(r"^([A-Za-z_]\w*)\s+\.{2,}\s*(.*)$")
_CMDLINE = re.compile(r"\bpretrain_\w+\.py\b")
_CLI_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?:=|'?,?\s+'?)(?!--)([^\s',\]]+)")
_CLI_SWITCH = re.compile(r"--(bf16|fp16)\b")
_BANNER = re.compile(r"^={3,}\s*(\S.*?)\s*={3,}$")
_PART = re.compile(r"^\s*(.+?)\s*:\s*(\S+)")
_KEY_SEP = re.compile(r"[-_\s]+")
# After the last iteration line: a stop by hand (every rank prints the interrupt's traceback)
_RANK_PREFIX = r"(?:\[?rank\d+\]?:\s*|\d+:\s*)?"  # torchrun --tee / srun -l line prefixes
_CTRL_C = re.compile(rf"^{_RANK_PREFIX}KeyboardInterrupt\b")
_TRACEBACK = re.compile(rf"^{_RANK_PREFIX}Traceback \(most recent call last\):")
_EXCEPTION = re.compile(rf"^{_RANK_PREFIX}(?P<err>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b(?::.*)?)$")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|-inf|-nan)$", re.IGNORECASE)

# The LR schedule's arguments: kept with the others, and recorded apart (with train_iters) as lr_schedule_args.
_LR_ARGS = (
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_fraction",
    "lr_warmup_samples",
    "lr_warmup_init",
)
_SCHEDULE_ARGS = (*_LR_ARGS, "train_iters")
# Arguments worth keeping in the run's config (the dump has a few hundred).
_KEEP_ARGS = (
    "train_iters",
    "train_samples",
    *_LR_ARGS,
    "log_interval",
    "eval_interval",
    "eval_iters",
    "save_interval",
    "global_batch_size",
    "micro_batch_size",
    "seq_length",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "world_size",
    "fp16",
    "bf16",
    "loss_scale",
    "initial_loss_scale",
    "clip_grad",
    "weight_decay",
    "optimizer",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "load",
    "finetune",
)


def looks_like_megatron(head: str) -> bool:
    """An iteration or validation line, the argument dump, or a ``pretrain_*.py`` launch with
    Megatron flags near the start (the first iteration is often past the first 64 KiB)."""
    for raw in head.splitlines():
        line = raw.strip()
        if not line:
            continue
        if _ITER.search(line) and "|" in line.split("iteration", 1)[1]:
            return True
        if _VAL.search(line) or _ARGS_START.match(line):
            return True
        if _CMDLINE.search(line) and re.search(r"--(train-iters|tensor-model-parallel-size|micro-batch-size)", line):
            return True
    return False


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("None", ""):
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _float(text: str) -> float | None:
    text = text.strip().rstrip("|").strip()
    if "/" in text:  # "23426.6/23000.0": this interval / running mean (some forks)
        text = text.split("/", 1)[0]
    if not _NUMBER.match(text):
        return None
    return float(text)


@dataclass
class _Preamble:
    """What the log says between two iteration lines: read when the next launch starts."""

    banner: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    cli: dict[str, Any] = field(default_factory=dict)
    stamp: float | None = None


@dataclass
class _Run:
    banner: str | None
    args: dict[str, Any]
    items: list[Item] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    first_iter: int | None = None
    last_iter: int | None = None
    planned: int | None = None
    done: bool = False
    skipped_total: int = 0
    nan_total: int = 0
    nan_lines: int = 0
    tests: int = 0
    prev_iter: int | None = None
    prev_tokens: int | None = None
    prev_samples: int | None = None
    rel: float = 0.0  # seconds since the current segment's start
    last_rest: str = ""
    scale_placeholders: dict[float, int] = field(default_factory=dict)  # printed value -> lines
    ctrl_c_after: int | None = None  # the last iteration logged before a KeyboardInterrupt
    traceback: bool = False  # a Python traceback since the last iteration line
    end_error: str | None = None  # the first exception it ended in

    @property
    def log_interval(self) -> int:
        li = self.args.get("log_interval")
        return li if isinstance(li, int) and li > 0 else 1


def parse_megatron(path: Path) -> tuple[list[Item], LogMeta]:
    runs: list[_Run] = []
    pre = _Preamble()
    in_args = False
    variant = "megatron"
    bad = 0
    for n, line in terminal_lines(path):
        if in_args:
            if _ARGS_END.match(line):
                in_args = False
                continue
            m = _ARG.match(line)
            if m is not None:
                pre.args.setdefault(m.group(1), _value(m.group(2)))
                continue
            in_args = False  # a dump cut short: read on as ordinary lines
        m = _ITER.search(line)
        if m is not None and "|" in m.group("rest"):
            try:
                _iteration(m, runs, pre)
            except ValueError as exc:
                bad += 1
                log.warning("%s: line %d: %s; skipped", path, n, exc)
            pre = _Preamble()
            if runs:  # what came before this line did not end the run
                runs[-1].traceback, runs[-1].end_error = False, None
            continue
        m = _VAL.search(line)
        if m is not None:
            if runs:
                _validation(m, runs[-1])
            continue
        if _ARGS_START.match(line):
            in_args = True
            pre.args = {}
            continue
        if "deepspeed" in line.lower():
            variant = "megatron-deepspeed"
        if "[after training is done]" in line and runs:
            runs[-1].done = True
        if runs and _CTRL_C.match(line):
            runs[-1].ctrl_c_after = runs[-1].last_iter
        elif runs and _TRACEBACK.match(line):
            runs[-1].traceback = True
        elif runs and runs[-1].traceback and runs[-1].end_error is None and (em := _EXCEPTION.match(line)):
            runs[-1].end_error = em.group("err")[:200]
        m = _BANNER.match(line)
        if m is not None and "argument" not in m.group(1).lower():
            pre.banner = m.group(1)
        if _CMDLINE.search(line) and not pre.cli:
            pre.cli = _cli_args(line)
        for sm in ISO_STAMP.finditer(line):
            t = iso_to_epoch(sm)
            if t is not None:
                pre.stamp = t
    runs = [r for r in runs if any(isinstance(it, TrainPoint) for it in r.items)]
    if not runs:
        raise ImportFormatError(f"{path}: no Megatron iteration lines found")
    segments = [seg for r in runs for seg in r.segments]
    if all(seg.anchor == 0.0 for seg in segments):
        time_source = "the timestamps Megatron prints on its iteration lines (read as UTC)"
        lay_out(segments, path, time_source)
    else:
        time_source = lay_out(segments, path, "elapsed time per iteration (ms) summed over the logged iterations")
    if len(runs) == 1:
        return runs[0].items, _meta(runs[0], variant, bad, time_source)
    items: list[Item] = []
    for k, r in enumerate(runs, 1):
        label = f"run{k}" + (f"-{_banner_label(r.banner)}" if r.banner else "")
        rm = _meta(r, variant, 0, time_source)
        if k == 1:
            reason = "the first of several runs written into this file"
        else:
            reason = (
                f"the iteration counter starts over at {r.first_iter}"
                + (f" after a '{r.banner}' banner" if r.banner else "")
                + ": a fresh launch, not a resume"
            )
        items.append(
            RunMark(
                label=label,
                reason=reason,
                planned_steps=rm.planned_steps,
                status=rm.status,
                config=rm.config,
                notes=rm.notes,
            )
        )
        items.extend(r.items)
    notes = [f"{bad} damaged log lines skipped"] if bad else []
    worlds = {_world_size(r) for r in runs}
    meta = LogMeta(
        world_size=worlds.pop() if len(worlds) == 1 else None,
        format="megatron_stdout",
        framework=variant,
        config={"time_source": time_source},
        notes=notes,
        step_base=1,  # "iteration N" is logged after N iterations
    )
    return items, meta


def _banner_label(banner: str) -> str:
    words = banner.split()
    if words and words[0].lower() == "run" and len(words) > 1:
        words = words[1:]
    return "".join(words) if sum(len(w) for w in words) <= 24 else "-".join(words)


def _cli_args(line: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in _CLI_FLAG.finditer(line):
        out.setdefault(m.group(1).replace("-", "_"), _value(m.group(2)))
    for m in _CLI_SWITCH.finditer(line):
        out[m.group(1)] = True
    return out


def _key(name: str) -> str:
    """A field name as Megatron's words, lower-cased (``lm-loss``, ``lm_loss`` -> ``lm loss``)."""
    return _KEY_SEP.sub(" ", name.strip().lower())


def _iteration(m: re.Match[str], runs: list[_Run], pre: _Preamble) -> None:
    it = int(m.group("it"))
    total = int(m.group("total"))
    parts = pipe_fields(m.group("rest"), _PART, _key)
    run = runs[-1] if runs else None
    if run is not None and it == run.prev_iter and run.last_rest == m.group("rest"):
        return  # the same line printed twice (two ranks, or tee'd output)
    fresh = run is None or (run.prev_iter is not None and it <= (run.first_iter or 0) and it <= run.prev_iter)
    resumed = not fresh and run is not None and run.prev_iter is not None and it <= run.prev_iter
    if fresh:
        args = {**pre.cli, **pre.args} if (pre.args or pre.cli) else {}
        run = _Run(banner=pre.banner, args=args)
        runs.append(run)
    assert run is not None
    stamp_m = ISO_STAMP.match(m.group("stamp") or "")
    stamp = iso_to_epoch(stamp_m) if stamp_m else None
    if fresh or resumed or not run.segments:
        if resumed and (pre.args or pre.cli):
            run.args = {**run.args, **pre.cli, **pre.args}
        run.segments.append(Segment(anchor=0.0 if stamp is not None else pre.stamp))
        run.rel = 0.0
        run.prev_tokens = run.prev_samples = None
        run.prev_iter = None
    seg = run.segments[-1]

    elapsed_ms = _pf(parts, "elapsed time per iteration (ms)")
    if elapsed_ms is None and "iteration time" in parts:  # the TensorBoard tag's spelling: seconds
        seconds = _pf(parts, "iteration time")
        elapsed_ms = seconds * 1000.0 if seconds is not None else None
    span = it - run.prev_iter if run.prev_iter is not None and it > run.prev_iter else None
    steps = span or min(it, run.log_interval) or 1
    losses = {k: v for k, v in parts.items() if k.endswith("loss") and k != "loss scale"}
    key = "lm loss" if "lm loss" in losses else next(iter(losses), None)
    loss = _float(losses[key]) if key is not None else None
    if key is not None and loss is None:
        raise ValueError(f"{key} {losses[key]!r} is not a number")
    skipped_n = _int(parts.get("number of skipped iterations"))
    nan_n = _int(parts.get("number of nan iterations"))
    if loss is None and nan_n:
        loss = math.nan  # every iteration of the interval was NaN: Megatron prints no average then
        run.nan_lines += 1
    run.skipped_total += skipped_n or 0
    run.nan_total += nan_n or 0
    skipped = None
    if skipped_n is not None:
        skipped = True if skipped_n >= steps else (False if skipped_n == 0 else None)

    tokens = _tokens(run, it, parts)
    if stamp is not None:
        t: float | None = stamp
    elif elapsed_ms is not None and math.isfinite(elapsed_ms):
        run.rel += elapsed_ms / 1000.0 * steps
        t = run.rel
    else:
        t = None
    lr = _pf(parts, "learning rate")
    scale = _pf(parts, "loss scale")
    if scale is not None and not scale > 0:  # a scale is a positive multiplier: -1 means "not Megatron's"
        run.scale_placeholders[scale] = run.scale_placeholders.get(scale, 0) + 1
        scale = None
    if run.args.get("bf16") is True and not run.args.get("fp16"):
        scale = None  # bf16 prints a constant 1.0: there is no scaler to watch
    point = TrainPoint(
        step=it,
        loss=loss,
        grad_norm=_pf(parts, "grad norm"),
        lr=[lr] if lr is not None else None,
        tokens=tokens,
        step_time=round(elapsed_ms / 1000.0, 7) if elapsed_ms is not None else None,
        time=t,
        loss_scale=scale,
        skipped=skipped,
    )
    run.items.append(point)
    seg.points.append(point)
    if run.first_iter is None:
        run.first_iter = it
    run.last_iter = it
    run.prev_iter = it
    run.last_rest = m.group("rest")
    if total > 0:
        run.planned = total


def _pf(parts: dict[str, str], key: str) -> float | None:
    return _float(parts[key]) if key in parts else None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        x = _float(text)
        return int(x) if x is not None and math.isfinite(x) else None


def _tokens(run: _Run, it: int, parts: dict[str, str]) -> int | None:
    """Tokens per iteration: the cumulative counters' growth over the iterations since the last
    line (from 0 for the first line: the counters are cumulative over the whole training)."""
    seq = run.args.get("seq_length")
    ctoks = _int(parts.get("consumed tokens"))
    csamp = _int(parts.get("consumed samples"))
    since = it - run.prev_iter if run.prev_iter is not None and it > run.prev_iter else it
    out = None
    if ctoks is not None:
        base = run.prev_tokens if run.prev_iter is not None and run.prev_tokens is not None else 0
        out = (ctoks - base) / since if since > 0 else None
    elif csamp is not None and isinstance(seq, int):
        base = run.prev_samples if run.prev_iter is not None and run.prev_samples is not None else 0
        out = (csamp - base) * seq / since if since > 0 else None
    else:
        gbs = _int(parts.get("global batch size"))
        if gbs is not None and isinstance(seq, int):
            out = gbs * seq
    run.prev_tokens = ctoks
    run.prev_samples = csamp
    return round(out) if out is not None and out >= 0 else None


def _validation(m: re.Match[str], run: _Run) -> None:
    if m.group("which") is not None and m.group("which").lower() != "val":
        run.tests += 1
        return
    step = int(m.group("it")) if m.group("it") is not None else run.last_iter
    if step is None:
        return
    values: dict[str, float] = {}
    metrics: dict[str, float] = {}
    for part in m.group("rest").split("|"):
        pm = re.match(r"^\s*(.+?)\s+(value|PPL)\s*:\s*(\S+)", part)
        if pm is None:
            continue
        x = _float(pm.group(3))
        if x is None:
            continue
        name = re.sub(r"\W+", "_", pm.group(1).strip().lower())
        if pm.group(2) == "value":
            values[name] = x
        else:
            metrics[f"{name}_ppl"] = x
    if not values:
        return
    key = "lm_loss" if "lm_loss" in values else next(iter(values))
    for k, v in values.items():
        if k != key:
            metrics[k] = v
    suffix = m.group("suffix").strip()
    ev = EvalPoint(step, values[key], metrics)
    if run.segments and run.segments[-1].points:
        ev.time = run.rel if run.segments[-1].anchor != 0.0 else run.segments[-1].points[-1].time
        run.segments[-1].points.append(ev)
    if suffix:
        log.debug("validation at %d %s", step, suffix)
    run.items.append(ev)


def _placeholders(run: _Run, config: dict[str, Any]) -> list[str]:
    """Drop what the run printed for a feature that was off (module docstring); notes saying so."""
    notes = []
    points = [it for it in run.items if isinstance(it, TrainPoint)]
    for value, lines in sorted(run.scale_placeholders.items()):
        config["loss_scale_placeholder"] = value
        notes.append(
            f"'loss scale: {value}' on {lines} lines is not a scale (Megatron's own scaler is off: the DeepSpeed "
            "engine, when on, keeps it); not imported"
        )
    norms = [p.grad_norm for p in points if p.grad_norm is not None]
    losses = {p.loss for p in points if p.loss is not None and math.isfinite(p.loss)}
    if norms and all(g == 0.0 for g in norms) and len(losses) > 1:
        for p in points:
            p.grad_norm = None
        config["grad_norm_placeholder"] = 0.0
        notes.append(
            f"'grad norm: 0.000' on all {len(norms)} lines while the loss moves is a placeholder (the DeepSpeed "
            "engine clips in this code path), not vanishing gradients; not imported"
        )
    static = run.args.get("loss_scale")
    scales = {p.loss_scale for p in points if p.loss_scale is not None}
    if isinstance(static, (int, float)) and static > 0 and scales <= {float(static)}:
        for p in points:
            p.loss_scale = None
        config["static_loss_scale"] = float(static)
        if scales:
            notes.append(
                f"loss scale {float(static):g} is static (--loss-scale): configuration, not a dynamic scaler's state"
            )
    world = _world_size(run)
    if world is not None and world > 1:  # the wire's tokens are one rank's: the job's total is tokens x world
        for p in points:
            if p.tokens is not None:
                p.tokens = round(p.tokens / world)
        notes.append(
            f"tokens per iteration are the global batch's (consumed tokens, or samples x seq_length), stored as "
            f"each of the {world} ranks' share (world_size from the argument dump) so the run's totals are the job's"
        )
    if points and all(p.skipped is True for p in points):
        config["never_trained"] = True
        start = next((p.loss_scale for p in points if p.loss_scale is not None), None)
        end = next((p.loss_scale for p in reversed(points) if p.loss_scale is not None), None)
        search = f" while the fp16 scaler searched down from {start:.4g} to {end:.4g}" if start and end else ""
        notes.append(
            f"the run never trained: every one of its {run.skipped_total} logged iterations was skipped{search}; "
            "no optimizer update was applied (no loss or grad norm is printed for a skipped iteration)"
        )
    return notes


def _meta(run: _Run, variant: str, bad: int, time_source: str) -> LogMeta:
    args = run.args
    planned = run.planned or (args.get("train_iters") if isinstance(args.get("train_iters"), int) else None)
    status = None
    if planned and run.last_iter is not None:
        status = "finished" if run.last_iter >= planned else "interrupted"
    elif run.done:
        status = "finished"
    notes = [f"{bad} damaged log lines skipped"] if bad else []
    config: dict[str, Any] = {
        "time_source": time_source,
        "skipped_iterations_total": run.skipped_total,
        "nan_iterations_total": run.nan_total,
    }
    notes += _placeholders(run, config)
    if run.ctrl_c_after is not None and run.ctrl_c_after == run.last_iter and status != "finished":
        status = "interrupted"
        config["ended_by"] = "keyboard_interrupt"
        notes.append(
            f"stopped by hand after iteration {run.last_iter} (KeyboardInterrupt: Ctrl-C or SIGINT); the tracebacks "
            "that follow are the ranks unwinding, not a crash"
        )
    elif run.end_error is not None and status != "finished" and not run.done:
        status = "failed"
        config["end_error"] = run.end_error
        notes.append(f"the run crashed after iteration {run.last_iter}: {run.end_error}")
    if run.skipped_total or run.nan_total:
        skipped_lines = sum(1 for it in run.items if isinstance(it, TrainPoint) and it.skipped and it.loss is None)
        notes.append(
            f"Megatron counted {run.skipped_total} skipped and {run.nan_total} NaN iterations; "
            f"{skipped_lines} logged lines print no loss because every iteration in them was skipped (imported as "
            f"skipped steps without a loss, not NaN), {run.nan_lines} because every one was NaN (imported as NaN)"
        )
    li = run.log_interval
    if li > 1:
        notes.append(f"one line per {li} iterations: losses and step times are means over the interval")
    if run.banner:
        config["banner"] = run.banner
    kept = {k: args[k] for k in _KEEP_ARGS if args.get(k) is not None}
    if kept:
        config["megatron_args"] = kept
    sched = {k: args[k] for k in _SCHEDULE_ARGS if args.get(k) is not None}
    if sched:
        config["lr_schedule_args"] = sched
        notes.append(
            "LR schedule arguments are recorded in lr_schedule_args, not declared: Megatron logs lr(N) = lr*N/warmup "
            "at iteration N, one step off trainmon's schedule convention, so the detector infers the schedule"
        )
    if args.get("bf16") is True:
        config["precision"] = "bf16"
    elif args.get("fp16") is True:
        config["precision"] = "fp16"
    if run.tests:
        config["test_set_evaluations_not_imported"] = run.tests
    if run.done:
        config["after_training_is_done"] = True
    return LogMeta(
        step_base=1,  # "iteration N" is logged after N iterations
        format="megatron_stdout",
        framework=variant,
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
        world_size=_world_size(run),
    )


def _world_size(run: _Run) -> int | None:
    """The job's GPU count from the argument dump (the log holds one rank's view of it)."""
    world = run.args.get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None
