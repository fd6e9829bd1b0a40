"""Node health and liveness, sampled on a background thread.

Every ``health_interval`` seconds: the process (CPU, RSS), the host (memory, disk and network
counters) through psutil, and each visible GPU through NVML (nvidia-ml-py) when it is installed
and a driver answers: temperature, utilisation, memory, power, SM clock, throttle reasons, ECC
counts, UUID. Every ``heartbeat_interval`` seconds a heartbeat with the last finished step, so
the collector can tell a hung rank (heartbeats, no steps) from a dead one (neither).

NVML calls are host-side driver queries; they never touch the CUDA stream of the training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HealthSampler", "gpu_uuid_of", "nvml_snapshot"]

log = logging.getLogger("trainmon.health")

try:
    import psutil
except ImportError:  # optional on the trainer side
    psutil = None

try:
    import pynvml
except ImportError:
    pynvml = None

_nvml_ready: bool | None = None


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


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # a field a GPU does not support (ECC on consumer cards, ...)
        return None


def nvml_snapshot() -> list[dict[str, Any]]:
    """One dict per GPU with the health fields of the wire format; [] without NVML."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = _try(lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
        util = _try(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h))
        power = _try(lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
        clock = _try(lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        gpu = {
            "index": i,
            "uuid": _try(lambda h=h: nv.nvmlDeviceGetUUID(h)),
            "temperature_c": _try(lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            "utilization_ratio": None if util is None else util.gpu / 100.0,
            "mem_used_bytes": None if mem is None else mem.used,
            "mem_total_bytes": None if mem is None else mem.total,
            "power_w": None if power is None else power / 1000.0,
            "sm_clock_hz": None if clock is None else clock * 1_000_000,
            "throttle_reasons": _try(lambda h=h: nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
            "ecc_corrected": _try(
                lambda h=h: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
            ),
            "ecc_uncorrected": _try(
                lambda h=h: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
            ),
        }
        out.append({k: v for k, v in gpu.items() if v is not None})
    return out


def gpu_uuid_of(device_index: int) -> str | None:
    """UUID of a CUDA device as torch numbers it (respects CUDA_VISIBLE_DEVICES)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class HealthSampler:
    """Daemon thread emitting ``health`` and ``heartbeat`` events through ``emit``."""

    def __init__(
        self,
        emit: Callable[[str, dict[str, Any]], None],
        last_step: Callable[[], int],
        *,
        health_interval: float = 10.0,
        heartbeat_interval: float = 5.0,
    ) -> None:
        self._emit = emit
        self._last_step = last_step
        self._health_interval = health_interval
        self._heartbeat_interval = heartbeat_interval
        self._stop = threading.Event()
        self._proc = psutil.Process() if psutil is not None else None
        if self._proc is not None:
            self._proc.cpu_percent(None)  # prime: the first call always returns 0
        self._thread = threading.Thread(target=self._run, name="trainmon-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if psutil is not None:
            with self._proc.oneshot():
                fields["cpu_percent"] = self._proc.cpu_percent(None)
                fields["rss_bytes"] = self._proc.memory_info().rss
            vm = psutil.virtual_memory()
            fields["host_mem_used_bytes"] = vm.total - vm.available
            fields["host_mem_total_bytes"] = vm.total
            disk = _try(psutil.disk_io_counters)
            if disk is not None:
                fields["disk_read_bytes"] = disk.read_bytes
                fields["disk_write_bytes"] = disk.write_bytes
            net = _try(psutil.net_io_counters)
            if net is not None:
                fields["net_sent_bytes"] = net.bytes_sent
                fields["net_recv_bytes"] = net.bytes_recv
        gpus = nvml_snapshot()
        if gpus:
            fields["gpus"] = gpus
        return fields

    def _run(self) -> None:
        next_health = time.monotonic()
        next_beat = time.monotonic() + self._heartbeat_interval
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_health:
                    self._emit("health", self.sample())
                    next_health = now + self._health_interval
                if now >= next_beat:
                    step = self._last_step()
                    self._emit("heartbeat", {"step": step if step >= 0 else None})
                    next_beat = now + self._heartbeat_interval
            except Exception:
                log.exception("trainmon health sampler failed; continuing")
            self._stop.wait(max(0.05, min(next_health, next_beat) - time.monotonic()))
