"""What every foreign-log importer shares: parsed points in, wire-format events out.

Each format module only parses its file into :class:`TrainPoint` / :class:`EvalPoint` items and
a :class:`LogMeta`; :func:`build_events` turns them into the events trainmon's own hooks would
have sent (``run_start``, one ``step`` per logged training step, ``eval``, ``run_end``). Keeping
that in one place is what makes every import look the same to the detectors, and what keeps
the rules honest in one place too: a signal the log does not hold is left out and named in
``run_start.config["missing_signals"]``, never invented, and a clock the log does not have is
synthesised (one second per logged entry, ordinal only) and flagged ``synthetic_time``.

How the log counts its steps goes into ``run_start.config`` too, for the post-mortem to count
steps as the trainer does: ``step_base`` (0 when a step is logged under the number of steps done
before it, trainmon's and llm.c's way; 1 when under the number done after it, HF's ``global_step``),
``steps_done`` (the trainer's own count at the end of the file, when the file states it: it can be
past the last logged step) and ``ends_at_checkpoint`` (the file is a snapshot saved with the
checkpoint of that step, e.g. HF's ``checkpoint-N/trainer_state.json``: the log ends there because
the file was written then, not because the run stopped).

A log can hold more than one attempt of a run: the step counter going back (a restart from a
checkpoint appended to the same log) or a format-specific sign of a resume (HF's epoch counter
resetting) starts a new producer stream with ``run_start.resumed``, exactly as a resumed
trainer would, so attempts are counted and the detectors keep their baselines across it.
No ``resume`` or ``checkpoint`` event is made up: the log does not say which checkpoint was
loaded, only that the run went on from somewhere.

A log can also hold several *separate* runs written one after another (a sweep script appending
fresh runs to one stdout file). That is not a resume, so it is not an attempt: a
:class:`RunMark` ends the current run and starts another one, named ``{run}-{label}``, with its
own ``run_start`` and ``run_end``. Importing such a file yields one run id per run.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import logging
import math
import operator
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from trainmon.wire import MAX_INT, MAX_KEY, MAX_MAP, MAX_TIME, Event, validate_event

__all__ = [
    "BOOKKEEPING_KEYS",
    "EVAL_TIMINGS",
    "EvalPoint",
    "ImportFormatError",
    "LogMeta",
    "ResumeMark",
    "RunMark",
    "SchedulerEnd",
    "TrainPoint",
    "apply_scheduler_end",
    "build_events",
    "eval_metric_names",
    "file_digest",
    "gc_paused",
    "read_scheduler_end",
    "run_id_from_path",
    "split_runs",
]

BOOKKEEPING_KEYS = frozenset(
    {
        "imported_from",
        "format",
        "synthetic_time",
        "time_source",
        "missing_signals",
        "step_base",
        "steps_done",
        "ends_at_checkpoint",
        "notes",
        "line_shapes",
        "tag_mapping",
        "column_mapping",
        "event_files",
        "ignored_keys",
        "run_in_file",
        "run_split_reason",
        "attempt_inferred_from",
        "resumed_after_step",
        "last_progress_percent",
        "elapsed_resolution_seconds",
        "loss_mean_over_steps",
        "lr_warmup_offset",
        "loss_series",
        "grad_norm_series",
        "eval_sets",
        "step_base_from",
        "duplicate_lines",
    }
)
"""``run_start.config`` keys an importer writes about how it read the log, not about the training run:
a comparison of two imports leaves them out."""

log = logging.getLogger("trainmon.import")

_P = ParamSpec("_P")
_R = TypeVar("_R")

HOST = "imported"
"""Host name of imported events: the log does not say which machine wrote it."""

# Signals a trainmon hook records and a foreign log may lack; named when absent.
_OPTIONAL_SIGNALS = ("loss", "grad_norm", "lr", "tokens", "step_time")
# Never present in any foreign format we read: always named, so nobody looks for them.
_NEVER = ("phases", "memory", "node_health", "checkpoints", "batch_fingerprints")

_GENERIC_STEMS = {"trainer_state", "metrics", "log", "main", "train", "events", "history", "output", "stdout"}


class ImportFormatError(ValueError):
    """The file is not in a format we read, or too damaged to read anything from."""


@dataclass(slots=True)
class TrainPoint:
    """One logged training step. ``time`` is wall time when the log has it. Slots: a long log holds
    a million of them at once (a third of the memory a ``__dict__`` each took)."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: list[float] | None = None
    tokens: int | None = None
    step_time: float | None = None
    time: float | None = None
    loss_scale: float | None = None
    """The mixed-precision loss scale the log prints (fp16), None when it has none."""
    skipped: bool | None = None
    """The optimizer step was skipped (overflow or NaN gradients); None when the log cannot tell."""


@dataclass(slots=True)
class EvalPoint:
    """One evaluation: the loss it reported and any other numbers it logged."""

    step: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    duration: float | None = None
    time: float | None = None


@dataclass
class ResumeMark:
    """The log shows the run went on from a checkpoint here (e.g. HF's epoch reset)."""

    after_step: int
    reason: str


@dataclass
class RunMark:
    """A separate run starts here: the file holds several runs written one after another.

    Not a resume (the run's counters and model start over). The items after it, up to the next
    mark, become their own run named ``{run}-{label}``; items before the first mark belong to the
    first marked run. ``planned_steps``, ``status`` and ``config`` override the file's
    :class:`LogMeta` for that run, ``notes`` add to its notes (a sweep's runs need not share their length or outcome).
    """

    label: str
    reason: str
    planned_steps: int | None = None
    status: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step_base: int | None = None
    """The run's own step base when it differs from the file's (a pipeline's stages count differently)."""
    loss_mean_over: float | None = None
    """The run's own :attr:`LogMeta.loss_mean_over` (a stage whose loss is smoothed in a file whose next is not)."""


Item = TrainPoint | EvalPoint | ResumeMark | RunMark


@dataclass
class LogMeta:
    """What the file says about the run as a whole."""

    format: str
    framework: str
    planned_steps: int | None = None
    status: str | None = None
    """``finished`` when the log shows the run completed, ``interrupted`` when it stops short of its
    planned steps, None when the log cannot tell (the ``run_end`` then says ``unknown``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Extra facts from the file (logging interval, epochs, ...), copied into ``run_start.config``."""
    notes: list[str] = field(default_factory=list)
    """Caveats a reader of the post-mortem should know (window-averaged losses, truncation...)."""
    world_size: int | None = None
    step_base: int = 0
    """The step number of the first optimizer step: 0 (trainmon, llm.c, Lightning) or 1 (HF's
    ``global_step``, Megatron's iteration). Steps done at a logged step N: ``N + 1 - step_base``."""
    steps_done: int | None = None
    """The trainer's own count of optimizer steps done at the end of the file, when it states one
    (HF's ``global_step``); None when only the logged steps tell. A file of one run only."""
    ends_at_checkpoint: int | None = None
    """The file is a snapshot saved with the checkpoint of this step (HF's ``checkpoint-N``): the log
    ends there because the file was written then. Leave ``status`` None: how the run ended is unknown."""
    loss_mean_over: float | None = None
    """Each logged loss averages about this many steps' losses (a logging window's mean, an EMA's
    variance-equivalent window): its noise is about sqrt(N) times smaller than one step's, and its
    excursions are spread over that many steps. None: one step's loss. ``run_start.config.loss_mean_over_steps``."""
    lr_warmup_offset: int = 0
    """How a printed LR relates to its printed step during warmup. A logged step N is optimizer step
    ``s = N - step_base`` (0-based); after warmup it ran at the schedule's ``lr(s)``, and in warmup at
    ``lr(s + lr_warmup_offset)``: 0 for torch/transformers (``step / warmup``, 0 at the first step), 1
    for a trainer whose warmup counts the step being taken (llm.c: ``max_lr * (step + 1) / warmup``).
    ``run_start.config.lr_warmup_offset``; the LR-schedule detector reads it."""


# SLURM's own line when it kills a job or step: ``slurmstepd: error: *** JOB 123 ON node CANCELLED AT
# 2024-05-01T12:00:00 DUE TO TIME LIMIT ***`` (no ``DUE TO`` when a user cancelled it), and the plain
# ``CANCELLED AT ...`` form. The ISO time is required: it is what makes the line SLURM's.
_SLURM_CANCEL = re.compile(
    r"(?:\*{3}\s*(?P<unit>JOB|STEP)\s+(?P<job>\S+)\s+(?:ON\s+(?P<node>\S+)\s+)?)?"
    r"\bCANCELLED AT (?P<at>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})"
    r"(?:\s+DUE TO (?P<reason>[A-Z][A-Z ]*[A-Z]))?"
)
# A training-step line of any text format read here: a cancel line followed by one is not the end.
_STEP_LIKE = re.compile(r"(?i)\b(?:step|iter(?:ation)?|epoch)\b\s*[:\[]?\s*\d|^s:\d+\s|^\d+\s+(?:train|val)\s")
_CANCEL_REASONS = {
    "TIME LIMIT": "at its time limit",
    "PREEMPTION": "to preempt it",
    "NODE FAILURE": "after a node failure",
}


@dataclass
class SchedulerEnd:
    """The batch scheduler stopped the job: a status and a note for the run, not a training event."""

    at: str
    reason: str | None
    job: str | None = None
    node: str | None = None
    ends_log: bool = True
    """No training step is logged after it (False: the log goes on, e.g. a requeued job appending)."""

    def note(self, finished: bool = False) -> str:
        why = _CANCEL_REASONS.get(self.reason or "", f"due to {self.reason.lower()}" if self.reason else "")
        who = "cancelled by SLURM " + (why or "(scancel, by a user or an admin)")
        job = f"job {self.job}" + (f" on {self.node}" if self.node else "") if self.job else "the job"
        if not self.ends_log:
            return f"{job} was {who} at {self.at}, and the log goes on after it (requeued or restarted)"
        if finished:
            return f"{job} was {who} at {self.at}, after its training steps had finished (while saving or exiting)"
        return (
            f"{job} was {who} at {self.at}: the run was stopped from outside, not by an error in training; "
            "it ends where the log ends (resume it from its last checkpoint)"
        )


def read_scheduler_end(path: Path) -> SchedulerEnd | None:
    """The last SLURM cancellation of a text log, and whether training steps follow it.

    SLURM often prints the job's line and its steps' lines together (``*** JOB 7 ... DUE TO TIME
    LIMIT ***`` then ``*** STEP 7.0 ... ***``): lines with no step between them are one cancellation,
    the job's id and any stated reason kept."""
    found: SchedulerEnd | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "CANCELLED AT" in line and (m := _SLURM_CANCEL.search(line)) is not None:
                same = found is not None and found.ends_log
                prev = found if same else None
                job = m["job"] if m["unit"] == "JOB" or prev is None or prev.job is None else prev.job
                found = SchedulerEnd(
                    at=m["at"],
                    reason=m["reason"] or (prev.reason if prev else None),
                    job=job,
                    node=m["node"] or (prev.node if prev else None),
                )
            elif found is not None and found.ends_log and _STEP_LIKE.search(line.strip()):
                found.ends_log = False
    return found


def apply_scheduler_end(items: list[Item], meta: LogMeta, end: SchedulerEnd) -> None:
    """Read a scheduler's cancellation into the run's end: ``interrupted`` (unless the log shows the
    run finished its training first) and a note; in a file of several runs, into the last one."""
    marks = [it for it in items if isinstance(it, RunMark)]
    target: RunMark | LogMeta = marks[-1] if marks else meta
    finished = (target.status or (meta.status if marks else None)) == "finished"
    if end.ends_log:
        if not finished:
            target.status = "interrupted"
        target.config["scheduler_end"] = {
            "scheduler": "slurm",
            "event": "cancelled",
            "at": end.at,
            "reason": end.reason.lower() if end.reason else "scancel",
            **({"job": end.job} if end.job else {}),
            **({"node": end.node} if end.node else {}),
        }
    target.notes.append(end.note(finished))


def file_digest(path: Path) -> str:
    """Content hash of a file: the same log imported twice gets the same stream ids (stored once)."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_id_from_path(path: Path) -> str:
    """A stable run id from the file name; generic names (``trainer_state.json``) take their folder's.

    ``out/checkpoint-6000/trainer_state.json`` becomes ``out-checkpoint-6000`` rather than a run
    called ``trainer_state`` that every HF import would share.
    """
    path = Path(path)
    stem = path.name if path.is_dir() else path.stem
    if stem.startswith("events.out.tfevents") or path.name.startswith("events.out.tfevents"):
        stem = ""
    parts = [stem] if stem and stem.lower() not in _GENERIC_STEMS else []
    parent = path if path.is_dir() else path.parent
    parent = parent.resolve()
    while not parts or (len(parts) < 3 and parts[0].lower().startswith(("checkpoint", "version_"))):
        if parent.name == "":
            break
        parts.insert(0, parent.name)
        parent = parent.parent
    raw = "-".join(parts) or "imported"
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")
    clean = clean[-128:].lstrip("-._") or "imported"
    return clean


def gc_paused(parse: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a log's parser with the cyclic garbage collector paused.

    A long log's parse allocates a million points that all live on, no garbage among them: each
    collection the allocations trigger scans them all again for nothing (a 1M-row CSV's points took
    2.1 CPU seconds to build, 0.9 of them without collections). Reference counting still frees
    whatever the parser drops; the collector runs again, as it was, once the parser returns.
    """

    @functools.wraps(parse)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def build_events(
    items: list[Item],
    meta: LogMeta,
    *,
    run: str,
    source: Path,
    digest: str,
    mtime: float | None = None,
) -> Iterator[Event]:
    """Wire-format events for a parsed log, in time order, one stream per attempt.

    ``digest`` (the file's content hash) seeds the stream ids, so re-importing a file is
    idempotent. Raises :class:`ImportFormatError` at once (not on iteration) when the log holds
    no training step at all. With :class:`RunMark` items the events of each run follow one
    another, each run under its own name (see :func:`split_runs`).
    """
    items = _wire_steps(items, meta, run)
    runs = split_runs(items, meta, run)
    if not runs:
        raise ImportFormatError(f"{source}: no training steps found in this {meta.format} log")
    if len(runs) == 1 and RunMark not in map(type, items):
        name, its, m = runs[0]
        train = [it for it in its if type(it) is TrainPoint]
        return _batched(_events(its, train, m, run=name, source=source, digest=digest, mtime=mtime))
    return _batched(_runs_events(runs, source=source, digest=digest, mtime=mtime))


_BATCH = 16384
"""Events made at a time with the garbage collector paused."""


@gc_paused
def _take(events: Iterator[Event]) -> list[Event]:
    return list(itertools.islice(events, _BATCH))


def _batched(events: Iterator[Event]) -> Iterator[Event]:
    """The events, made a batch at a time with the garbage collector paused (:func:`gc_paused`).

    Made one at a time, each of a million events and its fields is counted by the collector, which scans
    them again and again as they pile up in a caller that keeps them (1.8 of a 1M-row CSV's 3.0 CPU seconds
    of building its events); a batch's objects are counted once it is made. The post-mortem's own import
    pauses the collector throughout (``importers.store``); this is for every other caller.
    """
    return itertools.chain.from_iterable(iter(functools.partial(_take, events), []))  # flattened at C speed


def _wire_steps(items: list[Item], meta: LogMeta, run: str) -> list[Item]:
    """The items without the points whose step no step can be (negative, or past 2**53: a text log's
    corrupted line, a counter gone wild), said in a note; one such point must not fail the whole log at
    the wire's range check. Asked at C speed: a long log asks it of a million points."""
    steps = list(map(getattr, items, itertools.repeat("step"), itertools.repeat(0)))
    if not steps or (set(map(type, steps)) <= {int} and min(steps) >= 0 and max(steps) <= MAX_INT):
        return items
    kept = [it for it, s in zip(items, steps, strict=True) if type(s) is int and 0 <= s <= MAX_INT]
    dropped = len(items) - len(kept)
    log.warning("%s: %d entries with a step no step can be (negative or past 2**53) skipped", run, dropped)
    meta.notes.append(f"{dropped} entries with a step no step can be (negative or past 2**53) skipped")
    return kept


def split_runs(items: list[Item], meta: LogMeta, run: str) -> list[tuple[str, list[Item], LogMeta]]:
    """The runs of a file: (run name, items, meta) for each run that has a training step.

    Without a :class:`RunMark` that is the whole file under ``run``. With marks, each run is
    ``{run}-{label}`` (the base name shortened to keep the id valid) and its meta is the file's
    with the mark's planned steps, status and config laid over it; a run without a training step
    (a launch that crashed before its first iteration) is left out with a warning.
    """
    if RunMark not in map(type, items):  # the usual file, asked at C speed
        return [(run, items, meta)] if TrainPoint in map(type, items) else []
    groups: list[tuple[RunMark | None, list[Item]]] = [(None, [])]
    for it in items:
        if isinstance(it, RunMark):
            if groups[-1][0] is None and not any(isinstance(x, TrainPoint) for x in groups[-1][1]):
                groups[-1] = (it, groups[-1][1])  # evals before the first mark join the first run
            else:
                groups.append((it, []))
        else:
            groups[-1][1].append(it)
    n = len(groups)
    out: list[tuple[str, list[Item], LogMeta]] = []
    for i, (mark, its) in enumerate(groups, 1):
        label = _clean_label(mark.label if mark is not None else f"run{i}")
        name = f"{run[: max(1, 127 - len(label))].rstrip('-._')}-{label}"
        if not any(isinstance(it, TrainPoint) for it in its):
            log.warning("%s: run %d of %d in the file (%s) has no training step; left out", run, i, n, label)
            continue
        config = {**meta.config, **(mark.config if mark is not None else {})}
        config["run_in_file"] = {"index": i, "of": n, "label": label}
        if mark is not None:
            config["run_split_reason"] = mark.reason
        notes = [
            *meta.notes,
            *(mark.notes if mark is not None else []),
            f"this file holds {n} separate runs; this is run {i} ({label}), imported as {name}",
        ]
        sub = LogMeta(
            format=meta.format,
            framework=meta.framework,
            planned_steps=(mark.planned_steps if mark is not None and mark.planned_steps else meta.planned_steps),
            status=(mark.status if mark is not None and mark.status else meta.status),
            config=config,
            notes=notes,
            world_size=meta.world_size,
            # one file, one trainer: the same numbering in every run, unless the mark says otherwise
            step_base=mark.step_base if mark is not None and mark.step_base is not None else meta.step_base,
            loss_mean_over=mark.loss_mean_over if mark is not None and mark.loss_mean_over else meta.loss_mean_over,
            lr_warmup_offset=meta.lr_warmup_offset,
        )
        out.append((name, its, sub))
    return out


def _clean_label(label: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-._")
    return clean[:48].rstrip("-._") or "run"


def _runs_events(
    runs: list[tuple[str, list[Item], LogMeta]], *, source: Path, digest: str, mtime: float | None
) -> Iterator[Event]:
    """The events of several runs of one file, one run after the other.

    A run without real time gets a synthetic clock that ends where the next run's begins (the
    last run's at the file's modification time), so the runs keep their order in the file.
    """
    ends: list[float | None] = [None] * len(runs)
    end = mtime if mtime is not None else 0.0
    for k in range(len(runs) - 1, -1, -1):
        train = [it for it in runs[k][1] if isinstance(it, TrainPoint)]
        ends[k] = end
        if not _any_missing(train, "time"):
            end = float(min(p.time for p in train)) - 2.0  # type: ignore[type-var]
        else:
            end -= len(train) + 2.0
    for (name, its, m), end_k in zip(runs, ends, strict=True):
        train = [it for it in its if isinstance(it, TrainPoint)]
        yield from _events(its, train, m, run=name, source=source, digest=digest, mtime=end_k)


def _events(
    items: list[Item],
    train: list[TrainPoint],
    meta: LogMeta,
    *,
    run: str,
    source: Path,
    digest: str,
    mtime: float | None,
) -> Iterator[Event]:
    real_time = not _any_missing(train, "time")
    missing = [name for name in _OPTIONAL_SIGNALS if name != "loss" and _all_missing(train, name)]
    if _all_missing(train, "loss"):
        missing.insert(0, "loss")
    if not real_time:
        missing.append("wall_time")
    missing += list(_NEVER)

    # The synthetic clock ends at the file's modification time and ticks once per logged entry.
    if not real_time:
        mtime = mtime if mtime is not None else 0.0
        span = _TICK * len(train)  # exactly the ticks' sum: whole numbers of seconds
        t0 = mtime - span - 1.0
    config_base: dict[str, Any] = {
        "imported_from": str(source),
        "format": meta.format,
        "synthetic_time": not real_time,
        "missing_signals": missing,
        "step_base": meta.step_base,
        **({"steps_done": meta.steps_done} if meta.steps_done is not None else {}),
        **({"ends_at_checkpoint": meta.ends_at_checkpoint} if meta.ends_at_checkpoint is not None else {}),
        **({"loss_mean_over_steps": meta.loss_mean_over} if meta.loss_mean_over else {}),
        **({"lr_warmup_offset": meta.lr_warmup_offset} if meta.lr_warmup_offset else {}),
        **meta.config,
    }
    if not real_time:
        config_base["time_source"] = "synthetic: one second per logged entry, ending at the file's modification time"
    if meta.notes:
        config_base["notes"] = list(meta.notes)

    emitter = _Emitter(run, digest, meta, config_base)
    step_event = emitter.step  # looked up once: a long log makes a million step events
    clock = t0 if not real_time else None
    prev_step: int | None = None
    last_time = -math.inf
    first_step = train[0].step
    marked = False
    for it in items:
        kind = type(it)
        if kind is TrainPoint:
            step = it.step  # type: ignore[union-attr]
            if prev_step is not None and step <= prev_step and not marked:
                fresh = step <= first_step
                reason = f"step went back from {prev_step} to {step}"
                emitter.new_attempt(resumed=not fresh, reason=reason, after_step=step - 1, time=last_time)
            if real_time:
                t = float(it.time)  # type: ignore[arg-type, union-attr]
            else:
                clock += _TICK
                t = clock
            if last_time > t:  # max(t, last_time), NaN handling included
                t = last_time
            last_time = t
            prev_step = step
            marked = False
            if emitter.pending is not None:
                yield emitter.start(t)
            yield step_event(it, t)  # type: ignore[arg-type]
        elif kind is ResumeMark:
            emitter.new_attempt(resumed=True, reason=it.reason, after_step=it.after_step, time=last_time)  # type: ignore[union-attr]
            marked = True  # the steps it replays are this attempt's, not one more
        else:
            if it.time is not None and real_time:  # type: ignore[union-attr]
                t = max(float(it.time), last_time)  # type: ignore[union-attr]
            else:
                t = last_time + 1e-3 if last_time > -math.inf else (clock if clock is not None else 0.0)
            last_time = t
            if emitter.pending is not None:
                yield emitter.start(t)
            yield emitter.eval(it, t)  # type: ignore[arg-type]
    yield emitter.end(last_time, prev_step)


def _all_missing(points: list[TrainPoint], name: str) -> bool:
    """No point holds ``name`` (asked at C speed: a long log asks it of a million points)."""
    return not any(map(operator.is_not, map(operator.attrgetter(name), points), itertools.repeat(None)))


def _any_missing(points: list[TrainPoint], name: str) -> bool:
    """Some point lacks ``name``."""
    return any(map(operator.is_, map(operator.attrgetter(name), points), itertools.repeat(None)))


_TICK = 1.0
"""Seconds the synthetic clock moves for each logged training step: one per logged entry.

Deliberately ordinal, not proportional to steps or logged durations: the clock is made up,
so it must not look irregular to silence-based detectors (``hang`` learns step intervals),
and a log printed every N steps must not look like N-second stalls.
"""


class _Emitter:
    """Stream ids, sequence numbers and the run_start of each attempt.

    A ``step`` or ``eval`` event is built as the wire format's :class:`Event` directly, not through
    :func:`trainmon.wire.validate_event`: that check exists for what a producer sends over the network,
    and here every value comes from our own typed code (floats made floats, non-finite ones already the
    decoded NaN/inf). What the emitter cannot vouch for (a step or token count beyond 2**53, a time
    outside the wire's range, a metric that is not a float, an overlong name) is handed to
    ``validate_event``, which rejects it with the wire format's own error. The ``run_start`` and
    ``run_end`` of an attempt (its run id, stream id and config) always go through it.
    """

    __slots__ = ("attempt", "config", "digest", "meta", "pending", "run", "seq", "stream")

    def __init__(self, run: str, digest: str, meta: LogMeta, config: dict[str, Any]) -> None:
        self.run = run
        self.digest = digest
        self.meta = meta
        self.config = config
        self.attempt = -1
        self.stream = ""
        self.seq = 0
        self.pending: dict[str, Any] | None = None
        self.new_attempt(resumed=False, reason=None, after_step=None, time=None)

    def new_attempt(self, *, resumed: bool, reason: str | None, after_step: int | None, time: float | None) -> None:
        self.attempt += 1
        key = f"{self.run}|{self.digest}|{self.attempt}".encode()
        self.stream = "imp-" + hashlib.sha1(key).hexdigest()[:24]
        self.seq = 0
        config = dict(self.config)
        if reason is not None:
            config["attempt_inferred_from"] = reason
            if resumed and after_step is not None:
                config["resumed_after_step"] = after_step
        fields: dict[str, Any] = {"config": config, "framework": self.meta.framework, "resumed": resumed}
        if self.meta.planned_steps:
            fields["planned_steps"] = int(self.meta.planned_steps)
        if self.meta.world_size:
            fields["world_size"] = int(self.meta.world_size)
        self.pending = fields  # sent with the attempt's first event, at its time
        if self.attempt > 0:
            log.info("%s: attempt %d starts (%s)", self.run, self.attempt, reason)

    def _validated(self, kind: str, t: float, fields: dict[str, Any]) -> Event:
        raw = {
            "kind": kind,
            "run": self.run,
            "rank": 0,
            "host": HOST,
            "stream": self.stream,
            "seq": self.seq,
            "time": t,
            "fields": fields,
        }
        self.seq += 1
        return validate_event(raw, f"{self.run} {kind}")

    def _event(self, kind: str, t: float, fields: dict[str, Any], sound: bool) -> Event:
        """The event; ``sound``: the caller vouches for ``fields`` (typed, in range), so only the time is checked."""
        if not (sound and 0.0 <= t <= MAX_TIME):
            return self._validated(kind, t, fields)
        seq = self.seq
        self.seq = seq + 1
        return Event(kind, self.run, 0, HOST, self.stream, seq, t, fields)

    def start(self, t: float) -> Event:
        """The attempt's run_start, sent with its first event, at that event's time."""
        fields, self.pending = self.pending, None
        return self._validated("run_start", t, fields)  # type: ignore[arg-type]

    def step(self, p: TrainPoint, t: float) -> Event:
        step = p.step
        fields: dict[str, Any] = {"step": step}
        sound = type(step) is int and 0 <= step <= MAX_INT
        # A finite float is its own wire value (``_wire_float``'s first case, asked here without the call: three
        # a step, a million steps).
        if (x := p.loss) is not None:
            fields["loss"] = x if type(x) is float and x - x == 0.0 else _wire_float(x)
        if (x := p.grad_norm) is not None:
            fields["grad_norm"] = x if type(x) is float and x - x == 0.0 else _wire_float(x)
        if lr := p.lr:
            if len(lr) == 1:
                x = lr[0]
                fields["lr"] = [x if type(x) is float and x - x == 0.0 else _wire_float(x)]
            else:
                fields["lr"] = list(map(_wire_float, lr))
        if (n := p.tokens) is not None and 0 <= n <= MAX_INT:  # a count the wire cannot hold is left out
            fields["tokens"] = int(n)
        if (x := p.step_time) is not None and math.isfinite(x) and x >= 0:
            fields["step_time"] = float(x)
        if (x := p.loss_scale) is not None:
            fields["loss_scale"] = _wire_float(x)
        if (b := p.skipped) is not None:
            fields["skipped"] = bool(b)
        return self._event("step", t, fields, sound)

    def eval(self, p: EvalPoint, t: float) -> Event:
        step = p.step
        fields: dict[str, Any] = {"step": step, "loss": _wire_float(p.loss)}
        metrics = {k: v for k, v in p.metrics.items() if _finite(v)}
        sound = type(step) is int and 0 <= step <= MAX_INT
        if metrics:
            fields["metrics"] = metrics
            sound = sound and len(metrics) <= MAX_MAP and all(type(v) is float for v in metrics.values())
            sound = sound and all(len(k) <= MAX_KEY for k in metrics)
        if p.duration is not None and math.isfinite(p.duration) and p.duration >= 0:
            fields["duration"] = float(p.duration)
        return self._event("eval", t, fields, sound)

    def end(self, t: float, last_step: int | None) -> Event:
        # "unknown" when the log cannot tell how the run ended: an imported run is not running,
        # but claiming it finished (or failed) would be a guess.
        fields: dict[str, Any] = {"status": self.meta.status or "unknown"}
        if last_step is not None:
            fields["step"] = last_step
        return self._validated("run_end", t + 1e-3, fields)


def _wire_float(x: float) -> float:
    """A float as the wire format decodes it: the value, or NaN/inf as the constants its markers stand for."""
    x = float(x)
    if x - x == 0.0:  # finite: inf - inf and nan - nan are nan
        return x
    return math.nan if x != x else (math.inf if x > 0 else -math.inf)


def lr_values(entry: dict[str, Any], keys: tuple[str, ...]) -> list[float] | None:
    """The learning rates a log row holds under the first of ``keys`` it has: one per param group (a list),
    or a single one."""
    for key in keys:
        v = entry.get(key)
        if type(v) is float:  # the common case first: to_float's own
            return [v]
        if isinstance(v, list):
            vals = [to_float(x) for x in v]
            if vals and all(x is not None for x in vals):
                return vals  # type: ignore[return-value]
        x = to_float(v)
        if x is not None:
            return [x]
    return None


def to_float(value: Any) -> float | None:
    """A logged number, or None for blanks and text ("nan"/"inf" strings count as numbers)."""
    if type(value) is float:  # the common case first: JSON logs call this millions of times
        return value
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return None
        try:
            return float(s)
        except ValueError:
            return None
    return None


def to_count(value: Any) -> int | None:
    """A logged step number or count: a non-negative number the wire can hold (at most 2**53; a float like
    ``52.0`` too), else None."""
    if type(value) is int and 0 <= value <= MAX_INT:  # the common case first: exact as a float, so itself
        return value
    x = to_float(value)
    if x is None or not 0 <= x <= MAX_INT:  # NaN fails the comparison too
        return None
    return int(x)


def pipe_fields(text: str, part: re.Pattern[str], key: Callable[[str], str]) -> dict[str, str]:
    """The ``name: value`` fields of a ``|``-separated progress line (Megatron's iteration lines,
    nanochat's step lines), keyed by ``key(name)``; the first of a repeated name wins.

    ``part`` matches one field, its name in group 1 and its value in group 2: the formats differ in
    what a name may hold and how it is normalised, not in how a line is cut into fields.
    """
    out: dict[str, str] = {}
    for field_text in text.split("|"):
        m = part.match(field_text)
        if m is not None:
            out.setdefault(key(m.group(1)), m.group(2))
    return out


EVAL_TIMINGS = ("runtime", "samples_per_second", "steps_per_second", "epoch")
"""Eval scalars that time the evaluation rather than score the model."""


def eval_metric_names(names: Iterable[str], eval_loss: str | None) -> dict[str, str]:
    """The task metrics logged beside the eval loss (``eval/wer`` beside ``eval/loss``, ``val_acc``
    beside ``val_loss``): each such column or tag name -> its metric name.

    A fine-tune is judged by its task metric (WER, accuracy) more than by its eval loss, which can
    rise while the metric improves (over-confidence); without the metric the eval detector calls
    that overfitting.
    """
    if eval_loss is None:
        return {}
    if "/" in eval_loss:
        prefix = eval_loss.rsplit("/", 1)[0] + "/"
    elif eval_loss.lower().endswith("_loss"):
        prefix = eval_loss[: -len("loss")]
    else:
        return {}
    out = {}
    for name in names:
        rest = name[len(prefix) :]
        if (
            name != eval_loss
            and name.lower().startswith(prefix.lower())
            and rest
            and "/" not in rest
            and rest.lower() not in EVAL_TIMINGS
        ):
            out[name] = rest
    return out


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""Terminal colour codes that trainer stdout carries when it was captured from a terminal."""


def mtime_of(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
