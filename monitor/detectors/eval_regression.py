"""``eval_regression``: evaluation loss rising while training loss falls, or jumping after a resume.

Why the rule is what it is (DESIGN "The detections"; failure-modes.md R5-R7 and C2):

* Overfitting or a train/eval mismatch shows as the held-out loss going up for several evals in
  a row while the train loss keeps falling. Eval sets are small and noisy, so it takes
  ``rising_evals`` consecutive increases, a total rise beyond ``min_rise_rel``/``min_rise_abs``,
  the latest eval ``above_best_rel`` above the best one, and the train level (median of the last
  ``train_window`` train losses) lower now than at the best eval. Leaky labels (C2) produce the
  same picture, far stronger.
* A resume that silently breaks the model (wrong weights, a different tokenizer or topology,
  R7) shows at the first eval after the resume as a jump against the last eval before it.

Resolves when an eval comes back within the noise margin of the best (or pre-resume) eval.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from trainmon.hooks.wire import Event
from trainmon.monitor.config import EvalRegressionConfig
from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["EvalRegression"]


class EvalRegression(Detector):
    """Consecutive eval-loss increases against a falling train loss; eval jump after resume."""

    kind = "eval_regression"

    def __init__(self, config: EvalRegressionConfig) -> None:
        self.config = config
        self._train = RollingWindow(config.train_window)
        # (step, eval loss, train level at that eval, attempt)
        self._evals: collections.deque[tuple[int, float, float | None, int]] = collections.deque(maxlen=config.history)
        self._best: tuple[int, float, float | None] | None = None
        self._open: dict[str, Any] | None = None

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        if event.kind == "run_start" and not f.get("resumed", False):
            self.__init__(self.config)  # a fresh run: its evals are not comparable with the previous one's
            return []
        if event.kind == "step":
            loss = f.get("loss")
            if finite(loss):
                self._train.add(loss)
            return []
        if event.kind != "eval":
            return []
        loss = f.get("loss")
        if not finite(loss):
            return []
        step = f["step"]
        train = self._train.median() if len(self._train) else None
        prev = self._evals[-1] if self._evals else None
        self._evals.append((step, loss, train, attempt))
        out: list[Finding] = []
        if self._open is not None:
            out.extend(self._follow(step, loss))
        elif prev is not None and attempt > prev[3]:
            out.extend(self._resume_jump(step, loss, prev, attempt))
        else:
            out.extend(self._rising(step, loss, train))
        if self._best is None or loss < self._best[1]:
            self._best = (step, loss, train)
        return out

    def _margin(self, ref: float, rel: float, abs_: float) -> float:
        return max(rel * abs(ref), abs_)

    def _resume_jump(self, step: int, loss: float, prev: tuple[int, float, float | None, int], attempt: int) -> list:
        cfg = self.config
        jump = loss - prev[1]
        if jump <= self._margin(prev[1], cfg.resume_jump_rel, cfg.resume_jump_abs):
            return []
        self._open = {"ref": prev[1], "why": "resume"}
        return [
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"eval loss {loss:.4g} at step {step}, the first eval after the resume (attempt {attempt}), "
                    f"is {jump:+.3g} above the last one before it ({prev[1]:.4g} at step {prev[0]})"
                ),
                hint=(
                    "The resumed model is worse than the one that was checkpointed: check that the right checkpoint "
                    "was loaded (path, step), that all weights and the optimizer state were restored, and that the "
                    "tokenizer, world size and batch are unchanged (see bad_resume findings around the resume)."
                ),
                evidence={"eval_loss": loss, "before_resume": prev[1], "before_step": prev[0], "attempt": attempt},
            )
        ]

    def _rising(self, step: int, loss: float, train: float | None) -> list[Finding]:
        cfg = self.config
        n = cfg.rising_evals + 1
        if len(self._evals) < n or self._best is None:
            return []
        tail = list(self._evals)[-n:]
        if any(b[1] <= a[1] for a, b in itertools.pairwise(tail)):
            return []
        if len({e[3] for e in tail}) > 1:
            return []  # a resume in between: the jump rule's business
        rise = loss - tail[0][1]
        if rise < self._margin(tail[0][1], cfg.min_rise_rel, cfg.min_rise_abs):
            return []
        best_step, best, best_train = self._best
        if loss < best + self._margin(best, cfg.above_best_rel, cfg.min_rise_abs):
            return []
        if train is None or best_train is None or train >= best_train:
            return []  # train loss did not fall: not the overfitting picture
        self._open = {"ref": best, "why": "rising"}
        return [
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"eval loss rose {cfg.rising_evals} evals in a row to {loss:.4g} at step {step} "
                    f"(best {best:.4g} at step {best_step}) while the train loss fell {best_train:.4g} -> {train:.4g}"
                ),
                hint=(
                    "Train and eval disagree: overfitting (too many epochs over a small dataset, data repeated), "
                    "or the train loss is flattered by leakage (labels not shifted, eval data in the train set); "
                    "check init_loss findings and the data pipeline, then stop at or roll back to the best "
                    f"checkpoint (around step {best_step})."
                ),
                evidence={
                    "eval_losses": [round(e[1], 5) for e in tail],
                    "eval_steps": [e[0] for e in tail],
                    "best_eval": best,
                    "best_step": best_step,
                    "train_at_best": round(best_train, 5),
                    "train_now": round(train, 5),
                },
            )
        ]

    def _follow(self, step: int, loss: float) -> list[Finding]:
        cfg = self.config
        assert self._open is not None
        ref = self._open["ref"]
        if loss <= ref + self._margin(ref, cfg.above_best_rel, cfg.min_rise_abs) / 2:
            self._open = None
            return [
                Finding(
                    kind=self.kind,
                    severity="info",
                    step=step,
                    message=f"eval loss back to {loss:.4g} at step {step} (reference {ref:.4g})",
                    hint="The eval regression has cleared.",
                    evidence={"eval_loss": loss, "reference": ref},
                    resolved=True,
                )
            ]
        return []
