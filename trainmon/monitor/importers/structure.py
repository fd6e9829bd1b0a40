"""Which logged series is "the loss", the grad norm and the LR, recognised by the structure of their names
and values when no name we know is there (CSV columns, TensorBoard tags of any trainer).

Principles (the importers that use this state them in their docstrings too):

* **Loss-like by structure.** A series is loss-like when a word of its name is ``loss`` (``train_disc_loss``,
  ``train/box_loss``, ``Dielectric_Air_loss``, ``lm loss``, ``loss_G``), and it is not an evaluation's
  (``val``/``eval``/``test`` in the name), a gradient norm of a loss (``grad_norm_loss_critic``), a loss
  scale, a coefficient or an epoch aggregate.
* **Which series is the loss.** A series named as the training loss (``train/loss``, ``loss``) is the loss.
  Without one, a total of the terms (``mean_loss``, ``total_loss``: ``loss`` with only words such as
  total/mean/sum/avg) is the loss. Without a total, the loss is the sum of the terms (a detector's box +
  objectness + class losses, a PINN's residuals, a GAN's two players, one critic per agent): its level is not
  the trainer's (weights unknown) but its shape and its finiteness are. The series used is named in the
  import (``column_mapping`` / ``tag_mapping`` and ``loss_series``).
* **Auxiliary terms are not the loss** when a main term is there: Megatron's ``lm loss`` beside an MoE
  ``load_balancing_loss``, a router ``z_loss`` or an ``mtp_1 loss`` is the loss; the auxiliaries are named
  and left out (a spike in a regulariser is not the model's loss spiking). Smoothed views of the loss
  (``loss_ema``) count as totals, the unsmoothed one first.
* **A signed series is not a loss curve.** A series that takes negative values is an objective (a policy
  gradient surrogate, REINFORCE's advantage-weighted log-probabilities, an entropy bonus, a WGAN critic), not
  a loss that falls towards a floor: the spike, divergence and initial-loss rules measure it against its own
  level, which means nothing for a signed value. It is left out of the loss (and of a sum of terms), and
  the import says so and that it was not checked. Its non-finite values still reach the loss: a NaN is a
  fault whatever the series means.
* **Rewards and task metrics are not losses** (higher is better): no ``loss`` word, never chosen. A run
  that logs a reward or return beside its losses is a reinforcement-learning run, judged by its reward:
  its policy, value (critic), entropy and KL terms are not a loss curve either (a value loss chases returns
  that grow as the policy improves; the others are signed), so they are left out of the loss the same way.
* **Grad norms** the same way: a series named as the total grad norm; else one whose name says total;
  else the root of the sum of squares of the per-part norms (the global norm over disjoint parameter sets,
  as clipping computes it; an upper bound when the parts share parameters).
* **Parameter groups.** LR series numbered by group (``x/lr0``, ``x/lr1``, ``x/lr2``; ``lr-AdamW/pg1``) are
  one LR per param group, in group order, never merged into one series.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "LossChoice",
    "choose_grad_norm",
    "choose_loss",
    "combine",
    "is_eval_name",
    "is_reward_name",
    "is_signed",
    "logging_interval",
    "loss_like",
    "lr_groups",
]

_WORD = re.compile(r"[^a-z0-9]+")
_EVAL_WORDS = frozenset({"val", "valid", "validation", "eval", "evaluation", "test", "dev", "holdout"})
_NOT_LOSS_WORDS = frozenset(
    {"grad", "grads", "gradient", "norm", "scale", "scaler", "epoch", "lr", "weight", "weights", "coef", "coeff", "vs"}
)
_TOTAL_WORDS = frozenset({"total", "mean", "avg", "average", "overall", "sum", "all", "full", "combined"})
_TRAIN_WORDS = frozenset({"train", "training", "trn", "step"})
_VIEW_WORDS = frozenset({"ema", "smooth", "smoothed", "running", "rolling", "raw"})
"""Words of another view of the same loss: a total in another form, preferred unsmoothed."""
_AUX_WORDS = frozenset(
    {"aux", "auxiliary", "balance", "balancing", "lb", "z", "zloss", "router", "mtp", "reg", "penalty", "l1", "l2"}
)
_REWARD_WORDS = frozenset({"reward", "rewards", "return", "returns", "rew"})
_RL_WORDS = frozenset({"policy", "actor", "critic", "value", "entropy", "objective", "surrogate", "pg", "vf", "kl"})
_NOT_NORM_WORDS = frozenset({"clipped", "clip", "after", "post", "vs"})
_LR_GROUP = (
    # x/lr0, lr/pg1, lr/group0, learning_rate_2
    re.compile(r"^(?P<stem>(?:.*[/_\-. ])?(?:lr|learning[_\-. ]?rate))(?P<sep>[/_\-. ]?(?:pg|group)?)(?P<n>\d+)$"),
    # Lightning's LearningRateMonitor with several groups: lr-AdamW/pg1, lr-AdamW/pg2
    re.compile(r"^(?P<stem>lr-[^/]+)(?P<sep>/pg)(?P<n>\d+)$"),
)


def _words(name: str) -> list[str]:
    return [w for w in _WORD.split(name.lower()) if w]


def is_eval_name(name: str) -> bool:
    """The series belongs to an evaluation (``val/box_loss``, ``eval_squad_loss``, ``test/reward``)."""
    words = set(_words(name))
    return bool(words & _EVAL_WORDS) or any(w.startswith(("val", "eval")) and w.endswith("loss") for w in words)


def loss_like(name: str) -> bool:
    """A training loss or a term of one, judged by the words of its name (module docstring)."""
    words = _words(name)
    if not any(w == "loss" or w.endswith("loss") for w in words):
        return False
    return not (set(words) & (_EVAL_WORDS | _NOT_LOSS_WORDS)) and not is_eval_name(name)


def _is_total(name: str) -> bool:
    """``total_loss``, ``mean_loss``, ``loss_ema``: the whole loss (or a smoothed view of it), not a term."""
    rest = [w for w in _words(name) if w != "loss" and w not in _TRAIN_WORDS]
    return bool(rest) and all(w in _TOTAL_WORDS or w in _VIEW_WORDS for w in rest)


def _is_auxiliary(name: str) -> bool:
    """A regulariser beside the main loss (MoE load balancing, router z-loss, MTP, weight penalty)."""
    return bool(set(_words(name)) & _AUX_WORDS)


def is_signed(values: Iterable[float]) -> bool:
    """The series takes negative values: an objective, not a loss curve. Asked of a million values at C speed
    first (no value below zero, NaN included, is the usual answer); only a series below zero somewhere is asked
    whether that value is finite (-inf is a divergence, not a sign)."""
    values = list(values)
    if not any(map(operator.lt, values, itertools.repeat(0.0))):
        return False
    return any(math.isfinite(x) and x < 0 for x in values)


@dataclass
class LossChoice:
    """The series that make the loss, how, and what was left out (and why)."""

    terms: list[str] = field(default_factory=list)
    """Series summed into the loss (one: the loss itself); empty: no loss curve."""
    how: str = ""
    left_out: dict[str, str] = field(default_factory=dict)
    """Loss-like series not judged as a loss curve -> why (their non-finite values still count)."""

    @property
    def label(self) -> str:
        return " + ".join(self.terms)

    @property
    def signed(self) -> list[str]:
        return list(self.left_out)

    def facts(self) -> dict[str, object]:
        return {"how": self.how, "terms": list(self.terms), "not_judged": dict(self.left_out)}

    def notes(self) -> list[str]:
        out = []
        if len(self.terms) > 1:
            out.append(
                f"the loss is the sum of the {len(self.terms)} loss terms {', '.join(self.terms)} (no total is "
                "logged): its shape and finiteness are the run's, its level is not the trainer's weighted loss"
            )
        elif self.terms and self.how == "total":
            out.append(f"the loss is {self.terms[0]}, the total of the loss terms logged beside it")
        by_why: dict[str, list[str]] = {}
        for name, why in self.left_out.items():
            by_why.setdefault(why, []).append(name)
        for why, names in by_why.items():
            out.append(
                f"not a loss curve: {', '.join(names)} ({why}); not checked for spikes, divergence or the "
                "initial loss, only for non-finite values"
            )
        if self.left_out and not self.terms:
            out.append("no loss curve in this log: the loss rules had nothing to judge")
        return out


_SIGNED = "takes negative values: a signed objective such as a policy-gradient surrogate or an entropy bonus"
_AUX = "an auxiliary term beside the main loss (load balancing, router z-loss, MTP, a penalty)"
_RL_TERM = (
    "a reinforcement-learning term in a run judged by its reward: value losses chase returns that move as the "
    "policy improves, policy and entropy terms are signed"
)


@functools.lru_cache(maxsize=4096)
def is_reward_name(name: str) -> bool:
    """An RL run's reward or return (higher is better): never a loss. Cached: an HF log asks it of
    every key of every entry until it finds a reward."""
    return bool(set(_words(name)) & _REWARD_WORDS)


def _rl_term(name: str) -> bool:
    return bool(set(_words(name)) & _RL_WORDS)


def choose_loss(named: str | None, candidates: Iterable[str], values: Mapping[str, Iterable[float]]) -> LossChoice:
    """The loss of a log: ``named`` (a series named as the training loss) or, without it, the
    loss-like ``candidates`` by structure (module docstring). ``values`` gives each series' values
    for the sign test. When a candidate is an RL reward or return on the training side, the RL
    terms among the loss-like ones are left out: they are parts of a policy objective, not a loss."""
    if named is not None:
        if is_signed(values.get(named, ())):
            return LossChoice(how="not a loss curve", left_out={named: _SIGNED})
        return LossChoice(terms=[named], how="named")
    candidates = list(candidates)
    cands = [c for c in candidates if loss_like(c)]
    left_out = {c: _SIGNED for c in cands if is_signed(values.get(c, ()))}
    if any(is_reward_name(c) and not is_eval_name(c) for c in candidates):
        left_out.update({c: _RL_TERM for c in cands if c not in left_out and _rl_term(c)})
    kept = [c for c in cands if c not in left_out]
    totals = sorted((c for c in kept if _is_total(c)), key=lambda c: bool(set(_words(c)) & (_VIEW_WORDS - {"raw"})))
    if totals:
        return LossChoice(terms=[totals[0]], how="total", left_out=left_out)
    main = [c for c in kept if not _is_auxiliary(c)]
    if main and len(main) < len(kept):
        left_out.update({c: _AUX for c in kept if c not in main})
        kept = main
    if not kept:
        return LossChoice(how="not a loss curve" if left_out else "", left_out=left_out)
    return LossChoice(terms=kept, how="sum of terms" if len(kept) > 1 else "structure", left_out=left_out)


def combine(terms: list[float | None], signed: list[float | None]) -> float | None:
    """One step's loss from its terms: NaN when any loss-like value (left-out ones too) is not finite;
    the sum when every term is there; None otherwise (a term missing on this row)."""
    if any(x is not None and not math.isfinite(x) for x in (*terms, *signed)):
        return math.nan
    if not terms or any(x is None for x in terms):
        return None
    return math.fsum(terms)  # type: ignore[arg-type]


def grad_norm_like(name: str) -> bool:
    words = set(_words(name))
    norm = ("grad" in words or "gradient" in words or "grads" in words) and "norm" in words
    norm = norm or bool(words & {"gnorm", "gradnorm"})
    return norm and not (words & (_EVAL_WORDS | _NOT_NORM_WORDS))


def choose_grad_norm(named: str | None, candidates: Iterable[str]) -> tuple[list[str], str]:
    """The grad-norm series: the named one; else one whose name says total; else all the per-part
    norms, combined as a root sum of squares. Returns (series, how)."""
    if named is not None:
        return [named], "named"
    cands = [c for c in candidates if grad_norm_like(c)]
    totals = [
        c
        for c in cands
        if all(w in _TOTAL_WORDS for w in _words(c) if w not in {"grad", "grads", "gradient", "norm"} | _TRAIN_WORDS)
    ]
    if totals:
        return [totals[0]], "total"
    return cands, ("root sum of squares of the per-part norms" if len(cands) > 1 else "structure")


def root_sum_squares(values: list[float | None]) -> float | None:
    """The global norm of per-part norms; NaN when one is not finite; None when one is missing."""
    if any(x is not None and not math.isfinite(x) for x in values):
        return math.nan
    if not values or any(x is None for x in values):
        return None
    return math.sqrt(math.fsum(x * x for x in values))  # type: ignore[operator]


def lr_groups(names: Iterable[str]) -> list[str]:
    """LR series numbered by param group (``x/lr0``, ``x/lr1``; ``lr-AdamW/pg1``), in group order: the
    largest family sharing one stem; else one series whose last part is ``lr``/``learning_rate`` under a
    namespace (``charts/learning_rate``); empty when there is none."""
    names = list(names)
    fams: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        m = next((m for rx in _LR_GROUP if (m := rx.match(name.lower()))), None)
        if m is not None and not is_eval_name(name):
            fams.setdefault(m["stem"] + m["sep"], []).append((int(m["n"]), name))
    if not fams:
        # one LR under a namespace of its own (CleanRL's charts/learning_rate, optim/lr)
        single = [
            n for n in names if not is_eval_name(n) and _words(n.rsplit("/", 1)[-1]) in (["lr"], ["learning", "rate"])
        ]
        return single[:1]
    best = max(fams.values(), key=len)
    return [name for _, name in sorted(best)]


def logging_interval(steps: Sequence[int]) -> int | None:
    """A log's logging interval: the median gap between consecutive logged steps that go up (the upper of the two
    middle ones), None without such a gap. Asked of an int64 array where every step is an int that its gaps fit (a
    million steps' gaps sorted as Python ints took 0.08 s), else of the Python values."""
    if len(steps) > 1 and set(map(type, steps)) == _INT and min(steps) >= 0 and max(steps) <= 2**62:
        gaps = np.diff(np.array(steps, dtype=np.int64))
        gaps = gaps[gaps > 0]
        return int(np.partition(gaps, len(gaps) // 2)[len(gaps) // 2]) if len(gaps) else None
    rises = sorted(b - a for a, b in itertools.pairwise(steps) if b > a)
    return rises[len(rises) // 2] if rises else None


_INT = {int}


def infer_step_base(steps: list[int]) -> tuple[int, str]:
    """The step base of a log whose step column or tag does not say it: (base, why).

    A log that holds a step 0 counts from 0. One whose first logged step is one logging interval
    in (10, 20, 30 ...; 1, 2, 3 ...) or is 1 followed by multiples of the interval (HF's
    ``logging_first_step``: 1, 10, 20 ...) numbers each step by the steps done after it, as HF's
    ``global_step`` does: base 1, so a log of steps 1..N covers N steps. Anything else (Lightning's
    ``(step + 1) % n == 0``: 1, 3, 5 ... or 49, 99 ...) counts from 0."""
    if not steps:
        return 0, "no steps"
    first = steps[0]
    if first == 0:
        return 0, "the log holds a step 0"
    interval = logging_interval(steps)
    if interval is None:
        return (1, "a single logged step 1") if first == 1 else (0, "one logged step")
    if first == interval and all(s % interval == 0 for s in steps[:50]):
        return 1, f"the first logged step is {first}, one logging interval ({interval}) in: steps done, counted from 1"
    if first == 1 and len(steps) > 1 and steps[1] % interval == 0:
        return 1, f"the first logged step is 1, then every {interval}: steps done, counted from 1"
    return 0, f"the first logged step is {first} with a logging interval of {interval}: counted from 0"


@dataclass
class EvalSet:
    """One evaluation set: its loss series (several: terms of one loss, summed) and its task metrics."""

    name: str | None
    """The set's name (``squad``, ``wiki``, ``dataloader_idx_1``); None for a run's one unnamed eval."""
    loss: list[str]
    metrics: dict[str, str] = field(default_factory=dict)
    """Series -> metric name (``eval_squad_accuracy`` -> ``accuracy``)."""


_EVAL_TIMING_WORDS = frozenset({"runtime", "samples", "steps", "second", "per", "epoch"})


def _template(name: str) -> tuple[str, str] | None:
    """``eval_squad_loss`` -> (``eval_squad_``, ````): the text around the name's loss word."""
    m = re.search(r"(?i)(?<![a-z])loss(?![a-z])", name)
    return (name[: m.start()], name[m.end() :]) if m else None


def _set_name(prefix: str, suffix: str) -> str | None:
    words = [w for w in _words(prefix + " " + suffix) if w not in _EVAL_WORDS]
    return "_".join(words) or None


def eval_sets(names: Iterable[str]) -> list[EvalSet]:
    """The evaluation sets of a log, by structure: each eval-side loss series (``eval_squad_loss``,
    ``eval/wiki/loss``, ``val_loss/dataloader_idx_1``) with the task metrics written the same way
    (``eval_squad_accuracy``, ``eval/wiki/accuracy``, ``val_acc/dataloader_idx_1``).

    Several eval losses are several *sets* when at least two of them have their own metric (each set
    scored on its own); eval losses without metrics of their own are *terms* of one evaluation (a
    detector's val box/obj/cls losses), one set whose loss is their sum."""
    names = [n for n in names if is_eval_name(n)]
    losses = [n for n in names if _template(n) is not None and not grad_norm_like(n)]
    if not losses:
        return []
    templates = {n: _template(n) for n in losses}
    sets: dict[str, EvalSet] = {n: EvalSet(_set_name(*templates[n]), [n]) for n in losses}  # type: ignore[misc]
    for other in names:
        if other in templates:
            continue
        best: tuple[int, str, str] | None = None
        for n, (pre, suf) in templates.items():  # type: ignore[misc]
            if other.startswith(pre) and other.endswith(suf) and len(other) > len(pre) + len(suf):
                word = other[len(pre) : len(other) - len(suf)]
                if "/" in word or set(_words(word)) & (_EVAL_TIMING_WORDS | {"loss"}):
                    continue
                if best is None or len(pre) + len(suf) > best[0]:
                    best = (len(pre) + len(suf), n, word)
        if best is not None:
            sets[best[1]].metrics[other] = best[2]
    with_metrics = [s for s in sets.values() if s.metrics]
    if len(sets) > 1 and len(with_metrics) < 2:
        return [EvalSet(None, losses, {k: v for s in sets.values() for k, v in s.metrics.items()})]
    return list(sets.values())


def eval_point_values(sets: list[EvalSet], get: Callable[[str], float | None]) -> tuple[float | None, dict[str, float]]:
    """One evaluation's (loss, metrics) from its series values (``get(name)``: a float or None).

    The first set is the run's eval (its loss is the eval loss, its metrics by their own names); every
    other set goes into the metrics as ``SET/loss`` and ``SET/METRIC``, so one eval event carries them
    all and a detector that reads sets can judge each on its own."""
    loss: float | None = None
    metrics: dict[str, float] = {}
    for k, s in enumerate(sets):
        terms = [get(n) for n in s.loss]
        value = combine(terms, []) if all(x is not None for x in terms) else None
        own = {m: x for n, m in s.metrics.items() if (x := get(n)) is not None}
        if k == 0:
            loss = value
            metrics.update(own)
        else:
            label = s.name or f"set{k}"
            if value is not None:
                metrics[f"{label}/loss"] = value
            metrics.update({f"{label}/{m}": x for m, x in own.items()})
    return loss, metrics


def eval_sets_facts(sets: list[EvalSet]) -> dict[str, object]:
    """``run_start.config.eval_sets``: each set's loss series and metrics, the first being the eval loss."""
    return {
        (s.name or "eval"): {"loss": list(s.loss), "metrics": dict(s.metrics), "primary": k == 0}
        for k, s in enumerate(sets)
    }


def eval_sets_notes(sets: list[EvalSet]) -> list[str]:
    if len(sets) > 1:
        names = ", ".join(s.name or f"set{k}" for k, s in enumerate(sets))
        return [
            f"{len(sets)} evaluation sets ({names}), each with its own loss and metrics: the eval loss is "
            f"{sets[0].name}'s; the others are in each eval's metrics as SET/loss and SET/METRIC"
        ]
    if len(sets[0].loss) > 1:
        return [f"the eval loss is the sum of the eval loss terms {', '.join(sets[0].loss)} (no total is logged)"]
    return []
