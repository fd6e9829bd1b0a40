"""``loss_spike``: a loss far above its recent robust level; recoverable or not.

Why the rule is what it is (failure-modes.md S1, and §2 "spike rules shipped in open-source
code"):

* The level is the **median** of the last ``window`` accepted losses and the noise scale sigma is the
  MAD of their step-to-step differences (÷√2). A spike is never admitted to the window, so an
  earlier outlier inflates neither the level nor sigma: OLMo-core's mean + 6sigma over 128 steps is
  blinded for 128 steps by the very spike it just saw, and a falling trend inflates a plain
  std. Differences cancel the trend, so the rule stays sensitive through warmup and decay.
* It fires on the spike step itself (a rollback decision wants the exact step and batch).
* Spikes often self-recover (BLOOM's first one took ~30 iterations): the anomaly opens as a
  warning, resolves when the loss is back in the band within ``recover_steps``, and escalates
  to critical with the rollback recipe (PaLM/BLOOM: restart before the spike, skip the
  batches around it) when it is not.
* Grad norm leads loss in real spikes (BLOOM 0.17 → 960 over ~5 steps): the hint says whether
  it rose first (optimisation instability) or not (a bad batch, named by its fingerprint).
"""

from __future__ import annotations

import collections
import math
from typing import Any

from trainmon.hooks.wire import Event
from trainmon.monitor.config import LossSpikeConfig
from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["LossSpike"]


class LossSpike(Detector):
    """Robust loss-spike detector with a recoverable/not-recoverable lifecycle."""

    kind = "loss_spike"

    def __init__(self, config: LossSpikeConfig) -> None:
        self.config = config
        self._level = RollingWindow(config.window)
        self._diffs = RollingWindow(2 * config.window)
        self._prev: float | None = None
        self._norms = RollingWindow(config.window)
        self._recent: collections.deque[tuple[int, float | None, float | None]] = collections.deque(
            maxlen=config.precursor_steps + 1
        )
        self._spike: dict[str, Any] | None = None  # the open spike, if any
        self._lrs: collections.deque[list[float]] = collections.deque(maxlen=config.precursor_steps + 1)

    # -- statistics --------------------------------------------------------------------------

    def _sigma(self, level: float) -> float:
        """Noise scale from the MAD of accepted step-to-step differences, with a small floor."""
        if len(self._diffs) < 4:
            return max(abs(level) * 0.01, 1e-6)
        n = len(self._diffs)
        sigma = 1.4826 * self._diffs.median() / math.sqrt(2.0) * (1.0 + 1.7 / math.sqrt(n))
        return max(sigma, abs(level) * 1e-3, 1e-6)

    def _threshold(self, level: float, sigma: float, z: float) -> float:
        return level + max(z * sigma, self.config.min_rel * abs(level), self.config.min_abs)

    def _accept(self, loss: float) -> None:
        if self._prev is not None:
            self._diffs.add(abs(loss - self._prev))
        self._prev = loss
        self._level.add(loss)

    # -- events ------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            if not event.fields.get("resumed", False):
                self.__init__(self.config)  # a fresh run (same id, restarted from scratch): a new baseline
            self._prev = None  # a resume may legitimately move the level a little; keep the window
            return []
        if event.kind != "step":
            return []
        f = event.fields
        step = f["step"]
        loss = f.get("loss")
        norm = f.get("grad_norm")
        norm = norm if finite(norm) and norm > 0 else None
        out: list[Finding] = []
        if not finite(loss):
            self._recent.append((step, None, norm))
            return out  # non-finite values are nan_inf's business
        if self._spike is not None:
            out.extend(self._follow(step, loss))
        elif len(self._level) >= self.config.min_history:
            level = self._level.median()
            sigma = self._sigma(level)
            if loss > self._threshold(level, sigma, self.config.z):
                out.append(self._open(event, step, loss, level, sigma, norm))
        if self._spike is None:
            self._accept(loss)
            if norm is not None:
                self._norms.add(norm)
        lrs = f.get("lr")
        if isinstance(lrs, list):
            self._lrs.append(list(lrs[:64]))
        self._recent.append((step, loss, norm))
        return out

    def _open(self, event: Event, step: int, loss: float, level: float, sigma: float, norm: float | None) -> Finding:
        cfg = self.config
        f = event.fields
        norm_med = self._norms.median() if len(self._norms) >= 4 else None
        precursor = None
        if norm_med:
            before = [(s, n) for s, _, n in self._recent if n is not None][-cfg.precursor_steps :]
            risen = [(s, n) for s, n in before if n > cfg.precursor_ratio * norm_med]
            if risen:
                precursor = risen[0]
        lr_jump = None
        lrs = f.get("lr")
        recent_lrs = [*self._lrs, lrs] if isinstance(lrs, list) else list(self._lrs)
        if len(recent_lrs) >= 2:
            base = recent_lrs[0]  # LRs of a step before the precursor window
            for cur in recent_lrs[1:]:
                if len(cur) != len(base):
                    continue
                for g, (now, was) in enumerate(zip(cur, base, strict=True)):
                    if finite(now) and finite(was) and was > 0 and now > 3 * was:
                        lr_jump = (g, was, now)
                        break
                if lr_jump:
                    break
        self._spike = {
            "step": step,
            "loss": loss,
            "level": level,
            "sigma": sigma,
            "band": self._threshold(level, sigma, cfg.recover_z),
            "peak": loss,
            "escalated": False,
            "fingerprint": f.get("batch_fingerprint"),
        }
        z = (loss - level) / sigma
        evidence: dict[str, Any] = {
            "loss": loss,
            "baseline_median": round(level, 6),
            "sigma": round(sigma, 6),
            "z": round(z, 1),
            "ratio": round(loss / level, 3) if level else None,
        }
        if norm is not None:
            evidence["grad_norm"] = norm
        if norm_med:
            evidence["grad_norm_median"] = round(norm_med, 6)
        if f.get("batch_fingerprint"):
            evidence["batch_fingerprint"] = f["batch_fingerprint"]
        causes = []
        if precursor is not None:
            evidence["grad_norm_rose_at"] = precursor[0]
            causes.append(
                f"the grad norm rose first (step {precursor[0]}: {precursor[1]:.3g} vs median {norm_med:.3g}): "
                "optimisation instability (BLOOM/OLMo ordering): lower the LR or lengthen warmup, check the "
                "fp16 loss scale and attention-logit growth"
            )
        elif norm is not None and norm_med and norm > cfg.precursor_ratio * norm_med:
            causes.append(
                f"the grad norm jumped at the same step ({norm:.3g} vs median {norm_med:.3g}) with no build-up: "
                "a bad batch or a sudden change to the weights or LR"
            )
        else:
            causes.append("the grad norm did not rise first: most likely the data of this batch")
        if lr_jump is not None:
            g, was, now = lr_jump
            evidence["lr_jump"] = [g, was, now]
            causes.insert(0, f"the LR of param group {g} jumped {now / was:.0f}x ({was:.3g} -> {now:.3g})")
        fp = f.get("batch_fingerprint")
        batch = f"; inspect batch {fp} (step {step})" if fp else f"; inspect the batch of step {step}"
        lo = max(0, step - cfg.skip_back)
        hint = (
            "; ".join(causes)
            + batch
            + f". If the loss is not back within {cfg.recover_steps} steps, roll back to the checkpoint before "
            f"step {step} and skip the batches in [{lo}, {step}]."
        )
        return Finding(
            kind=self.kind,
            severity="warning",
            step=step,
            message=(
                f"loss spike at step {step}: {loss:.4g} vs a median of {level:.4g} "
                f"({loss / level:.2f}x, {z:.1f} robust sigma)"
                if level
                else f"loss spike at step {step}: {loss:.4g} ({z:.1f} robust sigma)"
            ),
            hint=hint,
            evidence=evidence,
        )

    def _follow(self, step: int, loss: float) -> list[Finding]:
        """While a spike is open: resolve when back in the band, escalate when it stays up."""
        sp = self._spike
        assert sp is not None
        cfg = self.config
        sp["peak"] = max(sp["peak"], loss)
        since = step - sp["step"]
        if loss <= sp["band"]:
            self._spike = None
            how = "recovered" if not sp["escalated"] else "finally recovered"
            return [
                Finding(
                    kind=self.kind,
                    severity="critical" if sp["escalated"] else "warning",
                    step=step,
                    message=(
                        f"loss {how} at step {step} ({loss:.4g}, band {sp['band']:.4g}) "
                        f"{since} steps after the spike at step {sp['step']}"
                    ),
                    hint="Recoverable spike: no action needed unless spikes repeat; then lower the LR.",
                    evidence={"loss": loss, "band": round(sp["band"], 6), "spike_step": sp["step"], "steps": since},
                    resolved=True,
                )
            ]
        if not sp["escalated"] and since >= cfg.recover_steps:
            sp["escalated"] = True
            x = sp["step"]
            lo = max(0, x - cfg.skip_back)
            fp = f" (batch {sp['fingerprint']})" if sp["fingerprint"] else ""
            return [
                Finding(
                    kind=self.kind,
                    severity="critical",
                    step=step,
                    message=(
                        f"loss has not recovered {since} steps after the spike at step {x}{fp}: {loss:.4g} vs "
                        f"{sp['level']:.4g} before it. Roll back to the checkpoint before step {x} and skip the "
                        f"batches in [{lo}, {x}]."
                    ),
                    hint=(
                        f"Not recoverable on its own: roll back to the checkpoint before step {x}, skip the batches "
                        f"in [{lo}, {x}], and lower the LR if it happens again (PaLM/BLOOM practice)."
                    ),
                    evidence={
                        "loss": loss,
                        "baseline_median": round(sp["level"], 6),
                        "spike_step": x,
                        "peak": sp["peak"],
                        "steps_since": since,
                    },
                )
            ]
        return []
