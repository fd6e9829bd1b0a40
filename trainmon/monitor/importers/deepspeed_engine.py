"""What a DeepSpeed engine and its launcher print, whatever the training script: the pieces
:mod:`.deepspeed` reads every DeepSpeed stdout with.

* ``[Rank 0] step=N, skipped=K, lr=[...]`` (``log_dist``, every ``steps_per_print`` updates): the
  engine's ``global_steps`` after the update (skipped ones included), its skip counter, and the LR
  of each param group as the scheduler holds it after N updates. The scheduler is not stepped on an
  overflow-skipped update, so that LR is the schedule's value at ``N - K``.
* The fp16 loss scaler's messages (:class:`Scale`): ZeRO's ``[deepspeed] OVERFLOW! Rank 0 Skipping
  step. Attempted loss scale: A, reducing to B`` (or ``but hysteresis is h``: skipped, the scale
  kept) on rank 0 only, its doublings after each clean window silent; FP16_Optimizer's
  ``Reducing/Increasing dynamic loss scale from A to B`` on every rank (one copy per rank: a message
  repeating the change just applied is a copy) and rank 0's ``Overflow detected. Skipping step.
  Attempted loss scale: A, reducing to B`` summary of the same change.
* The config dump (``gradient_accumulation_steps ....``, ``fp16_enabled ....``), the launcher's
  ``cmd = ...`` line, ``dist_world_size=N`` and its ``Process N exits successfully`` / ``exits with
  return code`` lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainmon.monitor.importers.common import to_float

__all__ = [
    "EXIT_BAD",
    "EXIT_OK",
    "FUSED_CHANGE",
    "FUSED_SKIP",
    "GA_CLI",
    "GA_DUMP",
    "NUM",
    "PRECISION_DUMP",
    "STAMP",
    "STEP_LINE",
    "WORLD",
    "ZERO_SCALE",
    "Engine",
    "Scale",
    "read_lrs",
]

NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf)"
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]")
STEP_LINE = re.compile(r"\[Rank\s+\d+\]\s+step=(\d+),\s*skipped=(\d+),\s*lr=\[([^\]]*)\]")
ZERO_SCALE = re.compile(
    r"OVERFLOW! Rank \d+ Skipping step\. Attempted loss scale: (" + NUM + r")"
    r"(?:, reducing to (" + NUM + r")|, but hysteresis is \d+)"
)
FUSED_CHANGE = re.compile(r"(Reducing|Increasing) dynamic loss scale from (" + NUM + r") to (" + NUM + r")")
FUSED_SKIP = re.compile(
    r"Overflow detected\. Skipping step\. Attempted loss scale: (" + NUM + r"), reducing to (" + NUM + r")"
)
_WRAPPER = re.compile(r"[A-Za-z_][\w.]*\(")
GA_DUMP = re.compile(r"\bgradient_accumulation_steps \.+\s*(\d+)")
GA_CLI = re.compile(r"--gradient_accumulation_steps[ =](\d+)")
PRECISION_DUMP = re.compile(r"\b(fp16|bfloat16)_enabled \.+\s*(True|False)")
EXIT_OK = re.compile(r"launch\.py:\d+:main\] Process \d+ exits successfully")
EXIT_BAD = re.compile(r"launch\.py:\d+:\w+\] .*(?:exits with return code|Killing subprocess)")
WORLD = re.compile(r"\bdist_world_size=(\d+)")


def read_lrs(text: str) -> list[float]:
    """The learning rates of a ``lr=[...]`` list: plain floats, or wrapped (``np.float64(1e-05)``,
    ``tensor(1e-05, device='cuda:0')``: the wrapper and any keyword after the value dropped)."""
    out = []
    for item in text.split(","):
        x = to_float(_WRAPPER.sub("", item).replace(")", "").strip())
        if x is not None:
            out.append(x)
    return out


@dataclass
class Engine:
    """One DeepSpeed engine's ``step=N, skipped=K, lr=[...]`` lines."""

    skipped: int = 0
    lr_first: list[float] | None = None
    lr_peak: float = 0.0
    lines: int = 0


@dataclass
class Scale:
    """The fp16 loss scale as the scaler's messages state it; copies from other ranks are dropped."""

    value: float | None = None
    fresh: bool = False  # a message stated it since the last step point
    messages: int = 0
    copies: int = 0
    changes: int = 0
    lowest: float | None = None
    lowest_at: int | None = None
    prints_increases: bool = False
    rank_lines: int = 0  # FP16_Optimizer's change messages, printed by every rank

    def change(self, old: float, new: float, at: int | None, *, per_rank: bool) -> None:
        """A change from ``old`` to ``new``; ``per_rank``: a message every rank prints, so one that
        repeats the change just applied is another rank's copy (a rank-0 line never is)."""
        self.messages += 1
        if per_rank and self.value is not None and self.value == new and old != new:
            self.copies += 1  # another rank's copy of a change already applied
            return
        self.value = new
        self.fresh = True
        self.changes += 1
        if self.lowest is None or new < self.lowest:
            self.lowest, self.lowest_at = new, at

    def state(self, value: float) -> None:
        """The scale a message states without changing it (ZeRO's hysteresis: skipped, the scale kept)."""
        self.messages += 1
        self.value = value
        self.fresh = True

    def take(self) -> float | None:
        """The scale to put on the step point being made: the current one when the scaler prints its
        increases too (so it is never stale), else only when a message stated it since the last point
        (ZeRO doubles silently after each clean window)."""
        out = self.value if (self.fresh or self.prints_increases) else None
        self.fresh = False
        return out
