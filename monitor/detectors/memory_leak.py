"""``memory_leak``: memory rising steadily across many steps.

Why the rule is what it is (``failure-modes.md`` P4, pytorch/pytorch#5902): a leak (tensors kept
with their graphs, growing caches, copy-on-access in dataloader workers) grows memory roughly
linearly until the OOM killer or an allocator error ends the run, hours later. P4's rule is to
fit a trend over a long window and alert if it is projected to reach 90% of the memory within
6 h. Benign growth looks different: the caching allocator fills during the first steps (skipped,
``warmup_steps``) and an eval or a new buffer adds one step-like increase, after which memory is
flat again.

The detector keeps up to 2 x ``points`` samples spanning the whole attempt (when full, every other
sample is dropped, so memory stays bounded) and judges the latest ``points`` of them: a window of
the recent half (or more) of the attempt, long enough to see a slow trend, recent enough that a
leak starting late is not averaged away. It fires when

1. the medians of the window's four quarters rise one after the other, each by at least
   ``min_quarter_share`` of the total and by more than their noise (growth spread over the
   window, not one jump and not a ramp that has levelled off),
2. the growth is at least ``min_growth_fraction`` of the start and ``min_growth_bytes``, and
3. the Theil-Sen slope (median of pairwise slopes: robust to spikes) reaches ``limit_fraction``
   of the memory within ``horizon_hours``, or the window grew by ``big_growth_fraction`` when the
   memory size is unknown.

Series: the device memory of ``step`` events (``mem_allocated_bytes``: the CUDA allocator, or the
process RSS on CPU in the reference trainer), else the ``rss_bytes`` of ``health`` events. The
memory size comes from the ``health`` events (GPU total, or host total for RSS).
"""

from __future__ import annotations

import itertools
import math

from trainmon.hooks.wire import Event
from trainmon.monitor.config import MemoryLeakConfig
from trainmon.monitor.detectors.base import Detector, Finding

__all__ = ["MemoryLeak", "theil_sen"]


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


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class MemoryLeak(Detector):
    """Robust trend of device memory per step (or process RSS per health sample)."""

    kind = "memory_leak"

    def __init__(self, config: MemoryLeakConfig) -> None:
        self.config = config
        self._device = _Series(config.points)
        self._rss = _Series(config.points)
        self._steps_since_start = 0
        self._last_step: int | None = None
        self._on_cpu = True
        self._gpu_total: int | None = None
        self._host_total: int | None = None
        self._host_used: int | None = None
        self._open = False
        self._open_severity = ""
        self._kept = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        if event.kind == "run_start":
            self._on_cpu = not str(f.get("device") or "cpu").startswith("cuda")
            self._steps_since_start = 0
            self._device.clear()
            self._rss.clear()
            return []
        if event.kind == "health":
            self._host_total = f.get("host_mem_total_bytes") or self._host_total
            self._host_used = f.get("host_mem_used_bytes") or self._host_used
            gpus = f.get("gpus") or []
            if gpus and gpus[0].get("mem_total_bytes"):
                self._gpu_total = gpus[0]["mem_total_bytes"]
            rss = f.get("rss_bytes")
            warm = self._steps_since_start > self.config.warmup_steps
            if (
                rss
                and warm
                and not self._device.samples
                and self._rss.add(event.time, float(rss), self._last_step or 0)
            ):
                return self._judge(self._rss, "process RSS", self._host_limit(), event.time)
            return []
        if event.kind != "step":
            return []
        self._last_step = f["step"]
        self._steps_since_start += 1
        mem = f.get("mem_allocated_bytes")
        if not mem or self._steps_since_start <= self.config.warmup_steps:
            return []
        if not self._device.add(event.time, float(mem), f["step"]):
            return []
        self._kept += 1
        if self._kept % 4 and not self._open:  # judge every 4th kept sample: the fit is O(points^2)
            return []
        what = "process memory (RSS)" if self._on_cpu else "device memory"
        limit = self._host_limit() if self._on_cpu else self._gpu_limit()
        return self._judge(self._device, what, limit, event.time)

    def _host_limit(self) -> tuple[float, float] | None:
        """(bytes at which memory counts as exhausted, bytes used by others) for host memory."""
        if not self._host_total:
            return None
        return self.config.limit_fraction * self._host_total, float(self._host_total)

    def _gpu_limit(self) -> tuple[float, float] | None:
        if not self._gpu_total:
            return None
        return self.config.limit_fraction * self._gpu_total, float(self._gpu_total)

    def _judge(self, series: _Series, what: str, limit: tuple[float, float] | None, now: float) -> list[Finding]:
        cfg = self.config
        samples = series.samples[-cfg.points :]  # the recent half to all of the attempt
        if len(samples) < cfg.min_points:
            return []
        q = len(samples) // 4
        medians = [_median([s[1] for s in samples[i * q : (i + 1) * q]]) for i in range(4)]
        start, current = medians[0], medians[3]
        growth = current - start
        # Each quarter must add a share of the growth, and more than the noise of a quarter median
        # (about 1.25 sigma / sqrt(n) each; sigma from the pooled MAD around the quarter medians).
        spread = _median([abs(s[1] - medians[i]) for i in range(4) for s in samples[i * q : (i + 1) * q]])
        noise = 3 * math.sqrt(2) * 1.25 * 1.4826 * spread / math.sqrt(q)
        need = max(cfg.min_quarter_share * growth, noise)
        rising = growth > 0 and all(b - a >= need for a, b in itertools.pairwise(medians))
        big_enough = growth >= cfg.min_growth_bytes and start > 0 and growth / start >= cfg.min_growth_fraction
        step = samples[-1][2]
        if not (rising and big_enough):
            if self._open and medians[3] <= medians[2]:
                self._open = False
                self._open_severity = ""
                return [
                    Finding(
                        kind=self.kind,
                        severity="info",
                        step=step,
                        message=f"{what} stopped growing ({current / 2**20:.0f} MiB)",
                        hint="No action needed if it stays flat.",
                        evidence={"bytes": int(current)},
                        resolved=True,
                    )
                ]
            return []
        slope = theil_sen([(s[0], s[1]) for s in samples])  # bytes per second
        span_steps = max(1, samples[-1][2] - samples[0][2])
        per_step = theil_sen([(float(s[2]), s[1]) for s in samples])
        eta_h = math.inf
        if limit is not None and slope > 0:
            used = samples[-1][1]
            if (self._on_cpu or series is self._rss) and self._host_used is not None:
                used = max(used, float(self._host_used))  # the other processes on the host count too
            eta_h = max(0.0, limit[0] - used) / slope / 3600
        fires = eta_h <= cfg.horizon_hours or (limit is None and growth / start >= cfg.big_growth_fraction)
        if not fires:
            return []
        severity = "critical" if eta_h <= cfg.critical_hours else "warning"
        if self._open and severity == self._open_severity:
            return []
        self._open, self._open_severity = True, severity
        eta = f"reaches {cfg.limit_fraction:.0%} of memory in ~{_duration(eta_h)}" if math.isfinite(eta_h) else ""
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=step,
                message=(
                    f"{what} grew {start / 2**20:.0f} -> {current / 2**20:.0f} MiB (+{growth / start:.0%}) over "
                    f"{span_steps} steps, {slope / 2**20:.3g} MiB/s (~{per_step / 2**20:.3g} MiB/step)"
                    + (f"; {eta}" if eta else "")
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
                    "hours_to_limit": round(eta_h, 3) if math.isfinite(eta_h) else "inf",
                },
            )
        ]


def _duration(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h"
