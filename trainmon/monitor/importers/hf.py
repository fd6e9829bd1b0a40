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
  ``eval_runtime`` as duration). With several eval sets (``Trainer(eval_dataset={"squad": ...,
  "wiki": ...})``) each set is its own entry at the same step (``eval_squad_loss``,
  ``eval_squad_accuracy``): the entries of one step are one evaluation, the first set seen is the
  run's eval loss and metrics, each other set goes into its metrics as ``SET/loss`` and
  ``SET/METRIC`` (as every importer writes sets), and ``config.eval_sets`` names them. An eval at
  step 0 (``eval_on_start``, before any training) is an eval like the others. An evaluation that
  logs no eval loss (a Seq2SeqTrainer's generation metrics only: ``eval_rouge-l``, ``eval_bleu-4``) is
  not an eval event; a note names its metrics and says they were not judged. The closing
  ``train_runtime`` entry marks a finished run.
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
* A row that logs a policy's reward (TRL's GRPO, PPO, RLOO: ``reward``, ``rewards/<func>/mean``,
  ``objective/rlhf_reward``) is a reinforcement-learning run, judged by its reward: its ``loss`` is the
  policy objective plus beta*KL (GRPO's is about beta*KL, 3e-4 printed to 4 digits, signed in general),
  not a loss curve whose level or ratios mean anything. It is left out of the loss, and the import says
  so (``loss_series`` with no terms); its non-finite values still reach the loss, a NaN is a fault
  whatever the series means (``importers.structure``: rewards and RL terms are not a loss curve).
  The preference trainers' ``rewards/chosen|rejected|margins|accuracies`` are not such a reward: they
  are the implicit reward the DPO loss is computed from, and that loss is a loss curve.
* TRL's preference trainers (DPO, ORPO, CPO, KTO) log ``rewards/accuracies``, ``rewards/margins``,
  ``logps/chosen`` and ``logps/rejected`` beside the loss: the run's own measure of how far the policy
  has moved from its reference. They are kept (step, value; the last ``_PREFERENCE_KEEP`` entries of
  each) as ``config.preference``, the evidence that tells a saturated preference loss (0.0 with
  accuracies 1.0 and exploding margins) from a hidden NaN (``degenerate``).

A truncated file (a checkpoint copied while being written) is salvaged entry by entry up to the
damage, with a warning; anything after ``log_history`` (``max_steps`` ...) is then unknown.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import orjson

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    ResumeMark,
    TrainPoint,
    gc_paused,
    lr_values,
    to_count,
    to_float,
)
from trainmon.monitor.importers.structure import is_reward_name, logging_interval
from trainmon.wire import MAX_INT

__all__ = ["looks_like_hf", "parse_hf"]

log = logging.getLogger("trainmon.import")

_LR_KEYS = ("learning_rate", "lr")
_TOKEN_KEYS = ("num_input_tokens_seen", "num_tokens")
_META_KEYS = ("global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "num_train_epochs", "epoch")
_KNOWN_TRAIN_KEYS = {"loss", "grad_norm", "epoch", "step", *_LR_KEYS, *_TOKEN_KEYS}
_PREFERENCE_KEYS = ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
_IMPLICIT_REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


_EVAL_SET_LOSS = re.compile(r"^eval_(.+)_loss$")
_EVAL_TIMING = ("runtime", "samples_per_second", "steps_per_second")


@dataclasses.dataclass(frozen=True, slots=True)
class _Keys:
    """What the keys of a log_history entry say, whatever their values."""

    eval_set: str | None
    """The first ``eval_<set>_loss`` key: the entry is an evaluation of that set (when it has no ``eval_loss``)."""
    unknown: tuple[str, ...]
    """Keys a training row does not read (``config.ignored_keys``)."""
    rewards: tuple[str, ...]
    """Keys named as a policy's reward, in the entry's order (not the preference trainers' implicit ones)."""
    preference: tuple[str, ...]
    """The preference trainers' keys (``_PREFERENCE_KEYS``) it holds, in their order."""
    tokens: tuple[str, ...]
    """The token counters (``_TOKEN_KEYS``) it holds, in their order."""


@functools.lru_cache(maxsize=1024)
def _keys(names: tuple[str, ...]) -> _Keys:
    """Worked out once per distinct set of keys: a log's entries share a few, and a long log has 300,000."""
    sets = (k for k in names if k.startswith("eval_") and _EVAL_SET_LOSS.match(k))
    return _Keys(
        eval_set=next(sets, None),
        unknown=tuple(k for k in names if k not in _KNOWN_TRAIN_KEYS),
        rewards=tuple(
            k
            for k in names
            if is_reward_name(k) and k not in _IMPLICIT_REWARDS and "zero_std" not in k and not k.endswith("_std")
        ),
        preference=tuple(k for k in _PREFERENCE_KEYS if k in names),
        tokens=tuple(k for k in _TOKEN_KEYS if k in names),
    )


def _eval_set_of(entry: dict[str, Any], key: str) -> tuple[str, float, dict[str, float]] | None:
    """An evaluation of one named set (``Trainer(eval_dataset={"squad": ..., "wiki": ...})`` logs each as its
    own entry: ``eval_squad_loss``, ``eval_squad_accuracy``, ``eval_squad_runtime``): (set, loss, metrics).
    ``key``: the entry's set loss key (:attr:`_Keys.eval_set`)."""
    loss = to_float(entry[key])
    if loss is None:
        return None
    name = _EVAL_SET_LOSS.match(key).group(1)  # type: ignore[union-attr]
    prefix = f"eval_{name}_"
    metrics = {
        k[len(prefix) :]: x
        for k, v in entry.items()
        if k.startswith(prefix) and k != key and k[len(prefix) :] not in _EVAL_TIMING and (x := to_float(v)) is not None
    }
    return name, loss, metrics


def _policy_reward(entry: dict[str, Any]) -> str | None:
    """The key of a policy's reward in a training row (an RL run), None for a supervised or preference row."""
    return next((k for k in _keys(tuple(entry)).rewards if to_float(entry[k]) is not None), None)


_PREFERENCE_KEEP = 256


def looks_like_hf(head: str) -> bool:
    """A JSON object with a ``log_history`` key near its start (HF sorts keys; it comes early)."""
    return head.lstrip().startswith("{") and '"log_history"' in head


_DIGITS = bytes(ord("0") if chr(c) in "0123456789" else ord(chr(c) if chr(c) in ".-" else " ") for c in range(256))
"""Every digit as ``0``, the decimal point and the minus sign kept, anything else a space: a number's digit runs,
and what precedes them."""
_BIG_INTS = (b" " + b"0" * 20, b"-" + b"0" * 19)
"""Where a JSON integer orjson turns into a float must show (2**64 and more: 20 digits, after no digit nor point;
less than -2**63: 19 digits after a minus), as JSON writes no leading zeros. A 19-digit one is below 10**19 < 2**64:
orjson keeps it, HF's ``num_train_epochs`` of ``sys.maxsize`` (2**63 - 1) with ``max_steps`` among them."""


def _fast_loads(data: bytes) -> Any:
    """The file's JSON read by orjson (0.25 s of CPU for a 300,000-entry log where ``json`` took 0.58), or None
    where orjson's reading could differ from ``json``'s or it refuses the text: ``json`` reads it then.

    The speed costs memory while orjson reads: its own copy of the text and its tree of values, besides the
    objects it makes (the parse's peak 234 -> 319 MB for that 49 MB file)."""
    if not _orjson_reads_as_json(data):
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _orjson_reads_as_json(data: bytes) -> bool:
    """Whether orjson would read the text as ``json`` does, where it reads it at all.

    orjson reads every number as ``json`` does (checked on 2 million numbers, exact halfway cases of 1,200 digits
    among them) but for an integer outside [-2**63, 2**64), which it turns into a float: a file with a run of
    digits that could be one goes to ``json``, for 0.07 s of scan (a float's digits after its point cannot be one).
    orjson refuses ``NaN`` and ``Infinity``, which ``json`` reads: they go to ``json`` at once, not after orjson
    has read up to them; so does what orjson refuses and ``json`` reads another way (a lone surrogate escape, a
    number past the largest float, bytes that are not UTF-8) or refuses with its own message. The scan's copy of
    the file is gone before orjson reads it (held, the parse's peak memory was 47 MB higher)."""
    if b"NaN" in data or b"Infinity" in data:
        return False
    digits = data.translate(_DIGITS)
    return not (any(run in digits for run in _BIG_INTS) or digits.startswith(_BIG_INTS[0][1:]))


def _load(path: Path) -> tuple[dict[str, Any], bool]:
    """The state as a dict, and whether it had to be salvaged from a truncated file."""
    state = _fast_loads(path.read_bytes())
    if state is None:
        state, salvaged = _load_text(path)
        if salvaged:
            return state, True
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise ImportFormatError(f"{path}: JSON without a log_history list: not a trainer_state.json")
    return state, False


def _load_text(path: Path) -> tuple[Any, bool]:
    """The file read by ``json`` (it reads ``NaN``), or salvaged from a truncated one: (its JSON, salvaged)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return json.loads(text), False
    except json.JSONDecodeError as exc:
        salvaged = _salvage(text)
        if salvaged is None:
            raise ImportFormatError(f"{path}: not valid JSON and no log_history to salvage ({exc})") from exc
        log.warning("%s: damaged JSON (%s); read %d log entries before the damage", path, exc, len(salvaged))
        head = _header_fields(text)
        return {**head, "log_history": salvaged}, True


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


@gc_paused
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
    reward_key: str | None = None
    primary_set: str | None = None  # the first named eval set (Trainer(eval_dataset={...})): the run's eval loss
    sets_seen: dict[str, None] = {}
    set_group_step: int | None = None
    eval_without_loss = 0
    eval_metrics_without_loss: dict[str, None] = {}
    for n, entry in enumerate(history):
        if not isinstance(entry, dict):
            skipped += 1
            continue
        # to_count's and to_float's common cases inline, here and below: 0.06 s of CPU in a 300,000-entry log
        v = entry.get("step")
        step = v if type(v) is int and 0 <= v <= MAX_INT else to_count(v)
        if step is None:
            skipped += 1
            log.warning("%s: log_history[%d] has no usable step; skipped", path, n)
            continue
        if "train_runtime" in entry:
            finished = True  # the Trainer writes this closing entry when train() returns
            runtime = to_float(entry.get("train_runtime"))
            continue
        keys = _keys(tuple(entry))
        named = _eval_set_of(entry, keys.eval_set) if keys.eval_set is not None and "eval_loss" not in entry else None
        if named is not None:
            name, loss, metrics = named
            primary_set = primary_set or name
            last = items[-1] if items else None
            # another set of the same evaluation: one entry per set, all at one step
            same = isinstance(last, EvalPoint) and last.step == step and set_group_step == step
            group = last if same else None
            runtime_s = to_float(entry.get(f"eval_{name}_runtime"))
            if name == primary_set:
                if group is not None and not math.isnan(group.loss):
                    skipped += 1  # the same set twice at one step: keep the first
                    continue
                if group is None:
                    items.append(EvalPoint(step, loss, metrics, duration=runtime_s))
                    set_group_step = step
                else:
                    group.loss = loss
                    group.metrics.update(metrics)
                    group.duration = (group.duration or 0.0) + (runtime_s or 0.0)
            else:
                extra = {f"{name}/loss": loss, **{f"{name}/{k}": v for k, v in metrics.items()}}
                if group is None:
                    items.append(EvalPoint(step, math.nan, extra, duration=runtime_s))  # its own set comes next
                    set_group_step = step
                else:
                    group.metrics.update(extra)
                    group.duration = (group.duration or 0.0) + (runtime_s or 0.0)
            sets_seen.setdefault(name, None)
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
        v = entry.get("loss")
        loss = v if type(v) is float else to_float(v)
        v = entry.get("learning_rate")
        lr = [v] if type(v) is float else lr_values(entry, _LR_KEYS)
        v = entry.get("grad_norm")
        norm = v if type(v) is float else to_float(v)
        if loss is None and lr is None and norm is None:
            unjudged = [
                k.removeprefix("eval_") for k in entry if k.startswith("eval_") and to_float(entry[k]) is not None
            ]
            if unjudged:  # an evaluation with no eval loss (generation metrics only): said, not judged
                eval_without_loss += 1
                for k in unjudged:
                    if k not in _EVAL_TIMING:
                        eval_metrics_without_loss.setdefault(k, None)
            continue  # another callback's numbers (e.g. only eval metrics without a loss)
        if reward_key is None and keys.rewards:  # asked only of a row that names a reward: most name none
            reward_key = _policy_reward(entry)
        v = entry.get("epoch")
        epoch = v if type(v) is float else to_float(v)
        if (
            epoch is not None
            and prev_epoch is not None
            and epoch < prev_epoch - 1e-9  # the test that fails on almost every row, before the step's
            and prev_train_step is not None
            and step > prev_train_step
        ):
            why = f"epoch went back from {prev_epoch:g} to {epoch:g} after step {prev_train_step}"
            items.append(ResumeMark(prev_train_step, why))
        tokens = None
        for key in keys.tokens:
            seen = to_float(entry[key])
            if seen is None or not 0 < seen <= MAX_INT:  # a count it cannot be (NaN, inf, past 2**53) says nothing
                continue
            if prev_tokens is not None and step > prev_tokens[0] and seen >= prev_tokens[1]:
                tokens = round((seen - prev_tokens[1]) / (step - prev_tokens[0]))
            prev_tokens = (step, seen)
            break
        if keys.unknown:
            ignored.update(keys.unknown)
        for key in keys.preference:
            x = to_float(entry[key])
            if x is not None and math.isfinite(x):
                kept = preference.setdefault(key, [])
                kept.append([step, x])
                del kept[:-_PREFERENCE_KEEP]
        items.append(TrainPoint(step, loss, norm, lr, tokens))
        prev_train_step = step
        if epoch is not None:
            prev_epoch = epoch

    # an evaluation whose run's own set was missing at that step has no eval loss: its other sets go too
    items = [it for it in items if not (isinstance(it, EvalPoint) and math.isnan(it.loss))]
    if reward_key is not None:  # an RL run: its "loss" is not a loss curve (module docstring); NaNs still count
        for k, it in enumerate(items):
            if isinstance(it, TrainPoint) and it.loss is not None and math.isfinite(it.loss):
                items[k] = dataclasses.replace(it, loss=None)
    max_steps = to_count(state.get("max_steps"))
    global_step = to_count(state.get("global_step"))
    logging_steps = to_float(state.get("logging_steps"))
    if logging_steps is None:
        interval = logging_interval([it.step for it in items if isinstance(it, TrainPoint)])
        logging_steps = float(interval) if interval is not None else None
    last = prev_train_step  # the last training row's step
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
    if len(sets_seen) > 1:
        config["eval_sets"] = {name: {"primary": name == primary_set} for name in sets_seen}
    if reward_key is not None:
        config["loss_series"] = {
            "how": f"none: a reinforcement-learning run judged by its reward ({reward_key})",
            "terms": [],
            "not_judged": {"loss": "the policy objective plus beta*KL of an RL run, not a loss curve"},
        }
    if preference:
        config["preference"] = preference
    notes: list[str] = []
    if eval_without_loss:
        names = ", ".join(list(eval_metrics_without_loss)[:8])
        notes.append(
            f"{eval_without_loss} evaluations log no eval loss, only {names}: they are not judged (a generation "
            "metric on a small eval set moves a lot between evals; without the eval loss to move with it, a drop "
            "is not evidence of a regression)"
        )
    if len(sets_seen) > 1:
        notes.append(
            f"{len(sets_seen)} evaluation sets ({', '.join(sets_seen)}), each with its own loss and metrics: the eval "
            f"loss is {primary_set}'s; the others are in each eval's metrics as SET/loss and SET/METRIC"
        )
    if reward_key is not None:
        notes.append(
            f"an RL run (it logs the policy's reward, {reward_key}): its 'loss' is the policy objective plus "
            "beta*KL, not a loss curve; it is not judged (spikes, divergence, initial loss), only its non-finite "
            "values are; judge the run by its reward"
        )
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
