"""nanochat stdout (``speedrun.sh``: ``base_train``, ``mid_train``, ``chat_sft`` and their forks).

A nanochat log is usually the whole pipeline written to one file (``screen -L``, ``tee``): ``uv``
progress bars, tokenizer training, then one ``torchrun`` launch per stage, each with its own step
counter, schedule and line shape, initialised from the previous stage's checkpoint. What is read:

* Step lines. ``base_train``: ``step 00042/21400 (0.20%) | loss: X | lrm: 1.00 | dt: 476.2ms |
  tok/sec: 1,100,809 | mfu: 48.58 | total time: 1.28m`` (newer versions add ``epoch``, ``eta`` and
  call the MFU ``bf16_mfu``; forks add ``grad norm``). The printed step is the 0-based index of the
  step just done (``step_base`` 0: ``step 00000`` is the first update, ``/21400`` the planned
  length, the last step printed 21399). ``mid_train`` (and the newer ``chat_sft``): ``step 00001
  (0.28%) | loss: ...`` without a total: printed after the counter is incremented, so the step is
  the number of steps done (``step_base`` 1). The step base of a stage is read from its first
  printed step (0 or 1) and otherwise from its shape. Fields come in any order; unknown ones are
  ignored.
* The loss of those lines is nanochat's *debiased EMA* (beta 0.9) of one micro-batch's loss on
  rank 0 (the last micro-batch of the step, not the step's mean over micro-batches and ranks). It
  is a smoothed value, not the step's loss: its variance is (1 - beta) / (1 + beta) = 1/19 of one
  micro-batch's, so it counts as a mean over about 19 steps (``LogMeta.loss_mean_over``), and a
  one-step excursion shows as a bump that decays over ~20 steps (0.9**k). One NaN makes every
  later value NaN. ``loss: nan`` comes through as NaN.
* ``chat_sft`` (2025): ``Step 00042/00651 | Training loss: X| lrm: X| num_tokens: N``: the step's
  own loss (the last micro-batch on rank 0, not smoothed: per-batch noise of conversations of
  varying length), the 0-based step index (``step_base`` 0; the loop stops before training its
  last index, so 651 planned steps print 0..649), ``num_tokens`` the supervised tokens of the step
  (kept as its tokens). No step time is printed: that stage has no clock of its own.
* ``lrm`` is the LR *multiplier* the printed step used (``get_lr_multiplier`` evaluated for that
  step before its update), not a learning rate: no LR is imported (``lrm_first`` / ``lrm_last`` are
  kept). ``dt`` is the step time; summed from the last timestamp logged before a launch's first
  step it is the real clock. ``mfu`` / ``bf16_mfu`` (percent) is kept as the stage's median. Tokens
  per step are the launch's ``Total batch size N`` when printed, else ``tok/sec x dt`` (both the
  whole job's), divided by the ``Distributed world size`` when every launch prints the same one: a
  step event counts one rank's tokens.
* Evaluations: ``Step 00250 | Validation bpb: 0.8123`` (bits per byte, kept as the eval loss and as
  ``val_bpb``) or ``Step N | Validation loss: X``; the other ``Step N | name: value`` lines (``CORE
  metric``, ``mmlu_acc: X, arc_easy_acc: Y``, ``ChatCORE: X | ChatCORE_cat: Y``) join that step's
  evaluation as metrics. An evaluation printed before a launch's first step is that launch's
  step-0 evaluation.
* Terminal residue: escape sequences are removed, and keystrokes a terminal echoed in caret
  notation before a step line (``^[[B^[[B...step 04354/21400``, cursor keys typed into a ``screen``
  session) are dropped, so the line is read. ``\\r`` redraws are separate lines.

Several launches in one file:

* A *stage* starts when the step lines change shape or the step counter starts over: a new launch
  with its own counter, schedule and loss definition, initialised from the previous stage's
  checkpoint (``Loading model from .../base_checkpoints/d20 with step 21400``). It is a separate run
  (a :class:`RunMark`), never a resume or an attempt of the stage before: the previous stage
  finished, and this one starts a new schedule. Each stage is named for the checkpoint folder it
  saves to (``base_checkpoints`` -> ``base``, ``mid_checkpoints`` -> ``mid``, ``chatsft_checkpoints``
  -> ``chatsft``), else ``stageN``; a file with one stage keeps the file's run name.
* A relaunch of the same stage is an *attempt* (a :class:`ResumeMark`) only with evidence of a
  restart: nanochat's ``Resuming optimization from step N`` (also before the file's first step: the
  log starts at a resume). A relaunch that starts its counter over without it is a new run
  (``base-2``, or ``stageN`` when it saved no checkpoint), not a resume. The same step line printed
  twice in a row (a terminal redraw) is read once, and said in the notes.
* A launch that fails before logging a step (``torchrun``'s ``scripts.base_train FAILED`` with the
  error its ranks raised) has no run of its own: it is named in the notes and in
  ``config.failed_launches_before`` of the run launched after it (it did not crash that run), or
  ``config.failed_launches_after`` of the last run when nothing was launched after it (a pipeline
  whose later stages failed: that run's own outcome is unaffected). A ``FAILED`` line after a
  stage's steps with no other launch in between is that stage's failure: status ``failed``.

Status of each stage: ``finished`` when its end lines (``Peak memory usage``, ``Total training
time``) follow its last step, when it saved its final checkpoint (step >= planned - 1) after its
last step, or when a 0-based stage printed its planned last index; ``failed`` as above;
``interrupted`` when the log (or the stage, followed by another launch) stops short of that, with
its progress under 100%; unknown otherwise.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    ResumeMark,
    RunMark,
    TrainPoint,
    pipe_fields,
)
from trainmon.monitor.importers.terminal import clean_text, drop_echoed
from trainmon.monitor.importers.textclock import ISO_STAMP, Segment, iso_to_epoch, lay_out

__all__ = ["EMA_BETA", "looks_like_nanochat", "parse_nanochat"]

log = logging.getLogger("trainmon.import")

EMA_BETA = 0.9
"""nanochat's smoothing of the printed training loss (``ema_beta`` in its training scripts)."""
_EMA_WINDOW = round((1 + EMA_BETA) / (1 - EMA_BETA), 6)
"""Steps of independent noise whose plain mean has the EMA's variance: (1 + beta) / (1 - beta) = 19."""

_STEP = re.compile(r"^step\s+(\d+)(?:\s*/\s*(\d+))?\s+\(\s*([-+\d.]+|nan)\s*%\)\s*\|(.*)$")
_SFT = re.compile(r"^Step\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_EVAL = re.compile(r"^Step\s+(\d+)\s*\|(.*)$")
_PAIR = re.compile(r"^\s*([^:|,]+?)\s*:\s*(\S+?)\s*$")
_PART = re.compile(r"^\s*([\w/ ]+?)\s*:\s*(\S+)")
_BATCH = re.compile(r"^Total batch size\s+([\d,]+)")
_END = re.compile(r"^(Peak memory|Total training time|Minimum validation)")
_NUM = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+)$|^[-+]?(?:nan|inf)$", re.IGNORECASE)
_WORLD = re.compile(r"Distributed world size:\s*(\d+)")
_LOADED = re.compile(r"Loading model from\s+(\S+?)/?\s+with step\s+(\d+)")
_RESUMING = re.compile(r"Resuming optimization from step\s+(\d+)")
_SAVED = re.compile(r"Saved (?:model|optimizer|metadata)\b[^/]*?(/\S*?([\w.-]+)_checkpoints/\S*)")
_SAVED_STEP = re.compile(r"_(\d+)(?:_rank\d+)?\.(?:pt|json)$")
_FAILED = re.compile(r"^([\w.]+) FAILED$")
_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception)):\s*(\S.*)$")

_LOSS_EMA = "ema"
_LOSS_STEP = "step"


def looks_like_nanochat(head: str) -> bool:
    """A ``step N (p%) | loss: ...`` or ``Step N/M | Training loss: ...`` line near the start."""
    for raw in head.splitlines():
        line = _clean(raw)
        m = _STEP.match(line)
        if m is not None and "loss" in m.group(4):
            return True
        m = _SFT.match(line)
        if m is not None and "training loss" in m.group(3).lower():
            return True
    return False


def _clean(raw: str) -> str:
    """The text of a line as a step line would read: escapes removed, echoed keystrokes in front dropped."""
    return drop_echoed(clean_text(raw))


def _num(text: str) -> float | None:
    text = text.replace(",", "").rstrip("%").strip()
    unit = re.match(r"^(.*?)(ms|s|m)$", text)
    if unit is not None and _NUM.match(unit.group(1)):
        text = unit.group(1)
    return float(text) if _NUM.match(text) else None


def _key(name: str) -> str:
    return re.sub(r"\W+", "_", name.strip().lower()).strip("_")


@dataclass
class _Launch:
    """What the log printed since the last step line: the set-up of the next launch."""

    stamp: float | None = None
    batch: int | None = None
    world_size: int | None = None
    loaded: tuple[str, int] | None = None
    resume_from: int | None = None
    started: bool = False  # a launch's set-up lines were printed (world size, model loading, resume)
    evals: list[tuple[int, str]] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None  # the first exception the ranks raised since the last FAILED line


@dataclass
class _Stage:
    shape: str  # "total" (step N/M (p%)), "progress" (step N (p%)), "sft" (Step N/M | Training loss)
    loss_kind: str
    first_step: int
    launch: _Launch
    items: list[Item] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    last_step: int = -1
    planned: int | None = None
    last_pct: float | None = None
    ended: bool = False
    saved_family: str | None = None
    saved_step: int | None = None
    saved_after_last: bool = False
    failed: dict[str, str] | None = None
    failed_after: list[dict[str, str]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    evals: dict[int, EvalPoint] = field(default_factory=dict)
    pending: dict[int, dict[str, float]] = field(default_factory=dict)
    lrm: list[float] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    mfu_key: str | None = None
    duplicates: int = 0
    rel: float = 0.0

    @property
    def step_base(self) -> int:
        if not self.resumes and self.first_step in (0, 1):
            return self.first_step
        return 1 if self.shape == "progress" else 0

    def resumed(self, from_step: int, step: int) -> None:
        """nanochat said it resumed this stage from ``from_step`` before printing ``step``."""
        self.resumes.append(from_step)
        reason = f"nanochat printed 'Resuming optimization from step {from_step}'"
        self.items.append(ResumeMark(after_step=step - 1, reason=reason))


def parse_nanochat(path: Path) -> tuple[list[Item], LogMeta]:
    stages: list[_Stage] = []
    launch = _Launch()
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            line = _clean(raw)
            if not line:
                continue
            stage = stages[-1] if stages else None
            parsed = _step_line(line)
            if parsed is not None:
                shape, step, total, pct, parts = parsed
                loss_text = parts.get("loss", parts.get("training_loss"))
                loss = _num(loss_text) if loss_text is not None else None
                if loss is None:
                    bad += 1
                    log.warning("%s: line %d: a step line without a readable loss; skipped", path, n)
                    continue
                if stage is not None and shape == stage.shape and launch.resume_from is not None:
                    stage.resumed(launch.resume_from, step)
                    stage.segments.append(Segment(anchor=launch.stamp))
                    stage.rel = 0.0
                    launch = _Launch()
                elif stage is not None and shape == stage.shape and step == stage.last_step and not launch.started:
                    stage.duplicates += 1  # the same line printed twice (a terminal redraw)
                    continue
                elif stage is None or shape != stage.shape or step < stage.last_step or launch.started:
                    stage = _Stage(shape, _LOSS_STEP if shape == "sft" else _LOSS_EMA, step, launch)
                    stage.segments.append(Segment(anchor=launch.stamp))
                    if launch.resume_from is not None:  # the log starts at a resume of this stage
                        stage.resumed(launch.resume_from, step)
                    for at, text in launch.evals:
                        _eval(stage, at, text)
                    stages.append(stage)
                    launch = _Launch()
                _add_step(stage, step, total, pct, parts, loss)
                continue
            m = _EVAL.match(line)
            if m is not None:
                if stage is None or stage.ended or launch.started:
                    launch.evals.append((int(m.group(1)), m.group(2)))  # the next launch's step-0 evaluation
                else:
                    _eval(stage, int(m.group(1)), m.group(2))
                continue
            _context(line, stage, launch)
    if not stages:
        raise ImportFormatError(f"{path}: no nanochat step lines found")
    if launch.failed:
        stages[-1].failed_after.extend(launch.failed)
    for stage in stages:
        if not any(isinstance(p, TrainPoint) and p.time is not None for p in stage.items):
            for p in stage.items:  # no step times (chat_sft): its evaluations have no clock either
                if isinstance(p, EvalPoint):
                    p.time = None
    time_source = lay_out(
        [seg for st in stages for seg in st.segments], path, "dt (ms per step) summed over the logged steps"
    )
    return _assemble(stages, time_source, bad)


def _step_line(line: str) -> tuple[str, int, int | None, float | None, dict[str, str]] | None:
    m = _STEP.match(line)
    if m is not None:
        shape = "total" if m.group(2) else "progress"
        return (
            shape,
            int(m.group(1)),
            int(m.group(2)) if m.group(2) else None,
            _num(m.group(3)),
            pipe_fields(m.group(4), _PART, _key),
        )
    m = _SFT.match(line)
    if m is not None and "training loss" in m.group(3).lower():
        step, total = int(m.group(1)), int(m.group(2))
        return "sft", step, total, 100.0 * step / total if total else None, pipe_fields(m.group(3), _PART, _key)
    return None


def _add_step(
    stage: _Stage, step: int, total: int | None, pct: float | None, parts: dict[str, str], loss: float
) -> None:
    dt_ms = _num(parts["dt"]) if "dt" in parts else None
    dt = dt_ms / 1000.0 if dt_ms is not None and parts["dt"].strip().endswith("ms") else dt_ms
    steps = step - stage.last_step if stage.last_step >= 0 and step > stage.last_step else 1
    t: float | None = None
    if dt is not None and math.isfinite(dt) and dt >= 0:
        stage.rel += dt * steps
        t = stage.rel
    tok_s = _num(parts["tok/sec"]) if "tok/sec" in parts else None
    tokens = stage.launch.batch
    if "num_tokens" in parts and (x := _num(parts["num_tokens"])) is not None and math.isfinite(x):
        tokens = int(x)
    if tokens is None and tok_s is not None and dt is not None and math.isfinite(tok_s * dt):
        tokens = round(tok_s * dt)
    if "lrm" in parts and (x := _num(parts["lrm"])) is not None:
        stage.lrm.append(x)
    for key in ("bf16_mfu", "mfu"):
        if key in parts and (x := _num(parts[key])) is not None and math.isfinite(x):
            stage.mfu.append(x)
            stage.mfu_key = key
            break
    point = TrainPoint(
        step=step,
        loss=loss,
        grad_norm=_num(parts["grad_norm"]) if "grad_norm" in parts else None,
        tokens=tokens,
        step_time=dt,
        time=t,
    )
    stage.items.append(point)
    stage.segments[-1].points.append(point)
    stage.last_step = step
    stage.planned = total or stage.planned
    stage.last_pct = pct if pct is not None else stage.last_pct
    stage.ended = False
    stage.saved_after_last = False


def _context(line: str, stage: _Stage | None, launch: _Launch) -> None:
    """A line that is neither a step nor an evaluation: launch set-up, checkpoints, failures, the end."""
    m = _BATCH.match(line)
    if m is not None:
        launch.batch = int(m.group(1).replace(",", ""))
        return
    if stage is not None and _END.match(line) and not launch.started:
        stage.ended = True
        return
    m = _FAILED.match(line)
    if m is not None:
        failure = {"script": m.group(1), **({"error": launch.error} if launch.error else {})}
        launch.error = None
        if stage is not None and not stage.ended and not launch.started and stage.failed is None:
            stage.failed = failure  # its own torchrun: nothing else was launched since its last step
        else:
            launch.failed.append(failure)
        return
    m = _ERROR.match(line)
    if m is not None and "ChildFailedError" not in m.group(1):
        launch.error = launch.error or f"{m.group(1)}: {m.group(2).strip()}"[:300]
        return
    m = _SAVED.search(line)
    if m is not None and stage is not None and not launch.started:
        stage.saved_family = m.group(2)
        sm = _SAVED_STEP.search(m.group(1))
        if sm is not None:
            stage.saved_step = int(sm.group(1))
            stage.saved_after_last = True
        return
    if (m := _WORLD.search(line)) is not None:
        launch.world_size = int(m.group(1))
        launch.started = True
    elif (m := _LOADED.search(line)) is not None:
        launch.loaded = (m.group(1), int(m.group(2)))
        launch.started = True
    elif (m := _RESUMING.search(line)) is not None:
        launch.resume_from = int(m.group(1))
        launch.started = True
    sm = ISO_STAMP.search(line[:40])
    if sm is not None and (t0 := iso_to_epoch(sm)) is not None:
        launch.stamp = t0


def _eval(stage: _Stage, step: int, text: str) -> None:
    """``Step N | name: value[, name: value] [| name: value]``: the step's evaluation and its metrics."""
    values: dict[str, float] = {}
    for part in re.split(r"[|,]", text):
        pm = _PAIR.match(part)
        if pm is not None and (x := _num(pm.group(2))) is not None:
            values[_key(pm.group(1))] = x
    for key, x in values.items():
        if key in ("validation_bpb", "val_bpb", "validation_loss", "val_loss"):
            metric = "val_bpb" if key.endswith("bpb") else "val_loss"
            ev = EvalPoint(step, x, {metric: x, **stage.pending.pop(step, {})}, time=stage.rel)
            stage.evals[step] = ev
            stage.items.append(ev)
            stage.segments[-1].points.append(ev)
        elif (ev := stage.evals.get(step)) is not None:
            ev.metrics[key] = x
        else:
            stage.pending.setdefault(step, {})[key] = x


def _status(stage: _Stage, last: bool) -> str | None:
    if stage.failed is not None:
        return "failed"
    final_save = stage.saved_after_last and stage.planned and (stage.saved_step or 0) >= stage.planned - 1
    if stage.ended or final_save or (stage.planned and stage.step_base == 0 and stage.last_step >= stage.planned - 1):
        return "finished"
    if stage.last_pct is not None and stage.last_pct < 100.0:
        return "interrupted"
    return None if last else "interrupted"


def _label(stage: _Stage, index: int, taken: set[str]) -> str:
    family = stage.saved_family
    label = family if family else f"stage{index}"
    k = 2
    unique = label
    while unique in taken:
        unique = f"{label}-{k}"
        k += 1
    taken.add(unique)
    return unique


def _launches(failures: list[dict[str, str]]) -> str:
    return ", ".join(f"{x['script']}" + (f" ({x['error']})" if "error" in x else "") for x in failures)


def _stage_meta(stage: _Stage, last: bool) -> tuple[str | None, dict[str, Any], list[str]]:
    """(status, config, notes) of one stage."""
    config: dict[str, Any] = {}
    notes: list[str] = []
    if stage.loss_kind == _LOSS_EMA:
        notes.append(
            f"loss is nanochat's debiased EMA (beta {EMA_BETA}) of one micro-batch's loss per step, not each step's "
            f"own loss: a mean over about {_EMA_WINDOW:.0f} steps, a one-step excursion decays over ~20 steps"
        )
    else:
        notes.append("loss is each step's own loss (one micro-batch, not smoothed): per-batch noise")
    notes.append("no learning rate: nanochat prints only the LR multiplier lrm (the one the printed step used)")
    if stage.lrm:
        config["lrm_first"], config["lrm_last"] = stage.lrm[0], stage.lrm[-1]
    if stage.launch.batch is not None:
        config["total_batch_size_tokens"] = stage.launch.batch
    if stage.last_pct is not None:
        config["last_progress_percent"] = stage.last_pct
    if stage.mfu:
        config["mfu_percent_median"] = statistics.median(stage.mfu)
        config["mfu_key"] = stage.mfu_key
    if stage.launch.world_size is not None:
        config["world_size"] = stage.launch.world_size
    if stage.launch.loaded is not None:
        where, at = stage.launch.loaded
        config["initialised_from"] = {"checkpoint": where, "step": at}
        if not stage.resumes:
            notes.append(
                f"initialised from {where} (step {at}): a new stage with its own step counter and schedule, "
                "not a resume of the run that wrote that checkpoint"
            )
    if stage.launch.failed:
        config["failed_launches_before"] = stage.launch.failed
        notes.append(
            f"before this launch, {len(stage.launch.failed)} launch(es) failed before logging a step: "
            f"{_launches(stage.launch.failed)}; they are not part of this run and did not crash it"
        )
    if stage.failed is not None:
        config["failure"] = stage.failed
        notes.append(f"this launch failed: {_launches([stage.failed])} after its last logged step")
    if stage.failed_after:
        config["failed_launches_after"] = stage.failed_after
        notes.append(
            f"after this run, {len(stage.failed_after)} later launch(es) failed before logging a step: "
            f"{_launches(stage.failed_after)}; the pipeline did not finish, this run's own outcome is unaffected"
        )
    if stage.duplicates:
        notes.append(f"{stage.duplicates} step line(s) printed twice were read once")
    return _status(stage, last), config, notes


def _assemble(stages: list[_Stage], time_source: str, bad: int) -> tuple[list[Item], LogMeta]:
    common_notes = [f"{bad} damaged log lines skipped"] if bad else []
    sizes = {st.launch.world_size for st in stages if st.launch.world_size is not None}
    world_size = sizes.pop() if len(sizes) == 1 else None
    if world_size and world_size > 1:  # the printed batch is the job's; a step event counts one rank's tokens
        for st in stages:
            for p in st.items:
                if isinstance(p, TrainPoint) and p.tokens is not None:
                    p.tokens = round(p.tokens / world_size)
    if len(stages) == 1:
        (stage,) = stages
        status, config, notes = _stage_meta(stage, last=True)
        config["time_source"] = time_source
        meta = LogMeta(
            format="nanochat_stdout",
            framework="nanochat",
            planned_steps=stage.planned,
            status=status,
            config=config,
            notes=notes + common_notes,
            world_size=world_size,
            step_base=stage.step_base,
            loss_mean_over=_EMA_WINDOW if stage.loss_kind == _LOSS_EMA else None,
        )
        return stage.items, meta
    items: list[Item] = []
    taken: set[str] = set()
    for i, stage in enumerate(stages, 1):
        status, config, notes = _stage_meta(stage, last=i == len(stages))
        label = _label(stage, i, taken)
        config["nanochat_stage"] = label
        reason = (
            f"nanochat stage {i} of {len(stages)}: a new launch whose step counter starts at {stage.first_step}"
            + (f" ({stage.shape} step lines)" if i == 1 or stage.shape != stages[i - 2].shape else "")
        )
        items.append(
            RunMark(
                label=label,
                reason=reason,
                planned_steps=stage.planned,
                status=status,
                config=config,
                notes=notes,
                step_base=stage.step_base,
                loss_mean_over=_EMA_WINDOW if stage.loss_kind == _LOSS_EMA else None,
            )
        )
        items.extend(stage.items)
    labels = ", ".join(m.label for m in items if isinstance(m, RunMark))
    meta = LogMeta(
        format="nanochat_stdout",
        framework="nanochat",
        config={"time_source": time_source},
        notes=[
            *common_notes,
            f"a nanochat pipeline of {len(stages)} stages ({labels}): "
            "each stage is a separate run, not an attempt of the one before",
        ],
        world_size=world_size,
    )
    return items, meta
