"""Node health and liveness, sampled on a background thread.

Every ``health_interval`` seconds: the process (CPU, RSS), the host (memory, disk and network
counters) through psutil, the memory limit of the process's cgroup when one is set, and each
visible GPU through NVML (nvidia-ml-py) when it is installed and a driver answers: temperature,
utilisation, memory, power, SM clock, throttle reasons, ECC counts, UUID. Every
``heartbeat_interval`` seconds a heartbeat with the last finished step, so the collector can tell
a hung rank (heartbeats, no steps) from a dead one (neither).

Process memory is also sampled every ``memory_interval`` seconds (1 s by default) and the samples
travel with the next health event (``rss_samples``): a leak of 1 MiB per step at 30 steps/s fills
a host in minutes, and ten-second samples alone are too few to tell its trend from noise within
the first minute. On Linux one sample is a ``pread`` of ``/proc/self/statm`` on a descriptor kept
open (about 2 us, no allocation beyond a small bytes object); elsewhere psutil's ``memory_info``.

NVML calls are host-side driver queries; they never touch the CUDA stream of the training.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["HealthSampler", "gpu_uuid_of", "nvml_snapshot"]

log = logging.getLogger("trainmon.health")

try:
    import psutil

    _HAVE_PSUTIL = True
except ImportError:  # optional on the trainer side
    _HAVE_PSUTIL = False

try:
    import pynvml
except ImportError:
    pynvml = None

_T = TypeVar("_T")
_nvml_ready: bool | None = None
_MAX_RSS_SAMPLES = 600  # memory samples between two health events at most (10 min at 1 s)


def _nvml() -> Any:
    """pynvml after a successful nvmlInit, else None (no package, no driver, no GPU)."""
    global _nvml_ready
    if pynvml is None:
        return None
    if _nvml_ready is None:
        try:
            pynvml.nvmlInit()
            _nvml_ready = True
        except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            _nvml_ready = False
    return pynvml if _nvml_ready else None


def _try(fn: Callable[[], _T]) -> _T | None:
    try:
        return fn()
    except Exception:  # a field a GPU does not support (ECC on consumer cards, ...)
        return None


def nvml_snapshot() -> list[dict[str, Any]]:
    """One dict per GPU with the health fields of the wire format; [] without NVML."""
    nv = _nvml()
    if nv is None:
        return []
    return [_gpu_health(nv, i) for i in range(nv.nvmlDeviceGetCount())]


def _gpu_health(nv: Any, i: int) -> dict[str, Any]:
    """The health fields NVML gives for GPU ``i``; a field it cannot read is left out."""
    h = nv.nvmlDeviceGetHandleByIndex(i)
    mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    power = _try(lambda: nv.nvmlDeviceGetPowerUsage(h))
    clock = _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
    gpu = {
        "index": i,
        "uuid": _try(lambda: nv.nvmlDeviceGetUUID(h)),
        "temperature_c": _try(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "utilization_ratio": None if util is None else util.gpu / 100.0,
        "mem_used_bytes": None if mem is None else mem.used,
        "mem_total_bytes": None if mem is None else mem.total,
        "power_w": None if power is None else power / 1000.0,
        "sm_clock_hz": None if clock is None else clock * 1_000_000,
        "throttle_reasons": _try(lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "ecc_corrected": _try(
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        ),
        "ecc_uncorrected": _try(
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        ),
    }
    return {k: v for k, v in gpu.items() if v is not None}


class _Rss:
    """Reads the process's resident memory cheaply: ``/proc/self/statm`` (Linux), else psutil."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._page = 0
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):  # not Linux
            self._fd = None
        self._proc = psutil.Process() if self._fd is None and _HAVE_PSUTIL else None

    def read(self) -> int | None:
        """Resident bytes now, or None when the platform offers no way to read them."""
        if self._fd is not None:
            return int(os.pread(self._fd, 256, 0).split()[1]) * self._page
        if self._proc is not None:
            return self._proc.memory_info().rss
        return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _cgroup_files() -> tuple[str, str, str] | None:
    """(limit, usage, stat) files of this process's memory cgroup (v2, else v1), or None.

    The path in ``/proc/self/cgroup`` is tried under the mount first; inside a container with a
    cgroup namespace the process's cgroup is the mount's root.
    """
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        paths[controllers] = path.lstrip("/")
    candidates = []
    if "" in paths:  # v2: the unified hierarchy
        for base in (os.path.join("/sys/fs/cgroup", paths[""]), "/sys/fs/cgroup"):
            candidates.append((f"{base}/memory.max", f"{base}/memory.current", f"{base}/memory.stat"))
    v1 = next((p for c, p in paths.items() if "memory" in c.split(",")), None)
    if v1 is not None:
        for base in (os.path.join("/sys/fs/cgroup/memory", v1), "/sys/fs/cgroup/memory"):
            candidates.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes", f"{base}/memory.stat"))
    return next((c for c in candidates if os.path.exists(c[0]) and os.path.exists(c[1])), None)


def cgroup_memory(files: tuple[str, str, str], host_total: int) -> dict[str, int]:
    """The cgroup's memory limit and working set (usage minus inactive file cache, which the kernel
    reclaims before it OOM-kills), or {} when no limit below the host's memory is set."""
    limit_path, usage_path, stat_path = files
    with open(limit_path) as f:
        raw = f.read().strip()
    if raw == "max" or int(raw) >= host_total:
        return {}
    with open(usage_path) as f:
        usage = int(f.read())
    inactive = 0
    with open(stat_path) as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                inactive = int(value)
    return {"cgroup_mem_limit_bytes": int(raw), "cgroup_mem_used_bytes": max(0, usage - inactive)}


def gpu_uuid_of(device_index: int) -> str | None:
    """UUID of a CUDA device as torch numbers it (respects CUDA_VISIBLE_DEVICES)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class HealthSampler:
    """Daemon thread emitting ``health`` and ``heartbeat`` events through ``emit``.

    ``memory_interval`` (0: off) paces the process-memory samples that ride on the health events;
    at most ``_MAX_RSS_SAMPLES`` wait between two of them (older ones are dropped), so a long health
    interval cannot make an event unbounded.
    """

    def __init__(
        self,
        emit: Callable[[str, dict[str, Any]], None],
        last_step: Callable[[], int],
        *,
        health_interval: float = 10.0,
        heartbeat_interval: float = 5.0,
        memory_interval: float = 1.0,
    ) -> None:
        self._emit = emit
        self._last_step = last_step
        self._health_interval = health_interval
        self._heartbeat_interval = heartbeat_interval
        self._memory_interval = memory_interval if memory_interval > 0 and health_interval > 0 else float("inf")
        self._stop = threading.Event()
        self._proc = psutil.Process() if _HAVE_PSUTIL else None
        if self._proc is not None:
            self._proc.cpu_percent(None)  # prime: the first call always returns 0
        self._rss = _Rss()
        self._rss_samples: collections.deque[int] = collections.deque(maxlen=_MAX_RSS_SAMPLES)
        self._rss_first = self._rss_last = 0.0  # monotonic times of the oldest and newest waiting samples
        self._cgroup = _cgroup_files()
        self._thread = threading.Thread(target=self._run, name="trainmon-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if not self._thread.is_alive():
            self._rss.close()

    def sample_memory(self) -> None:
        """Take one process-memory sample for the next health event."""
        rss = self._rss.read()
        if rss is None:
            return
        self._rss_last = time.monotonic()
        if not self._rss_samples:
            self._rss_first = self._rss_last
        elif len(self._rss_samples) == self._rss_samples.maxlen:
            self._rss_first += (self._rss_last - self._rss_first) / (len(self._rss_samples) - 1)  # oldest dropped
        self._rss_samples.append(rss)

    def sample(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self._proc is not None:  # psutil is installed
            with self._proc.oneshot():
                fields["cpu_percent"] = self._proc.cpu_percent(None)
                fields["rss_bytes"] = self._proc.memory_info().rss
            vm = psutil.virtual_memory()
            fields["host_mem_used_bytes"] = vm.total - vm.available
            fields["host_mem_total_bytes"] = vm.total
            cgroup = self._cgroup
            if cgroup is not None:
                fields.update(_try(lambda: cgroup_memory(cgroup, vm.total)) or {})
            disk = _try(psutil.disk_io_counters)
            if disk is not None:
                fields["disk_read_bytes"] = disk.read_bytes
                fields["disk_write_bytes"] = disk.write_bytes
            net = _try(psutil.net_io_counters)
            if net is not None:
                fields["net_sent_bytes"] = net.bytes_sent
                fields["net_recv_bytes"] = net.bytes_recv
        if self._rss_samples:
            n = len(self._rss_samples)
            fields["rss_samples"] = [float(v) for v in self._rss_samples]
            if n > 1:  # the measured spacing: a late wake-up of this thread stretches it
                fields["rss_sample_interval"] = (self._rss_last - self._rss_first) / (n - 1)
            self._rss_samples.clear()
        gpus = nvml_snapshot()
        if gpus:
            fields["gpus"] = gpus
        return fields

    def _run(self) -> None:
        now = time.monotonic()
        next_health, next_memory = now, now
        next_beat = now + self._heartbeat_interval
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_memory or now >= next_health:  # the last sample is the health event's
                    self.sample_memory()
                    next_memory = now + self._memory_interval
                if now >= next_health:
                    self._emit("health", self.sample())
                    next_health = now + self._health_interval
                if now >= next_beat:
                    step = self._last_step()
                    self._emit("heartbeat", {"step": step if step >= 0 else None})
                    next_beat = now + self._heartbeat_interval
            except Exception:
                log.exception("trainmon health sampler failed; continuing")
            self._stop.wait(max(0.05, min(next_health, next_beat, next_memory) - time.monotonic()))
