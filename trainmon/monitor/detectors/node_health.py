"""``node_health``: NVML and psutil thresholds and counters from ``health`` events.

Why the rule is what it is (``failure-modes.md`` H1, P7, P4): most interruptions at scale are
hardware (Llama 3: faulty GPUs and HBM are half of them) and their precursors are weak, so the
few cheap, reliable ones are worth reporting the moment they appear:

- uncorrected (double-bit) ECC errors > 0 (H1: "any double-bit error") - critical;
- corrected ECC errors rising by ``ecc_corrected_rise`` within ``ecc_window`` samples (H1: "a
  rising single-bit rate") - warning;
- NVML clock-event (throttle) reasons in ``throttle_mask``: HW slowdown, SW/HW thermal slowdown,
  HW power brake (P7: annotate when they are set). SW power cap and idle are routine and ignored;
- GPU temperature above ``gpu_temp_warning_c`` / ``gpu_temp_critical_c`` (P7);
- GPU memory near full, host memory above ``host_mem_fraction`` of the total, process RSS near the
  host total (P4: the OOM killer is next);
- the host's clock off the collector's by more than ``skew_threshold`` seconds for ``skew_sustain``
  seconds (as NTP monitoring reports an offset): the collector measures liveness on its own clock
  and aligns the rank's times by the offset it estimates (``Event.clock_offset``), but every time
  the trainer writes itself (its logs, checkpoint names) is off by as much, and a skew that large
  says the node runs without NTP. Judged on every event that arrived live, health or not.

Level conditions must hold for ``sustain`` consecutive samples (one hot reading is noise);
counters fire at once. One anomaly per rank lists every active condition; it is updated when the
set of conditions or the severity changes and resolved after ``resolve_after`` clean samples.
"""

from __future__ import annotations

import collections
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, cast

from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet
from trainmon.wire import Event

__all__ = ["THROTTLE_REASONS", "NodeHealth", "NodeHealthConfig", "decode_throttle"]


@dataclass
class NodeHealthConfig:
    """``node_health``: NVML/psutil thresholds and counters."""

    gpu_temp_warning_c: float = 85.0
    """GPU temperature (C) worth acting on this shift (data-centre GPUs slow down near 87-90 C, P7)."""
    gpu_temp_critical_c: float = 92.0
    """GPU temperature (C) at which to page."""
    throttle_mask: int = 0xE8
    """NVML clock-event reasons that matter: HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, power brake 0x80."""
    ecc_corrected_rise: int = 10
    """Rise of corrected ECC errors within ``ecc_window`` samples that counts as rising (H1)."""
    ecc_window: int = 60
    """Health samples over which the corrected-ECC rise is measured."""
    gpu_mem_fraction: float = 0.99
    """GPU memory used over total at which the GPU is near full (allocator caches keep it above 90%)."""
    host_mem_fraction: float = 0.95
    """Host memory used over total that means memory pressure."""
    host_mem_critical_fraction: float = 0.98
    """Host memory used over total at which to page (the OOM killer is next)."""
    rss_fraction: float = 0.9
    """Process resident memory over host total that means the process is about to be OOM-killed."""
    sustain: int = 2
    """Consecutive samples a level condition must hold (one hot sample is noise); counters fire at once."""
    resolve_after: int = 3
    """Consecutive clean samples after which the anomaly is resolved."""
    skew_threshold: float = 5.0
    """Seconds between the host's clock and the collector's beyond which the host's clock is skewed
    (the estimate's own error is the transport's least latency: milliseconds)."""
    skew_sustain: float = 60.0
    """Seconds (collector clock) the skew must last before it is reported: a producer whose first
    events are a replayed backlog looks skewed until its first fresh event."""


THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""NVML ``nvmlClocksEventReasons`` (formerly ``nvmlClocksThrottleReasons``) bits and their names."""

_HINTS = {
    "clock_skew": (
        "the host's clock is off (no NTP, a stepped or drifting clock, a VM or container with its own "
        "time). The collector keeps liveness and the run's times on its own clock, but the trainer's own "
        "timestamps (logs, checkpoint names, traces) are off by as much: check `timedatectl` and "
        "`chronyc tracking` on the host and enable NTP"
    ),
    "ecc_uncorrected": (
        "uncorrected ECC errors: the GPU's memory returned corrupt data (HBM fault, H1). Expect a crash "
        "or silent corruption: drain the node, run the vendor diagnostics (dcgmi diag -r 3), check "
        "`nvidia-smi -q -d ECC,ROW_REMAPPER` for pending row remaps, restart from the last checkpoint"
    ),
    "ecc_corrected": (
        "corrected ECC errors are rising: a degrading HBM region often precedes an uncorrectable error "
        "(H1). Schedule the node for diagnostics and check pending row remaps"
    ),
    "throttle": (
        "the GPU is throttling its clocks: check cooling and airflow, power delivery and the PSU "
        "(`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`); a throttled GPU makes this rank a straggler"
    ),
    "gpu_temp": "the GPU runs hot: check fans, airflow, inlet temperature and the thermal interface (P7)",
    "gpu_mem": (
        "GPU memory is nearly full: an out-of-memory error is close. Check for growing activations or "
        "caches (memory_leak), fragmentation (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), batch size"
    ),
    "host_mem": (
        "host memory is nearly exhausted: the OOM killer is next. Check dataloader workers' memory "
        "(copy-on-access of Python objects, P4), pinned-memory buffers and other processes on the host"
    ),
    "rss": (
        "this training process holds most of the host's memory: look for a host-side leak (lists of "
        "tensors kept with their graphs, growing caches) before the OOM killer ends the run"
    ),
}


def decode_throttle(mask: int) -> list[str]:
    """Names of the NVML clock-event reason bits set in ``mask``."""
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class NodeHealth(Detector):
    """Thresholds on one rank's health samples; one anomaly lists every active condition."""

    kind = "node_health"
    batch_from = 32  # per event, looked at against observed: 2 events 2.7 us against 1.3, 64 0.34 against 0.32
    config_class = NodeHealthConfig
    order = 70
    priority = 160
    plots = ()
    localised = False

    def __init__(self, config: NodeHealthConfig) -> None:
        self.config = config
        self._streak: dict[str, int] = collections.defaultdict(int)
        self._ecc: dict[Any, collections.deque[int]] = {}
        self._open: dict[str, str] = {}  # condition -> severity, as last reported
        self._clean = 0
        self._last_step: int | None = None
        self._health: dict[str, tuple[str, str, dict[str, Any]]] = {}  # active conditions of the latest sample
        self._skewed_since: float | None = None  # collector time since which the clock is off beyond the threshold
        self._skew: dict[str, tuple[str, str, dict[str, Any]]] = {}  # the clock condition, while reported

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        offset = event.clock_offset
        clock = offset is not None and self._clock_changed(event.time, offset)
        kind = event.kind
        if kind != "health":
            if kind == "step":
                self._last_step = event.fields["step"]
            return self._report(event.host, sample=False) if clock else []
        found = self._conditions(event.fields)
        active: dict[str, tuple[str, str, dict[str, Any]]] = {}
        for key, (severity, text, evidence, level) in found.items():
            self._streak[key] += 1
            if not level or self._streak[key] >= self.config.sustain:
                active[key] = (severity, text, evidence)
        for key in list(self._streak):
            if key not in found:
                del self._streak[key]
        self._health = active
        return self._report(event.host, sample=True)

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step is quiet (:mod:`.quiet`) when its clock says nothing new: no offset (every step of an imported log),
        or one within the threshold while no skew is being timed or reported (a live step of a sane host). It only
        marks the last step. Where the steps with an offset are is the batch's (:attr:`.batch.Reading.clocked`, which
        hang reads too), not a look at each event's: D_w1m's node_health CPU 0.065 -> 0.03 s."""
        observe_quiet(self.observe, events, attempts, out, self._quiet_until)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        calm = self._calm
        watched = self._skew or self._skewed_since is not None
        end = batch.quiet_end(i)
        clocked, events = batch.clocked, batch.events  # where the events with an offset are: an import has none
        at = bisect_left(clocked, i)
        while clocked[at] < end:  # (it ends with the batch's length)
            if watched or not calm(cast(float, events[clocked[at]].clock_offset)):  # (clocked: it has one)
                return clocked[at]
            at += 1
        return end

    def _calm(self, offset: float) -> bool:
        """The host's clock is within the threshold of the collector's."""
        return abs(offset) <= self.config.skew_threshold

    def _clock_changed(self, t: float, offset: float) -> bool:
        """Follow the host's clock offset; True when the clock condition starts or ends."""
        cfg = self.config
        if self._calm(offset):
            self._skewed_since = None
            if not self._skew:
                return False
            self._skew = {}
            return True
        now = t + offset  # the collector's clock
        if self._skewed_since is None:
            self._skewed_since = now
        if self._skew or now - self._skewed_since < cfg.skew_sustain:
            return False
        way = "behind" if offset > 0 else "ahead of"
        self._skew = {
            "clock_skew": (
                "warning",
                f"clock {abs(offset):.1f} s {way} the collector's",
                {"clock_offset_s": round(offset, 3), "threshold_s": cfg.skew_threshold},
            )
        }
        return True

    def _report(self, host: str, sample: bool) -> list[Finding]:
        """The rank's anomaly after a change: opened, updated, or resolved once clean (``sample``: a
        health sample; the clock condition ends at once, its estimate being a minimum)."""
        active = {**self._health, **self._skew}
        if not active:
            if not self._open:
                return []
            self._clean += 1 if sample else self.config.resolve_after
            if self._clean < self.config.resolve_after:
                return []
            self._open = {}
            return [
                self.resolve(
                    self._last_step,
                    f"node health back to normal on {host}",
                    "No action needed; keep an eye on the node if it recurs.",
                    {},
                )
            ]
        self._clean = 0
        now = {k: v[0] for k, v in active.items()}
        if now == self._open or (set(now) <= set(self._open) and _rank_of(now) <= _rank_of(self._open)):
            return []  # nothing new or worse: the open anomaly already says it
        self._open = now
        severity = max((v[0] for v in active.values()), key=_SEVERITY.index)
        order = sorted(active, key=lambda k: -_SEVERITY.index(active[k][0]))
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=self._last_step,
                message=f"{host}: " + "; ".join(active[k][1] for k in order),
                hint="Likely cause: " + "; ".join(_HINTS[k.split(":")[0]] for k in dict.fromkeys(order)) + ".",
                evidence={k: active[k][2] for k in order},
            )
        ]

    def _conditions(self, f: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any], bool]]:
        """Condition key -> (severity, message, evidence, is a level condition)."""
        cfg = self.config
        out: dict[str, tuple[str, str, dict[str, Any], bool]] = {}
        for gpu in f.get("gpus") or []:
            idx = gpu.get("index", 0)
            tag = f"GPU {idx}"
            unc = gpu.get("ecc_uncorrected")
            if isinstance(unc, int) and unc > 0:
                out[f"ecc_uncorrected:{idx}"] = (
                    "critical",
                    f"{tag}: {unc} uncorrected ECC errors",
                    {"gpu": idx, "ecc_uncorrected": unc},
                    False,
                )
            cor = gpu.get("ecc_corrected")
            if isinstance(cor, int):
                hist = self._ecc.setdefault(idx, collections.deque(maxlen=cfg.ecc_window))
                hist.append(cor)
                rise = cor - hist[0]
                if rise >= cfg.ecc_corrected_rise:
                    out[f"ecc_corrected:{idx}"] = (
                        "warning",
                        f"{tag}: corrected ECC errors rose by {rise} over the last {len(hist)} samples (now {cor})",
                        {"gpu": idx, "ecc_corrected": cor, "rise": rise},
                        False,
                    )
            mask = gpu.get("throttle_reasons")
            if isinstance(mask, int) and mask & cfg.throttle_mask:
                names = decode_throttle(mask & cfg.throttle_mask)
                severe = mask & 0xC8  # HW slowdown, HW thermal, power brake: the hardware protecting itself
                out[f"throttle:{idx}"] = (
                    "critical" if severe else "warning",
                    f"{tag}: clocks throttled ({', '.join(names)}; reasons 0x{mask:x})",
                    {"gpu": idx, "throttle_reasons": mask, "names": names, "sm_clock_hz": gpu.get("sm_clock_hz")},
                    True,
                )
            temp = gpu.get("temperature_c")
            if isinstance(temp, (int, float)) and temp >= cfg.gpu_temp_warning_c:
                out[f"gpu_temp:{idx}"] = (
                    "critical" if temp >= cfg.gpu_temp_critical_c else "warning",
                    f"{tag}: {temp:.0f} C (warning at {cfg.gpu_temp_warning_c:.0f} C)",
                    {"gpu": idx, "temperature_c": temp},
                    True,
                )
            used, total = gpu.get("mem_used_bytes"), gpu.get("mem_total_bytes")
            if isinstance(used, int) and isinstance(total, int) and total > 0 and used / total >= cfg.gpu_mem_fraction:
                out[f"gpu_mem:{idx}"] = (
                    "warning",
                    f"{tag}: memory {used / total:.1%} full ({used / 2**30:.1f} of {total / 2**30:.1f} GiB)",
                    {"gpu": idx, "mem_used_bytes": used, "mem_total_bytes": total},
                    True,
                )
        used, total = f.get("host_mem_used_bytes"), f.get("host_mem_total_bytes")
        if isinstance(used, int) and isinstance(total, int) and total > 0:
            share = used / total
            if share >= cfg.host_mem_fraction:
                out["host_mem"] = (
                    "critical" if share >= cfg.host_mem_critical_fraction else "warning",
                    f"host memory {share:.1%} used ({used / 2**30:.1f} of {total / 2**30:.1f} GiB)",
                    {"host_mem_used_bytes": used, "host_mem_total_bytes": total},
                    True,
                )
            rss = f.get("rss_bytes")
            if isinstance(rss, int) and rss / total >= cfg.rss_fraction:
                out["rss"] = (
                    "critical",
                    f"process RSS {rss / 2**30:.1f} GiB is {rss / total:.0%} of the host's memory",
                    {"rss_bytes": rss, "host_mem_total_bytes": total},
                    True,
                )
        return out


_SEVERITY = ("info", "warning", "critical")


def _rank_of(conditions: dict[str, str]) -> int:
    return max((_SEVERITY.index(s) for s in conditions.values()), default=0)
