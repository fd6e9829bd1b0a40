"""``nan_inf``: a non-finite loss or gradient norm."""

from __future__ import annotations

import collections
import math
import statistics

from trainmon.hooks.wire import Event
from trainmon.monitor.config import NanInfConfig
from trainmon.monitor.detectors.base import Detector, Finding

__all__ = ["NanInf"]


class NanInf(Detector):
    """Fires on the first step whose loss or pre-clip grad norm is NaN or infinite.

    Whether the grad norm was climbing just before tells a numerical blow-up (LR, fp16
    overflow) from a sudden fault (a bad batch, or hardware corrupting a value), which decides
    what to check first.
    """

    kind = "nan_inf"

    def __init__(self, config: NanInfConfig) -> None:
        self.config = config
        self._log_norms: collections.deque[float] = collections.deque(maxlen=config.precursor_window)
        self._open = False
        self._finite_run = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind != "step":
            return []
        f = event.fields
        step = f["step"]
        bad = {k: f[k] for k in ("loss", "grad_norm") if k in f and not math.isfinite(f[k])}
        if not bad:
            norm = f.get("grad_norm")
            if norm is not None and norm > 0:
                self._log_norms.append(math.log(norm))
            if self._open:
                self._finite_run += 1
                if self._finite_run >= self.config.resolve_after:
                    self._open = False
                    return [self._finding(step, {}, resolved=True)]
            return []
        self._finite_run = 0
        self._open = True
        return [self._finding(step, bad)]

    def _precursor_z(self) -> float | None:
        hist = list(self._log_norms)
        if len(hist) < 5:
            return None
        base = hist[:-3]
        spread = statistics.pstdev(base) or 1e-3
        return (max(hist[-3:]) - statistics.fmean(base)) / spread

    def _finding(self, step: int, bad: dict[str, float], resolved: bool = False) -> Finding:
        z = self._precursor_z()
        numerical = z is not None and z > self.config.precursor_z
        what = " and ".join(f"{k} = {v}" for k, v in bad.items()) or "values finite again"
        if numerical:
            hint = (
                "The grad norm was climbing before the blow-up: numerical instability. Lower the "
                "LR or raise warmup, check the fp16 loss scale, and restart from the last "
                "checkpoint before the climb."
            )
        else:
            hint = (
                "No grad-norm build-up preceded it: suspect the batch at this step (bad data) or "
                "the hardware (silent corruption). Replay the step from the last checkpoint; if it "
                "does not reproduce, drain the node."
            )
        return Finding(
            kind=self.kind,
            severity="critical",
            step=step,
            message=f"non-finite {what} at step {step}" if bad else f"finite values resumed at step {step}",
            hint=hint,
            evidence={**{k: str(v) for k, v in bad.items()}, "precursor_z": z},
            resolved=resolved,
        )
