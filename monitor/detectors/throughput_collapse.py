"""``throughput_collapse``: a sustained drop of tokens/s, naming the phase whose time grew.

Why the rule is what it is (``failure-modes.md``):

- **P3 / P2** (input stalls, GC pauses): a collapse shows in the step time, and only the phase
  split says why. The detector keeps a robust baseline of seconds per token (median of the last
  ``baseline_window`` normal steps, taken *before* the recent window so a collapse never becomes
  its own baseline) and fires when the recent window is ``slowdown`` x slower on average, holds at
  least ``min_slow_steps`` slow steps (a sustained drop, or periodic spikes such as gen-2 GC
  pauses, not one blip) and has lost ``min_excess_seconds`` overall. With the default window of
  8 it fires within 8 steps of the onset.
- **P5** (checkpoint/eval stalls): routine saves and evaluations are not a collapse, so their
  phases are taken out of the step time. A save is reported when it is ``checkpoint_ratio`` x
  slower than the median of the earlier saves *and* costs more than ``checkpoint_fraction`` of
  the time since the previous save *and* exceeds the typical save by ``checkpoint_min_seconds``
  (the first save, with no median, must cost ``checkpoint_first_fraction`` of the time before
  it). Either P5 condition alone fires on healthy runs that save often or whose saves take
  milliseconds; both together single out a save that stalled.

The phase named in the hint is the one whose mean time in the slow recent steps grew most over
its baseline median.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

from trainmon.hooks.wire import Event
from trainmon.monitor.config import ThroughputCollapseConfig
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["ThroughputCollapse"]

_TIMED = ("data", "forward", "backward", "comm", "optimizer", "other")
_EXCLUDED = ("checkpoint", "eval")

_CAUSES = {
    "data": (
        "input pipeline stall: the data phase grew. Check the dataloader (num_workers, prefetch, "
        "tokenisation in collate_fn) and the storage it reads from (network filesystem, disk I/O)."
    ),
    "comm": (
        "communication: time waiting in collectives grew. Check the network/NCCL (NCCL_DEBUG=INFO, "
        "link errors, a congested switch) and whether another rank is straggling."
    ),
    "optimizer": (
        "the optimizer step grew: check optimizer-state offload, gradient clipping on the host, "
        "or extra synchronisations added to the step."
    ),
    "forward": (
        "compute slowed (forward grew): suspect GPU throttling (thermal or power, see node_health) "
        "or a slow/shared GPU; check clocks and temperature with nvidia-smi."
    ),
    "backward": (
        "compute slowed (backward grew): suspect GPU throttling (thermal or power, see node_health) "
        "or a slow/shared GPU; check clocks and temperature with nvidia-smi."
    ),
    "other": (
        "host-side work between phases grew: Python GC pauses (time gen-2 collections with "
        "gc.callbacks, try gc.freeze() / scheduled gc), logging or metric syncs, or a CPU-starved host."
    ),
}


class ThroughputCollapse(Detector):
    """Tokens/s against a lagged robust baseline, with checkpoint/eval time taken out."""

    kind = "throughput_collapse"

    def __init__(self, config: ThroughputCollapseConfig) -> None:
        self.config = config
        self._base = RollingWindow(config.baseline_window)  # seconds per token of normal steps
        # per-token phase seconds of the same normal steps, (one tuple per step, in _TIMED order): read
        # only to name the grown phase when a collapse is found, so kept raw, not as sorted windows
        self._base_phases: collections.deque[tuple[float, ...]] = collections.deque(maxlen=config.baseline_window)
        # (step, seconds per token, step seconds, tokens, phases) of the recent steps, oldest first
        self._recent: collections.deque[tuple[int, float, float, float, dict[str, float]]] = collections.deque()
        self._recent_spt: collections.deque[float] = collections.deque()  # their seconds per token (C sum)
        self._since_start = 0
        self._open: str | None = None  # "steps" or "checkpoint" while an anomaly is open
        self._open_severity = ""
        self._open_phase = ""
        self._normal_run = 0
        self._saves = RollingWindow(16)
        self._last_save_time: float | None = None
        self._first_step_time: float | None = None
        self._save_seen_since_step = False

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            self._since_start = 0
            self._recent.clear()
            self._recent_spt.clear()
            self._first_step_time = None
            self._last_save_time = None
            return []
        if event.kind == "checkpoint":
            duration = event.fields.get("duration")
            self._save_seen_since_step = True
            return self._check_save(event.fields["step"], duration, event.time)
        if event.kind != "step":
            return []
        return self._on_step(event)

    # -- steps ---------------------------------------------------------------------------------

    def _on_step(self, event: Event) -> list[Finding]:
        f = event.fields
        step = f["step"]
        phases: dict[str, float] = f.get("phases") or {}
        out: list[Finding] = []
        if self._first_step_time is None:
            self._first_step_time = event.time
        if not self._save_seen_since_step and phases.get("checkpoint", 0.0) > 0:
            # No checkpoint event (another framework): judge the save from its phase.
            out += self._check_save(max(0, step - 1), phases["checkpoint"], event.time)
        self._save_seen_since_step = False
        seconds = f.get("step_time")
        if seconds is None or not math.isfinite(seconds):
            return out
        seconds -= sum(phases.get(p, 0.0) for p in _EXCLUDED)
        if seconds <= 0:
            return out
        tokens = f.get("tokens") or 1
        spt = seconds / tokens
        self._since_start += 1
        if self._since_start <= self.config.warmup_steps:
            return out
        cfg = self.config
        self._recent.append((step, spt, seconds, tokens, phases))
        self._recent_spt.append(spt)
        if len(self._recent) > cfg.window:
            old = self._recent.popleft()
            self._recent_spt.popleft()
            if self._open != "steps":  # a collapse never enters its own baseline
                self._admit(old)
        if len(self._base) < cfg.min_baseline or len(self._recent) < cfg.window:
            return out
        base = self._base.median()
        if base <= 0:
            return out
        ratio = sum(self._recent_spt) / (len(self._recent) * base)
        if self._open is None and ratio < cfg.slowdown:
            return out  # the window without its worst step is slower still only if the whole window is
        slow = [r for r in self._recent if r[1] > cfg.slow_step * base]
        # Sustained: the window must be slow even without its worst step (one long step is a hang
        # or a blip, reported by ``hang`` if long enough; two or more are a collapse).
        worst = max(self._recent, key=lambda r: r[1])
        ratio_rest = (sum(r[1] for r in self._recent) - worst[1]) / ((len(self._recent) - 1) * base)
        excess_rest = sum(r[2] - base * r[3] for r in self._recent) - (worst[2] - base * worst[3])
        collapsed = (
            ratio_rest >= cfg.slowdown and len(slow) >= cfg.min_slow_steps and excess_rest >= cfg.min_excess_seconds
        )
        latest_slow = spt > cfg.slow_step * base
        if self._open == "steps":
            self._normal_run = 0 if (latest_slow or ratio >= cfg.slowdown) else self._normal_run + 1
            if self._normal_run >= cfg.resolve_after:
                self._open = None
                out.append(self._resolved(step, ratio, base))
            elif collapsed:
                phase, grew = self._grown_phase(slow)
                severity = "critical" if ratio >= cfg.critical_slowdown else "warning"
                escalated = severity == "critical" and self._open_severity != "critical"
                if escalated or phase != self._open_phase:  # new information, not a wobble
                    out.append(self._finding(step, ratio, base, slow, phase, grew, severity))
            return out
        if self._open == "checkpoint":
            self._normal_run = 0 if latest_slow else self._normal_run + 1
            if self._normal_run >= cfg.resolve_after:
                self._open = None
                out.append(self._resolved(step, ratio, base))
                return out
        if collapsed:
            phase, grew = self._grown_phase(slow)
            severity = "critical" if ratio >= cfg.critical_slowdown else "warning"
            self._open, self._normal_run = "steps", 0
            out.append(self._finding(step, ratio, base, slow, phase, grew, severity))
        return out

    def _admit(self, rec: tuple[int, float, float, float, dict[str, float]]) -> None:
        self._base.add(rec[1])
        self._base_phases.append(tuple(rec[4].get(p, 0.0) / rec[3] for p in _TIMED))

    def _grown_phase(self, slow: list[tuple[int, float, float, float, dict[str, float]]]) -> tuple[str, float]:
        """The phase whose per-token time in the slow steps grew most over its baseline median."""
        best, grew = "other", -math.inf
        for i, p in enumerate(_TIMED):
            ref = statistics.median(v[i] for v in self._base_phases) if self._base_phases else 0.0
            mean = sum(r[4].get(p, 0.0) / r[3] for r in slow) / len(slow)
            if mean - ref > grew:
                best, grew = p, mean - ref
        return best, grew

    def _finding(
        self,
        step: int,
        ratio: float,
        base: float,
        slow: list[tuple[int, float, float, float, dict[str, float]]],
        phase: str,
        grew: float,
        severity: str,
    ) -> Finding:
        self._open_severity, self._open_phase = severity, phase
        drop = 1 - 1 / ratio
        tokens = sum(r[3] for r in self._recent) / len(self._recent)
        msg = (
            f"throughput down {drop:.0%} over the last {len(self._recent)} steps "
            f"({1 / (base * ratio):.4g} vs {1 / base:.4g} tokens/s baseline); {len(slow)} slow steps, "
            f"the {phase} phase grew by {grew * tokens:.3g} s per step"
        )
        return Finding(
            kind=self.kind,
            severity=severity,
            step=step,
            message=msg,
            hint=f"Likely cause: {_CAUSES[phase]}",
            evidence={
                "slowdown": round(ratio, 3),
                "baseline_tokens_per_s": round(1 / base, 3),
                "recent_tokens_per_s": round(1 / (base * ratio), 3),
                "slow_steps": [r[0] for r in slow],
                "phase": phase,
                "phase_growth_s": round(grew * tokens, 6),
            },
        )

    def _resolved(self, step: int, ratio: float, base: float) -> Finding:
        self._open_severity = self._open_phase = ""
        return Finding(
            kind=self.kind,
            severity="info",
            step=step,
            message=f"throughput recovered at step {step} ({1 / (base * ratio):.4g} tokens/s, baseline {1 / base:.4g})",
            hint="No action needed; compare with the stall's window if it recurs.",
            evidence={"slowdown": round(ratio, 3)},
            resolved=True,
        )

    # -- saves ---------------------------------------------------------------------------------

    def _check_save(self, step: int, duration: Any, now: float) -> list[Finding]:
        cfg = self.config
        if duration is None or not math.isfinite(duration) or duration < 0:
            return []
        since = self._last_save_time if self._last_save_time is not None else self._first_step_time
        self._last_save_time = now
        typical = self._saves.median() if len(self._saves) else None
        interval = (now - since) if since is not None else None
        slow_vs_typical = typical is None or duration > cfg.checkpoint_ratio * typical
        share_limit = cfg.checkpoint_fraction if typical is not None else cfg.checkpoint_first_fraction
        costly = interval is not None and interval > 0 and duration > share_limit * interval
        excess = duration - (typical or 0.0)
        if not (slow_vs_typical and costly and excess >= cfg.checkpoint_min_seconds):
            self._saves.add(duration)
            return []
        self._saves.add(duration)  # a stalled save joins the history: repeated stalls raise the bar
        if self._open is not None:
            return []
        self._open, self._normal_run = "checkpoint", 0
        share = duration / interval if interval else math.inf
        typical_text = f"{typical:.3g} s typical" if typical is not None else "the first save of the run"
        return [
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"checkpoint at step {step} took {duration:.3g} s ({typical_text}), "
                    f"{share:.0%} of the {interval:.3g} s since the previous save"
                ),
                hint=(
                    "Likely cause: checkpoint I/O stall: slow or contended storage (NFS/object-store "
                    "throughput, full disk) or a synchronous save. Check the filesystem's write "
                    "throughput, save asynchronously or shard the save, or save less often (P5)."
                ),
                evidence={
                    "phase": "checkpoint",
                    "duration_s": round(duration, 4),
                    "typical_s": None if typical is None else round(typical, 4),
                    "interval_s": round(interval, 3) if interval else None,
                    "share": round(share, 4) if math.isfinite(share) else str(share),
                },
            )
        ]
