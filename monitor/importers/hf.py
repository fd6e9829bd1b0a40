"""Hugging Face ``trainer_state.json``: the ``log_history`` a ``Trainer`` saves with each checkpoint.

What the file holds and how it maps (transformers ``Trainer``, TRL, ms-swift, LLaMA-Factory
all write the same shape):

* Training entries (``loss`` with ``learning_rate``, or ``lr`` in some custom trainers, and
  ``grad_norm`` since transformers 4.38) become one ``step`` each. ``step`` is the
  ``global_step`` as logged (optimizer steps done, 1-based), kept as is so the post-mortem
  names the steps the user sees in their own logs; ``step_base`` 1 says so, and the file's
  ``global_step`` is the trainer's own count of steps done (``steps_done``: logged step 5000 of
  ``max_steps`` 5000 is 5000 steps, not 5001). With ``logging_steps`` > 1 the loss is the
  mean over the logging window, not one step's loss: said in the notes.
* Entries with ``eval_loss`` become ``eval`` events (other ``eval_*`` numbers as metrics,
  ``eval_runtime`` as duration). The closing ``train_runtime`` entry marks a finished run.
* ``max_steps`` is the planned length. The file has no clock, no schedule declaration, no
  phase times: the LR schedule is left for the detector to infer, the time is synthetic.
* The Trainer writes the file with every checkpoint (``checkpoint-N/trainer_state.json``) and,
  through ``save_state()``, after ``train()`` returns. Without the closing ``train_runtime`` entry
  and short of ``max_steps`` the file is a checkpoint snapshot: the log ends at step N because the
  file was saved then (``ends_at_checkpoint``). Whether training went on, stopped or failed after
  it is not in the file, so the status is left unknown: not ``interrupted``, not a failure.
* A resumed streaming run shows its resume only as ``epoch`` going back to 0 while the step
  goes on; the step going back shows a restart. Either starts a new attempt.
* ``num_input_tokens_seen`` (Trainer) or ``num_tokens`` (TRL) are cumulative: tokens per step
  are their difference over the steps between two entries.
* TRL's preference trainers (DPO, ORPO, CPO, KTO) log ``rewards/accuracies``, ``rewards/margins``,
  ``logps/chosen`` and ``logps/rejected`` beside the loss: the run's own measure of how far the policy
  has moved from its reference. They are kept (step, value; the last ``_PREFERENCE_KEEP`` entries of
  each) as ``config.preference``, the evidence that tells a saturated preference loss (0.0 with
  accuracies 1.0 and exploding margins) from a hidden NaN (``degenerate``).

A truncated file (a checkpoint copied while being written) is salvaged entry by entry up to the
damage, with a warning; anything after ``log_history`` (``max_steps`` ...) is then unknown.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
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

__all__ = ["looks_like_hf", "parse_hf"]

log = logging.getLogger("trainmon.import")

_LR_KEYS = ("learning_rate", "lr")
_TOKEN_KEYS = ("num_input_tokens_seen", "num_tokens")
_META_KEYS = ("global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "num_train_epochs", "epoch")
_KNOWN_TRAIN_KEYS = {"loss", "grad_norm", "epoch", "step", *_LR_KEYS, *_TOKEN_KEYS}
_PREFERENCE_KEYS = ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
_PREFERENCE_KEEP = 256


def looks_like_hf(head: str) -> bool:
    """A JSON object with a ``log_history`` key near its start (HF sorts keys; it comes early)."""
    return head.lstrip().startswith("{") and '"log_history"' in head


def _load(path: Path) -> tuple[dict[str, Any], bool]:
    """The state as a dict, and whether it had to be salvaged from a truncated file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        salvaged = _salvage(text)
        if salvaged is None:
            raise ImportFormatError(f"{path}: not valid JSON and no log_history to salvage ({exc})") from exc
        log.warning("%s: damaged JSON (%s); read %d log entries before the damage", path, exc, len(salvaged))
        head = _header_fields(text)
        return {**head, "log_history": salvaged}, True
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise ImportFormatError(f"{path}: JSON without a log_history list: not a trainer_state.json")
    return state, False


def _salvage(text: str) -> list[dict[str, Any]] | None:
    """Entries of ``log_history`` decodable one by one, up to the first damaged one."""
    key = text.find('"log_history"')
    if key < 0:
        return None
    start = text.find("[", key)
    if start < 0:
        return None
    dec = json.JSONDecoder()
    pos = start + 1
    out: list[dict[str, Any]] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _header_fields(text: str) -> dict[str, Any]:
    """Top-level scalars written before ``log_history`` (HF sorts keys), from a damaged file."""
    out: dict[str, Any] = {}
    head = text[: max(0, text.find('"log_history"'))]
    for key in _META_KEYS:
        i = head.find(f'"{key}"')
        if i < 0:
            continue
        j = head.find(":", i) + 1
        while j < len(head) and head[j] in " \t\r\n":
            j += 1
        try:
            out[key], _ = json.JSONDecoder().raw_decode(head, j)
        except (json.JSONDecodeError, ValueError):
            continue
    return out


def _trainer_best(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint the Trainer itself kept as best (``best_metric``, ``best_global_step``,
    ``best_model_checkpoint``; ``metric_for_best_model`` / ``greater_is_better`` when the file has them),
    for ``eval_regression`` to check against the evals and to name in its advice."""
    out: dict[str, Any] = {}
    metric = to_float(state.get("best_metric"))
    if metric is not None and math.isfinite(metric):
        out["best_metric"] = metric
    step = to_count(state.get("best_global_step"))
    if step is not None:
        out["best_global_step"] = step
    for key in ("best_model_checkpoint", "metric_for_best_model"):
        v = state.get(key)
        if isinstance(v, str) and v:
            out[key] = v[-200:]  # the end of a path names the checkpoint
    if isinstance(state.get("greater_is_better"), bool):
        out["greater_is_better"] = state["greater_is_better"]
    return out


def parse_hf(path: Path) -> tuple[list[Item], LogMeta]:
    state, salvaged = _load(path)
    history = state["log_history"]
    items: list[Item] = []
    ignored: set[str] = set()
    prev_epoch: float | None = None
    prev_train_step: int | None = None
    prev_tokens: tuple[int, float] | None = None
    finished = False
    runtime: float | None = None
    skipped = 0
    preference: dict[str, list[list[float]]] = {}
    for n, entry in enumerate(history):
        if not isinstance(entry, dict):
            skipped += 1
            continue
        step = to_count(entry.get("step"))
        if step is None:
            skipped += 1
            log.warning("%s: log_history[%d] has no usable step; skipped", path, n)
            continue
        if "train_runtime" in entry:
            finished = True  # the Trainer writes this closing entry when train() returns
            runtime = to_float(entry.get("train_runtime"))
            continue
        if "eval_loss" in entry:
            loss = to_float(entry.get("eval_loss"))
            if loss is None:
                skipped += 1
                continue
            metrics = {}
            for k, v in entry.items():
                x = to_float(v)
                if k.startswith("eval_") and k not in ("eval_loss", "eval_runtime") and x is not None:
                    metrics[k.removeprefix("eval_")] = x
            items.append(EvalPoint(step, loss, metrics, duration=to_float(entry.get("eval_runtime"))))
            continue
        loss = to_float(entry.get("loss"))
        lr = lr_values(entry, _LR_KEYS)
        norm = to_float(entry.get("grad_norm"))
        if loss is None and lr is None and norm is None:
            continue  # another callback's numbers (e.g. only eval metrics without a loss)
        epoch = to_float(entry.get("epoch"))
        if (
            epoch is not None
            and prev_epoch is not None
            and prev_train_step is not None
            and step > prev_train_step
            and epoch < prev_epoch - 1e-9
        ):
            why = f"epoch went back from {prev_epoch:g} to {epoch:g} after step {prev_train_step}"
            items.append(ResumeMark(prev_train_step, why))
        tokens = None
        for key in _TOKEN_KEYS:
            seen = to_float(entry.get(key))
            if seen is None or seen <= 0:
                continue
            if prev_tokens is not None and step > prev_tokens[0] and seen >= prev_tokens[1]:
                tokens = round((seen - prev_tokens[1]) / (step - prev_tokens[0]))
            prev_tokens = (step, seen)
            break
        ignored.update(k for k in entry if k not in _KNOWN_TRAIN_KEYS)
        for key in _PREFERENCE_KEYS:
            x = to_float(entry.get(key))
            if x is not None and math.isfinite(x):
                kept = preference.setdefault(key, [])
                kept.append([step, x])
                del kept[:-_PREFERENCE_KEEP]
        items.append(TrainPoint(step=step, loss=loss, grad_norm=norm, lr=lr, tokens=tokens))
        prev_train_step = step
        if epoch is not None:
            prev_epoch = epoch

    max_steps = to_count(state.get("max_steps"))
    global_step = to_count(state.get("global_step"))
    logging_steps = to_float(state.get("logging_steps"))
    train_steps = [it.step for it in items if isinstance(it, TrainPoint)]
    if logging_steps is None and len(train_steps) >= 2:
        gaps = sorted(b - a for a, b in itertools.pairwise(train_steps) if b > a)
        logging_steps = float(gaps[len(gaps) // 2]) if gaps else None
    last = train_steps[-1] if train_steps else None
    ends_at_checkpoint: int | None = None
    if finished or (max_steps and global_step is not None and global_step >= max_steps):
        status: str | None = "finished"
    else:
        status = None  # a snapshot (or a damaged file) does not say how the run ended
        if last is not None and not salvaged:
            ends_at_checkpoint = global_step if global_step is not None and global_step >= last else last
    config: dict[str, Any] = {k: state[k] for k in _META_KEYS if k in state and state[k] is not None}
    if ignored:
        config["ignored_keys"] = sorted(ignored)
    if runtime is not None:
        config["train_runtime_seconds"] = runtime
    config.update(_trainer_best(state))
    if preference:
        config["preference"] = preference
    notes: list[str] = []
    if logging_steps and logging_steps > 1:
        notes.append(
            f"each logged loss is the mean over {logging_steps:g} optimizer steps (logging_steps), not one step's loss"
        )
    if ends_at_checkpoint is not None:
        short = f" of max_steps {max_steps}" if max_steps else ""
        notes.append(
            f"the log ends at step {ends_at_checkpoint}{short}: this trainer_state.json is the snapshot saved with "
            "that checkpoint, not the end of the run; whether training went on, stopped or failed after it is unknown"
        )
    if salvaged:
        notes.append("the file is truncated or damaged: entries after the damage and max_steps may be missing")
    if skipped:
        notes.append(f"{skipped} log_history entries could not be read and were skipped")
    meta = LogMeta(
        format="hf_trainer_state",
        framework="hf",
        planned_steps=max_steps,
        status=status,
        config=config,
        notes=notes,
        step_base=1,
        steps_done=global_step if global_step is not None and (last is None or global_step >= last) else None,
        ends_at_checkpoint=ends_at_checkpoint,
    )
    return items, meta
