"""``nan_inf``: a non-finite loss or gradient norm, and a loss of exactly 0.0 that stands for one.

Two conditions share the anomaly kind (one anomaly per run and rank at a time):

* **non-finite**: the loss or the pre-clip grad norm is NaN or infinite. The anomaly opens at the
  first non-finite step and its message keeps naming that step while it stays current (how many
  steps, still going). What came before decides the reading: nothing finite since the attempt
  started is a setup or initialisation bug (or, after a resume, the checkpoint); a grad norm or loss
  climbing into it is a numerical blow-up (LR, fp16 overflow) when it climbs out of its own scatter
  (the last losses above the upper quartile of the ones before, not merely 1.3x the lowest of a noisy
  series); too little history says little, so
  the setup is checked first; a steady run that suddenly goes NaN points at the batch or the
  hardware. An infinite grad norm on a step the fp16 scaler skipped, with a finite loss, is the
  scaler doing its job and not a finding.
* **zero loss**: exactly 0.0 for ``zero_confirm`` logged steps in a row, straight after a loss of
  ``zero_jump_min_loss`` or more (or from the first logged step). HF Trainer's
  ``logging_nan_inf_filter`` (on by default) logs a window whose steps were all NaN/inf as 0.0, and
  a loss that is really 0.0 means nothing is being trained on; neither is convergence, which
  reaches exact zeros only through small values (a rounded, converged classification loss).
  A warning, not critical: the non-finite values are inferred, not seen.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import carries, columns, observe_runs, read
from trainmon.wire import Event

__all__ = ["NanInf", "NanInfConfig"]


@dataclass
class NanInfConfig:
    """``nan_inf``: any non-finite loss or grad norm, and a loss that is exactly 0.0 where no real
    loss can be (the way HF Trainer logs a window of NaN steps)."""

    resolve_after: int = 20
    """Consecutive finite steps after which the anomaly is marked resolved."""
    precursor_window: int = 20
    """Steps of grad-norm and loss history used to tell a numerical blow-up from a sudden fault."""
    precursor_z: float = 3.0
    """A log grad-norm z-score above this before the NaN means it was building up..."""
    precursor_norm_ratio: float = 2.0
    """...if the norm also reached this many times its recent median: on a quiet series a 1.4x step is
    3 sigma, and calling a sudden NaN after it numerical instability sends the user to the LR instead
    of the batch or the hardware (2 of 102 synthetic sudden NaNs did)."""
    precursor_loss_rise: float = 1.3
    """The median of the last 3 finite losses at this many times the lowest loss before them (within
    ``precursor_window``) means the loss was climbing into the NaN: a numerical blow-up, which is all
    a log without grad norms shows (nanochat's SFT went 5.5 -> 9.5 -> NaN). Multiplicative noise of
    5% puts that ratio near 1.15, so 1.3 is a real climb."""
    early_steps: int = 10
    """Fewer finite steps than this before the first non-finite one are too little history to call
    it a sudden fault (the grad-norm precursor needs a baseline): the hint points at the setup (LR,
    warmup, init scale, fp16) instead of a bad batch or the hardware."""
    zero_confirm: int = 3
    """Consecutive logged losses of exactly 0.0 before the zero rule speaks: three logging windows
    in a row with no finite-loss step, not one odd window."""
    zero_jump_min_loss: float = 0.1
    """A loss of exactly 0.0 right after a logged loss at least this large (or with no nonzero loss
    before it) is not convergence: a converging loss passes through small values first (HF rounds to
    4 digits and averages each window, so a classification fine-tune shows 0.0003, 0.0002, 0.0001
    before its zeros), while HF's ``logging_nan_inf_filter`` turns an all-NaN window into 0.0 straight
    after a real loss (LLaMA-Factory: 122.14, then 0.0 for 36 windows). Falling 2000x from 0.1 to
    under 5e-5 within one logging window is not a descent."""


_NAMES = {"loss": "loss", "grad_norm": "grad norm"}
# Frameworks whose logged loss goes through HF Trainer's logging_nan_inf_filter.
_HF_FRAMEWORKS = ("hf", "transformers", "llamafactory", "llama-factory", "ms-swift", "swift", "trl")


def _series_name(config: Any) -> str | None:
    """The column or tag an importer read the loss from (``column_mapping``/``tag_mapping``), when it is
    not plainly called ``loss``: the message names what the user will find in their own log."""
    if not isinstance(config, dict):
        return None
    for key in ("column_mapping", "tag_mapping"):
        mapping = config.get(key)
        name = mapping.get("loss") if isinstance(mapping, dict) else None
        if isinstance(name, str) and name and name.lower() not in ("loss", "train/loss"):
            return name[:120]
    return None


class NanInf(Detector):
    """Non-finite loss or grad norm from its first step, with the reading its history supports;
    exact-zero losses that hide non-finite ones."""

    kind = "nan_inf"
    config_class = NanInfConfig
    order = 10
    priority = 10
    plots = ("loss", "grad")
    localised = True
    consumes = frozenset(("run_start", "step"))
    batch_from = 64  # per event, screened against observed: 2 events 8.9 us against 1.6, 32 0.84 against 0.57, 128 0.40
    # against 0.53

    def __init__(self, config: NanInfConfig) -> None:
        self.config = config
        # grad norms above zero; their logs are taken only when a first non-finite value asks what came before
        self._norms: collections.deque[float] = collections.deque(maxlen=config.precursor_window)
        self._losses: collections.deque[float] = collections.deque(maxlen=config.precursor_window)
        self._finite_steps = 0  # steps with finite values, over the detector's life (history for the precursor)
        self._attempt_finite = False  # a finite step since the current attempt's run_start
        self._resumed = False  # the current attempt continues from a checkpoint
        self._framework = ""
        self._loss_series: str | None = None  # the log's own name for the loss, when an importer chose it
        self._open: str | None = None  # "nonfinite", "zero" or None
        self._finite_run = 0  # consecutive finite (nonzero, for the zero note) steps while open
        # the non-finite episode
        self._ep: dict[str, Any] = {}
        # exact zeros
        self._last_nonzero: tuple[int, float] | None = None  # (step, loss) of the last finite nonzero loss
        self._zero_run: list[int] = []  # first step and count of the current run of exact zeros
        self._zero_before: tuple[int, float] | None = None  # the nonzero loss just before that run
        # the open zero note: first zero step, zero steps, logged steps since, last zero step
        self._z_first = self._z_count = self._z_seen = self._z_last = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        if event.kind != "step":
            if event.kind == "run_start":
                self._attempt_finite = False
                self._resumed = bool(f.get("resumed"))
                self._framework = str(f.get("framework") or "").lower()
                self._loss_series = _series_name(f.get("config"))
            return []
        step = f["step"]
        loss, norm = f.get("loss"), f.get("grad_norm")
        # each value tested once: a healthy step (a finite loss and norm, nothing open) costs a few comparisons
        loss_ok = finite(loss)
        norm_ok = norm is None or finite(norm)
        if not (loss_ok and norm_ok):
            if not norm_ok and loss_ok and f.get("skipped") is True:
                norm, norm_ok = None, True  # an fp16 overflow the scaler skipped: expected, loss_scale_collapse's
            if not (norm_ok and (loss_ok or loss is None)):
                bad = {k: v for k, v in (("loss", loss), ("grad_norm", norm)) if v is not None and not finite(v)}
                return self._nonfinite(step, bad, hidden_loss=loss == 0.0)
            if loss is None and norm is None:
                return []
        self._attempt_finite = True
        self._finite_steps += 1
        if norm is not None and norm > 0:
            self._norms.append(norm)
        if self._open == "nonfinite":
            self._ep["seen"] += 1
            if loss == 0.0:
                return []  # neither a real loss nor a NaN: does not resolve the episode
            self._finite_run += 1
            if self._finite_run >= self.config.resolve_after:
                return [self._close_nonfinite(step)]
            return []
        if loss is None:
            return []
        if loss != 0.0:
            self._losses.append(loss)
            self._last_nonzero = (step, loss)
            if self._zero_run:
                self._zero_run = []
            if self._open == "zero":
                self._finite_run += 1
                self._z_seen += 1
                if self._finite_run >= self.config.resolve_after:
                    return [self._close_zero(step)]
            return []
        return self._zero(step)

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event, in fewer steps: while nothing is open, a step whose loss is finite and
        nonzero and whose grad norm is finite (or absent) finds nothing and only moves the history a first
        non-finite value would read; the batch's columns pick those steps out at once (nearly all of a long log),
        and a run of them moves that history in one go (:meth:`_quiet`). Every other event, and every step while
        something is open, is :meth:`observe`'s (:func:`observe_runs`)."""
        screen: tuple[list[dict[str, Any]], list[Any], list[Any], np.ndarray] | None = None

        def take(i: int) -> int:
            nonlocal screen
            if self._open is not None:
                return i
            if screen is None:
                screen = self._screen(events)
            fields, losses, norms, loud = screen
            at = int(np.searchsorted(loud, i))
            j = int(loud[at]) if at < len(loud) else len(events)
            if j > i:
                self._quiet(fields, losses, norms, i, j)
            return j

        observe_runs(self.observe, events, attempts, out, take)

    def _screen(self, events: list[Event]) -> tuple[list[dict[str, Any]], list[Any], list[Any], np.ndarray]:
        """The batch's fields, losses and grad norms, and the positions of its events that are not quiet steps."""
        fields, others, (losses, norms) = columns(events, "loss", "grad_norm")
        # a validated event's loss and grad norm are floats when present (trainmon.wire); absent reads as NaN here (the
        # batch's arrays, which other detectors read too)
        batch = read(events)
        loss = batch.floats("loss")
        quiet = np.isfinite(loss) & (loss != 0.0)
        if carries(events, "grad_norm"):  # else every step's is absent, which is fine: no look at them
            norm_ok = np.isfinite(batch.floats("grad_norm"))
            # absent or not finite: only those are asked which (a log with grad norms has none, where a look at each
            # for a None cost 0.015 s a million steps)
            odd = np.flatnonzero(~norm_ok).tolist()
            norm_ok[odd] = [norms[k] is None for k in odd]
            quiet &= norm_ok
        quiet[others] = False
        return fields, losses, norms, np.flatnonzero(~quiet)

    def _quiet(
        self, fields: list[dict[str, Any]], losses: list[float], norms: list[float | None], i: int, j: int
    ) -> None:
        """What :meth:`observe` leaves after the quiet steps ``i:j`` with nothing open: of their histories, only the
        last entries stay."""
        self._attempt_finite = True
        self._finite_steps += j - i
        keep = self._norms.maxlen or 0
        got: list[float] = []
        for k in range(j - 1, i - 1, -1):  # the last grad norms above zero, usually the last few steps
            x = norms[k]
            if x is not None and x > 0:
                got.append(x)
                if len(got) == keep:
                    break
        self._norms.extend(reversed(got))
        self._losses.extend(losses[max(i, j - (self._losses.maxlen or 0)) : j])
        self._last_nonzero = (fields[j - 1]["step"], losses[j - 1])
        if self._zero_run:
            self._zero_run = []

    # -- non-finite ---------------------------------------------------------------------------------

    def _nonfinite(self, step: int, bad: dict[str, float], *, hidden_loss: bool) -> list[Finding]:
        out = []
        if self._open == "zero":
            out.append(self._close_zero(step, nan_at=step))
        self._zero_run = []
        self._finite_run = 0
        if self._open != "nonfinite":
            self._open = "nonfinite"
            self._ep = {"first": step, "values": {}, "count": 0, "seen": 0, "hidden_loss": False, **self._cause()}
        ep = self._ep
        # a non-finite grad norm with the loss logged as exactly 0.0: the loss is non-finite too, filtered
        ep["hidden_loss"] |= hidden_loss and "loss" not in ep["values"]
        for k, v in bad.items():
            ep["values"].setdefault(k, str(v))
        ep["count"] += 1
        ep["seen"] += 1
        ep["last"] = step
        out.append(self._nonfinite_finding(step))
        return out

    def _cause(self) -> dict[str, Any]:
        """How the history before the first non-finite step reads: setup, resume, numerical, early, sudden."""
        z = self._precursor_z()
        rise = self._loss_rise()
        cfg = self.config
        norm_climb = z is not None and z > cfg.precursor_z and self._norm_ratio() >= cfg.precursor_norm_ratio
        loss_climb = rise is not None and rise >= cfg.precursor_loss_rise and self._loss_above_range()
        if not self._attempt_finite:
            cause = "resume" if self._resumed else "setup"
        elif norm_climb or loss_climb:
            cause = "numerical"
        elif self._finite_steps < self.config.early_steps:
            cause = "early"
        else:
            cause = "sudden"
        return {
            "cause": cause,
            "precursor_z": z,
            "loss_rise": rise,
            "norm_climb": norm_climb,
            "loss_climb": loss_climb,
            "finite_before": self._finite_steps,
            "has_norms": bool(self._norms),
        }

    def _log_norms(self) -> list[float]:
        return [math.log(n) for n in self._norms]

    def _precursor_z(self) -> float | None:
        hist = self._log_norms()
        if len(hist) < 5:
            return None
        base = hist[:-3]
        spread = statistics.pstdev(base) or 1e-3
        return (max(hist[-3:]) - statistics.fmean(base)) / spread

    def _norm_ratio(self) -> float:
        """The largest of the last 3 grad norms over the median before them: a z-score alone calls a
        1.4x step on a quiet series a climb, and a sudden NaN after it numerical instability."""
        hist = self._log_norms()
        return math.exp(max(hist[-3:]) - statistics.median(hist[:-3]))

    def _loss_rise(self) -> float | None:
        """The median of the last 3 finite losses over the lowest one before them (a climb into the NaN)."""
        hist = list(self._losses)
        if len(hist) < 4:
            return None
        low = min(hist[:-3])
        return statistics.median(hist[-3:]) / low if low > 0 else None

    def _loss_above_range(self) -> bool:
        """The last 3 finite losses sit above the upper quartile of the ones before them: the loss is at
        the top of its recent range, not inside its own scatter. A noisy loss (a PINN's residuals swing
        2-9x from one epoch to the next) is often 1.3x its recent low; a climb into a NaN is above
        nearly all of its recent values (nanochat's SFT: 9.5 over 5.5-8.5)."""
        hist = list(self._losses)
        base = hist[:-3]
        top = statistics.quantiles(base, n=4)[2] if len(base) >= 2 else max(base)
        return statistics.median(hist[-3:]) > top

    def _what(self) -> str:
        names = {**_NAMES, **({"loss": f"loss ({self._loss_series})"} if self._loss_series else {})}
        what = " and ".join(
            f"{names[k]} ({v})" if names[k] == _NAMES[k] else f"{names[k][:-1]}: {v})"
            for k, v in self._ep["values"].items()
        )
        return what + (" (the loss logged as exactly 0.0)" if self._ep["hidden_loss"] else "")

    def _severity(self) -> str:
        """Critical when the loss is (or hides) a non-finite value; a grad norm alone with a finite loss
        is a warning (an fp16 overflow the scaler skipped looks like that)."""
        return "critical" if "loss" in self._ep["values"] or self._ep["hidden_loss"] else "warning"

    def _nonfinite_finding(self, step: int) -> Finding:
        ep = self._ep
        first, count, seen = ep["first"], ep["count"], ep["seen"]
        what = self._what()
        if ep["cause"] in ("setup", "resume"):
            where = "the first logged step" if ep["cause"] == "setup" else "the first step after the resume"
            tail = "nothing finite yet"
            if count > 1:
                tail = f"nothing finite in {count} logged steps, still at step {step}"
            message = f"{what} non-finite from {where} (step {first}): {tail}"
        elif count == 1:
            message = f"{what} non-finite at step {first}"
        elif count == seen:
            message = f"{what} non-finite since step {first}: {count} logged steps in a row, still at step {step}"
        else:
            message = (
                f"{what} non-finite since step {first}: {count} of the {seen} logged steps since, latest at step {step}"
            )
        return Finding(
            kind=self.kind,
            severity=self._severity(),
            step=step,
            message=message,
            hint=self._hint(),
            evidence=self._evidence(),
        )

    def _evidence(self) -> dict[str, Any]:
        ep = self._ep
        return {
            **ep["values"],  # "loss": "nan", as before
            "values": dict(ep["values"]),
            "first_step": ep["first"],
            "last_nonfinite_step": ep["last"],
            "nonfinite_steps": ep["count"],
            "logged_steps_since_first": ep["seen"],
            "cause": ep["cause"],
            "loss_logged_as_zero": ep["hidden_loss"],
            "finite_steps_before": ep["finite_before"],
            "precursor_z": ep["precursor_z"],
            "loss_rise": ep["loss_rise"],
        }

    def _hint(self) -> str:
        hint = self._cause_hint()
        if self._ep["hidden_loss"]:
            hint = (
                "The loss is logged as exactly 0.0 while the grad norm is non-finite: the loss is non-finite too, "
                "hidden by the logging (HF Trainer's logging_nan_inf_filter logs an all-NaN window as 0.0). " + hint
            )
        return hint

    def _cause_hint(self) -> str:
        ep = self._ep
        cause = ep["cause"]
        if cause in ("setup", "resume", "early") and "loss" not in ep["values"] and not ep["hidden_loss"]:
            return (
                "Only the grad norm is non-finite; the loss is finite. In an fp16 run the loss scaler starts (or, "
                "after a resume, restarts) at a scale too high and skips the steps that overflow until it finds its "
                "scale: expected at the start, and over once finite norms follow. Without a loss scaler (bf16, "
                "fp32) the update carries the NaN into the weights and the loss goes non-finite next: then check "
                "the initial weights (or the checkpoint) and the LR warmup."
            )
        if cause == "setup":
            return (
                "Nothing was finite from the first logged step on, so this is not a bad batch or the hardware: it "
                "is the setup or the initialisation. Check the initial weights (or the checkpoint they were loaded "
                "from) for NaN/inf, compute the loss of one batch by hand before any optimizer step (labels all "
                "masked or a zero token count divide by zero; a log of 0), check the input normalisation, and an "
                "fp16 model's first forward pass (overflow). Stop the run: no step since has trained."
            )
        if cause == "resume":
            return (
                "Values were finite before the resume and nothing has been finite since: suspect the checkpoint "
                "it resumed from (NaN/inf in the weights or the optimizer state) or a setting that changed on "
                "resume (LR, loss scale). Check the checkpoint's tensors for NaN/inf and restart from an earlier one."
            )
        if cause == "numerical":
            climbed = [s for s, c in (("grad norm", ep["norm_climb"]), ("loss", ep["loss_climb"])) if c]
            detail = []
            if ep["norm_climb"]:
                detail.append(f"log grad norm {ep['precursor_z']:.1f} sigma over its recent level")
            if ep["loss_climb"]:
                detail.append(f"loss {ep['loss_rise']:.2f}x its recent low")
            return (
                f"The {' and the '.join(climbed)} {'were' if len(climbed) > 1 else 'was'} climbing before the "
                f"blow-up ({', '.join(detail)}): numerical instability. Lower the LR or raise warmup, check the "
                "fp16 loss scale, and restart from the last checkpoint before the climb."
            )
        if cause == "early":
            return (
                f"It went non-finite after only {ep['finite_before']} finite steps, too few to tell a blow-up from "
                "a sudden fault. This early it is usually the setup: an LR too high for the initialisation (no or "
                "too short warmup), too large an init scale, fp16 without loss scaling, inputs not normalised. "
                "Check those before looking for a single bad batch."
            )
        steady = (
            "the grad norm and the loss were not climbing"
            if ep["has_norms"]
            else "the loss was not climbing; no grad norm"
        )
        hint = (
            f"No build-up preceded it ({steady}): suspect the batch at step {ep['first']} (bad data) or the "
            "hardware (silent corruption). Replay the step from the last checkpoint; if it does not reproduce, "
            "drain the node."
        )
        if "loss" not in ep["values"] and not ep["hidden_loss"]:
            hint += (
                " Only the grad norm is non-finite and the loss is not: in an fp16 run this is an overflow the loss "
                "scaler skips (expected now and then); otherwise the next update spreads it into the weights."
            )
        return hint

    def _close_nonfinite(self, step: int) -> Finding:
        ep = self._ep
        self._open = None
        self._finite_run = 0
        first_finite = step - self.config.resolve_after + 1
        span = f"step {ep['first']}" if ep["first"] == ep["last"] else f"steps {ep['first']} to {ep['last']}"
        return Finding(
            kind=self.kind,
            severity=self._severity(),
            step=step,
            message=(
                f"finite again since step {first_finite}: {self._what()} was non-finite at {span} "
                f"({ep['count']} logged steps)"
            ),
            hint=self._hint(),
            evidence=self._evidence(),
            resolved=True,
        )

    # -- exact zeros --------------------------------------------------------------------------------

    def _zero(self, step: int) -> list[Finding]:
        self._finite_run = 0
        if self._open == "zero":
            self._z_count += 1
            self._z_seen += 1
            self._z_last = step
            return [self._zero_finding(step, step)]
        if not self._zero_run:
            self._zero_run = [step, 0]
            self._zero_before = self._last_nonzero
        self._zero_run[1] += 1
        first, count = self._zero_run
        before = self._zero_before
        if count < self.config.zero_confirm:
            return []
        if before is not None and before[1] < self.config.zero_jump_min_loss:
            return []  # reached through small values: a converged (rounded) loss
        self._open = "zero"
        self._z_first, self._z_count, self._z_seen, self._z_last = first, count, count, step
        out = [self._zero_finding(first, step)]
        if step != first:
            out.append(self._zero_finding(step, step))  # the anomaly's last step, at once
        return out

    def _zero_head(self) -> str:
        before = self._zero_before
        if before is None:
            return f"loss exactly 0.0 from the first logged step (step {self._z_first})"
        return f"loss exactly 0.0 since step {self._z_first}, straight after {before[1]:.4g} at step {before[0]}"

    def _zero_finding(self, step: int, now: int) -> Finding:
        count, seen = self._z_count, self._z_seen
        if count == seen:
            tail = f"{count} logged steps in a row, still at step {now}"
        else:
            tail = f"{count} of the {seen} logged steps since, latest at step {self._z_last}"
        return Finding(
            kind=self.kind,
            severity="warning",
            step=step,
            message=f"{self._zero_head()}: {tail}",
            hint=self._zero_hint(),
            evidence=self._zero_evidence(),
        )

    def _zero_hint(self) -> str:
        before = self._zero_before
        if before is None:
            lead = "A loss of exactly 0.0 from the start is not a trained loss."
        else:
            lead = (
                f"A loss does not fall from {before[1]:.4g} to exactly 0.0 without passing through small values: "
                "this is not convergence."
            )
        if self._framework.startswith(_HF_FRAMEWORKS):
            return (
                f"{lead} HF Trainer's logging_nan_inf_filter (on by default) logs a window whose steps were all "
                "NaN/inf as 0.0, so the loss most likely went non-finite here and stayed so while the schedule "
                "went on. Rerun a few steps with logging_nan_inf_filter=False to see it, then treat it as a NaN "
                "(LR and warmup, fp16 loss scale, the data). If the loss really is 0.0, nothing is being trained "
                "on: every label masked (a wrong template or cutoff length) or empty batches."
            )
        return (
            f"{lead} Either non-finite values are being logged as 0 (a nan_to_num or a NaN filter in the "
            "logging), or the loss is not computed from the data: every label masked, empty batches, a loss "
            "multiplied by 0. Compute the loss of one batch by hand."
        )

    def _zero_evidence(self) -> dict[str, Any]:
        before = self._zero_before
        return {
            "pattern": "zero_from_start" if before is None else "zero_after_loss",
            "zero_since": self._z_first,
            "zero_steps": self._z_count,
            "logged_steps_since": self._z_seen,
            "last_zero_step": self._z_last,
            "loss_before": before[1] if before is not None else None,
            "loss_before_step": before[0] if before is not None else None,
        }

    def _close_zero(self, step: int, *, nan_at: int | None = None) -> Finding:
        self._open = None
        self._finite_run = 0
        span = f"from step {self._z_first} to {self._z_last}"
        if nan_at is not None:
            message = f"loss exactly 0.0 {span}, then non-finite from step {nan_at} (reported on its own)"
        else:
            message = (
                f"loss real again for {self.config.resolve_after} logged steps (at step {step}): it was exactly 0.0 "
                f"at {self._z_count} logged steps {span}"
            )
        return Finding(
            kind=self.kind,
            severity="warning",
            step=step,
            message=message,
            hint=self._zero_hint(),
            evidence=self._zero_evidence(),
            resolved=True,
        )
