"""``init_loss``: the first losses against ln(vocab), and a loss under any plausible floor.

Why the rule is what it is (failure-modes.md C1, C2, C3):

* A freshly initialised LM predicts roughly uniformly, so its first cross-entropy is ≈ ln V.
  ``|loss0 - ln V| > 0.5`` nats on a fresh run (``run_start.resumed`` false) means bad init or
  logit scale (≫), a loss summed over grad-accumulation micro-batches (loss0 / ln V ≈ accum,
  C3), or leakage / pretrained weights (≪). The first ``first_steps`` losses must all be past
  the tolerance on the same side, so one noisy first batch does not fire it.
* Labels not shifted (C2): the model learns to copy its input and the loss falls below the
  data's entropy floor (**sim**: 0.21 at step 50 vs a floor of 1.61). When ``run_start`` declares
  the floor (``loss_floor``; the reference trainer sends its Markov chain's entropy rate) a loss under
  ``floor_fraction`` x floor is impossible. Without a declared floor, a loss under ``leak_loss`` nats
  before ``early_steps`` is impossible only for a language model *pretrained from scratch*, and
  only that is checked: ``run_start`` declares ``vocab_size`` and the run's first loss is near
  ln V or above (a fresh model; a first loss already well under ln V means pretrained weights).
  A fine-tune legitimately goes under 0.1 nats within a few hundred steps (real logs: Whisper
  large-v2 ASR 0.067 at step 450, P-tuning on tiny data 0.065 at 280, a sequence classifier
  exactly 0 from step 50), and a log that does not say how the run started (an imported
  ``trainer_state.json``, a resumed attempt whose first loss we never saw) is not assumed to be
  pretraining. Either rule is critical, after ``leak_consecutive`` steps in a row.
* ln V is the start of a cross-entropy over the vocabulary. A first loss that is ln K for a small
  integer K (up to ``choice_max``, to ``choice_tol`` relative: the printed digits) is a K-way choice
  at its uniform start instead: a DPO/pairwise preference loss is -log sigmoid(0) = ln 2 = 0.6931 while
  the policy equals its reference, a 4-way multiple-choice head starts at ln 4. Such a run is not
  "far below ln V" (no leakage, no pretrained-weights warning from the initial check).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet
from trainmon.wire import Event

__all__ = ["InitLoss", "InitLossConfig"]


@dataclass
class InitLossConfig:
    """``init_loss``: first loss against ln(vocab)."""

    tolerance: float = 0.5
    """|loss0 - ln V| above this many nats is a warning (a fresh model predicts ~uniformly)."""
    first_steps: int = 3
    """The first this-many losses must all be past the tolerance on the same side (one noisy
    first batch is not a bad init)."""
    accum_match: float = 0.2
    """loss0 / ln V within this relative distance of accum_steps points to a summed GA loss."""
    leak_loss: float = 0.1
    """A loss below this many nats early in a run known to start from scratch (run_start declares
    ``vocab_size`` and the first loss is near ln V) means the labels leak. Not applied to
    fine-tunes or to runs that do not say how they started: their loss may legitimately go lower."""
    floor_fraction: float = 0.85
    """A loss below this fraction of the declared data-entropy floor (run_start ``loss_floor``)
    is impossible without leakage; a declared floor replaces ``leak_loss``."""
    early_steps: int = 2000
    """The leakage rule watches steps before this."""
    leak_consecutive: int = 3
    """Consecutive steps under the floor needed (one lucky batch is not a leak)."""
    choice_max: int = 16
    """A first loss that is ln K for an integer K up to this is a K-way choice at its uniform start (DPO's ln 2), not a
    cross-entropy over the vocabulary ..."""
    choice_tol: float = 1e-3
    """... to this relative tolerance (the printed digits: 0.6931 against ln 2 = 0.693147)."""


def _choice_objective(loss0: float, k_max: int, tol: float) -> int | None:
    """K when the first loss is ln K for a small integer K (to ``tol``, relative): the loss of a uniform K-way choice
    (a pairwise preference loss at -log sigmoid(0) = ln 2, a 4-way multiple choice at ln 4), None otherwise."""
    for k in range(2, k_max + 1):
        if abs(loss0 - math.log(k)) <= tol * math.log(k):
            return k
    return None


class InitLoss(Detector):
    """Initial-loss sanity (warning) and label-leakage floor (critical)."""

    kind = "init_loss"
    config_class = InitLossConfig
    order = 130
    priority = 70
    plots = ("loss",)
    localised = False
    consumes = frozenset(("run_start", "step"))

    def __init__(self, config: InitLossConfig) -> None:
        self.config = config
        self._ln_v: float | None = None
        self._accum = 1
        self._fresh = False
        self._first: list[tuple[int, float]] = []
        self._open: str | None = None  # "high", "low" or "leak"
        self._floor: float | None = None
        self._under = 0
        self._leak_done = False
        self._scratch: bool | None = None  # from scratch (None: not known yet, or never)
        self._loss0: float | None = None
        self._loss0_ln_v: float | None = None  # ln V when the first loss was read (a resume may not declare it)
        self._until = self._busy_until()

    def _busy_until(self) -> float:
        """The step from which this attempt's steps have nothing left to check, so that they cost one comparison:
        both rules watch the first steps only (the first losses of a fresh run, and the leak rule before
        ``early_steps`` with a floor to hold the loss to), and a 1M-step log has them all after those."""
        initial = self._fresh or self._open in ("high", "low")
        if (self._fresh and self._scratch is None) or (initial and self._ln_v is not None):
            return math.inf
        if self._leak_done or (self._floor is None and not self._scratch):
            return -math.inf
        return self.config.early_steps

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        if event.kind == "step":
            if f["step"] >= self._until:
                return []
            out = self._on_step(f)
            self._until = self._busy_until()
            return out
        if event.kind == "run_start":
            v = f.get("vocab_size")
            # A fine-tune starts from pretrained weights: its first loss owes nothing to ln V.
            self._ln_v = math.log(v) if isinstance(v, int) and v > 1 and not f.get("pretrained") else None
            acc = f.get("accum_steps")
            self._accum = acc if isinstance(acc, int) and acc > 0 else 1
            self._fresh = not f.get("resumed", False) and attempt == 0
            self._first = []
            if self._fresh:  # a new run: decided again from its first loss
                self._scratch = self._loss0 = self._loss0_ln_v = None
            floor = f.get("loss_floor")
            cfg = f.get("config")
            if floor is None and isinstance(cfg, dict):
                floor = cfg.get("entropy_floor")  # older reference-trainer logs
            self._floor = floor if finite(floor) and floor > 0 else None
            self._until = self._busy_until()
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step from :meth:`_busy_until` on is quiet (:mod:`.quiet`): the first steps of a long log are all the
        detector reads of it."""
        observe_quiet(self.observe, events, attempts, out, self._quiet_until)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        until, end = self._until, batch.quiet_end(i)
        if until == -math.inf:  # every step is quiet: only a start can matter (no step to read)
            return end
        return next(compress(range(i, end), map(operator.lt, batch.column("step")[i:end], repeat(until))), end)

    def _on_step(self, f: dict[str, Any]) -> list[Finding]:
        loss = f.get("loss")
        if not finite(loss):
            return []
        step = f["step"]
        if self._fresh and self._scratch is None:
            # Decided once, on the first loss of a fresh run: near or above ln V is a fresh model.
            self._loss0, self._loss0_ln_v = loss, self._ln_v
            self._scratch = self._ln_v is not None and loss >= self._ln_v - self.config.tolerance
        out: list[Finding] = []
        if (self._fresh or self._open in ("high", "low")) and self._ln_v is not None:
            out.extend(self._initial(step, loss))
        out.extend(self._leak(step, loss))
        return out

    # -- loss0 against ln V -----------------------------------------------------------------

    def _initial(self, step: int, loss: float) -> list[Finding]:
        cfg = self.config
        ln_v = self._ln_v
        assert ln_v is not None
        if self._open in ("high", "low"):
            if self._open == "high" and loss <= ln_v + cfg.tolerance:
                self._open = None
                self._fresh = False
                return [
                    self.resolve(
                        step,
                        f"loss {loss:.4g} back under ln V + {cfg.tolerance} = {ln_v + cfg.tolerance:.4g}",
                        "The initial excess has been trained away; the init or scaling issue may still cost "
                        "early progress.",
                        {"loss": loss, "ln_vocab": round(ln_v, 4)},
                    )
                ]
            return []
        self._first.append((step, loss))
        if len(self._first) < cfg.first_steps:
            return []
        self._fresh = False  # decided once
        losses = [v for _, v in self._first]
        loss0 = losses[0]
        if all(v > ln_v + cfg.tolerance for v in losses):
            side = "high"
        elif all(v < ln_v - cfg.tolerance for v in losses):
            side = "low"
            k = _choice_objective(loss0, cfg.choice_max, cfg.choice_tol)
            if k is not None:
                return []  # a K-way objective at its uniform start (DPO's ln 2): not a cross-entropy over V
        else:
            return []
        self._open = side
        ratio = loss0 / ln_v
        evidence = {
            "loss0": loss0,
            "first_losses": [round(v, 4) for v in losses],
            "ln_vocab": round(ln_v, 4),
            "ratio": round(ratio, 3),
            "accum_steps": self._accum,
        }
        if side == "high":
            if self._accum > 1 and abs(ratio / self._accum - 1) <= cfg.accum_match:
                hint = (
                    f"loss0 / ln V = {ratio:.2f} ≈ accum_steps = {self._accum}: the loss is summed over "
                    "grad-accumulation micro-batches instead of averaged (divide by accum, or normalise by the "
                    "token count of the whole step)."
                )
            else:
                hint = (
                    f"loss0 / ln V = {ratio:.2f} (accum_steps = {self._accum}): the model is confidently wrong at "
                    "init: check the init std and the output-head / logit scale (tied embeddings scaled up, a "
                    "missing 1/sqrt(d) or muP multiplier), and whether the loss is summed rather than averaged."
                )
        else:
            hint = (
                f"loss0 / ln V = {ratio:.2f}: lower than a fresh model can reach. If the run starts from pretrained "
                "weights this is expected; otherwise suspect label leakage (labels not shifted, the target visible "
                "in the input) or a loss that ignores most tokens."
            )
        word = "above" if side == "high" else "below"
        return [
            Finding(
                kind=self.kind,
                severity="warning",
                step=self._first[0][0],
                message=(
                    f"initial loss {loss0:.4g} is {abs(loss0 - ln_v):.2f} nats {word} ln(vocab) = {ln_v:.4g} "
                    f"(first {len(losses)} losses all {word})"
                ),
                hint=hint,
                evidence=evidence,
            )
        ]

    # -- labels not shifted --------------------------------------------------------------------

    def _leak(self, step: int, loss: float) -> list[Finding]:
        cfg = self.config
        if self._leak_done or step >= cfg.early_steps:
            return []
        if self._floor is not None:  # the declared floor is authoritative, from scratch or not
            limit = cfg.floor_fraction * self._floor
            why = f"{cfg.floor_fraction:.0%} of the declared data-entropy floor {self._floor:.4g}"
        elif self._scratch:
            limit = cfg.leak_loss
            loss0, ln_v = self._loss0, self._loss0_ln_v
            why = f"{cfg.leak_loss} nats (a from-scratch run: first loss {loss0:.4g}, ln V {ln_v:.4g})"
        else:
            return []  # a fine-tune, or a run that does not say how it started: no floor is known
        if loss >= limit:
            self._under = 0
            return []
        self._under += 1
        if self._under < cfg.leak_consecutive:
            return []
        self._leak_done = True
        self._open = "leak"
        return [
            Finding(
                kind=self.kind,
                severity="critical",
                step=step,
                message=(
                    f"loss {loss:.4g} at step {step} is below {why} for {self._under} steps: lower than the data allows"
                ),
                hint=(
                    "Labels not shifted / leakage: the model is predicting tokens it can see. Check that targets "
                    "are inputs shifted by one (y = x[1:], not y = x), the causal attention mask, and that the "
                    "eval loss (shifted labels) is not rising while train loss falls."
                ),
                evidence={
                    "loss": loss,
                    "limit": round(limit, 6),
                    "entropy_floor": self._floor,
                    "steps_under": self._under,
                    "loss0": self._loss0,
                },
            )
        ]
