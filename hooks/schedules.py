"""Learning-rate schedules, defined once for the trainer and for the monitor.

The trainer builds its ``LambdaLR`` from :func:`lr_factor`, and declares the same schedule in
``run_start`` as a plain dict (``Schedule.to_dict()``); the collector rebuilds it with
``Schedule.from_dict`` and computes the LR every step *should* have had. Keeping one
definition is what makes "actual LR vs expected" a meaningful comparison. Standard library
only: the collector never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

__all__ = ["SCHEDULE_NAMES", "Schedule"]

SCHEDULE_NAMES = ("cosine", "wsd", "linear", "constant", "inverse_sqrt")


@dataclass(frozen=True, slots=True)
class Schedule:
    """An LR schedule as a function of the optimizer step (0-based, before the step is taken).

    ``lr(step)`` is the LR used by optimizer step ``step``: the scheduler is stepped after
    each optimizer step, so step 0 runs at ``lr(0)``.

    Attributes:
        name: one of ``cosine`` (linear warmup then cosine to ``min_ratio``), ``wsd``
            (warmup, stable at peak, then linear decay over the last ``decay_fraction`` of
            the steps), ``linear`` (warmup then linear decay), ``constant`` (warmup then
            flat), ``inverse_sqrt`` (warmup then peak·sqrt(warmup/step)).
        peak_lr: the LR at the end of warmup.
        total_steps: the planned number of optimizer steps.
        warmup_steps: steps of linear warmup from ``peak_lr / warmup_steps``.
        min_ratio: the floor as a fraction of ``peak_lr`` (cosine, wsd, linear).
        decay_fraction: share of the steps spent decaying (wsd only).
    """

    name: str
    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.name not in SCHEDULE_NAMES:
            raise ValueError(f"schedule.name: unknown schedule {self.name!r}, expected one of {SCHEDULE_NAMES}")
        if not (self.peak_lr > 0 and math.isfinite(self.peak_lr)):
            raise ValueError(f"schedule.peak_lr: must be a positive number, got {self.peak_lr}")
        if self.total_steps < 1:
            raise ValueError(f"schedule.total_steps: must be at least 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"schedule.warmup_steps: must be within [0, total_steps], got {self.warmup_steps}")
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(f"schedule.min_ratio: must be within [0, 1], got {self.min_ratio}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"schedule.decay_fraction: must be within (0, 1], got {self.decay_fraction}")

    def factor(self, step: int) -> float:
        """LR of ``step`` as a fraction of ``peak_lr`` (what ``LambdaLR`` wants)."""
        w, n, lo = self.warmup_steps, self.total_steps, self.min_ratio
        if step < w:
            return (step + 1) / w
        if self.name == "constant":
            return 1.0
        if self.name == "inverse_sqrt":
            return math.sqrt(max(w, 1) / (step + 1))
        if self.name == "wsd":
            decay_start = n - max(1, round(self.decay_fraction * n))
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / max(1, n - decay_start))
            return 1.0 - (1.0 - lo) * progress
        progress = min(1.0, (step - w) / max(1, n - w))
        if self.name == "linear":
            return 1.0 - (1.0 - lo) * progress
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Schedule:
        """Rebuild a declared schedule; unknown keys are named in the error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"schedule.{unknown[0]}: unknown field, expected one of {sorted(known)}")
        return cls(**raw)
