"""TensorBoard event files (``events.out.tfevents.*``): the scalars a trainer logged.

Read without TensorBoard or TensorFlow: the file is TFRecord framing (length, masked CRC32C of
the length, an ``Event`` protobuf, masked CRC32C of the data) and the few protobuf fields we
need (``Event.wall_time``, ``.step``, ``.summary.value[].tag``, ``.simple_value`` or a scalar
``.tensor``) are decoded here by hand, so the daemon side gains no dependency and imports in
milliseconds. TensorBoard is only needed to *write* such files (the test fixtures use
``torch.utils.tensorboard.SummaryWriter``).

Scalar tags are mapped to wire fields by name (``train/loss``, ``loss``, ``train/grad_norm``,
``lr``, ``learning_rate``, ``lr-AdamW``, ``eval/loss``, ``val/loss``; Megatron-LM's ``grad-norm``,
``learning-rate``, ``iteration-time`` (seconds per iteration), ``loss-scale``, ``lm loss validation``
...); the first tag of each kind found wins. Other trainers' tags are recognised by structure
(:mod:`trainmon.monitor.importers.structure`): Megatron's ``lm loss`` (not ``lm loss vs samples``, the
same loss against another x-axis), a detector's ``train/box_loss`` + ``obj_loss`` + ``cls_loss`` (summed:
no total is logged), an RL library's policy/value/entropy losses beside an episode reward (not a loss
curve: left out and said so), ``x/lr0``..``x/lr2`` as one LR per param group. The mapping used is
recorded in ``run_start.config.tag_mapping``. Only scalars are read: image summaries, histograms,
``graph_def`` and run-metadata events are skipped.

Semantics: each scalar is the value the trainer passed for that step (no re-averaging). The step is
whatever the writer passed (HF: ``global_step``, counted from 1; Lightning: 0-based; YOLOv5: the epoch;
Megatron: the iteration, from 1): the base is inferred from the steps (``step_base_from``, see
:func:`~trainmon.monitor.importers.structure.infer_step_base`). The LR is the one logged at that step.
Wall time comes from the events, so the time is real. A folder's files are one run (a restart
writes a new file: an attempt). A damaged record is skipped; a damaged length header ends the
file (the rest cannot be framed), with a warning either way.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import (
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    TrainPoint,
    eval_metric_names,
)
from trainmon.monitor.importers.structure import (
    LossChoice,
    choose_grad_norm,
    choose_loss,
    combine,
    eval_point_values,
    eval_sets,
    eval_sets_facts,
    eval_sets_notes,
    infer_step_base,
    loss_like,
    lr_groups,
    root_sum_squares,
)

__all__ = ["TAGS", "is_event_file", "looks_like_tfrecord", "parse_tensorboard", "read_scalars"]

log = logging.getLogger("trainmon.import")

# Lower-cased tag -> field, most specific first within each field.
TAGS: dict[str, tuple[str, ...]] = {
    "loss": ("train/loss", "train/loss_step", "train_loss_step", "train_loss", "loss/train", "training_loss", "loss"),
    "grad_norm": (
        "train/grad_norm",
        "grad_norm",
        "train/gradient_norm",
        "gradient_norm",
        "grad_norm/total",
        "grad-norm",  # Megatron-LM
        "norm",
    ),
    "lr": (
        "train/learning_rate",
        "train/lr",
        "learning_rate",
        "learning-rate",  # Megatron-LM
        "lr",
        "lr-adamw",
        "lr-adam",
        "lr-sgd",
        "lr/group0",
    ),
    "eval_loss": (
        "eval/loss",
        "val/loss",
        "val_loss",
        "eval_loss",
        "validation/loss",
        "loss/val",
        "valid/loss",
        "lm loss validation",  # Megatron-LM
    ),
    "tokens": ("train/tokens", "tokens"),
    "step_time": ("iteration-time", "train/step_time", "step_time"),  # Megatron-LM: seconds per iteration
    "loss_scale": ("loss-scale", "train/loss_scale", "loss_scale"),
}

# -- CRC32C (Castagnoli), as TFRecord uses it -------------------------------------------------

_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def looks_like_tfrecord(head: bytes) -> bool:
    """The first 12 bytes are a TFRecord length header with a valid CRC."""
    if len(head) < 12:
        return False
    (crc,) = struct.unpack("<I", head[8:12])
    return _masked(head[:8]) == crc


def is_event_file(path: Path) -> bool:
    return "tfevents" in path.name


def _records(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        n = 0
        while True:
            header = f.read(12)
            if not header:
                return
            if len(header) < 12:
                log.warning("%s: truncated record header after %d records; stopping", path, n)
                return
            length, crc = struct.unpack("<QI", header)
            if _masked(header[:8]) != crc:
                log.warning("%s: corrupt record length after %d records; the rest cannot be read", path, n)
                return
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                log.warning("%s: truncated record after %d records; stopping", path, n)
                return
            n += 1
            if _masked(data) != struct.unpack("<I", footer)[0]:
                log.warning("%s: record %d fails its checksum; skipped", path, n)
                continue
            yield data


# -- protobuf wire format, just enough of it ---------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message: ints, 8/4-byte raw, or bytes."""
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 1:
            val = buf[pos : pos + 8]
            pos += 8
        elif wt == 2:
            ln, pos = _varint(buf, pos)
            val = buf[pos : pos + ln]
            pos += ln
        elif wt == 5:
            val = buf[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        if pos > n:
            raise ValueError("message runs past its end")
        yield num, wt, val


_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9


def _tensor_scalar(buf: bytes) -> float | None:
    """A scalar TensorProto (new-style summaries): float/double/int values or raw content."""
    dtype = None
    content = b""
    for num, wt, val in _fields(buf):
        if num == 1 and wt == 0:
            dtype = val
        elif num == 4 and wt == 2:
            content = val
        elif num == 5:  # float_val, packed or not
            return struct.unpack("<f", val[:4])[0] if len(val) >= 4 else None
        elif num == 6:
            return struct.unpack("<d", val[:8])[0] if len(val) >= 8 else None
        elif num in (7, 10) and wt == 0:  # int_val, int64_val
            return float(val)
    if content:
        if dtype == _DT_FLOAT and len(content) == 4:
            return struct.unpack("<f", content)[0]
        if dtype == _DT_DOUBLE and len(content) == 8:
            return struct.unpack("<d", content)[0]
        if dtype == _DT_INT32 and len(content) == 4:
            return float(struct.unpack("<i", content)[0])
        if dtype == _DT_INT64 and len(content) == 8:
            return float(struct.unpack("<q", content)[0])
    return None


def _summary_values(buf: bytes) -> Iterator[tuple[str, float]]:
    for num, wt, val in _fields(buf):
        if num != 1 or wt != 2:
            continue
        tag = None
        value = None
        for vnum, vwt, v in _fields(val):
            if vnum == 1 and vwt == 2:
                tag = v.decode("utf-8", errors="replace")
            elif vnum == 2 and vwt == 5:
                value = struct.unpack("<f", v)[0]
            elif vnum == 8 and vwt == 2:
                value = _tensor_scalar(v)
        if tag is not None and value is not None:
            yield tag, value


def read_scalars(path: Path) -> Iterator[tuple[float, int, str, float]]:
    """(wall_time, step, tag, value) of every scalar in an event file, in file order."""
    for n, data in enumerate(_records(path), 1):
        try:
            wall = 0.0
            step = 0
            summary = None
            for num, wt, val in _fields(data):
                if num == 1 and wt == 1:
                    wall = struct.unpack("<d", val)[0]
                elif num == 2 and wt == 0:
                    step = val if val < 1 << 63 else val - (1 << 64)
                elif num == 5 and wt == 2:
                    summary = val
            if summary is not None:
                for tag, value in _summary_values(summary):
                    yield wall, step, tag, value
        except (ValueError, IndexError, struct.error) as exc:
            log.warning("%s: record %d is not a readable Event (%s); skipped", path, n, exc)


def _choose(tags: set[str]) -> dict[str, str]:
    """Which logged tag feeds each field: the first candidate present, case-insensitively."""
    lower = {t.lower(): t for t in sorted(tags)}
    out = {}
    for fld, cands in TAGS.items():
        for c in cands:
            if c in lower:
                out[fld] = lower[c]
                break
        else:
            if fld == "lr":
                lrs = [t for low, t in lower.items() if low.startswith("lr-") and "/" not in low]
                if lrs:
                    out[fld] = lrs[0]
    return out


@dataclass
class _Series:
    """Which tags make each field of a step (see :mod:`trainmon.monitor.importers.structure`)."""

    loss: LossChoice
    grad_norm: list[str]
    grad_norm_how: str
    lr: list[str]
    single: dict[str, str]
    """Other fields fed by one tag each (tokens, step_time, loss_scale)."""

    def tags(self) -> set[str]:
        return {*self.loss.terms, *self.loss.left_out, *self.grad_norm, *self.lr, *self.single.values()}


def _series(tags: set[str], mapping: dict[str, str], values: dict[str, list[float]]) -> _Series:
    free = sorted(t for t in tags if t not in mapping.values())
    loss = choose_loss(mapping.get("loss"), free, values)
    gn, gn_how = choose_grad_norm(mapping.get("grad_norm"), free)
    lr = [mapping["lr"]] if "lr" in mapping else lr_groups(free)
    single = {k: v for k, v in mapping.items() if k in ("tokens", "step_time", "loss_scale")}
    return _Series(loss, gn, gn_how, lr, single)


def parse_tensorboard(paths: list[Path]) -> tuple[list[Item], LogMeta]:
    """One run from one event file or a folder's event files (a restart writes a new file).

    Within a file the scalars of a step arrive as separate events, in any order, so they are
    grouped by step (the last value of a tag at a step wins, as TensorBoard shows it); files
    are read oldest first and a file whose steps go back starts a new attempt.
    """
    per_file = [(p, list(read_scalars(p))) for p in sorted(paths)]
    tags = {tag for _, rows in per_file for _, _, tag, _ in rows}
    if not tags:
        raise ImportFormatError(f"{paths[0]}: no scalar summaries in this TensorBoard event file")
    mapping = _choose(tags)
    values: dict[str, list[float]] = {}
    for _, rows in per_file:
        for _, _, tag, value in rows:
            if loss_like(tag) or tag == mapping.get("loss"):
                values.setdefault(tag, []).append(value)
    series = _series(tags, mapping, values)
    if not (series.loss.terms or series.loss.left_out or series.grad_norm):
        raise ImportFormatError(
            f"{paths[0]}: no training-loss or grad-norm tag among {sorted(tags)[:20]}; "
            "expected one of " + ", ".join(TAGS["loss"]) + ", or a tag with 'loss' in its name"
        )
    metric_tags = eval_metric_names(tags, mapping.get("eval_loss"))
    sets = eval_sets(sorted(tags))
    if not (len(sets) > 1 or ("eval_loss" not in mapping and sets)):
        sets = []  # one named eval: read by name, with the metrics beside it
    set_tags = {n for st in sets for n in (*st.loss, *st.metrics)}
    wanted = series.tags()
    items: list[Item] = []
    for _, rows in per_file:
        by_step: dict[int, dict[str, float]] = {}
        when: dict[int, float] = {}
        evals: dict[int, EvalPoint] = {}
        metrics: dict[int, dict[str, float]] = {}
        set_values: dict[int, dict[str, float]] = {}
        for wall, step, tag, value in rows:
            if tag in set_tags:
                set_values.setdefault(step, {})[tag] = value
                when_eval = evals.get(step)
                evals[step] = EvalPoint(step, math.nan, time=min(wall, when_eval.time or wall) if when_eval else wall)
            elif sets:
                if tag in wanted:
                    by_step.setdefault(step, {})[tag] = value
                    when[step] = min(when.get(step, wall), wall)
            elif tag in metric_tags:
                metrics.setdefault(step, {})[metric_tags[tag]] = value
            elif tag == mapping.get("eval_loss"):
                evals[step] = EvalPoint(step, value, time=wall)
            elif tag in wanted:
                by_step.setdefault(step, {})[tag] = value  # the last value of a tag at a step wins
                when[step] = min(when.get(step, wall), wall)
        train: dict[int, TrainPoint] = {}
        for step, vals in by_step.items():
            point = TrainPoint(step=step, time=when[step])
            point.loss = combine([vals.get(t) for t in series.loss.terms], [vals.get(t) for t in series.loss.left_out])
            norms = [vals.get(t) for t in series.grad_norm]
            point.grad_norm = norms[0] if len(norms) == 1 else root_sum_squares(norms)
            lrs = [vals.get(t) for t in series.lr]
            point.lr = lrs if lrs and all(x is not None for x in lrs) else None  # type: ignore[assignment]
            for fld, tag in series.single.items():
                if (x := vals.get(tag)) is not None:
                    setattr(point, fld, round(x) if fld == "tokens" else x)
            train[step] = point
        for step, point in list(evals.items()):
            if sets:
                loss, point.metrics = eval_point_values(sets, set_values.get(step, {}).get)
                if loss is None:
                    del evals[step]
                else:
                    point.loss = loss
            else:
                point.metrics = metrics.get(step, {})
        merged: list[tuple[int, int, Item]] = [(s, 0, p) for s, p in train.items()]
        merged += [(s, 1, e) for s, e in evals.items()]
        merged.sort(key=lambda x: (x[0], x[1]))
        items.extend(it for _, _, it in merged)
    used = dict(mapping)
    if series.loss.terms:
        used["loss"] = series.loss.label
    else:
        used.pop("loss", None)
    if series.grad_norm:
        used["grad_norm"] = (
            series.grad_norm[0] if len(series.grad_norm) == 1 else "rss(" + ", ".join(series.grad_norm) + ")"
        )
    if series.lr:
        used["lr"] = series.lr[0] if len(series.lr) == 1 else ", ".join(series.lr)
    config: dict[str, Any] = {"tag_mapping": used, "event_files": [p.name for p in sorted(paths)]}
    notes = series.loss.notes()
    if series.loss.how not in ("named", ""):
        config["loss_series"] = series.loss.facts()
    if len(series.grad_norm) > 1:
        config["grad_norm_series"] = {"how": series.grad_norm_how, "terms": series.grad_norm}
        notes.append(f"the grad norm is the {series.grad_norm_how} ({', '.join(series.grad_norm)})")
    if len(series.lr) > 1:
        notes.append(f"{len(series.lr)} learning rates, one per param group ({', '.join(series.lr)})")
    if sets:
        used["eval_loss"] = " + ".join(sets[0].loss)
        config["eval_sets"] = eval_sets_facts(sets)
        notes += eval_sets_notes(sets)
    steps = sorted({it.step for it in items if isinstance(it, TrainPoint)})
    base, why = infer_step_base(steps)
    config["step_base_from"] = why
    meta = LogMeta(format="tensorboard", framework="tensorboard", config=config, notes=notes, step_base=base)
    return items, meta
