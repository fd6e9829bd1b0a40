"""nanochat stdout (``base_train.py``, ``mid_train.py``, ``chat_sft.py`` and their forks).

What is read:

* Step lines, ``step 00042[/21400] (0.20%) | loss: 5.47 | lrm: 1.00 | dt: 1142.98ms |
  tok/sec: 22,429 | mfu: 0.00 | epoch: 1 | total time: 0.00m`` (fields in any order, unknown
  ones ignored). ``/21400`` is the planned length when printed. The loss is nanochat's
  *debiased EMA* of the training loss (beta 0.9), not the step's own loss: said in the notes
  (one NaN step makes every later value NaN, and spikes are smoothed). ``loss: nan`` comes
  through as NaN. ``dt`` is the step time and, summed from the last logging timestamp before
  the first step, the real clock. ``lrm`` is only the LR *multiplier* of nanochat's schedule,
  not a learning rate, so no LR is imported (it is kept as ``lrm_first``/``lrm_last``). Tokens
  per step are the header's ``Total batch size N`` when printed, else ``tok/sec x dt``.
  ``grad_norm`` is read when a fork prints it.
* Evaluation lines, ``Step 00250 | Validation bpb: 0.8123`` (the validation bits per byte, kept
  as the eval loss and as ``val_bpb``) or ``Step N | Validation loss: X``; other ``Step N | name:
  value`` lines (``CORE metric``, ...) join that step's evaluation as metrics.

Status: ``finished`` when the end-of-run lines (``Peak memory usage``, ``Total training time``)
follow the last step or it reaches the planned length; ``interrupted`` when the log stops with
its progress under 100% and no end-of-run lines (a killed run); unknown otherwise.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from trainmon.monitor.importers.common import ANSI_ESCAPE, EvalPoint, ImportFormatError, Item, LogMeta, TrainPoint
from trainmon.monitor.importers.textclock import ISO_STAMP, Segment, iso_to_epoch, lay_out

__all__ = ["looks_like_nanochat", "parse_nanochat"]

log = logging.getLogger("trainmon.import")

_STEP = re.compile(r"^step\s+(\d+)(?:\s*/\s*(\d+))?\s+\(\s*([-+\d.]+|nan)\s*%\)\s*\|(.*)$")
_EVAL = re.compile(r"^Step\s+(\d+)\s*\|\s*([^:|]+?)\s*:\s*(\S+)\s*$")
_PART = re.compile(r"^\s*([\w/ ]+?)\s*:\s*(\S+)")
_BATCH = re.compile(r"^Total batch size\s+([\d,]+)")
_END = re.compile(r"^(Peak memory usage|Total training time|Minimum validation)")
_NUM = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+)$|^[-+]?(?:nan|inf)$", re.IGNORECASE)


def looks_like_nanochat(head: str) -> bool:
    """A ``step N (p%) | loss: ...`` line near the start."""
    for raw in head.splitlines():
        m = _STEP.match(ANSI_ESCAPE.sub("", raw).strip())
        if m is not None and "loss" in m.group(4):
            return True
    return False


def _num(text: str) -> float | None:
    text = text.replace(",", "").strip()
    unit = re.match(r"^(.*?)(ms|s|m)$", text)
    if unit is not None and _NUM.match(unit.group(1)):
        text = unit.group(1)
    return float(text) if _NUM.match(text) else None


def parse_nanochat(path: Path) -> tuple[list[Item], LogMeta]:
    items: list[Item] = []
    seg = Segment(anchor=None)
    pending: dict[int, dict[str, float]] = {}  # metrics of a step whose validation line is still to come
    evals: dict[int, EvalPoint] = {}
    stamp: float | None = None
    batch: int | None = None
    planned: int | None = None
    rel = 0.0
    prev: int | None = None
    last_pct: float | None = None
    ended = False
    bad = 0
    lrm: list[float] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            line = ANSI_ESCAPE.sub("", raw).strip()
            if not line:
                continue
            m = _STEP.match(line)
            if m is not None:
                step = int(m.group(1))
                parts: dict[str, str] = {}
                for part in m.group(4).split("|"):
                    pm = _PART.match(part)
                    if pm is not None:
                        parts.setdefault(pm.group(1).strip().lower(), pm.group(2))
                loss = _num(parts["loss"]) if "loss" in parts else None
                if loss is None:
                    bad += 1
                    log.warning("%s: line %d: a step line without a readable loss; skipped", path, n)
                    continue
                if seg.anchor is None and prev is None:
                    seg.anchor = stamp
                dt_ms = _num(parts["dt"]) if "dt" in parts else None
                dt = dt_ms / 1000.0 if dt_ms is not None and parts["dt"].strip().endswith("ms") else dt_ms
                steps = step - prev if prev is not None and step > prev else 1
                t: float | None = None
                if dt is not None and math.isfinite(dt) and dt >= 0:
                    rel += dt * steps
                    t = rel
                tok_s = _num(parts["tok/sec"]) if "tok/sec" in parts else None
                tokens = batch
                if tokens is None and tok_s is not None and dt is not None and math.isfinite(tok_s * dt):
                    tokens = round(tok_s * dt)
                if "lrm" in parts and (x := _num(parts["lrm"])) is not None:
                    lrm.append(x)
                point = TrainPoint(
                    step=step,
                    loss=loss,
                    grad_norm=_num(parts["grad_norm"]) if "grad_norm" in parts else None,
                    tokens=tokens,
                    step_time=dt,
                    time=t,
                )
                items.append(point)
                seg.points.append(point)
                prev = step
                planned = int(m.group(2)) if m.group(2) else planned
                pct = _num(m.group(3))
                last_pct = pct if pct is not None else last_pct
                ended = False
                continue
            m = _EVAL.match(line)
            if m is not None:
                _eval(int(m.group(1)), m.group(2), m.group(3), items, seg, evals, pending, rel)
                continue
            m = _BATCH.match(line)
            if m is not None:
                batch = int(m.group(1).replace(",", ""))
                continue
            if prev is not None and _END.match(line):
                ended = True
            if prev is None:
                sm = ISO_STAMP.match(line)
                if sm is not None and (t0 := iso_to_epoch(sm)) is not None:
                    stamp = t0
    if prev is None:
        raise ImportFormatError(f"{path}: no nanochat step lines found")
    time_source = lay_out([seg], path, "dt (ms per step) summed over the logged steps")
    status = None
    if ended or (planned and prev >= planned - 1):
        status = "finished"
    elif last_pct is not None and last_pct < 100.0:
        status = "interrupted"
    notes = [
        "loss is nanochat's debiased EMA of the training loss (beta 0.9), not each step's own loss",
        "no learning rate: nanochat prints only the LR multiplier lrm",
    ]
    if bad:
        notes.append(f"{bad} damaged log lines skipped")
    config: dict[str, object] = {"time_source": time_source}
    if lrm:
        config["lrm_first"], config["lrm_last"] = lrm[0], lrm[-1]
    if batch is not None:
        config["total_batch_size_tokens"] = batch
    if last_pct is not None:
        config["last_progress_percent"] = last_pct
    meta = LogMeta(
        step_base=1,  # the step printed is the number of steps done (1 after the first)
        format="nanochat_stdout",
        framework="nanochat",
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
    )
    return items, meta


def _eval(
    step: int,
    name: str,
    value: str,
    items: list[Item],
    seg: Segment,
    evals: dict[int, EvalPoint],
    pending: dict[int, dict[str, float]],
    rel: float,
) -> None:
    x = _num(value)
    if x is None:
        return
    key = re.sub(r"\W+", "_", name.strip().lower()).strip("_")
    if key in ("validation_bpb", "val_bpb", "validation_loss", "val_loss"):
        metric = "val_bpb" if key.endswith("bpb") else "val_loss"
        ev = EvalPoint(step, x, {metric: x, **pending.pop(step, {})}, time=rel)
        evals[step] = ev
        items.append(ev)
        seg.points.append(ev)
        return
    ev = evals.get(step)
    if ev is not None:
        ev.metrics[key] = x
    else:
        pending.setdefault(step, {})[key] = x
