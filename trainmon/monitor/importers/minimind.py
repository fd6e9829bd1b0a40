"""MiniMind stdout (``train_pretrain.py``, ``train_full_sft.py``, ``train_lora.py``, ...).

Line shapes (anything else is ignored, including the ``\\r``-joined progress bars of HF
``datasets``, which Python's universal newlines split into lines of their own):

* ``Epoch:[1/2](100/44160), loss: 2.3456, logits_loss: 2.3456, aux_loss: 0.0000, lr: 0.00049999,
  epoch_time: 95.0min`` (current), and the older ``Epoch:[0/1](100/44160) loss:2.345
  lr:0.000550000000 epoch_Time:1022.0min:``.

The step within the epoch becomes a global step, ``(epoch - first) x steps_per_epoch + step``
(the first epoch is 1 in current MiniMind, 0 in older versions, judged from the first line), so
a multi-epoch run does not look like a restart at each epoch; ``epochs x steps_per_epoch`` is the
planned length. ``logits_loss`` and ``aux_loss`` (MoE balance loss) are not step signals and are
summarised in the config. ``epoch_time`` is MiniMind's estimate of the minutes *left* in the
epoch, not a clock, so the time is synthetic (one second per logged entry), as for the other
text logs.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import ImportFormatError, Item, LogMeta, TrainPoint

__all__ = ["looks_like_minimind", "parse_minimind"]

log = logging.getLogger("trainmon.import")

_LINE = re.compile(r"^Epoch:\s*\[(\d+)/(\d+)\]\s*\((\d+)/(\d+)\)[,\s]*(.*)$")
_KV = re.compile(r"(\w+)\s*:\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf))", re.IGNORECASE)


def looks_like_minimind(head: str) -> bool:
    """An ``Epoch:[e/E](s/S) ... loss`` line near the start."""
    return any((m := _LINE.match(ln.strip())) is not None and "loss" in m.group(5) for ln in head.splitlines())


def parse_minimind(path: Path) -> tuple[list[Item], LogMeta]:
    items: list[Item] = []
    base: int | None = None
    planned: int | None = None
    per_epoch: int | None = None
    epochs: int | None = None
    last_step: int | None = None
    aux_max = 0.0
    aux_seen = False
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            m = _LINE.match(raw.strip())
            if m is None:
                continue
            epoch, n_epochs, step, iters = (int(m.group(i)) for i in range(1, 5))
            kv = {k.lower(): float(v) for k, v in _KV.findall(m.group(5))}
            if "loss" not in kv:
                bad += 1
                log.warning("%s: line %d: an Epoch line without a readable loss; skipped", path, n)
                continue
            if base is None:
                base = 0 if epoch == 0 else 1
            gstep = (epoch - base) * iters + step
            per_epoch, epochs = iters, n_epochs
            planned = n_epochs * iters if n_epochs > 0 and iters > 0 else planned
            if "aux_loss" in kv and math.isfinite(kv["aux_loss"]):
                aux_seen = True
                aux_max = max(aux_max, abs(kv["aux_loss"]))
            lr = kv.get("lr")
            items.append(TrainPoint(step=gstep, loss=kv["loss"], lr=[lr] if lr is not None else None))
            last_step = gstep
    if last_step is None:
        raise ImportFormatError(f"{path}: no MiniMind Epoch:[e/E](s/S) lines found")
    status = None
    if planned:
        # the last step is iters (1-based, current) or iters - 1 (0-based, older versions)
        status = "finished" if last_step >= planned - 1 else "interrupted"
    config: dict[str, Any] = {"steps_per_epoch": per_epoch, "epochs": epochs, "first_epoch_index": base}
    if aux_seen:
        config["aux_loss_max"] = aux_max
    notes = ["epoch_time is MiniMind's estimate of the minutes left in the epoch, not a clock: time is synthetic"]
    if bad:
        notes.append(f"{bad} damaged log lines skipped")
    return items, LogMeta(
        step_base=1,  # the step printed is the number of steps done (1 after the first)
        format="minimind_stdout",
        framework="minimind",
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
    )
