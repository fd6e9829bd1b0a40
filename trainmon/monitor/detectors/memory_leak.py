"""``memory_leak``: memory rising steadily across many steps, and when it will run out.

Why the rule is what it is (``failure-modes.md`` P4, pytorch/pytorch#5902): a leak (tensors kept
with their graphs, growing caches, copy-on-access in dataloader workers) grows memory roughly
linearly until the OOM killer or an allocator error ends the run. P4's rule is to fit a trend over
a long window and alert if it is projected to reach 90% of the memory within 6 h. Benign growth
looks different: the caching allocator fills during the first steps (skipped, ``warmup_steps``),
start-up buffers and caches fill in a few jumps or ever more slowly, an eval or a new buffer adds
one step-like increase; after that memory is flat again.

The detector keeps up to 2 x ``points`` samples spanning the whole attempt (when full, every other
sample is dropped, so memory stays bounded) and judges the latest ``points`` of them: a window of
the recent half (or more) of the attempt, long enough to see a slow trend, recent enough that a
leak starting late is not averaged away. It fires when

1. the medians of the window's four quarters rise one after the other, each by at least
   ``min_quarter_share`` of the total and by more than their noise (growth spread over the
   window, not one jump and not a ramp that has levelled off),
2. the later half of the window rises at least ``min_rate_ratio`` as fast as the earlier half (a
   cache filling ever slower is heading for its ceiling), and where the series is quiet enough to
   tell, at most ``max_plateaus`` of the seven increases between the medians of its eighths are
   flat (a few cache-filling jumps with flat stretches between them line up with the quarters now
   and then; a leak rises everywhere),
3. the growth is at least ``min_growth_fraction`` of the start and ``min_growth_bytes``, and
4. the Theil-Sen slope (median of pairwise slopes: robust to spikes) reaches ``limit_fraction``
   of the memory within ``horizon_hours``, or the window grew by ``big_growth_fraction`` when the
   memory size is unknown.

The memory is the tightest one the series counts against: the GPU for device memory; for process
memory the host (what other processes use counts too) and the process's cgroup limit when the
hooks report one (containers and batch schedulers OOM-kill at that limit, long before the host
is full). The finding says when that limit is reached, and while it is open its slope and time to
exhaustion are refreshed (at most every ``update_seconds``), its severity follows the time left,
and it resolves once the memory has stopped growing.

Series: the device memory of ``step`` events (``mem_allocated_bytes``: the CUDA allocator, or the
process RSS on CPU in the reference trainer), else the process RSS of ``health`` events: their
``rss_samples`` (one per second by default, so a fast leak is seen within the first minute), or
their single ``rss_bytes`` from producers that send no samples.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet, steps_without
from trainmon.monitor.detectors.rolling import sorted_median
from trainmon.wire import Event

__all__ = ["MemoryLeak", "MemoryLeakConfig", "theil_sen"]

_WITHOUT_MEMORY = steps_without("mem_allocated_bytes")


@dataclass
class MemoryLeakConfig:
    """``memory_leak``: memory rising across many steps."""

    warmup_steps: int = 10
    """Steps ignored at the start of each attempt (the caching allocator fills, buffers are created)."""
    points: int = 64
    """Samples judged (the latest of up to twice as many kept, decimated: the window spans the recent
    half or more of the attempt, P4's long window)."""
    min_points: int = 16
    """Samples needed before judging a trend."""
    min_growth_fraction: float = 0.05
    """Growth over the window, as a share of its start, below which nothing fires."""
    min_growth_bytes: int = 64 << 20
    """Growth over the window in bytes below which nothing fires."""
    min_quarter_share: float = 0.15
    """Each quarter of the window must add this share of the total growth (a spread-out rise, not
    one or two step-like increases)."""
    horizon_hours: float = 6.0
    """Fire when the trend reaches ``limit_fraction`` of the memory within this many hours (P4: 6 h)."""
    critical_hours: float = 0.5
    """Projected exhaustion sooner than this is critical."""
    limit_fraction: float = 0.9
    """Share of the device or host memory taken as the exhaustion point (P4: 90% of RAM)."""
    big_growth_fraction: float = 0.5
    """Growth over the window that fires even when the memory size is unknown."""
    min_rate_ratio: float = 0.6
    """The later half of the window must rise at least this fraction as fast as the earlier half: a
    cache filling ever slower is heading for its ceiling, a leak keeps its pace."""
    max_plateaus: int = 1
    """Of the increases between the medians of the window's eighths, at most this many may be flat
    (under a quarter of the mean) when the series is quiet enough to tell: caches that fill in a few
    jumps with flat stretches between them are not a leak."""
    update_seconds: float = 10.0
    """An open finding's slope and time to exhaustion are refreshed at most this often (each refresh
    is a store write)."""


_MIB = float(1 << 20)
_GIB = float(1 << 30)


def theil_sen(points: list[tuple[float, float]], max_points: int = 48) -> float:
    """Median of the pairwise slopes of ``(x, y)`` points (subsampled to ``max_points``)."""
    if len(points) > max_points:
        stride = len(points) / max_points
        points = [points[int(i * stride)] for i in range(max_points)]
    slopes = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 > x1)
    if not slopes:
        return 0.0
    n = len(slopes)
    return slopes[n // 2] if n % 2 else 0.5 * (slopes[n // 2 - 1] + slopes[n // 2])


class _Series:
    """Decimating sample buffer: keeps every ``stride``-th sample, at most 2x ``points`` of them."""

    __slots__ = ("count", "points", "samples", "stride")

    def __init__(self, points: int) -> None:
        self.points = points
        self.samples: list[tuple[float, float, int]] = []  # (time, bytes, step)
        self.stride = 1
        self.count = 0

    def add(self, t: float, value: float, step: int) -> bool:
        """Add a sample; True when it was kept."""
        self.count += 1
        if (self.count - 1) % self.stride:
            return False
        self.samples.append((t, value, step))
        if len(self.samples) >= 2 * self.points:
            self.samples = self.samples[::2]
            self.stride *= 2
        return True

    def clear(self) -> None:
        self.samples.clear()
        self.stride, self.count = 1, 0


def _blocks(values: list[float], parts: int) -> tuple[list[float], float]:
    """Medians of ``parts`` equal blocks, and the smallest difference of two of them that is more
    than noise (about 3 sigma of the difference; sigma from the pooled MAD around the medians)."""
    n = len(values) // parts
    blocks = [values[i * n : (i + 1) * n] for i in range(parts)]
    medians = [sorted_median(sorted(b)) for b in blocks]
    spread = sorted_median(sorted(abs(v - m) for b, m in zip(blocks, medians, strict=True) for v in b))
    return medians, 3 * math.sqrt(2) * 1.25 * 1.4826 * spread / math.sqrt(n)


class MemoryLeak(Detector):
    """Robust trend of device memory per step (or process RSS from health samples)."""

    kind = "memory_leak"
    config_class = MemoryLeakConfig
    order = 80
    priority = 130
    plots = ()
    localised = False
    consumes = frozenset(("run_start", "health", "step"))

    def __init__(self, config: MemoryLeakConfig) -> None:
        self.config = config
        self._device = _Series(config.points)
        self._rss = _Series(config.points)
        self._steps_since_start = 0
        self._last_step: int | None = None
        self._warm_since: float | None = None  # time of the first step past the warm-up
        self._health_mark: tuple[float, int] | None = None  # (time, last step) at the previous health event
        self._on_cpu = True
        self._gpu_total: int | None = None
        self._host_total: int | None = None
        self._host_used: int | None = None
        self._cgroup: tuple[int, int] | None = None  # (limit, used)
        self._open_severity = ""  # "" while no finding is open
        self._emitted_at = -math.inf
        self._kept = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        kind = event.kind
        if kind == "step":
            step = self._last_step = f["step"]
            if self._warm_since is None:  # still warming up (it is set at the first step past the warm-up)
                self._steps_since_start += 1
                if self._steps_since_start <= self.config.warmup_steps:
                    return []
                self._warm_since = event.time
            mem = f.get("mem_allocated_bytes")
            if not mem or not self._device.add(event.time, float(mem), step):
                return []
            self._kept += 1
            if self._kept % 4:  # judge every 4th kept sample: the fit is O(points^2)
                return []
            what = "process memory (RSS)" if self._on_cpu else "device memory"
            return self._judge(self._device, what, self._on_cpu, event.time)
        if kind == "run_start":
            self._on_cpu = not str(f.get("device") or "cpu").startswith("cuda")
            self._steps_since_start = 0
            self._warm_since = None
            self._health_mark = None
            self._device.clear()
            self._rss.clear()
            return []
        if kind == "health":
            return self._observe_health(event)
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step past the warm-up without device memory is quiet (:mod:`.quiet`): it only marks the last step."""
        observe_quiet(self.observe, events, attempts, out, self._quiet_until)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        return i if self._warm_since is None else _WITHOUT_MEMORY(batch, i)

    def _observe_health(self, event: Event) -> list[Finding]:
        f = event.fields
        self._host_total = f.get("host_mem_total_bytes") or self._host_total
        self._host_used = f.get("host_mem_used_bytes") or self._host_used
        if f.get("cgroup_mem_limit_bytes"):
            self._cgroup = (f["cgroup_mem_limit_bytes"], f.get("cgroup_mem_used_bytes") or 0)
        gpus = f.get("gpus") or []
        if gpus and gpus[0].get("mem_total_bytes"):
            self._gpu_total = gpus[0]["mem_total_bytes"]
        step = self._last_step or 0
        previous, self._health_mark = self._health_mark, (event.time, step)
        if self._device.samples or self._warm_since is None:
            return []  # steps carry the memory (or the warm-up is not over)
        samples = [v for v in f.get("rss_samples") or () if finite(v) and v > 0]
        if not samples and f.get("rss_bytes"):
            samples = [float(f["rss_bytes"])]
        interval = f.get("rss_sample_interval") or 0.0
        kept = False
        for i, value in enumerate(samples):
            t = event.time - (len(samples) - 1 - i) * interval
            if t < self._warm_since:
                continue
            at = step
            if previous is not None and event.time > previous[0]:  # the step then, by interpolation
                at = round(previous[1] + (step - previous[1]) * max(0.0, t - previous[0]) / (event.time - previous[0]))
            kept |= self._rss.add(t, value, at)
        return self._judge(self._rss, "process RSS", True, event.time) if kept else []

    def _limits(self, host: bool, current: float) -> list[tuple[str, float]]:
        """(name, bytes left until exhaustion) for each memory the series counts against."""
        frac = self.config.limit_fraction
        out = []
        if not host:
            if self._gpu_total:
                out.append(
                    (f"{frac:.0%} of the GPU's {self._gpu_total / _GIB:.0f} GiB", frac * self._gpu_total - current)
                )
            return out
        if self._host_total:
            used = max(current, float(self._host_used or 0))  # the other processes on the host count too
            out.append((f"{frac:.0%} of the host's {self._host_total / _GIB:.0f} GiB", frac * self._host_total - used))
        if self._cgroup is not None:
            limit, used = self._cgroup
            out.append(
                (f"{frac:.0%} of the cgroup limit ({limit / _GIB:.3g} GiB)", frac * limit - max(current, float(used)))
            )
        return out

    def _judge(self, series: _Series, what: str, host: bool, now: float) -> list[Finding]:
        cfg = self.config
        samples = series.samples[-cfg.points :]  # the recent half to all of the attempt
        if len(samples) < cfg.min_points:
            return []
        values = [s[1] for s in samples]
        medians, noise = _blocks(values, 4)
        start, current = medians[0], medians[3]
        growth = current - start
        need = max(cfg.min_quarter_share * growth, noise)
        rising = growth > 0 and all(b - a >= need for a, b in itertools.pairwise(medians))
        big_enough = growth >= cfg.min_growth_bytes and start > 0 and growth / start >= cfg.min_growth_fraction
        step = samples[-1][2]
        if not (rising and big_enough and self._steady(samples)):
            if self._open_severity and medians[3] - medians[2] <= noise:
                self._open_severity = ""
                return [
                    self.resolve(
                        step,
                        f"{what} stopped growing ({current / _MIB:.0f} MiB)",
                        "No action needed if it stays flat.",
                        {"bytes": int(current)},
                    )
                ]
            return []
        slope = theil_sen([(s[0], s[1]) for s in samples])  # bytes per second
        per_step = theil_sen([(float(s[2]), s[1]) for s in samples])
        limits = self._limits(host, samples[-1][1])
        name, left = min(limits, key=lambda x: x[1]) if limits else ("", math.inf)
        eta_h = max(0.0, left) / slope / 3600 if slope > 0 else math.inf
        fires = eta_h <= cfg.horizon_hours or (not limits and growth / start >= cfg.big_growth_fraction)
        if not fires and not self._open_severity:
            return []
        severity = "critical" if eta_h <= cfg.critical_hours else "warning"
        if severity == self._open_severity and now - self._emitted_at < cfg.update_seconds:
            return []
        self._open_severity, self._emitted_at = severity, now
        span_steps = samples[-1][2] - samples[0][2]
        span = f"{span_steps} steps" if span_steps > 0 else f"{samples[-1][0] - samples[0][0]:.0f} s"
        rate = f"{slope / _MIB:.3g} MiB/s" + (f" (~{per_step / _MIB:.3g} MiB/step)" if span_steps > 0 else "")
        eta = f"; out of memory ({name}) in ~{_duration(eta_h)}" if math.isfinite(eta_h) else ""
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=step,
                message=(
                    f"{what} grew {start / _MIB:.0f} -> {current / _MIB:.0f} MiB (+{growth / start:.0%}) "
                    f"over {span}, {rate}{eta}"
                ),
                hint=(
                    "Likely cause: something keeps references every step: losses or outputs appended to a "
                    "list without .detach()/.item() (keeps the graphs), growing caches or metric buffers, "
                    "dataloader workers touching Python objects (copy-on-access, P4). Compare two "
                    "heap snapshots (torch.cuda.memory._snapshot / tracemalloc) a few hundred steps apart."
                ),
                evidence={
                    "series": what,
                    "start_bytes": int(start),
                    "current_bytes": int(current),
                    "growth_fraction": round(growth / start, 4),
                    "slope_bytes_per_s": round(slope, 1),
                    "bytes_per_step": round(per_step, 1),
                    "limit": name or "unknown",
                    "hours_to_limit": round(eta_h, 3) if math.isfinite(eta_h) else "inf",
                    "exhausted_at": round(now + eta_h * 3600, 1) if math.isfinite(eta_h) else "never",
                },
            )
        ]

    def _steady(self, samples: list[tuple[float, float, int]]) -> bool:
        """The rise keeps its pace (rule 2): not slowing down, and not a few jumps between flat stretches."""
        half = len(samples) // 2
        earlier = theil_sen([(s[0], s[1]) for s in samples[:half]])
        later = theil_sen([(s[0], s[1]) for s in samples[half:]])
        if later < self.config.min_rate_ratio * earlier:
            return False
        if len(samples) < 24:
            return True
        medians, noise = _blocks([s[1] for s in samples], 8)
        mean = (medians[-1] - medians[0]) / 7
        if mean <= noise:
            return True  # too noisy to tell a flat stretch from a slow rise
        return sum(b - a < 0.25 * mean for a, b in itertools.pairwise(medians)) <= self.config.max_plateaus


def _duration(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h"
