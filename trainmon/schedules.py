"""Learning-rate schedules, defined once for the trainer and for the monitor.

A run declares its schedule in ``run_start`` as a plain dict (``Schedule.to_dict()``, the wire
form); the collector rebuilds it with ``Schedule.from_dict`` and computes the LR every step
*should* have had. Keeping one definition is what makes "actual LR vs expected" a meaningful
comparison. A loop that builds its scheduler from a ``Schedule`` uses
``LambdaLR(optimizer, schedule.factor)``; a loop that keeps its torch or Hugging Face scheduler
declares nothing by hand: :meth:`Schedule.from_scheduler` reads the schedule off the scheduler
(``TrainMonitor.start`` does so for the scheduler given to ``watch``). The named shapes follow
those libraries to the last bit that matters (warmup ``step / warmup_steps`` from 0 as in
``transformers.get_*_schedule_with_warmup``, cosine to ``min_ratio`` as in
``CosineAnnealingLR``'s ``eta_min``), so a declared ``Schedule("cosine", ...)`` and the
``get_cosine_schedule_with_warmup`` it stands for give the same LR at every step.

Standard library only: the collector never imports torch, so schedulers are recognised by their
class and the (documented or plain) attributes they keep, not by ``isinstance``.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["SCHEDULE_NAMES", "WARMUP_SHAPES", "Schedule", "declared_schedule"]

SCHEDULE_NAMES = ("cosine", "wsd", "linear", "constant", "inverse_sqrt")
WARMUP_SHAPES = ("linear", "cosine")
_TORCH = "torch.optim.lr_scheduler"
_HF = "transformers.optimization"


@dataclass(frozen=True, slots=True)
class Schedule:
    """An LR schedule as a function of the optimizer step (0-based, before the step is taken).

    ``lr(step)`` is the LR used by optimizer step ``step``: the scheduler is stepped after
    each optimizer step, so step 0 runs at ``lr(0)``.

    Attributes:
        name: one of ``cosine`` (warmup then cosine to ``min_ratio``), ``wsd`` (warmup, stable
            at peak, then linear decay over the last ``decay_fraction`` of the steps),
            ``linear`` (warmup then linear decay), ``constant`` (warmup then flat),
            ``inverse_sqrt`` (warmup then ``1 / sqrt(step / warmup_steps)``, as
            ``transformers.get_inverse_sqrt_schedule``).
        peak_lr: the LR at the end of warmup.
        total_steps: the step at which the decay reaches ``min_ratio`` (and stays).
        warmup_steps: steps of warmup; step ``s`` of it runs at
            ``warmup_start + (1 - warmup_start) * s / warmup_steps`` of the peak (from 0, as the
            ``transformers`` schedules do).
        min_ratio: the floor as a fraction of ``peak_lr`` (cosine, wsd, linear); 0 as in
            ``transformers`` and ``CosineAnnealingLR``'s default ``eta_min``.
        decay_fraction: share of the steps spent decaying (wsd only).
        warmup_start: the warmup's first factor (``LinearLR``'s ``start_factor``,
            ``OneCycleLR``'s ``1 / div_factor``).
        warmup_shape: ``linear``, or ``cosine`` (a half cosine, ``OneCycleLR``'s default).
    """

    name: str
    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.0
    decay_fraction: float = 0.2
    warmup_start: float = 0.0
    warmup_shape: str = "linear"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in SCHEDULE_NAMES:
            raise ValueError(f"schedule.name: unknown schedule {self.name!r}, expected one of {SCHEDULE_NAMES}")
        if not (_is_number(self.peak_lr) and self.peak_lr > 0 and math.isfinite(self.peak_lr)):
            raise ValueError(f"schedule.peak_lr: must be a positive number, got {self.peak_lr!r}")
        if not (_is_int(self.total_steps) and self.total_steps >= 1):
            raise ValueError(f"schedule.total_steps: must be an integer of at least 1, got {self.total_steps!r}")
        if not (_is_int(self.warmup_steps) and 0 <= self.warmup_steps <= self.total_steps):
            raise ValueError(
                f"schedule.warmup_steps: must be an integer within [0, total_steps], got {self.warmup_steps!r}"
            )
        for name, low_open in (("min_ratio", False), ("decay_fraction", True), ("warmup_start", False)):
            v = getattr(self, name)
            if not (_is_number(v) and (v > 0 if low_open else v >= 0) and v <= 1):
                raise ValueError(f"schedule.{name}: must be within {'(' if low_open else '['}0, 1], got {v!r}")
        if self.warmup_shape not in WARMUP_SHAPES:
            raise ValueError(f"schedule.warmup_shape: expected one of {WARMUP_SHAPES}, got {self.warmup_shape!r}")

    def factor(self, step: int) -> float:
        """LR of ``step`` as a fraction of ``peak_lr`` (what ``LambdaLR`` wants)."""
        w, n, lo = self.warmup_steps, self.total_steps, self.min_ratio
        if step < w:
            p = step / w
            if self.warmup_shape == "cosine":
                p = 0.5 * (1.0 - math.cos(math.pi * p))
            return self.warmup_start + (1.0 - self.warmup_start) * p
        if self.name == "constant":
            return 1.0
        if self.name == "inverse_sqrt":
            timescale = max(w, 1)  # transformers' default timescale; 1 without warmup
            return 1.0 / math.sqrt((step + timescale - w) / timescale)
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> Schedule:
        """Rebuild a declared schedule from its wire form; a bad field is named in the error."""
        if not isinstance(raw, dict):
            raise ValueError(
                f"schedule: expected a Schedule or its dict (Schedule.to_dict()), got {type(raw).__name__}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"schedule.{unknown[0]}: unknown field, expected one of {known}")
        for name in ("name", "peak_lr", "total_steps"):
            if name not in raw:
                raise ValueError(f"schedule.{name}: missing")
        return cls(**raw)

    @classmethod
    def from_scheduler(cls, scheduler: Any, planned_steps: int | None = None) -> Schedule | None:
        """The schedule a torch or ``transformers`` scheduler follows, or None if it cannot be said exactly.

        Recognised: ``LambdaLR`` over ``Schedule.factor`` or a ``transformers``
        ``get_{constant,linear,cosine,cosine_with_min_lr,polynomial_decay (power 1),inverse_sqrt,
        wsd (linear decay)}_schedule*`` lambda; ``CosineAnnealingLR``; ``LinearLR``;
        ``OneCycleLR`` (two phases, a whole number of warmup steps); ``SequentialLR`` of a
        ``LinearLR`` warmup then a cosine, linear or constant one. Anything else, subclasses
        included (they may compute the LR their own way), gives None: the collector then infers
        the schedule, which is weaker but never wrong. ``planned_steps`` sizes the schedules
        that have no end of their own (constant, inverse-sqrt).
        """
        if type(scheduler).__name__ == "AcceleratedScheduler":  # accelerate's wrapper
            scheduler = getattr(scheduler, "scheduler", None)
        kind = type(scheduler).__name__ if type(scheduler).__module__ == _TORCH else None
        read = _READERS.get(kind or "")
        try:
            return read(scheduler, planned_steps) if read is not None else None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
            return None  # not the scheduler we know (another version, a hand-edited state): say nothing


def declared_schedule(
    schedule: Schedule | dict[str, Any] | None, scheduler: Any = None, planned_steps: int | None = None
) -> Schedule | None:
    """What ``run_start`` declares: the schedule given (a ``Schedule`` or its wire dict, validated),
    else the one ``scheduler`` follows exactly, else none."""
    if schedule is None:
        return Schedule.from_scheduler(scheduler, planned_steps) if scheduler is not None else None
    return schedule if isinstance(schedule, Schedule) else Schedule.from_dict(schedule)


# -- reading schedulers ------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _whole(v: Any) -> int:
    """An integral step count (transformers accepts ``10.0``); anything else is not ours to read."""
    if _is_number(v) and float(v).is_integer():
        return int(v)
    raise ValueError(f"not a whole number of steps: {v!r}")


def _base0(scheduler: Any) -> float:
    """Group 0's initial LR: the peak (the other groups keep their ratio to it)."""
    return float(scheduler.base_lrs[0])


def _lambda_lr(s: Any, planned: int | None) -> Schedule | None:
    # One factor function per param group (transformers repeats the same one): all must agree.
    shapes = {_factor_shape(fn, planned) for fn in s.lr_lambdas}
    if len(shapes) != 1:
        return None
    shape = shapes.pop()
    return replace(shape, peak_lr=_base0(s)) if shape is not None else None


def _factor_shape(fn: Any, planned: int | None) -> Schedule | None:
    """The schedule (peak 1) of a ``LambdaLR`` factor function, when it is one we can read."""
    if inspect.ismethod(fn) and fn.__func__ is Schedule.factor and isinstance(fn.__self__, Schedule):
        return replace(fn.__self__, peak_lr=1.0)
    if isinstance(fn, functools.partial) and not fn.args and getattr(fn.func, "__module__", None) == _HF:
        read = _HF_LAMBDAS.get(fn.func.__name__)
        return read(dict(fn.keywords), planned) if read is not None else None
    if getattr(fn, "__module__", None) == _HF and getattr(fn, "__name__", None) == "_get_constant_lambda":
        return Schedule("constant", 1.0, max(planned or 1, 1))
    return None


def _hf_constant(kw: dict[str, Any], planned: int | None) -> Schedule:
    w = _whole(kw["num_warmup_steps"])
    return Schedule("constant", 1.0, max(planned or 1, w, 1), w)


def _hf_linear(kw: dict[str, Any], planned: int | None) -> Schedule | None:
    w, n = _whole(kw["num_warmup_steps"]), _whole(kw["num_training_steps"])
    return Schedule("linear", 1.0, n, w) if w < n else None  # n == w: transformers drops to 0 at once


def _hf_cosine(kw: dict[str, Any], planned: int | None) -> Schedule | None:
    # Also get_cosine_with_min_lr_schedule_with_warmup: the same function with min_lr_rate.
    w, n = _whole(kw["num_warmup_steps"]), _whole(kw["num_training_steps"])
    if kw.get("num_cycles") != 0.5 or w >= n:
        return None  # other cycle counts rise again before the end
    return Schedule("cosine", 1.0, n, w, float(kw.get("min_lr_rate") or 0.0))


def _hf_polynomial(kw: dict[str, Any], planned: int | None) -> Schedule | None:
    w, n = _whole(kw["num_warmup_steps"]), _whole(kw["num_training_steps"])
    if kw["power"] != 1 or w >= n:
        return None
    return Schedule("linear", 1.0, n, w, kw["lr_end"] / kw["lr_init"])


def _hf_inverse_sqrt(kw: dict[str, Any], planned: int | None) -> Schedule | None:
    w = _whole(kw["num_warmup_steps"])
    if w < 1 or kw.get("timescale") != w:  # get_inverse_sqrt_schedule sets timescale = warmup (10000 without)
        return None
    return Schedule("inverse_sqrt", 1.0, max(planned or 1, w), w)


def _hf_wsd(kw: dict[str, Any], planned: int | None) -> Schedule | None:
    w, stable, decay = (_whole(kw[k]) for k in ("num_warmup_steps", "num_stable_steps", "num_decay_steps"))
    if kw["decay_type"] != "linear" or kw["warmup_type"] not in WARMUP_SHAPES or decay < 1 or stable < 0:
        return None
    n, lo = w + stable + decay, float(kw["min_lr_ratio"])
    built = Schedule("wsd", 1.0, n, w, lo, decay / n, warmup_start=lo, warmup_shape=kw["warmup_type"])
    return built if round(built.decay_fraction * n) == decay else None


_HF_LAMBDAS = {
    "_get_constant_schedule_with_warmup_lr_lambda": _hf_constant,
    "_get_linear_schedule_with_warmup_lr_lambda": _hf_linear,
    "_get_cosine_schedule_with_warmup_lr_lambda": _hf_cosine,
    "_get_polynomial_decay_schedule_with_warmup_lr_lambda": _hf_polynomial,
    "_get_inverse_sqrt_schedule_lr_lambda": _hf_inverse_sqrt,
    "_get_wsd_scheduler_lambda": _hf_wsd,
}


def _cosine_annealing(s: Any, planned: int | None) -> Schedule | None:
    bases = [float(b) for b in s.base_lrs]
    # eta_min is absolute: with other groups at other LRs their ratio to group 0 would drift.
    if (s.eta_min and any(b != bases[0] for b in bases)) or s.eta_min > bases[0]:
        return None
    return Schedule("cosine", bases[0], _whole(s.T_max), 0, s.eta_min / bases[0])


def _linear_lr(s: Any, planned: int | None) -> Schedule | None:
    start, end, n = float(s.start_factor), float(s.end_factor), _whole(s.total_iters)
    base = _base0(s)
    if start == 1.0:
        return (
            Schedule("constant", base, max(planned or 1, n, 1)) if end == 1.0 else Schedule("linear", base, n, 0, end)
        )
    if end == 1.0:  # a warmup from start_factor
        return Schedule("constant", base, max(planned or 1, n, 1), n, warmup_start=start)
    return None


def _one_cycle(s: Any, planned: int | None) -> Schedule | None:
    phases = s._schedule_phases
    shape = {"cos": "cosine", "linear": "linear"}.get(getattr(s, "_anneal_func_type", ""))
    if len(phases) != 2 or shape is None:  # three_phase, or a torch that keeps it elsewhere
        return None
    end = float(phases[0]["end_step"])  # pct_start * total_steps - 1, a float
    w = round(end)
    if abs(end - w) > 1e-9 or w < 1:
        return None
    g = s.optimizer.param_groups[0]
    peak = float(g["max_lr"])
    return Schedule(
        shape,
        peak,
        _whole(phases[1]["end_step"]),
        w,
        float(g["min_lr"]) / peak,
        warmup_start=float(g["initial_lr"]) / peak,
        warmup_shape=shape,
    )


def _sequential(s: Any, planned: int | None) -> Schedule | None:
    schedulers, milestones = list(s._schedulers), list(s._milestones)
    if len(schedulers) != 2 or len(milestones) != 1:
        return None
    warm, main = schedulers
    m = _whole(milestones[0])
    if type(warm).__module__ != _TORCH or type(warm).__name__ != "LinearLR":
        return None
    if float(warm.end_factor) != 1.0 or _whole(warm.total_iters) != m or m < 1:
        return None
    rest = Schedule.from_scheduler(main, None if planned is None else max(planned - m, 1))
    if rest is None or rest.warmup_steps or rest.name not in ("cosine", "linear", "constant"):
        return None
    return replace(rest, total_steps=rest.total_steps + m, warmup_steps=m, warmup_start=float(warm.start_factor))


_READERS = {
    "LambdaLR": _lambda_lr,
    "CosineAnnealingLR": _cosine_annealing,
    "LinearLR": _linear_lr,
    "OneCycleLR": _one_cycle,
    "SequentialLR": _sequential,
}
