"""``degenerate``: training that runs without error but stopped learning, in ways the loss rules cannot see.

A spike, divergence or NaN rule judges the loss against its own recent past; each of these runs has a
loss that looks calm (flat, falling, or zero) while the training is degenerate. Each mechanism rests on
a fact of the objective, not on a threshold fitted to a log:

* **A saturated objective** (a DPO/preference loss driven to exactly 0.0): the loss is exactly 0.0 at
  ``saturated_entries`` logged entries in a row *and* the gradient norm at those entries is finite, above
  zero and below ``vanished_ratio`` of its median at the entries before (81: 1.7e-8 after 1628 and 0.014).
  A sigmoid or softmax loss reaches 0.0 only when its margins are so large that no gradient is left: the run
  goes on spending compute and changes nothing (over-optimised against its reference). Zeros are not NaN:
  a gradient that is finite and nonzero says the loss was computed; an exactly zero gradient is the no-op
  rule below, and zeros with no gradient logged are ``nan_inf``'s (HF's filter hides NaN windows as 0.0).
  A loss that reaches 0.0 by rounding after converging through small values (38: 0.0001 then 0.0, grad norm
  still 5e-4) keeps its gradient, so it is not saturated. Preference metrics the importer found beside the
  loss (``run_start.config.preference``: rewards/accuracies, margins, log-probs of the rejected answers) are
  named as evidence, and stand in for a gradient norm the log does not carry: accuracies 1.0 with finite
  margins of ``saturated_margin`` or more say the loss was computed and is below the printed resolution
  (log(1 + e^-10) = 4.5e-5), not a NaN.
* **No-op steps**: an exactly zero gradient norm on a step with a finite loss means the step produced no
  gradient at all: every label of its batch was ignored (an answer truncated away), so the loss was NaN and a
  filter hid it. When at least ``noop_share`` of the logged grad norms (and ``noop_min`` of them) are exactly
  0.0 while at least ``noop_share`` are not (a norm that is always 0.0 is a placeholder printed while the
  feature is off), that share of the steps trained on nothing. Steps the fp16 scaler skipped
  (``skipped``) are no evidence either way. A warning with its cause left open: the file
  cannot show which samples were empty.
* **Stuck at chance**: the eval loss equals ln K for an integer K >= 2 (the loss of a uniform guess over K
  choices) within ``chance_tol`` (relative) at ``chance_evals`` evals in a row or more, and no eval was ever
  below it (a model that learnt and then fell back to uniform is another failure; the first eval of a fresh
  model may sit off chance before it settles there),
  where ln K is identifiable: ln (K+1) - ln K is ``chance_separation`` times the tolerance or more (a small K; a
  loss of 4.13 is within 0.2% of ln 62, and of ln of many integers near it, so it says nothing), or K is the
  declared vocabulary (a language model stuck at ln V),
  while the train loss has not gone below it either and the accuracy (when logged) is within
  ``chance_acc_band`` of 1/K (83: eval loss 1.3856-1.3863 = ln 4 for 20 epochs, accuracy 0.23-0.31). The
  model outputs the uniform distribution: nothing is learnt. A flat line at chance has no noise to measure, so
  its wiggles say nothing: this is the finding, not the spikes a rolling MAD would see on it.
* **Collapse to one class**: an eval whose recall is 1.0 and whose accuracy equals its precision (to
  ``collapse_tol``) predicts the positive class for every example: accuracy = precision = the positive rate
  of the eval set (84: 0.6056 at step 43). Not a perfect classifier (accuracy 1.0 is excluded). The eval loss
  at the entropy of that label split, and a trainer whose best checkpoint is that eval, are named as evidence.
  The finding stays open while later evals' accuracy stays within ``collapse_margin`` of that base rate.
  Without precision and recall: an accuracy identical at the first ``collapse_evals`` evals (a model that
  learns moves it) while the eval loss is the entropy of a two-class split with that majority rate (within
  ``collapse_entropy_tol``) is the same collapse, read from the base rate alone.

Each finding is a warning and persists (extended while the condition holds); its message says what was seen,
its hint what was not checked.
"""

from __future__ import annotations

import collections
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import carries, columns, observe_runs, read
from trainmon.wire import Event

__all__ = ["Degenerate", "DegenerateConfig"]


@dataclass
class DegenerateConfig:
    """``degenerate``: a saturated objective, no-op steps, a model stuck at chance, a classifier collapsed to one
    class (the principle of each in ``trainmon.monitor.detectors.degenerate``)."""

    saturated_entries: int = 2
    """Logged losses of exactly 0.0 in a row (with a vanishing, nonzero gradient) before the objective is saturated."""
    saturated_margin: float = 10.0
    """Without a logged grad norm: a preference margin (rewards/margins) at least this large, with accuracies 1.0,
    makes the zeros real (a sigmoid loss of log(1 + e^-10) = 4.5e-5 prints as 0.0)."""
    vanished_ratio: float = 1e-4
    """The grad norm at those entries, against its median before them, below which no gradient is left."""
    noop_share: float = 0.2
    """Share of logged grad norms exactly 0.0 (with a finite loss) that makes no-op steps a finding; at least as many
    must be nonzero (a norm always 0.0 is a placeholder)."""
    noop_min: int = 10
    """... and at least this many of them."""
    noop_update: int = 50
    """The no-op finding is restated every this many more zero grad norms (its extent)."""
    chance_evals: int = 5
    """Evals, all at ln K, before a run is stuck at chance."""
    chance_tol: float = 0.002
    """How close to ln K (relative) every eval loss must be: 83's 1.3856-1.3863 against ln 4 = 1.3863 is 0.05%."""
    chance_separation: float = 10.0
    """ln K counts only when ln (K+1) - ln K is at least this many tolerances (or K is the declared vocabulary):
    for a large K the log of some integer is always near (4.13 is within 0.2% of ln 62)."""
    chance_train_below: float = 0.1
    """Not stuck when the train loss is this fraction below ln K (memorising is another story)."""
    chance_acc_band: float = 0.1
    """The accuracy, when logged, must be within this of 1/K."""
    collapse_tol: float = 5e-4
    """Recall 1.0 and accuracy = precision to within this: one class predicted for every example."""
    collapse_margin: float = 0.05
    """The collapse clears when accuracy rises this far above the base rate it collapsed to."""
    collapse_evals: int = 3
    """Without precision/recall: evals from the first with the very same accuracy (and the eval loss at the entropy
    of that split) before the classifier has collapsed to its majority class ..."""
    collapse_entropy_tol: float = 0.05
    """... the eval loss within this fraction of that entropy."""


_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


def _entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


_MAX_LN_K = math.log(1e12)


class _Screen(NamedTuple):
    """A batch's columns as :meth:`Degenerate.observe_batch` reads them."""

    fields: list[dict[str, Any]]
    losses: list[Any]
    norms: list[Any]
    kept: np.ndarray  # a finite loss: a step observe reads (a non-finite loss is no evidence)
    counted: np.ndarray  # ... with a grad norm the no-op share counts
    before: np.ndarray  # ... with a grad norm the saturation rule keeps as its reference
    loud: np.ndarray  # the positions of the events that are not quiet steps


def _screen(events: list[Event]) -> _Screen:
    with read(events) as batch:  # one reading for the columns, arrays and the look for skips (the engine's is of
        # another list where it leaves kinds out)
        fields, others, (losses, norms, skipped) = columns(events, "loss", "grad_norm", "skipped")
        skips = carries(events, "skipped")
        # a validated event's loss and grad norm are floats when present (trainmon.wire); absent reads as NaN here
        # (the batch's arrays, which other detectors read too)
        loss, norm = batch.floats("loss"), batch.floats("grad_norm")
    kept = np.isfinite(loss)
    quiet = ~kept | ((loss != 0.0) & (norm != 0.0))
    quiet[others] = False
    counted = kept & np.isfinite(norm)
    before = counted & (norm > 0.0)
    # not on a step the fp16 scaler skipped (``True in`` a column of None costs 38 ns a step: asked of a log with skips)
    if skips and True in skipped:
        counted &= np.fromiter((x is not True for x in skipped), bool, len(skipped))
    return _Screen(fields, losses, norms, kept, counted, before, np.flatnonzero(~quiet))


class Degenerate(Detector):
    """Saturated objective, no-op steps, a model stuck at chance, a classifier collapsed to one class."""

    kind = "degenerate"
    config_class = DegenerateConfig
    order = 180
    priority = 50
    plots = ("loss",)
    localised = False
    consumes = frozenset(("run_start", "step", "eval"))
    batch_from = 64  # per event, screened against observed: 2 events 12.2 us against 1.6, 32 1.1 against 0.6, 128 0.47
    # against 0.58

    def __init__(self, config: DegenerateConfig) -> None:
        self.config = config
        self._open: str | None = None
        self._best_step: int | None = None
        self._vocab: int | None = None
        self._preference: dict[str, Any] = {}
        # saturation
        # grad norms at entries with a nonzero loss; their median is taken only when the loss has been 0.0 for
        # saturated_entries entries (statistics.median of the same values: what a sorted window gives)
        self._gn_before: collections.deque[float] = collections.deque(maxlen=64)
        self._zero_steps: list[int] = []  # the current run of exact zeros: its first 50 steps (evidence) ...
        self._zero_count = 0  # ... and its length
        self._zero_gn: collections.deque[float] = collections.deque(maxlen=64)  # grad norms at its latest entries
        self._last_nonzero: tuple[int, float] | None = None
        # no-op steps
        self._gn_seen = 0
        self._gn_zero = 0
        self._gn_first_zero: int | None = None
        self._loss_zero = 0
        self._noop_reported = 0
        # chance
        self._train: collections.deque[float] = collections.deque(maxlen=32)  # train losses; median at an eval
        self._evals = 0
        self._eval_lo = math.inf
        self._eval_hi = -math.inf
        self._first_eval: int | None = None
        self._acc: list[float] = []
        self._chance_k: int | None = None  # the K whose ln K the current run of evals sits at
        self._chance_k_open = 0
        self._chance_lo = math.inf
        # (step, eval loss, accuracy) of the current run of evals at ln K: its first and its latest ones (bounded)
        self._chance_run: collections.deque[tuple[int, float, float | None]] = collections.deque(maxlen=64)
        self._chance_first: tuple[int, int] = (0, 0)  # (first step of the run, evals in it)
        # collapse
        self._collapse: dict[str, Any] | None = None
        self._acc_runs: dict[str, list[Any]] = {}  # set -> [first accuracy, its step, evals equal to it (-1: moved)]

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        kind = event.kind
        if kind != "step":
            if kind == "run_start":
                if not f.get("resumed", False):
                    self.__init__(self.config)
                vocab = f.get("vocab_size")
                self._vocab = vocab if isinstance(vocab, int) and vocab > 1 else None
                cfg = f.get("config")
                if isinstance(cfg, dict):
                    self._read_config(cfg)
            elif kind == "eval":
                return self._on_eval(int(f["step"]), f.get("loss"), f.get("metrics"))
            return []
        # a step; a validated event's step is an int and its loss and grad norm floats (trainmon.wire): read as they are
        step = f["step"]
        loss = f.get("loss")
        if not finite(loss):  # no evidence of its own; the no-op share is restated all the same
            return self._noop(step) if self._gn_zero >= self.config.noop_min else []
        gn = f.get("grad_norm")
        if finite(gn):
            if f.get("skipped") is not True:  # a step the fp16 scaler skipped is no evidence
                self._gn_seen += 1
                if gn == 0.0:
                    self._gn_zero += 1
                    if self._gn_first_zero is None:
                        self._gn_first_zero = step
        else:
            gn = None
        if loss == 0.0:
            self._loss_zero += 1
        self._train.append(loss)
        if self._gn_zero >= self.config.noop_min:  # most logs have no zero grad norm: the no-op rule is not asked
            out = self._noop(step)  # first: an open no-op finding keeps the saturation rule out
            return out + self._saturation(step, loss, gn)
        return self._saturation(step, loss, gn)

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event, in fewer steps. Until ``noop_min`` grad norms were exactly 0.0 and while
        the saturation rule is not open, a step whose loss is not exactly 0.0 and whose grad norm is not exactly
        0.0 finds nothing (a non-finite loss leaves no trace at all): it only moves the counts and histories the
        rules read when the loss reaches 0.0 or at an eval. The batch's columns pick those steps out at once
        (nearly all of a long log), and a run of them moves the histories in one go (:meth:`_quiet`). Every other
        event is :meth:`observe`'s (:func:`observe_runs`)."""
        screen: _Screen | None = None

        def take(i: int) -> int:
            nonlocal screen
            if self._gn_zero >= self.config.noop_min or self._open == "saturated":
                return i
            if screen is None:
                screen = _screen(events)
            at = int(np.searchsorted(screen.loud, i))
            j = int(screen.loud[at]) if at < len(screen.loud) else len(events)
            if j > i:
                self._quiet(screen, i, j)
            return j

        observe_runs(self.observe, events, attempts, out, take)

    def _quiet(self, s: _Screen, i: int, j: int) -> None:
        """What :meth:`observe` leaves after the quiet steps ``i:j``: of the histories, only the last entries stay."""
        at = np.flatnonzero(s.kept[i:j]) + i
        if not len(at):
            return
        self._gn_seen += int(np.count_nonzero(s.counted[i:j]))
        last = int(at[-1])
        if self._zero_count:
            self._zero_steps.clear()
            self._zero_count = 0
            self._zero_gn.clear()
        self._last_nonzero = (s.fields[last]["step"], s.losses[last])
        self._train.extend(s.losses[k] for k in at[-(self._train.maxlen or 0) :].tolist())
        before = np.flatnonzero(s.before[i:j])[-(self._gn_before.maxlen or 0) :] + i
        self._gn_before.extend(s.norms[k] for k in before.tolist())

    def _read_config(self, cfg: dict[str, Any]) -> None:
        step = cfg.get("best_global_step")
        if isinstance(step, int) and not isinstance(step, bool):
            self._best_step = step
        ckpt = cfg.get("best_model_checkpoint")
        if self._best_step is None and isinstance(ckpt, str):
            m = _CHECKPOINT.search(ckpt)
            if m:
                self._best_step = int(m.group(1))
        pref = cfg.get("preference")
        if isinstance(pref, dict):
            self._preference = pref

    # -- training steps --------------------------------------------------------------------------

    def _saturation(self, step: int, loss: float, gn: float | None) -> list[Finding]:
        if loss != 0.0:
            if self._zero_count:  # (the run of zeros is empty already unless it counted one)
                self._zero_steps.clear()
                self._zero_count = 0
                self._zero_gn.clear()
            self._last_nonzero = (step, loss)
            if gn is not None and gn > 0.0:
                self._gn_before.append(gn)
            if self._open == "saturated":
                self._open = None
                return [
                    self.resolve(
                        step,
                        f"loss {loss:.4g} at step {step}: no longer exactly 0.0",
                        "The objective has a gradient again.",
                        {"loss": loss},
                    )
                ]
            return []
        cfg = self.config
        if len(self._zero_steps) < 50:
            self._zero_steps.append(step)
        self._zero_count += 1
        if gn is not None:
            self._zero_gn.append(gn)
        if self._open not in (None, "saturated") or self._zero_count < cfg.saturated_entries:
            return []
        if self._open == "saturated" and self._zero_count % cfg.noop_update:
            return []  # restated every so many entries while it lasts (its extent), not at each one
            return []
        first = self._zero_steps[0]
        prev = self._last_nonzero
        was = f" after {prev[1]:.4g} at step {prev[0]}" if prev is not None else ""
        evidence: dict[str, Any] = {"zero_loss_steps": self._zero_steps[:50], "zero_loss_entries": self._zero_count}
        pref = self._preference_note(step)
        if pref:
            evidence["preference"] = pref[1]
        margins = self._preference_at("rewards/margins", step)
        accuracy = self._preference_at("rewards/accuracies", step)
        if len(self._zero_gn) >= cfg.saturated_entries and len(self._gn_before):
            ref = statistics.median(self._gn_before)
            now = statistics.median(self._zero_gn)
            if not (0.0 < now <= cfg.vanished_ratio * ref):
                return []
            evidence["grad_norm_at_zeros"] = [float(f"{g:.3g}") for g in list(self._zero_gn)[:50]]
            evidence["grad_norm_median_before"] = float(f"{ref:.4g}")
            why = f"with a finite gradient norm of {now:.2g} ({now / ref:.1e} of its median {ref:.3g} before)"
        elif margins is not None and margins >= cfg.saturated_margin and accuracy is not None and accuracy >= 0.99:
            # no gradient logged: the preference metrics show the loss was computed (finite margins), and a
            # sigmoid loss at a margin of 10 or more prints as 0.0000 (log(1 + e^-10) = 4.5e-5)
            floor = math.log1p(math.exp(-margins))
            why = f"with finite preference margins of {margins:.4g} (a sigmoid loss of {floor:.1e})"
        else:
            return []  # without the gradient or the margins, a 0.0 may be a hidden NaN: nan_inf's to judge
        message = (
            f"loss exactly 0.0 at {self._zero_count} logged entries since step {first}{was}, {why}: the "
            "objective saturated, no gradient is left" + (f"; {pref[0]}" if pref else "")
        )
        hint = (
            "The loss is at its floor and the updates have stopped changing the model: the run is over-optimised "
            "against its objective (for DPO/preference losses: margins so large that the sigmoid is flat, often an LR "
            "or beta far above the usual, or too many epochs over few pairs). The zeros are not NaN (the gradient is "
            "finite and nonzero). Keep a checkpoint from before the loss reached 0.0, lower the LR (DPO: 5e-7 to 5e-6) "
            "or raise beta, train fewer epochs; judge the model on held-out preferences, not on this loss."
        )
        opening = self._open is None
        self._open = "saturated"
        return [Finding(self.kind, "warning", first if opening else step, message, hint, evidence)]

    def _preference_at(self, name: str, step: int) -> float | None:
        """A preference metric's value at the latest logged step up to ``step``."""
        series = self._preference.get(name)
        if not isinstance(series, list):
            return None
        vals = [v for s, v in series if isinstance(s, (int, float)) and s <= step and finite(v)]
        return float(vals[-1]) if vals else None

    def _preference_note(self, step: int) -> tuple[str, dict[str, Any]] | None:
        """The preference metrics the importer found, at the latest logged step up to ``step``."""
        got: dict[str, float] = {}
        for name, series in self._preference.items():
            if not isinstance(series, list):
                continue
            vals = [v for s, v in series if isinstance(s, (int, float)) and s <= step and finite(v)]
            if vals:
                got[name] = vals[-1]
        if not got:
            return None
        parts = [f"{k} {v:.4g}" for k, v in got.items()]
        first = {k: v[0][1] for k, v in self._preference.items() if isinstance(v, list) and v and finite(v[0][1])}
        return ", ".join(parts) + f" at step {step}", {"now": got, "first": first}

    def _noop(self, step: int) -> list[Finding]:
        """No-op steps, once ``noop_min`` grad norms were exactly 0.0 (the caller's gate: most logs have none)."""
        cfg = self.config
        seen, zero = self._gn_seen, self._gn_zero
        if seen == 0:
            return []
        share = zero / seen
        if share < cfg.noop_share or (seen - zero) / seen < cfg.noop_share:
            return []
        if self._open not in (None, "noop"):
            return []
        if self._open == "noop" and zero < self._noop_reported + cfg.noop_update:
            return []
        opening = self._open is None
        self._open = "noop"
        self._noop_reported = zero
        first = self._gn_first_zero if self._gn_first_zero is not None else step
        zeros = f"; {self._loss_zero} logged losses are exactly 0.0 too" if self._loss_zero else ""
        message = (
            f"{zero} of {seen} logged grad norms ({share:.0%}) are exactly 0.0 since step {first}, with a finite loss "
            f"and no NaN logged{zeros}: those steps produced no gradient (no-op steps)"
        )
        hint = (
            "An exactly zero gradient with a finite logged loss means the step trained on nothing. The most likely "
            "cause is samples whose labels are all ignored (the answer truncated away by max length, a template "
            "that masks everything): their loss is NaN, which HF's logging_nan_inf_filter hides, and their "
            "backward writes no gradient. Check the share of samples with no supervised token (max_source/target "
            "length, the chat template's masking); a loss that is genuinely 0.0 on those steps would need every "
            "sample predicted perfectly. The cause is not certain from the log alone."
        )
        evidence = {
            "grad_norm_zero": zero,
            "grad_norm_logged": seen,
            "share": round(share, 4),
            "first_zero_step": first,
            "loss_exactly_zero": self._loss_zero,
        }
        return [Finding(self.kind, "warning", first if opening else step, message, hint, evidence)]

    # -- evals ---------------------------------------------------------------------------------------

    def _on_eval(self, step: int, loss: Any, metrics: Any) -> list[Finding]:
        metrics = metrics if isinstance(metrics, dict) else {}
        out: list[Finding] = []
        if finite(loss):
            out += self._chance(step, float(loss), metrics)
            out += self._collapsed(step, float(loss), metrics)
        return out

    def _chance(self, step: int, loss: float, metrics: dict[str, Any]) -> list[Finding]:
        cfg = self.config
        self._evals += 1
        acc = [float(v) for k, v in metrics.items() if finite(v) and {"accuracy", "acc"} & set(_tokens(k))]
        k = self._chance_k
        ln_k = math.log(k) if k else 0.0
        if k and abs(loss - ln_k) <= cfg.chance_tol * ln_k:
            self._chance_run.append((step, loss, acc[0] if acc else None))
            self._chance_first = (self._chance_first[0], self._chance_first[1] + 1)
        else:
            was_open = self._open == "chance"
            # a uniform guess over K classes has loss ln K; past ln(1e12) no K is a class count (and exp overflows)
            k = round(math.exp(loss)) if 0.0 < loss < _MAX_LN_K else 0
            ln_k = math.log(k) if k >= 2 else 0.0
            identifiable = k >= 2 and (
                math.log(k + 1) - ln_k >= cfg.chance_separation * cfg.chance_tol * ln_k or k == self._vocab
            )
            # ln K and ln (K+1) too close to tell apart: any flat loss is near the log of some integer
            self._chance_k = k if identifiable and abs(loss - ln_k) <= cfg.chance_tol * ln_k else None
            self._chance_run.clear()
            if self._chance_k:
                self._chance_run.append((step, loss, acc[0] if acc else None))
            self._chance_first = (step, 1 if self._chance_k else 0)
            if was_open:
                self._open = None
                return [
                    self.resolve(
                        step,
                        f"eval loss {loss:.5g} at step {step} left ln {self._chance_k_open} = "
                        f"{math.log(self._chance_k_open):.5g}",
                        "The model has started to learn.",
                        {"eval_loss": loss},
                    )
                ]
        low = self._eval_lo
        self._eval_lo = min(self._eval_lo, loss)
        run = self._chance_run
        n = self._chance_first[1]
        if self._open not in (None, "chance") or not self._chance_k or n < cfg.chance_evals:
            return []
        k = self._chance_k
        ln_k = math.log(k)
        if min(low, loss) < ln_k - cfg.chance_tol * ln_k:
            return []  # it was below chance once: it learnt something, then lost it (not 'nothing is learnt')
        self._eval_hi = max(self._eval_hi if self._open == "chance" else -math.inf, *(x[1] for x in run))
        lo = min(x[1] for x in run) if self._open != "chance" else min(self._chance_lo, *(x[1] for x in run))
        self._chance_lo = lo
        self._acc = [x[2] for x in run if x[2] is not None]
        self._first_eval = self._chance_first[0]
        train = statistics.median(self._train) if self._train else None
        if train is not None and train < ln_k * (1 - cfg.chance_train_below):
            return []  # the train loss went below chance: memorising, not stuck (eval_regression's picture)
        acc_med = statistics.median(self._acc) if self._acc else None
        if acc_med is not None and abs(acc_med - 1 / k) > cfg.chance_acc_band:
            return []
        acc_txt = (
            f", accuracy {min(self._acc):.3g}-{max(self._acc):.3g} around 1/{k} = {1 / k:.3g}" if self._acc else ""
        )
        train_txt = f", train loss {train:.4g}" if train is not None else ""
        message = (
            f"stuck at chance: eval loss {lo:.5g}-{self._eval_hi:.5g} at {n} evals in a row since step "
            f"{self._first_eval}{' (every eval so far)' if n == self._evals else ''} is ln {k} = {ln_k:.5g}, "
            f"the loss of a uniform guess over {k} choices"
            f"{acc_txt}{train_txt}: nothing is learnt"
        )
        hint = (
            f"The model outputs the same uniform distribution over the {k} choices for every input. Check that the "
            "inputs reach the model (truncation cutting off the question or options, all inputs identical after "
            "preprocessing), that the labels match the inputs (shuffled separately), that the choice head is "
            "trained (frozen layers, LR too low or 0), and the LR schedule. Loss wiggles on a flat line at chance "
            "are not spikes."
        )
        evidence = {
            "k": k,
            "ln_k": round(ln_k, 6),
            "eval_loss_min": lo,
            "eval_loss_max": self._eval_hi,
            "evals": n,
            "accuracy_median": acc_med,
            "train_loss": train,
        }
        first = self._open is None
        self._open = "chance"
        self._chance_k_open = k
        return [Finding(self.kind, "warning", self._first_eval if first else step, message, hint, evidence)]

    def _collapsed(self, step: int, loss: float, metrics: dict[str, Any]) -> list[Finding]:
        cfg = self.config
        sets: dict[str, dict[str, float]] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not finite(value):
                continue
            toks = _tokens(name)
            role = next((t for t in toks if t in ("accuracy", "acc", "precision", "recall")), None)
            if role is None:
                continue
            prefix = name.lower().replace(role, "")
            sets.setdefault(prefix, {})["accuracy" if role == "acc" else role] = float(value)
        if self._collapse is not None:
            c = self._collapse
            got = sets.get(c["set"], {})
            acc = got.get("accuracy")
            if acc is None:
                return []
            if acc > c["base_rate"] + cfg.collapse_margin:
                self._collapse = None
                self._open = None
                return [
                    self.resolve(
                        step,
                        f"accuracy {acc:.4g} at step {step}, above the base rate {c['base_rate']:.4g}",
                        "The classifier no longer predicts one class only.",
                        {"accuracy": acc},
                    )
                ]
            c["later"].append({"step": step, **got})
            return [self._collapse_finding(step)]
        if self._open is not None:
            return []
        for prefix, got in sets.items():
            acc, prec, rec = got.get("accuracy"), got.get("precision"), got.get("recall")
            if acc is None or prec is None or rec is None:
                continue
            if rec < 1.0 - cfg.collapse_tol or abs(acc - prec) > cfg.collapse_tol or acc >= 1.0 - cfg.collapse_tol:
                continue
            self._collapse = {"set": prefix, "step": step, "base_rate": acc, "loss": loss, "later": [], "how": "recall"}
            self._open = "collapse"
            return [self._collapse_finding(step)]
        for prefix, got in sets.items():
            acc = got.get("accuracy")
            if acc is None or "recall" in got or (prefix not in self._acc_runs and len(self._acc_runs) >= 32):
                continue  # (bounded state: the first 32 eval sets)
            first = self._acc_runs.setdefault(prefix, [acc, step, 0])
            first[2] = first[2] + 1 if first[2] >= 0 and abs(acc - first[0]) <= cfg.collapse_tol else -1
            h = _entropy(acc)
            if first[2] < cfg.collapse_evals or not 0.5 <= acc < 1.0 or abs(loss - h) > cfg.collapse_entropy_tol * h:
                continue
            c = {"set": prefix, "step": first[1], "base_rate": acc, "loss": loss, "later": [], "how": "constant"}
            c["evals"] = first[2]
            self._collapse = c
            self._open = "collapse"
            return [self._collapse_finding(step)]
        return []

    def _collapse_finding(self, step: int) -> Finding:
        c = self._collapse
        assert c is not None
        p, at = c["base_rate"], c["step"]
        h = _entropy(p)
        ent = (
            f"; the eval loss {c['loss']:.4g} is the entropy of that label split ({h:.4g}): "
            "the model outputs the base rate"
            if h > 0 and abs(c["loss"] - h) <= 0.1 * h
            else ""
        )
        best = (
            "; the trainer's best checkpoint is this one (best_metric selects it)"
            if self._best_step is not None and abs(self._best_step - at) <= 1
            else ""
        )
        later = ""
        if c["later"]:
            later = "; later evals stay near it: " + ", ".join(
                f"accuracy {x.get('accuracy', float('nan')):.4g} recall {x.get('recall', float('nan')):.4g} "
                f"(step {x['step']})"
                for x in c["later"][-3:]
            )
        if c["how"] == "constant":
            message = (
                f"classifier collapsed to one class since step {at}: accuracy {p:.4g} at every one of its first "
                f"{c['evals']} evals{ent}: it predicts the majority class, whose share of the eval set is {p:.4g}"
                f"{best}{later}"
            )
        else:
            message = (
                f"classifier collapsed to one class at step {at}: recall 1.0 and accuracy = precision = {p:.4g}, so "
                f"every example is predicted positive and {p:.4g} is the positive rate of the eval set"
                f"{ent}{best}{later}"
            )
        hint = (
            "The model predicts the majority class for everything; F1 of the positive class still looks decent "
            "(recall 1.0), so metric_for_best_model=f1 picks this degenerate checkpoint. Check class balance (weights "
            "or resampling), the LR (1e-5 over a few epochs may not move the head), the inputs (truncated or "
            "identical), and judge by balanced accuracy or macro-F1 instead."
        )
        evidence = {"eval_step": at, "base_rate": p, "eval_loss": c["loss"], "label_entropy": round(h, 5)}
        evidence["later"] = c["later"][-5:]
        return Finding(self.kind, "warning", step, message, hint, evidence)
