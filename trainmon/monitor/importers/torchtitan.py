"""torchtitan stdout (``torchtitan/train.py``, PyTorch's own LLM trainer), read from its own logging code.

Every line goes through torchtitan's logger, ``[titan] 2025-06-01 12:00:00,123 - root - INFO - ...``
(``tools/logging.py``), often behind torchrun's ``[rank0]:`` when ``run_train.sh`` tees the ranks
named in ``LOG_RANK``, and in colour unless ``--metrics.disable_color_printing`` (ANSI codes, removed
before reading: red ``ESC[31m``, orange ``ESC[38;2;180;60;0m``, turquoise ``ESC[38;2;54;234;195m``,
reset ``ESC[39m``). What is read:

* Training lines (``components/metrics.py``, ``MetricsProcessor.log``): ``step: 10  loss:  7.9581
  grad_norm:  1.2345  memory: 23.45GiB(29.63%)  tps: 6,789  tflops: 123.45  mfu: 12.48%``. The
  step counter starts at 1 (``self.step += 1`` before the step runs): the printed step is the number
  of steps done (``step_base`` 1). A line is printed for step 1 and every ``metrics.log_freq``-th
  step (10 by default): the log samples the run, it does not average it. ``loss`` is the logged
  step's own loss: the sum of its gradient-accumulation micro-batches' losses (each already divided
  by the number of micro-batches), averaged over the data-parallel ranks (``global_avg_loss``).
  ``grad_norm`` is that step's total gradient norm before clipping (``clip_grad_norm_`` returns the
  norm it clipped). ``tps`` (tokens per second per device), ``tflops`` and ``mfu`` are means over the
  steps since the previous line, and ``memory`` the peak reserved since then: kept as medians / the
  maximum in the config. No learning rate is printed. With pipeline parallelism only the last stage
  has the loss; the other ranks print ``loss: -1.0000``, a placeholder read as no loss. Older builds
  (2024) print ``wps`` instead of ``tps`` and no ``grad_norm``; they logged the mean of the losses
  since the previous line (``losses_since_last_log``), so there the loss is a mean over the logging
  interval (``LogMeta.loss_mean_over``).
* Validation lines (``components/validate.py`` through ``log_validation``): ``validate step: 100
  loss:  6.1234  memory: ...  tps: ...``: the loss summed over the validation batches' tokens and
  divided by their count (a token-weighted mean over the whole validation set), at that step.
* The clock is the logger's timestamp (millisecond resolution, read as UTC). A step's time is the
  time of its line; its step time is the time since the previous line divided by the steps between
  them (a mean over the interval), left out when a validation, a checkpoint save or a new launch
  falls inside the interval (their time is not the steps').
* ``Trainer is initialized with local batch size 8, global batch size 64, gradient accumulation
  steps 1, sequence length 8192, total steps 1000 (warmup 200).`` (older builds print the same fields
  after ``Training starts at step 1, with``): the planned steps, and the tokens of one step (global
  batch size x sequence length).

Launches, resumes and runs: ``Training starts at step N.`` follows the checkpoint loading of each
launch (``Loading the checkpoint at step N`` / ``from .../step-N``). ``N`` > 1 is evidence of a resume
(the train state of step N - 1 was restored): an attempt (a :class:`ResumeMark`), also when it is the
first launch in the file (the log starts at a resume). A launch that starts again at step 1 after
logged steps loaded no train state: a separate run (a :class:`RunMark`), not an attempt. A seed or
weights-only checkpoint at step 0 is not a resume. When several ranks' lines are in the file, one
rank is read (the one with the most real losses), so every step is read once.

Status: ``finished`` after ``Training completed`` or when the last step reaches the planned total;
``failed`` when an exception (``...Error: ...``) or torchrun's ``FAILED`` follows the last step;
``interrupted`` when the log stops short of the planned total otherwise; unknown without a plan.
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
)
from trainmon.monitor.importers.terminal import clean_text
from trainmon.monitor.importers.textclock import ISO_STAMP, iso_to_epoch

__all__ = ["looks_like_torchtitan", "parse_torchtitan"]

log = logging.getLogger("trainmon.import")

_PREFIX = re.compile(
    r"^(?:\[(?:rank|default)(?P<rank>\d+)\]:\s*)?(?:\[titan\]\s*)?"
    r"(?:(?P<stamp>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)?)\s+-\s+\S+\s+-\s+[A-Z]+\s+-\s+)?(?P<msg>.*)$"
)
_STEP = re.compile(r"^step:\s*(\d+)\s+(.*\bloss:.*)$")
_VALIDATE = re.compile(r"^validate step:\s*(\d+)\s+(.*)$")
_PAIR = re.compile(r"([A-Za-z_][\w]*(?:\([^)]*\))?):\s*([-+]?(?:[\d,]*\.?\d+(?:[eE][-+]?\d+)?|nan|inf))", re.I)
_STARTS = re.compile(r"Training starts at step (\d+)")
_LOADING = re.compile(r"Loading the checkpoint (?:at step (\d+)|from \S*?step-(\d+))")
_SAVING = re.compile(r"Saving the checkpoint|Saving a full checkpoint|Saving the model")
_JOB = re.compile(r"^Starting job:")
_INIT = {
    "local_batch_size": re.compile(r"local batch size (\d+)"),
    "global_batch_size": re.compile(r"global batch size (\d+)"),
    "gradient_accumulation_steps": re.compile(r"gradient accumulation steps (\d+)"),
    "seq_len": re.compile(r"sequence length (\d+)"),
    "total_steps": re.compile(r"total steps (\d+)"),
    "warmup_steps": re.compile(r"\(warmup (\d+)\)"),
}
_PARAMS = re.compile(r"size:\s*([\d,]+) total parameters")
_DONE = re.compile(r"^Training completed")
_OUT_OF_DATA = re.compile(r"Ran out of data")
_ERROR = re.compile(r"^((?:\w+\.)*\w*(?:Error|Exception)):\s*(\S.*)$")
_FAILED = re.compile(r"^([\w./-]+) FAILED$")
_PLACEHOLDER_LOSS = -1.0  # pipeline parallelism: ranks without the last stage print loss -1.0


def _message(raw: str) -> tuple[int | None, float | None, str]:
    line = clean_text(raw).strip()
    m = _PREFIX.match(line)
    if m is None:  # pragma: no cover - the pattern matches any line
        return None, None, line
    stamp = None
    if m["stamp"] and (sm := ISO_STAMP.match(m["stamp"])) is not None:
        stamp = iso_to_epoch(sm)
    return (int(m["rank"]) if m["rank"] else None), stamp, m["msg"].strip()


def looks_like_torchtitan(head: str) -> bool:
    """A ``step: N  loss: X ... memory: ...`` line (torchtitan's metrics line) in the text."""
    for raw in head.splitlines():
        if "step:" not in raw:
            continue
        _, _, msg = _message(raw)
        m = _STEP.match(msg)
        if m is not None and re.search(r"\b(?:memory|tps|wps|mfu):", m.group(2)):
            return True
    return False


def _pairs(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in _PAIR.findall(text):
        name = re.sub(r"\(.*\)$", "", key).lower()
        try:
            out.setdefault(name, float(value.replace(",", "")))
        except ValueError:
            continue
    return out


@dataclass
class _Record:
    kind: str  # step, validate, starts, job, loading, saving, done, out_of_data, error, failed, init, params
    rank: int | None
    stamp: float | None
    step: int | None = None
    values: dict[str, float] = field(default_factory=dict)
    text: str = ""
    wps: bool = False


def _read(path: Path) -> list[_Record]:
    records: list[_Record] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            if not raw.strip():
                continue
            rank, stamp, msg = _message(raw)
            if (m := _STEP.match(msg)) is not None:
                rec = _Record("step", rank, stamp, int(m.group(1)), _pairs(m.group(2)), wps="wps:" in m.group(2))
            elif (m := _VALIDATE.match(msg)) is not None:
                rec = _Record("validate", rank, stamp, int(m.group(1)), _pairs(m.group(2)))
            elif (m := _STARTS.search(msg)) is not None:
                init = _init(msg)  # older builds: "Training starts at step 1, with local batch size 8, ..."
                if init:
                    records.append(_Record("init", rank, stamp, values=init))
                rec = _Record("starts", rank, stamp, int(m.group(1)), text=msg)
            elif _JOB.match(msg):
                rec = _Record("job", rank, stamp, text=msg)
            elif (m := _LOADING.search(msg)) is not None:
                rec = _Record("loading", rank, stamp, int(m.group(1) or m.group(2)), text=msg)
            elif _SAVING.search(msg):
                rec = _Record("saving", rank, stamp)
            elif _DONE.match(msg):
                rec = _Record("done", rank, stamp)
            elif _OUT_OF_DATA.search(msg):
                rec = _Record("out_of_data", rank, stamp, text=msg)
            elif (m := _ERROR.match(msg)) is not None and "ChildFailedError" not in m.group(1):
                rec = _Record("error", rank, stamp, text=f"{m.group(1)}: {m.group(2)}"[:300])
            elif (m := _FAILED.match(msg)) is not None:
                rec = _Record("failed", rank, stamp, text=m.group(1))
            else:
                init = _init(msg)
                if init:
                    rec = _Record("init", rank, stamp, values=init)
                elif (m := _PARAMS.search(msg)) is not None:
                    rec = _Record("params", rank, stamp, values={"n_params": float(m.group(1).replace(",", ""))})
                else:
                    continue
            records.append(rec)
    return records


def _init(msg: str) -> dict[str, float]:
    """The batch, sequence and schedule sizes of a ``Trainer is initialized with ...`` line (at least three)."""
    init = {k: float(m.group(1)) for k, rx in _INIT.items() if (m := rx.search(msg)) is not None}
    return init if len(init) >= 3 else {}


def _pick_rank(records: list[_Record]) -> tuple[list[_Record], str | None]:
    """The records of one rank (the one with the most real losses) when several ranks' lines are in the file."""
    ranks: dict[int, int] = {}
    for r in records:
        if r.kind == "step" and r.rank is not None:
            real = r.values.get("loss") not in (None, _PLACEHOLDER_LOSS)
            ranks[r.rank] = ranks.get(r.rank, 0) + int(real)
    if len(ranks) <= 1:
        return records, None
    best = max(sorted(ranks), key=lambda k: ranks[k])
    note = f"lines of ranks {sorted(ranks)} are in the file; rank {best} (the one with the loss) is read"
    return [r for r in records if r.rank in (None, best)], note


@dataclass
class _Run:
    items: list[Item] = field(default_factory=list)
    init: dict[str, float] = field(default_factory=dict)
    params: float | None = None
    last_step: int | None = None
    done: bool = False
    error: str | None = None
    failed: str | None = None
    out_of_data: bool = False
    placeholder: int = 0
    wps: bool = False
    resumes: list[int] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    tflops: list[float] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)
    intervals: list[int] = field(default_factory=list)


def parse_torchtitan(path: Path) -> tuple[list[Item], LogMeta]:
    records, rank_note = _pick_rank(_read(path))
    runs: list[_Run] = [_Run()]
    run = runs[0]
    prev_t: float | None = None
    prev_step: int | None = None
    dirty = True  # the interval since the previous step line holds something that is not training
    init: dict[str, float] = {}
    params: float | None = None
    loaded: int | None = None
    for rec in records:
        if rec.kind == "init":
            init = rec.values
            run.init = run.init or init
        elif rec.kind == "params":
            params = rec.values["n_params"]
            run.params = run.params or params
        elif rec.kind == "loading":
            loaded = rec.step
        elif rec.kind == "job":
            dirty = True
        elif rec.kind == "starts":
            dirty = True
            start = rec.step or 1
            if start > 1:
                reason = f"torchtitan printed 'Training starts at step {start}' (the train state of step {start - 1})"
                if loaded is not None:
                    reason += f" after loading the checkpoint at step {loaded}"
                run.items.append(ResumeMark(after_step=start - 1, reason=reason))
                run.resumes.append(start - 1)
            elif run.last_step is not None:
                run = _Run(init=init, params=params)
                runs.append(run)
                prev_step = None
            loaded = None
        elif rec.kind in ("saving", "validate"):
            dirty = True
            if rec.kind == "validate" and "loss" in rec.values and rec.step is not None:
                run.items.append(EvalPoint(rec.step, rec.values["loss"], time=rec.stamp))
        elif rec.kind == "step" and rec.step is not None:
            if prev_step is not None and rec.step <= prev_step and not (run.resumes and run.resumes[-1] < rec.step):
                # the counter went back without a resume line: a new launch from scratch
                run = _Run(init=init, params=params)
                runs.append(run)
                prev_step = None
            _step(run, rec, prev_t, prev_step, dirty, init)
            prev_t, prev_step, dirty = rec.stamp, rec.step, False
        elif rec.kind == "done":
            run.done = True
        elif rec.kind == "out_of_data":
            run.out_of_data = True
        elif rec.kind == "error" and run.last_step is not None:
            run.error = run.error or rec.text
        elif rec.kind == "failed" and run.last_step is not None:
            run.failed = rec.text
    runs = [r for r in runs if r.last_step is not None]
    if not runs:
        raise ImportFormatError(f"{path}: no torchtitan 'step: N  loss: X' lines found")
    return _assemble(runs, rank_note)


def _step(
    run: _Run, rec: _Record, prev_t: float | None, prev_step: int | None, dirty: bool, init: dict[str, float]
) -> None:
    v = rec.values
    loss = v.get("loss")
    if loss == _PLACEHOLDER_LOSS:
        run.placeholder += 1
        loss = None
    step_time = None
    if not dirty and prev_t is not None and rec.stamp is not None and prev_step is not None and rec.step > prev_step:
        dt = (rec.stamp - prev_t) / (rec.step - prev_step)
        step_time = dt if dt >= 0 else None
        run.intervals.append(rec.step - prev_step)
    tokens = None
    if "global_batch_size" in init and "seq_len" in init:
        tokens = int(init["global_batch_size"] * init["seq_len"])
    for key, bucket in (("tps", run.tps), ("wps", run.tps), ("tflops", run.tflops), ("mfu", run.mfu)):
        if key in v and math.isfinite(v[key]):
            bucket.append(v[key])
    if "memory" in v:
        run.memory.append(v["memory"])
    run.wps = run.wps or rec.wps
    run.items.append(
        TrainPoint(
            step=rec.step,  # type: ignore[arg-type]
            loss=loss,
            grad_norm=v.get("grad_norm"),
            lr=[v["lr"]] if "lr" in v else None,
            tokens=tokens,
            step_time=step_time,
            time=rec.stamp,
        )
    )
    run.last_step = rec.step


def _status(run: _Run, last: bool) -> str | None:
    planned = int(run.init["total_steps"]) if "total_steps" in run.init else None
    if run.error or run.failed:
        return "failed"
    if run.done or (planned and run.last_step is not None and run.last_step >= planned):
        return "finished"
    if planned or not last:
        return "interrupted"
    return None


def _run_meta(run: _Run, last: bool) -> tuple[str | None, dict[str, Any], list[str], float | None]:
    config: dict[str, Any] = {k: int(v) for k, v in run.init.items()}
    notes = [
        "each logged step is one step (the log prints step 1 and every log_freq-th step); its loss is the step's own "
        "mean over its micro-batches and the data-parallel ranks",
        "tps, tflops and mfu are means over the steps since the previous line; the step time is the time between "
        "two lines over the steps between them",
        "no learning rate: torchtitan's stdout does not print it",
    ]
    mean_over = None
    interval = statistics.median(run.intervals) if run.intervals else None
    if interval is not None:
        config["log_interval_steps"] = interval
    if run.wps:  # 2024 builds averaged the losses since the previous line
        notes[0] = "each logged loss is the mean over the steps since the previous line (a 2024 build: wps)"
        mean_over = float(interval) if interval else None
    if run.params is not None:
        config["n_params"] = int(run.params)
    for key, values in (("tps_median", run.tps), ("tflops_median", run.tflops), ("mfu_percent_median", run.mfu)):
        if values:
            config[key] = statistics.median(values)
    if run.memory:
        config["memory_max_reserved_gib"] = max(run.memory)
    if "global_batch_size" in run.init and "seq_len" in run.init:
        config["tokens_per_step"] = int(run.init["global_batch_size"] * run.init["seq_len"])
    if run.placeholder:
        notes.append(
            f"{run.placeholder} lines print loss -1.0, pipeline parallelism's placeholder on ranks without the "
            "last stage: read as no loss"
        )
    if run.out_of_data:
        notes.append("torchtitan ran out of data: its last step was canceled and training ended there")
    if run.error or run.failed:
        config["failure"] = {k: v for k, v in (("error", run.error), ("script", run.failed)) if v}
        notes.append(f"the launch failed after its last logged step: {run.error or run.failed}")
    return _status(run, last), config, notes, mean_over


def _assemble(runs: list[_Run], rank_note: str | None) -> tuple[list[Item], LogMeta]:
    extra = [rank_note] if rank_note else []
    if len(runs) == 1:
        (run,) = runs
        status, config, notes, mean_over = _run_meta(run, last=True)
        return run.items, LogMeta(
            format="torchtitan_stdout",
            framework="torchtitan",
            planned_steps=config.get("total_steps"),
            status=status,
            config=config,
            notes=notes + extra,
            step_base=1,
            loss_mean_over=mean_over,
        )
    items: list[Item] = []
    for i, run in enumerate(runs, 1):
        status, config, notes, mean_over = _run_meta(run, last=i == len(runs))
        items.append(
            RunMark(
                label=f"launch{i}",
                reason=f"torchtitan launch {i} of {len(runs)} starts again at step 1 without restoring a train state",
                planned_steps=config.get("total_steps"),
                status=status,
                config=config,
                notes=notes,
                loss_mean_over=mean_over,
            )
        )
        items.extend(run.items)
    meta = LogMeta(
        format="torchtitan_stdout",
        framework="torchtitan",
        notes=[f"{len(runs)} launches that each start at step 1: separate runs, not attempts", *extra],
        step_base=1,
    )
    return items, meta
