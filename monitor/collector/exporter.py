"""Prometheus exposition of the live state and of the collector's own health.

Training series are built at scrape time from :class:`~trainmon.monitor.collector.live.LiveState` by a custom
collector (the ``prometheus_client`` pattern for mirroring external state), so a run that ends
simply stops being exported: no stale label sets to remember to remove. Labels are bounded:
``run``, ``rank``, ``phase``, ``group``, ``kind``, ``severity``; never a step or a layer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trainmon.monitor.analysis.goodput import hang_open
from trainmon.monitor.collector.detection_process import DetectionProcess, LocalDetection
from trainmon.monitor.collector.live import LiveState

__all__ = ["FINISHED_RUN_TTL_SECONDS", "CollectorMetrics", "DetectionCollector", "TrainingCollector"]

FINISHED_RUN_TTL_SECONDS = 300.0
"""A finished run stays exported this long, so the last scrape sees its final values."""

_STEP_GAUGES = {
    # wire field -> (metric name, help)
    "loss": ("trainmon_loss", "Training loss of the latest step."),
    "grad_norm": ("trainmon_grad_norm", "Total gradient norm before clipping, latest step."),
    "grad_norm_clipped": ("trainmon_grad_norm_clipped", "Total gradient norm after clipping, latest step."),
    "clip_coef": ("trainmon_grad_clip_coefficient", "Factor the gradients were scaled by (1 = not clipped)."),
    "loss_scale": ("trainmon_loss_scale", "fp16 loss scale of the latest step."),
    "step_time": ("trainmon_step_time_seconds", "Wall time of the latest step."),
    "mem_allocated_bytes": ("trainmon_device_memory_allocated_bytes", "Device memory allocated."),
    "mem_peak_bytes": ("trainmon_device_memory_peak_bytes", "Peak device memory during the latest step."),
}


_GPU_GAUGES = {
    # health event GPU field -> (metric name, help)
    "temperature_c": ("trainmon_gpu_temperature_celsius", "GPU temperature."),
    "utilization_ratio": ("trainmon_gpu_utilization_ratio", "GPU busy fraction (NVML)."),
    "mem_used_bytes": ("trainmon_gpu_memory_used_bytes", "GPU memory in use (NVML)."),
    "mem_total_bytes": ("trainmon_gpu_memory_total_bytes", "GPU memory installed."),
    "power_w": ("trainmon_gpu_power_watts", "GPU power draw."),
    "sm_clock_hz": ("trainmon_gpu_sm_clock_hertz", "GPU SM clock."),
}


def _put(family: Metric, labels: list[str], value: Any, scale: float = 1.0) -> None:
    """One sample, if the value is a number: whatever one rank sent, the scrape of every run must work."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        family.add_metric(labels, float(value) * scale)


class TrainingCollector(Collector):
    """Yields the latest per-run, per-rank training values at each scrape."""

    def __init__(self, live: LiveState, clock=time.time) -> None:
        self._live = live
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        rl = ["run", "rank"]
        step = GaugeMetricFamily("trainmon_step", "Latest optimizer step.", labels=rl)
        last = GaugeMetricFamily(
            "trainmon_last_step_timestamp_seconds", "Wall time of the latest step (hang alerts).", labels=rl
        )
        seen = GaugeMetricFamily(
            "trainmon_last_seen_timestamp_seconds", "Wall time of the latest event of any kind.", labels=rl
        )
        gauges = {k: GaugeMetricFamily(name, doc, labels=rl) for k, (name, doc) in _STEP_GAUGES.items()}
        lr = GaugeMetricFamily("trainmon_learning_rate", "Learning rate per param group.", labels=[*rl, "group"])
        phase = GaugeMetricFamily("trainmon_phase_seconds", "Seconds per phase, latest step.", labels=[*rl, "phase"])
        tps = GaugeMetricFamily("trainmon_tokens_per_second", "Tokens per second of this rank.", labels=rl)
        tokens = CounterMetricFamily("trainmon_tokens", "Tokens processed by this rank.", labels=rl)
        attempt = GaugeMetricFamily("trainmon_attempt", "Attempt (process restart) the rank is on.", labels=rl)
        eval_loss = GaugeMetricFamily("trainmon_eval_loss", "Latest evaluation loss.", labels=["run"])
        world = GaugeMetricFamily("trainmon_run_world_size", "Ranks in the run.", labels=["run"])
        planned = GaugeMetricFamily("trainmon_run_planned_steps", "Optimizer steps the run plans.", labels=["run"])
        up = GaugeMetricFamily("trainmon_run_running", "1 while the run has not ended.", labels=["run"])
        lr_expected = GaugeMetricFamily(
            "trainmon_learning_rate_expected",
            "LR the declared schedule gives for the latest step (param group 0 only: one schedule is declared).",
            labels=[*rl, "group"],
        )
        mfu = GaugeMetricFamily("trainmon_mfu_ratio", "Model FLOPs utilisation of the rank's device.", labels=rl)
        missing = CounterMetricFamily(
            "trainmon_producer_missing_events", "Events a rank's producer dropped (sequence gaps).", labels=rl
        )
        nl = [*rl, "node"]
        cpu = GaugeMetricFamily(
            "trainmon_process_cpu_cores",
            "CPU cores the training process kept busy over the latest health interval (1.0 = one core).",
            labels=nl,
        )
        rss = GaugeMetricFamily("trainmon_process_resident_memory_bytes", "Training process RSS.", labels=nl)
        host_used = GaugeMetricFamily("trainmon_host_memory_used_bytes", "Host memory in use.", labels=nl)
        host_total = GaugeMetricFamily("trainmon_host_memory_total_bytes", "Host memory installed.", labels=nl)
        gl = [*nl, "gpu"]
        gpu_gauges = {k: GaugeMetricFamily(name, doc, labels=gl) for k, (name, doc) in _GPU_GAUGES.items()}
        throttled = GaugeMetricFamily(
            "trainmon_gpu_throttle_reasons", "NVML clock-event reasons bitmask (0: not throttled).", labels=gl
        )
        ecc = CounterMetricFamily("trainmon_gpu_ecc_errors", "GPU ECC errors since boot.", labels=[*gl, "type"])
        an_total = CounterMetricFamily(
            "trainmon_anomalies", "Anomalies opened by the collector.", labels=["run", "kind", "severity"]
        )
        an_active = GaugeMetricFamily(
            "trainmon_anomalies_active", "Anomalies currently open.", labels=["run", "kind", "severity"]
        )
        goodput = GaugeMetricFamily(
            "trainmon_goodput_ratio",
            "Share of the run's wall time that trained the model (rank 0's clock, all attempts).",
            labels=["run"],
        )
        badput = GaugeMetricFamily(
            "trainmon_badput_seconds",
            "Wall time of the run lost, by cause (trainmon.monitor.analysis.goodput); a cause can shrink "
            "when a resume turns earlier steps into recomputation.",
            labels=["run", "cause"],
        )
        recomputed = GaugeMetricFamily(
            "trainmon_recomputed_steps", "Steps run again after resuming from a checkpoint.", labels=["run"]
        )
        with self._live.lock:
            for run_id, run in list(self._live.runs.items()):
                ended = run.status != "running"
                last_seen = max((r.last_seen for r in run.ranks.values()), default=0.0)
                if ended and now - last_seen > FINISHED_RUN_TTL_SECONDS:
                    continue
                up.add_metric([run_id], 0.0 if ended else 1.0)
                if run.world_size is not None:
                    world.add_metric([run_id], run.world_size)
                if run.planned_steps is not None:
                    planned.add_metric([run_id], run.planned_steps)
                if run.eval_loss is not None:
                    eval_loss.add_metric([run_id], run.eval_loss)
                for (kind, sev), n in run.anomalies_total.items():
                    an_total.add_metric([run_id, kind, sev], n)
                for (kind, sev), n in run.anomalies_active.items():
                    an_active.add_metric([run_id, kind, sev], n)
                good = run.goodput.result(now, hang_open(run.anomalies_active))
                if good["fraction"] is not None:
                    goodput.add_metric([run_id], good["fraction"])
                    for cause, secs in good["badput_seconds"].items():
                        badput.add_metric([run_id, cause], secs)
                    recomputed.add_metric([run_id], good["recomputed_steps"])
                for rank_id, r in run.ranks.items():
                    labels = [run_id, str(rank_id)]
                    seen.add_metric(labels, r.last_seen)
                    attempt.add_metric(labels, r.attempt)
                    if r.step >= 0:
                        step.add_metric(labels, r.step)
                        last.add_metric(labels, r.last_step_time)
                        tokens.add_metric(labels, r.tokens_total)
                        if r.tokens_per_second is not None:
                            tps.add_metric(labels, r.tokens_per_second)
                        for key, fam in gauges.items():
                            _put(fam, labels, r.last.get(key))
                        for i, value in enumerate(r.last.get("lr") or ()):
                            _put(lr, [*labels, str(i)], value)
                        for name, secs in (r.last.get("phases") or {}).items():
                            _put(phase, [*labels, name], secs)
                        if (expected := r.expected_lr()) is not None:
                            lr_expected.add_metric([*labels, "0"], expected)
                        if (ratio := r.mfu()) is not None:
                            mfu.add_metric(labels, ratio)
                    missing.add_metric(labels, r.missing_events)
                    h = r.health
                    if h:
                        node = [*labels, r.host]
                        _put(cpu, node, h.get("cpu_percent"), 0.01)
                        _put(rss, node, h.get("rss_bytes"))
                        _put(host_used, node, h.get("host_mem_used_bytes"))
                        _put(host_total, node, h.get("host_mem_total_bytes"))
                        for g in h.get("gpus") or ():
                            if not isinstance(g, dict):
                                continue
                            gpu = [*node, str(g.get("index", 0))]
                            for key, fam in gpu_gauges.items():
                                _put(fam, gpu, g.get(key))
                            _put(throttled, gpu, g.get("throttle_reasons"))
                            _put(ecc, [*gpu, "corrected"], g.get("ecc_corrected"))
                            _put(ecc, [*gpu, "uncorrected"], g.get("ecc_uncorrected"))
        yield from (step, last, seen, *gauges.values(), lr, lr_expected, phase, tps, tokens, mfu, attempt, missing)
        yield from (cpu, rss, host_used, host_total, *gpu_gauges.values(), throttled, ecc)
        yield from (eval_loss, world, planned, up, an_total, an_active, goodput, badput, recomputed)


class DetectionCollector(Collector):
    """The detection process, read at scrape time: how often it was replaced, how far behind it is."""

    def __init__(self, detection: LocalDetection | DetectionProcess) -> None:
        self._detection = detection

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "trainmon_detection_restarts",
            "Detection processes replaced after dying or not answering; the groups they held were stored "
            "but never checked by the detectors.",
            value=self._detection.generation,
        )
        yield GaugeMetricFamily(
            "trainmon_detection_inflight_groups",
            "Committed groups waiting for their detection (the writer blocks at 8).",
            value=self._detection.inflight,
        )


class CollectorMetrics:
    """The collector's own health: what it ingested, rejected and how fast."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # A `_created` series per counter doubles the series count and no rule or panel reads it.
        # The switch is process-wide and read at scrape time, so it covers every counter the
        # collector's registry holds (the notifier's too); the custom collectors never set one.
        disable_created_metrics()
        self.events = Counter("trainmon_ingest_events", "Events stored.", ["kind"], registry=registry)
        self.duplicates = Counter(
            "trainmon_ingest_duplicate_events",
            "Events received again and skipped (retries, replays).",
            registry=registry,
        )
        self.batches = Counter("trainmon_ingest_batches", "Batches accepted.", registry=registry)
        self.limits = Gauge(
            "trainmon_collector_limit",
            "The collector's configured limits; trainmon_ingest_rejected_batches_total counts what they refused.",
            ["limit"],
            registry=registry,
        )
        self.rejected = Counter(
            "trainmon_ingest_rejected_batches", "Batches refused, by reason.", ["reason"], registry=registry
        )
        for reason in (
            "json",
            "schema",
            "too_large",
            "conflict",
            "auth",
            "origin",
            "content_type",
            "limit",
            "slow_headers",
            "slow_body",
            "overload",
            "storage",
            "unstorable",
        ):
            self.rejected.labels(reason)
        self.latency = Histogram(
            "trainmon_ingest_duration_seconds",
            "Time from receiving a batch to its acknowledgement: queueing, validation and the commit.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.inflight = Gauge(
            "trainmon_ingest_inflight_batches", "Batches received and not yet answered.", registry=registry
        )
