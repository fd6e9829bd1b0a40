"""``bad_resume``: the state a resume restored, against the checkpoint it loaded.

Why the rule is what it is (``/work/shared/research/failure-modes.md``, finding 1 and rows
R1-R7): on a small model, losing the Adam moments moved the loss by +0.008, a restarted warmup
by +0.014, and replaying every batch only made it noisier, yet each bug was obvious in one
piece of state (Adam step 151 -> 1, the scheduler position, duplicate batch hashes). So the
check is on state, at load time, not on the loss:

* The ``checkpoint`` events of the earlier attempt carry a fingerprint of the saved state
  (``trainmon.hooks.fingerprint``); the ``resume`` event carries the same fingerprint of the restored
  state. A correct resume restores everything, so any key that differs names a bug directly:
  ``next_step`` (step counter reset, R4), ``optimizer.*`` (Adam state not loaded, R3),
  ``scheduler.*`` (R1), ``rng.*`` (R6; not the generators the run never moved, ``rng_unused``),
  ``data_position`` (replay or skip, R5),
  ``loss_scale`` (R2), ``world_size``/``global_batch_tokens``/``accum_steps``/``config_hash``
  (topology or batch changed, R7), ``model.*`` (weights differ). That fires at the resume
  event itself, on the first step after it (delay 0).
* Then the first steps after the resume are checked: the first step must be the checkpoint's
  step + 1 (step 0 is a reset, critical); its LR must be the LR the saved scheduler set; its
  loss scale the saved one; its batches must not be batches seen earlier in the run at
  *earlier* steps (re-doing the steps after an older checkpoint repeats batches at the same
  steps, which is correct); the first losses must not jump above the last losses before the
  checkpoint beyond noise (a coarse check: on small models the loss barely moves, R3/R5).
* Without a saved fingerprint (the checkpoint is older than what the detector saw), only
  self-consistent checks run: next_step = checkpoint step + 1, Adam state and scheduler
  position not empty after training steps, and the ``run_start`` topology of the previous
  attempt.

* A resume seen only in a log (an imported file: no fingerprint, no checkpoint event; the importer
  marks the attempt ``resumed``) is still an event with its own checks, on what the log carries:
  the **LR across the resume** (the first LR after it against the one the log showed at the step
  before it, which for a resume from an older checkpoint is a step logged earlier: ``lr_jump`` times
  higher, or a schedule that had decayed to under ``lr_floor`` of its peak starting again at
  ``lr_restart`` of it or more, means the scheduler did not continue: restarted, or a new plan such as
  another ``max_steps``; 82: 0.0 -> 1.38e-3 at step 1501, then divergence), the **first updates' grad
  norm** (``gn_shock`` times the median before and ``gn_mads`` robust deviations of its log above it:
  Adam moments or the LR not restored make the first updates too large), and the loss continuity
  above. A log that *starts* at a resume has no "before": the first update is judged against the
  ``shock_steps`` steps that follow it (a first grad norm ``gn_shock`` times their median), and the
  loss against its first logged value (the checkpoint's level: the median of the following steps
  ``loss_rel`` above it is the resume making the model worse). An LR the log shows continuing, a
  loss that carries on, are a clean resume (04's three epoch-reset resumes).

One finding lists every failed check; later checks of the same resume update it. A later
resume that checks clean resolves it.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

from trainmon.fingerprint import compare_fingerprints
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import Reading, observe_runs, read
from trainmon.wire import Event, json_safe

__all__ = ["BadResume", "BadResumeConfig"]


@dataclass
class BadResumeConfig:
    """``bad_resume``: composite check of the first steps after a resume."""

    keep_checkpoints: int = 16
    """Checkpoint fingerprints remembered per rank (the resume may load an older one)."""
    rel_tol: float = 1e-3
    """Relative tolerance when comparing saved and restored floats (moment norms, loss scale)."""
    check_steps: int = 3
    """Steps after a resume whose batches and losses are checked (step, replay, loss continuity)."""
    batch_memory: int = 2048
    """Recent batch fingerprints remembered for the replay check (plus the run's first ``batch_head``)."""
    batch_head: int = 256
    """Batch fingerprints of the run's first steps kept for good: a replay usually restarts from 0."""
    loss_window: int = 32
    """Losses before the resume used as the baseline of the loss-continuity check."""
    loss_mads: float = 8.0
    """Loss-continuity check: jump in robust deviations (1.4826 x MAD) of the pre-resume losses..."""
    loss_rel: float = 0.25
    """...and as a fraction of their median; both must be exceeded (tiny models are noisy, R3/R5)."""
    lr_jump: float = 2.0
    """A resume seen in a log: the first LR after it this many times the last one before is a re-warm..."""
    lr_floor: float = 0.01
    """...and so is a schedule decayed under this fraction of its peak..."""
    lr_restart: float = 0.1
    """...starting again at this fraction of the peak or more (82: 0.0 -> 1.38e-3 of a 2e-3 peak)."""
    gn_shock: float = 10.0
    """The first updates' grad norm this many times the median before the resume (or, for a log that starts at a
    resume, the first one against the median of the ``shock_steps`` after it) is a shock..."""
    gn_mads: float = 6.0
    """...and this many robust deviations of the log grad norm above it."""
    shock_steps: int = 20
    """Steps of a log that starts at a resume whose grad norms and losses are the reference for its first update."""


_FIRST = itemgetter(0)
_INT: frozenset[type] = frozenset((int,))
_LIST: frozenset[type] = frozenset((list,))
_FINGERPRINT = frozenset(("batch_fingerprint",))
_AT_ONCE = 16  # steps in a row worth learning at once: the screens cost a few microseconds a run

_TOPOLOGY = ("world_size", "global_batch_tokens", "accum_steps", "config_hash")
_CRITICAL = {"step", "optimizer", "model"}
_ORDER = (
    "step",
    "optimizer",
    "scheduler",
    "data",
    "rng",
    "loss_scale",
    "topology",
    "model",
    "lr",
    "shock",
    "loss",
    "other",
)
_LABELS = {
    "step": "step continuity",
    "optimizer": "optimizer state",
    "scheduler": "scheduler position",
    "data": "data position",
    "rng": "RNG state",
    "loss_scale": "loss scale",
    "topology": "topology / global batch",
    "model": "model weights",
    "lr": "LR after resume",
    "shock": "first updates after resume",
    "loss": "loss continuity",
    "other": "other state",
}


def _group(key: str) -> str:
    head = key.split(".", 1)[0]
    if head == "next_step":
        return "step"
    if head in ("optimizer", "scheduler", "rng", "model", "loss_scale"):
        return head
    if head in ("data_position", "tokens", "samples"):
        return "data"
    if head in _TOPOLOGY:
        return "topology"
    return "other"


@dataclass
class _Check:
    """One resume being verified: what was restored, against what, and what failed so far."""

    ckpt_step: int | None = None
    saved: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)  # group -> evidence
    hints: dict[str, str] = field(default_factory=dict)
    steps_seen: int = 0
    first_step: int | None = None
    losses: list[float] = field(default_factory=list)
    replayed: list[tuple[int, int]] = field(default_factory=list)  # (step, seen at step)
    reported: frozenset[str] = frozenset()
    # what the log showed before the resume (None: the log starts here)
    lr_before: float | None = None
    lr_peak: float | None = None
    gn_before: list[float] | None = None
    grad_norms: list[float] = field(default_factory=list)
    starts_here: bool = False
    after_step: int | None = None  # the step the log says the run resumed after (no resume event: an imported log)


class BadResume(Detector):
    """Checks each resume: fingerprints at load time, then the first steps after it."""

    kind = "bad_resume"
    config_class = BadResumeConfig
    order = 30
    priority = 60
    plots = ("loss", "lr")
    localised = False
    consumes = frozenset(("run_start", "step", "checkpoint", "resume"))
    batch_from = _AT_ONCE  # shorter than a run worth learning: 2 steps cost 2.8 us each looked at, 1.9 observed

    def __init__(self, config: BadResumeConfig) -> None:
        self.config = config
        self._ckpts: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self._start_prev: dict[str, Any] | None = None
        self._start_cur: dict[str, Any] | None = None
        self._check: _Check | None = None
        self._open = False
        self._last_step: int | None = None
        self._losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=4 * config.loss_window)
        self._head: dict[str, int] = {}
        self._tail: collections.deque[str] = collections.deque()
        self._tail_steps: dict[str, int] = {}
        self._data_repeats = False  # batches repeat by design (epochs): the replay check is off
        # (step, LR) of recent steps: a resume's reference LR is the one logged at the step before its first one
        self._lrs: collections.deque[tuple[int, float]] = collections.deque(maxlen=config.batch_memory)
        self._peak_lr: float | None = None
        self._gns: collections.deque[float] = collections.deque(maxlen=config.loss_window)

    # -- events ------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        f = event.fields
        if kind == "step":  # every step feeds the history a resume is judged against, each field read and
            # tested once (a log may never resume); the steps just after one are checked
            step = int(f["step"])
            fp = f.get("batch_fingerprint")
            if fp is not None and not isinstance(fp, str):
                fp = None
            loss = _loss(f.get("loss"))
            gn = _grad_norm(f.get("grad_norm"))
            lr = _lr(f.get("lr"))  # group 0's
            chk = self._check
            out = [] if chk is None else self._after_resume(chk, step, f, fp, loss, gn, lr)
            if fp is not None:
                self._remember_batch(fp, step)
            if loss is not None:
                self._losses.append((step, loss))
            if gn is not None:
                self._gns.append(gn)
            if lr is not None:
                self._lrs.append((step, lr))
                peak = self._peak_lr
                if peak is None or lr > peak:
                    self._peak_lr = lr
            self._last_step = step
            return out
        if kind == "checkpoint":
            fp = f.get("fingerprint")
            if isinstance(fp, dict):
                self._ckpts[int(f["step"])] = fp
                self._ckpts.move_to_end(int(f["step"]))
                while len(self._ckpts) > self.config.keep_checkpoints:
                    self._ckpts.popitem(last=False)
            return []
        if kind == "run_start":
            self._start_prev, self._start_cur = self._start_cur, dict(f)
            out = self._finish_check()
            if f.get("resumed"):
                self._check = _Check(
                    lr_before=None,  # the LR logged at the step before the first one resumed (known at that step)
                    lr_peak=self._peak_lr,
                    gn_before=list(self._gns) if self._gns else None,
                    starts_here=self._last_step is None,
                    after_step=_after_step(f.get("config")),
                )
                self._check_topology()
            return out
        if kind == "resume":
            return self._on_resume(f)
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event; a run of steps that no resume check reads (no check open, no batch
        fingerprint) only feeds the history, of which the last values count: it is learnt at once (:meth:`_learn`).
        On a long log that never resumes that is every step. Every other event is :meth:`observe`'s
        (:func:`observe_runs`)."""
        batch = read(events)  # (the engine's reading, or of another list where it leaves kinds out)
        fingerprinted = not batch.keys.isdisjoint(_FINGERPRINT)  # most logs carry none: no step is looked at for one
        ends = batch.ends  # where each run of steps ends
        unread = 0  # the runs before this one are observe's: the screen refused them

        def take(i: int) -> int:
            nonlocal unread
            if i < unread or self._check is not None:  # the first steps after a resume are checked one by one
                return i
            j = ends[bisect.bisect_left(ends, i)]
            if j - i >= _AT_ONCE and self._learn(batch, i, j, fingerprinted):
                return j
            unread = j
            return i

        observe_runs(self.observe, events, attempts, out, take)

    def _learn(self, batch: Reading, i: int, j: int, fingerprinted: bool) -> bool:
        """The steps ``i`` to ``j`` of ``batch``, that no check reads, each as :meth:`observe` would have remembered it:
        the last ``maxlen`` usable losses, grad norms and LRs (read from the end, through the same rules), the LRs'
        peak, the last step. False, with nothing learnt, when a step carries a batch fingerprint (each is checked
        against those before it; looked for only where the batch carries one, ``fingerprinted``) or a step number is
        not an int (``int()`` of it may fail or round): read them one by one.

        The LRs' peak needs every LR: a column screened at once (each a list whose first value is a finite float,
        so that :func:`_lr` returns that value), else :func:`_lr` of each. The step and LR columns' types are the
        batch's, asked by other detectors too (loss_spike, hang, divergence; lr_schedule_drift)."""
        if not batch.only("step", _INT, i, j):  # (a step without a number reads None)
            return False
        fs = batch.fields[i:j]
        if fingerprinted and any(map(dict.__contains__, fs, repeat("batch_fingerprint"))):
            return False
        steps, lists = batch.column("step")[i:j], batch.column("lr")[i:j]
        lrs: list[float] | None = None
        if batch.only("lr", _LIST, i, j):
            first = batch.firsts("lr")  # the batch's group-0 LRs (lr_schedule_drift reads them too), where all floats
            if first is not None:
                lrs = first[i:j].tolist()
            else:
                try:
                    lrs = list(map(_FIRST, lists))
                except IndexError:  # an empty list
                    pass
                else:
                    if set(map(type, lrs)) != {float}:
                        lrs = None
            if lrs is not None and not math.isfinite(sum(lrs)):  # an overflowing sum: read each
                lrs = None
        lr_steps = steps
        if lrs is None:
            pairs = [(s, v) for s, v in zip(steps, map(_lr, lists), strict=True) if v is not None]
            lr_steps, lrs = [s for s, _ in pairs], [v for _, v in pairs]
        if lrs:
            top = max(lrs)  # the first of the largest, as the step-by-step ``lr > peak`` keeps it
            if self._peak_lr is None or top > self._peak_lr:
                self._peak_lr = top
            keep = self._lrs.maxlen
            self._lrs.extend(zip(lr_steps[-keep:] if keep else lr_steps, lrs[-keep:] if keep else lrs, strict=True))
        self._losses.extend(_tail(fs, steps, "loss", _loss, self._losses.maxlen))
        self._gns.extend(v for _, v in _tail(fs, steps, "grad_norm", _grad_norm, self._gns.maxlen))
        self._last_step = steps[-1]
        return True

    def _on_resume(self, f: dict[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        if self._check is None or self._check.ckpt_step is not None or self._check.steps_seen:
            out += self._finish_check()
            self._check = _Check()
        chk = self._check
        chk.ckpt_step = int(f["step"])
        restored = f.get("fingerprint")
        chk.restored = restored if isinstance(restored, dict) else None
        chk.saved = self._ckpts.get(chk.ckpt_step)
        if chk.restored is not None:
            if chk.saved is not None:
                self._compare(chk.saved, chk.restored)
            else:
                self._self_consistency(chk.ckpt_step, chk.restored)
        self._check_topology()
        if chk.failures:
            out.append(self._finding(chk.ckpt_step + 1))
        return out

    def _after_resume(
        self,
        chk: _Check,
        step: int,
        f: dict[str, Any],
        fp: str | None,
        loss: float | None,
        gn: float | None,
        lr: float | None,
    ) -> list[Finding]:
        """One of the first steps of a resumed attempt (``fp``, ``loss``, ``gn``, ``lr``: its fields, None when
        absent or unusable): its checks."""
        out: list[Finding] = []
        window = self.config.shock_steps if chk.starts_here else self.config.check_steps
        if chk.steps_seen < window:
            chk.steps_seen += 1
            if gn is not None:
                chk.grad_norms.append(gn)
            if chk.steps_seen == 1:
                chk.first_step = step
                self._first_step_checks(step, f)
                # a resume from an older checkpoint replays its steps: the LR it had there is the reference
                earlier = [(s, v) for s, v in self._lrs if s < step]
                chk.lr_before = max(earlier)[1] if earlier else None
                self._lr_shock(lr)
            if fp is not None and not self._data_repeats:
                seen = self._head.get(fp, self._tail_steps.get(fp))
                if seen is not None and seen < step:
                    chk.replayed.append((step, seen))
            if loss is not None:
                chk.losses.append(loss)
            if chk.steps_seen == self.config.check_steps:
                self._replay_check()
                if not chk.starts_here:
                    self._loss_check()
                    self._gn_shock()
            if chk.steps_seen == window and chk.starts_here:
                self._start_shock()
            if set(chk.failures) - chk.reported:
                out.append(self._finding(chk.first_step if chk.first_step is not None else step))
            if chk.steps_seen == window:
                out += self._finish_check()
        return out

    # -- a resume seen in a log ------------------------------------------------------------------

    def _lr_shock(self, lr: float | None) -> None:
        """The LR across the resume: the schedule must carry on from where it was."""
        chk = self._check
        assert chk is not None
        cfg = self.config
        before, peak = chk.lr_before, chk.lr_peak
        if lr is None or before is None or not peak or chk.saved is not None:
            return  # nothing to compare, or the saved scheduler's LR is checked exactly
        rewarm = before > 0 and lr >= cfg.lr_jump * before
        restart = before <= cfg.lr_floor * peak and lr >= cfg.lr_restart * peak
        if not (rewarm or restart):
            return
        ratio = f"{lr / before:.3g}x " if before > 0 else ""
        self._fail(
            "lr",
            {"lr_before_resume": before, "lr_after_resume": lr, "lr_peak_before": peak},
            f"the LR went from {before:.3g} before the resume to {lr:.3g} after it ({ratio}the value before; peak so "
            f"far {peak:.3g}): the schedule did not continue, it restarted or the run was resumed into a new plan "
            "(another max_steps or number of epochs, a new scheduler); a model that had annealed at a low LR is "
            "shocked by the jump. Resume with the saved scheduler state, or re-warm gradually from the LR it had",
        )

    def _gn_shock(self) -> None:
        """The first updates' grad norm against the norms before the resume (log-MAD noise)."""
        chk = self._check
        assert chk is not None
        cfg = self.config
        if not chk.gn_before or len(chk.gn_before) < 4 or not chk.grad_norms:
            return
        logs = [math.log(g) for g in chk.gn_before]
        med = statistics.median(logs)
        mad = statistics.median(abs(x - med) for x in logs) * 1.4826
        top = max(chk.grad_norms)
        if top >= cfg.gn_shock * math.exp(med) and math.log(top) - med > cfg.gn_mads * mad:
            self._fail(
                "shock",
                {"grad_norm_after": round(top, 6), "grad_norm_median_before": round(math.exp(med), 6)},
                f"the first updates after the resume have a grad norm of {top:.3g}, {top / math.exp(med):.3g}x the "
                f"median before it ({math.exp(med):.3g}): the optimizer moments or the LR were not restored",
            )

    def _start_shock(self) -> None:
        """A log that starts at a resume: its first update and loss against the steps that follow."""
        chk = self._check
        assert chk is not None
        cfg = self.config
        rest = chk.grad_norms[1:]
        if len(rest) >= 4 and chk.grad_norms:
            first, med = chk.grad_norms[0], statistics.median(rest)
            if first >= cfg.gn_shock * med:
                self._fail(
                    "shock",
                    {"first_grad_norm": round(first, 6), "grad_norm_median_after": round(med, 6)},
                    f"the log starts at a resume and its first update's grad norm ({first:.3g}) is {first / med:.3g}x "
                    f"the median of the steps that follow ({med:.3g}): the optimizer moments or the LR were not "
                    "restored",
                )
        if len(chk.losses) >= 4:
            first, med = chk.losses[0], statistics.median(chk.losses[1:])
            if first > 0 and med - first > cfg.loss_rel * first:
                self._fail(
                    "loss",
                    {"loss_first": round(first, 6), "loss_after": round(med, 6)},
                    f"the log starts at a resume and the loss rose from {first:.4g} (the checkpoint's level) to "
                    f"{med:.4g} in the steps after it: the resume made the model worse (LR re-warmed, state not "
                    "restored)",
                )

    # -- checks --------------------------------------------------------------------------------

    def _fail(self, group: str, evidence: dict[str, Any], hint: str) -> None:
        chk = self._check
        assert chk is not None
        if group == "topology":  # the same field seen in run_start and in the fingerprint: once
            evidence = {k.removeprefix("run_start."): v for k, v in evidence.items()}
        merged = {**chk.failures.get(group, {}), **evidence}
        chk.failures[group] = merged
        chk.hints.setdefault(group, hint)

    def _compare(self, saved: dict[str, Any], restored: dict[str, Any]) -> None:
        # a generator the run never moved before saving (``rng_unused``) need not be restored
        unused = saved.get("rng_unused") if isinstance(saved.get("rng_unused"), list) else []
        ignore = ["rng_unused", *(f"rng.{name}" for name in unused)]
        diff = compare_fingerprints(saved, restored, rel_tol=self.config.rel_tol, ignore=ignore)
        by_group: dict[str, dict[str, Any]] = {}
        for key, (a, b) in diff.items():
            if a is None or b is None:
                continue  # a field only one side reports (another trainer version): not evidence
            by_group.setdefault(_group(key), {})[key] = [a, b]
        for group, keys in by_group.items():
            self._fail(group, keys, self._hint(group, keys))

    def _self_consistency(self, ckpt_step: int, restored: dict[str, Any]) -> None:
        """Checks that need no saved fingerprint (the checkpoint is older than what was seen)."""
        expected = ckpt_step + 1
        nxt = restored.get("next_step")
        if isinstance(nxt, int) and nxt != expected:
            keys = {"next_step": [expected, nxt]}
            self._fail("step", keys, self._hint("step", keys))
        opt = restored.get("optimizer")
        if isinstance(opt, dict) and expected >= 2 and opt.get("adam_step_max") == 0:
            keys = {"optimizer.adam_step_max": [f">0 after {expected} steps", 0]}
            self._fail("optimizer", keys, self._hint("optimizer", {"optimizer.adam_step_max": [expected, 0]}))
        sched = restored.get("scheduler")
        if isinstance(sched, dict) and expected >= 2 and sched.get("last_epoch") == 0:
            keys = {"scheduler.last_epoch": [f">0 after {expected} steps", 0]}
            self._fail("scheduler", keys, self._hint("scheduler", {"scheduler.last_epoch": [expected, 0]}))

    def _check_topology(self) -> None:
        prev, cur = self._start_prev, self._start_cur
        if self._check is None or prev is None or cur is None or not cur.get("resumed"):
            return
        keys = {
            k: [prev[k], cur[k]]
            for k in _TOPOLOGY
            if prev.get(k) is not None and cur.get(k) is not None and prev[k] != cur[k]
        }
        if keys:
            self._fail("topology", {f"run_start.{k}": v for k, v in keys.items()}, self._hint("topology", keys))

    def _first_step_checks(self, step: int, f: dict[str, Any]) -> None:
        chk = self._check
        assert chk is not None
        if chk.ckpt_step is not None:
            expected = chk.ckpt_step + 1
            ok = step == expected
        elif self._ckpts:
            expected = next(reversed(self._ckpts)) + 1
            ok = (step - 1) in self._ckpts
        elif self._last_step is not None:
            expected = None
            ok = not (step == 0 and self._last_step > 0)
        else:
            return
        if not ok:
            keys = {"first_step": [expected, step]}
            self._fail("step", keys, self._hint("step", {"next_step": [expected, step]}))
        saved = chk.saved
        if saved is None:
            return
        # The step's loss scale is read after scaler.update(), so one overflow halves it and one growth
        # interval doubles it: only a factor beyond 2 says the scaler state was not restored. The
        # resume fingerprint (exact) is the primary check; this one covers producers without it.
        scale = saved.get("loss_scale")
        got = f.get("loss_scale")
        restored_scale = (chk.restored or {}).get("loss_scale")
        if (
            restored_scale is None
            and isinstance(scale, (int, float))
            and isinstance(got, (int, float))
            and scale > 0
            and not 0.5 <= got / scale <= 2.0
        ):
            keys = {"first_step.loss_scale": [scale, got]}
            self._fail("loss_scale", keys, self._hint("loss_scale", {"loss_scale": [scale, got]}))
        lrs_saved = (saved.get("scheduler") or {}).get("lrs")
        lrs = f.get("lr")
        if isinstance(lrs_saved, list) and isinstance(lrs, list) and len(lrs_saved) == len(lrs) and ok:
            bad = [
                (g, a, b)
                for g, (a, b) in enumerate(zip(lrs_saved, lrs, strict=True))
                if isinstance(a, (int, float)) and abs(a - b) > 0.01 * max(abs(a), 1e-12)
            ]
            if bad:
                g, a, b = bad[0]
                self._fail(
                    "lr",
                    {"first_step.lr": [a, b], "group": g},
                    f"the first step's LR (group {g}: {b:.3g}) is not the LR the saved scheduler set ({a:.3g}): "
                    "the scheduler or the optimizer's param-group LRs were not restored",
                )

    def _replay_check(self) -> None:
        chk = self._check
        assert chk is not None
        if chk.replayed:
            step, seen = chk.replayed[0]
            keys = {
                "replayed_batches": f"{len(chk.replayed)}/{chk.steps_seen}",
                "batch_of_step": step,
                "first_seen_at_step": seen,
            }
            self._fail(
                "data",
                keys,
                f"batches after the resume repeat batches already trained on (step {step}'s batch was step "
                f"{seen}'s): the data loader / sampler position was not restored (data replayed)",
            )

    def _loss_check(self) -> None:
        chk = self._check
        assert chk is not None
        cfg = self.config
        limit = chk.ckpt_step if chk.ckpt_step is not None else None
        before = [v for s, v in self._losses if limit is None or s <= limit][-cfg.loss_window :]
        if len(before) < 4 or not chk.losses:
            return
        med = statistics.median(before)
        mad = statistics.median(abs(v - med) for v in before) * 1.4826
        after = statistics.median(chk.losses)
        jump = after - med
        if jump > cfg.loss_mads * mad and jump > cfg.loss_rel * abs(med):
            self._fail(
                "loss",
                {"loss_before": round(med, 6), "loss_after": round(after, 6), "noise": round(mad, 6)},
                f"the loss jumped from {med:.4g} to {after:.4g} across the resume (noise {mad:.2g}): the "
                "restored model or optimizer state is not the one that was saved",
            )

    # -- batches -------------------------------------------------------------------------------

    def _remember_batch(self, fp: str, step: int) -> None:
        cfg = self.config
        prev = self._head.get(fp, self._tail_steps.get(fp))
        if prev is not None and prev != step and self._check is None and not self._open:
            self._data_repeats = True  # the same batch at two steps without a resume: epochs repeat data
        if len(self._head) < cfg.batch_head and fp not in self._head:
            self._head[fp] = step
            return
        if fp in self._head:
            return
        if fp not in self._tail_steps:
            self._tail.append(fp)
        self._tail_steps[fp] = step
        while len(self._tail) > cfg.batch_memory:
            self._tail_steps.pop(self._tail.popleft(), None)

    # -- findings ------------------------------------------------------------------------------

    def _finish_check(self) -> list[Finding]:
        """Close the current check; a clean resume resolves an anomaly left open by an earlier one."""
        chk = self._check
        self._check = None
        if chk is None or chk.failures or not self._open:
            return []
        if chk.ckpt_step is None and chk.steps_seen == 0:
            return []
        self._open = False
        step = chk.first_step if chk.first_step is not None else (chk.ckpt_step or 0) + 1
        return [
            self.resolve(
                step,
                f"resume at step {step} checked clean",
                "This resume restored every piece of state that was checked.",
                {"checkpoint_step": chk.ckpt_step},
            )
        ]

    def _finding(self, step: int) -> Finding:
        chk = self._check
        assert chk is not None
        self._open = True
        chk.reported = frozenset(chk.failures)
        groups = [g for g in _ORDER if g in chk.failures]
        severity = "critical" if any(g in _CRITICAL for g in groups) else "warning"
        if chk.ckpt_step is not None:
            src = f"the checkpoint of step {chk.ckpt_step}"
        elif chk.after_step is not None:
            src = f"the state of step {chk.after_step}" + (
                " (the log starts at this resume)" if chk.starts_here else ""
            )
        else:
            src = "a checkpoint"
        labels = ", ".join(_LABELS[g] for g in groups)
        details = "; ".join(_summary(g, chk.failures[g]) for g in groups)
        message = f"bad resume from {src} (first step {step}): {len(groups)} check(s) failed: {labels}. {details}"
        hint = "; ".join(chk.hints[g] for g in groups) + "."
        evidence = json_safe(
            {
                "checkpoint_step": chk.ckpt_step,
                "first_step": step,
                "failed": groups,
                "saved_fingerprint": chk.saved is not None,
                **{g: chk.failures[g] for g in groups},
            }
        )
        return Finding(self.kind, severity, step, message, hint, evidence)

    def _hint(self, group: str, keys: dict[str, Any]) -> str:
        def pair(key: str) -> tuple[Any, Any]:
            for k, v in keys.items():
                if k == key or k.endswith("." + key) or k.endswith(key):
                    return v[0], v[1]
            return None, None

        if group == "step":
            saved, got = pair("next_step")
            if got == 0:
                return (
                    f"the step counter was reset: the run restarts at step 0 instead of {saved} (global_step "
                    "not restored from the checkpoint; the schedule and step-based logic restart too)"
                )
            return (
                f"the step counter continues at {got} instead of {saved}: an extra or missing increment on load "
                "(off by one, Lightning#19403) or steps skipped"
            )
        if group == "optimizer":
            saved, got = pair("adam_step_max")
            if saved is not None:
                return (
                    f"optimizer.load_state_dict was not called (or loaded into a rebuilt optimizer): Adam step "
                    f"count {got} restored vs {saved} saved; the moments restart from zero and the first updates "
                    "are too large"
                )
            return "the optimizer moments differ from the saved ones: check optimizer.load_state_dict and param order"
        if group == "scheduler":
            saved, got = pair("last_epoch")
            return (
                f"scheduler.load_state_dict was not called: the scheduler is at position {got} instead of {saved}, "
                "so the LR restarts its warmup (see lr_schedule_drift)"
            )
        if group == "rng":
            names = ", ".join(k for k in keys if k.startswith("rng."))
            return (
                f"RNG states were not restored ({names}): restore torch/numpy/random (and CUDA) generator states "
                "from the checkpoint, or dropout masks and sampling differ from an uninterrupted run"
            )
        if group == "data":
            saved, got = pair("data_position")
            if saved is not None and got is not None and got < saved:
                return (
                    f"the data loader restarted at position {got} instead of {saved}: batches already trained "
                    "on are replayed (restore the sampler / loader state, or skip the consumed batches)"
                )
            if saved is not None and got is not None:
                return (
                    f"the data loader is at position {got} instead of {saved}: batches are skipped (check the "
                    "skip count, e.g. it ignores gradient accumulation)"
                )
            return "the consumed tokens/samples counters differ from the checkpoint's: check the data state restore"
        if group == "loss_scale":
            saved, got = pair("loss_scale")
            return (
                f"the fp16 GradScaler was not restored (scaler.load_state_dict): loss scale {got} restored vs "
                f"{saved} saved; expect "
                "a burst of overflow-skipped steps (transformers#34053)"
            )
        if group == "topology":
            what = ", ".join(f"{k.split('.')[-1]} {v[0]} -> {v[1]}" for k, v in keys.items())
            return (
                f"the run resumed with a different setup ({what}): the global batch, schedule length or data "
                "sharding no longer match the checkpoint; check the launch command and the data-loader state"
            )
        if group == "model":
            return "the restored weights differ from the saved ones: the wrong checkpoint or a partial model load"
        return "other saved state differs from what was restored: " + ", ".join(keys)


def _loss(value: Any) -> float | None:
    """A step's loss, when usable."""
    return value if isinstance(value, float) and math.isfinite(value) else None


def _grad_norm(value: Any) -> float | None:
    """A step's grad norm, when usable (positive: a log of it is taken)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def _lr(value: Any) -> float | None:
    """A step's LR (its ``lr`` list's first group), when usable."""
    if isinstance(value, list) and value and isinstance(value[0], (int, float)) and math.isfinite(value[0]):
        return float(value[0])
    return None


def _tail(
    fs: list[dict[str, Any]], steps: list[int], key: str, read: Callable[[Any], float | None], keep: int | None
) -> list[tuple[int, float]]:
    """The last ``keep`` (all with None) ``(step, value)`` of the steps' fields ``fs`` whose ``key`` ``read`` finds
    usable, in order: what appending every one to a window of ``keep`` leaves of them."""
    found: list[tuple[int, float]] = []
    for k in range(len(fs) - 1, -1, -1):
        if keep is not None and len(found) >= keep:
            break
        value = read(fs[k].get(key))
        if value is not None:
            found.append((steps[k], value))
    found.reverse()
    return found


def _after_step(config: Any) -> int | None:
    """``run_start.config.resumed_after_step``: where an importer saw the run go on from (a log shows no checkpoint)."""
    step = config.get("resumed_after_step") if isinstance(config, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _summary(group: str, evidence: dict[str, Any]) -> str:
    parts = []
    for key, value in list(evidence.items())[:4]:
        if isinstance(value, list) and len(value) == 2:
            parts.append(f"{key} saved {_short(value[0])} vs restored {_short(value[1])}")
        else:
            parts.append(f"{key} {_short(value)}")
    return f"{_LABELS[group]}: " + ", ".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value[:4]) + ("]" if len(value) <= 4 else ", ...]")
    return str(value)
