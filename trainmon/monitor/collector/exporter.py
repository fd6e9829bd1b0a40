"""Prometheus exposition of the live state and of the collector's own health.

Training series are built at scrape time from :class:`~trainmon.monitor.collector.live.LiveState` by a custom
collector (the ``prometheus_client`` pattern for mirroring external state), so a run that ends
simply stops being exported: no stale label sets to remember to remove. Labels are bounded:
``run``, ``rank``, ``phase``, ``group``, ``kind``, ``severity``; never a step or a layer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trainmon.monitor.collector.detection_process import DetectionProcess, LocalDetection, SplitDetection
from trainmon.monitor.collector.live import SCRAPE_EXTREMES, LiveState, RunState
from trainmon.monitor.collector.open_findings import OpenFindings
from trainmon.monitor.config import SeriesLimits
from trainmon.monitor.core.goodput import hang_open
from trainmon.monitor.detectors import SEVERITIES

__all__ = [
    "FINISHED_RUN_TTL_SECONDS",
    "MAX_PRECURSOR_GROUPS",
    "CollectorMetrics",
    "DetectionCollector",
    "TrainingCollector",
]

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


def _extreme_name(base: str, which: str) -> str:
    """``trainmon_loss`` -> ``trainmon_loss_max``; the unit stays last: ``trainmon_step_time_max_seconds``."""
    return base[: -len("_seconds")] + f"_{which}_seconds" if base.endswith("_seconds") else f"{base}_{which}"


_EXTREME_NOUNS = {"loss": "training loss", "grad_norm": "pre-clip gradient norm", "step_time": "step time"}
_EXTREME_GAUGES = {
    # SCRAPE_EXTREMES field -> ((lowest's metric, help), (highest's metric, help))
    key: tuple(
        (
            _extreme_name(_STEP_GAUGES[key][0], which),
            f"{word} {_EXTREME_NOUNS[key]} of the steps since the previous scrape (and of the value current "
            "before them), so a one-step spike between two scrapes is seen. Reset by each scrape: one "
            "Prometheus scrapes the collector (each member of an HA pair would see only its share).",
        )
        for which, word in (("min", "Lowest"), ("max", "Highest"))
    )
    for key in SCRAPE_EXTREMES
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


_PRECURSOR_GAUGES = {
    # sampled step field -> (how a rank's map folds into one value, metric name, help); never a series per layer
    "attn_logit_max": (
        max,
        "trainmon_attention_logit_bound_max",
        "Largest attention-logit bound over the attention modules, latest sampled step (instability_precursor).",
    ),
    "attn_entropy": (
        min,
        "trainmon_attention_entropy_min_nats",
        "Lowest attention entropy over the attention modules (one sampled head each), latest sampled step: "
        "toward 0 is attention collapsing to one-hot.",
    ),
    "linear_out_rms": (
        max,
        "trainmon_linear_output_rms_max",
        "Largest output RMS over the measured linear layers (QKV, attention and MLP output projections), "
        "latest sampled step.",
    ),
}
_PRECURSOR_SCALARS = {
    "output_logz": ("trainmon_output_logz", "Mean log Z of the LM head's logits, latest sampled step."),
    "output_logit_max": ("trainmon_output_logit_max", "Largest |logit| of the LM head, latest sampled step."),
}
_PRECURSOR_GROUPS = {
    "group_update_ratio": (
        "trainmon_update_ratio",
        "||update|| / ||param|| per param group over the sampled parameters, latest sampled step.",
    ),
    "adam_eps_frac": (
        "trainmon_adam_second_moment_below_eps_ratio",
        "Fraction of Adam's second moments below eps^2 per param group, latest sampled step: there the update "
        "is mostly eps and shrinks silently.",
    ),
}
MAX_PRECURSOR_GROUPS = 16
"""Param groups exported per rank for the per-group precursors (the first ones sent): a ``group`` label
bounded whatever a producer sends."""


def _number(value: Any) -> float | None:
    """The value as a sample, if it is a number: whatever one rank sent, the scrape of every run must work."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# A rank's sample of a per-rank family: (rank, key labels, holder labels, value). Key labels (phase, group,
# type) split a family into series that are aggregated apart; holder labels (node, gpu) describe the rank.
_Sample = tuple[int, tuple[str, ...], tuple[str, ...], float]


class _PerRank:
    """A family with a series per rank (labels ``run, rank, *keys, *holders``), and how ranks fold into a few."""

    def __init__(
        self,
        cls: type,
        name: str,
        doc: str,
        keys: tuple[str, ...] = (),
        holders: tuple[str, ...] = (),
        follows: str | None = None,
    ):
        self.family: Metric = cls(name, doc, labels=["run", "rank", *keys, *holders])
        self.name = name
        self.summed = cls is CounterMetricFamily and name != "trainmon_gpu_ecc_errors"  # ECC: per GPU, max matters
        self.keyed = bool(keys)
        self.holders = len(holders)
        # A wide run's min/median/max of this family are the values of the ranks chosen for ``follows``
        # (installed host memory follows memory in use): ``used / total`` then divides one rank's pair.
        self.follows = follows


def _nan_last(sample: _Sample) -> tuple[bool, float]:
    return math.isnan(sample[3]), sample[3]  # a NaN loss on any rank is the maximum, and shows


class TrainingCollector(Collector):
    """Yields the latest per-run, per-rank training values at each scrape, within ``SeriesLimits``.

    ``findings`` (the collector's open findings) names the ranks of a wide run that keep their own series.
    """

    def __init__(
        self,
        live: LiveState,
        clock=time.time,
        findings: OpenFindings | None = None,
        limits: SeriesLimits | None = None,
    ) -> None:
        self._live = live
        self._clock = clock
        self._findings = findings
        self._limits = limits or SeriesLimits()

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        per_rank = self._per_rank_families()
        run_level = self._run_families()
        holding = GaugeMetricFamily(
            "trainmon_rank_holding_max",
            'The rank whose series is the rank="max" aggregate of `metric`, in runs wider than the per-rank limit.',
            labels=["run", "metric"],
        )
        exported = left_out = 0
        with self._live.lock:
            runs = [
                (run_id, run, max((r.last_seen for r in run.ranks.values()), default=0.0))
                for run_id, run in self._live.runs.items()
            ]
            runs.sort(key=lambda x: -x[2])  # past the series cap, the runs heard from longest ago are left out
            for run_id, run, last_seen in runs:
                if run.status != "running" and now - last_seen > FINISHED_RUN_TTL_SECONDS:
                    continue
                out: list[tuple[Metric, list[str], float]] = []
                self._run_samples(run_id, run, now, run_level, out)
                samples = self._rank_samples(run, per_rank)
                if len(run.ranks) <= self._limits.rank_detail:
                    for fam, rows in samples.items():
                        out.extend((fam.family, [run_id, str(r), *k, *h], v) for r, k, h, v in rows)
                else:
                    self._fold(run_id, samples, self._named(run_id, run), holding, out)
                if exported + len(out) > self._limits.max_series:
                    left_out += len(out)
                    continue
                exported += len(out)
                for family, labels, value in out:
                    family.add_metric(labels, value)
        yield from (fam.family for fam in per_rank)
        yield from run_level.values()
        yield holding
        yield GaugeMetricFamily(
            "trainmon_exporter_series", "Training series in this scrape (SeriesLimits bounds them).", value=exported
        )
        yield GaugeMetricFamily(
            "trainmon_exporter_series_left_out",
            "Training series this scrape left out to stay within SeriesLimits.max_series (whole runs; 0: none).",
            value=left_out,
        )

    def _named(self, run_id: str, run: RunState) -> set[int]:
        """Ranks of the run that its open findings name (the straggler, the hung rank, the odd replica)."""
        if self._findings is None:
            return set()
        found, _ = self._findings.since(run_id, SEVERITIES[0], -1)
        return {f["rank"] for f in found if f["rank"] in run.ranks}

    @staticmethod
    def _fold(
        run_id: str,
        samples: dict[_PerRank, list[_Sample]],
        named: set[int],
        holding: GaugeMetricFamily,
        out: list[tuple[Metric, list[str], float]],
    ) -> None:
        """A wide run's per-rank samples as min/median/max (counters: their sum) plus the named ranks' own."""
        chosen: dict[str, dict[tuple[str, ...], list[tuple[str, int]]]] = {}  # family -> key -> (stat, rank)
        for fam, rows in samples.items():
            groups: dict[tuple[str, ...], list[_Sample]] = {}
            for row in rows:
                groups.setdefault(row[1], []).append(row)
                if row[0] in named and not fam.summed:
                    out.append((fam.family, [run_id, str(row[0]), *row[1], *row[2]], row[3]))
            picks = chosen[fam.name] = {}
            for key, group in groups.items():
                if fam.summed:
                    out.append((fam.family, [run_id, "all", *key, *[""] * fam.holders], sum(r[3] for r in group)))
                    continue
                if fam.follows is not None:
                    of_rank = {row[0]: row for row in group}
                    stats = [(stat, of_rank[r]) for stat, r in chosen[fam.follows].get(key, ()) if r in of_rank]
                else:
                    group.sort(key=_nan_last)
                    stats = [("min", group[0]), ("median", group[(len(group) - 1) // 2]), ("max", group[-1])]
                    if not fam.keyed:
                        out.append((holding, [run_id, fam.name], group[-1][0]))
                picks[key] = [(stat, row[0]) for stat, row in stats]
                for stat, row in stats:
                    out.append((fam.family, [run_id, stat, *key, *row[2]], row[3]))

    @staticmethod
    def _run_families() -> dict[str, Metric]:
        return {
            "eval_loss": GaugeMetricFamily("trainmon_eval_loss", "Latest evaluation loss.", labels=["run"]),
            "world": GaugeMetricFamily("trainmon_run_world_size", "Ranks in the run.", labels=["run"]),
            "reporting": GaugeMetricFamily(
                "trainmon_run_ranks_reporting", "Ranks the collector holds live values of.", labels=["run"]
            ),
            "planned": GaugeMetricFamily(
                "trainmon_run_planned_steps", "Optimizer steps the run plans.", labels=["run"]
            ),
            "up": GaugeMetricFamily("trainmon_run_running", "1 while the run has not ended.", labels=["run"]),
            "an_total": CounterMetricFamily(
                "trainmon_anomalies", "Anomalies opened by the collector.", labels=["run", "kind", "severity"]
            ),
            "an_active": GaugeMetricFamily(
                "trainmon_anomalies_active", "Anomalies currently open.", labels=["run", "kind", "severity"]
            ),
            "goodput": GaugeMetricFamily(
                "trainmon_goodput_ratio",
                "Share of the run's wall time that trained the model (rank 0's clock, all attempts).",
                labels=["run"],
            ),
            "badput": GaugeMetricFamily(
                "trainmon_badput_seconds",
                "Wall time of the run lost, by cause (trainmon.monitor.core.goodput); a cause can shrink "
                "when a resume turns earlier steps into recomputation.",
                labels=["run", "cause"],
            ),
            "recomputed": GaugeMetricFamily(
                "trainmon_recomputed_steps", "Steps run again after resuming from a checkpoint.", labels=["run"]
            ),
        }

    @staticmethod
    def _run_samples(
        run_id: str, run: RunState, now: float, fams: dict[str, Metric], out: list[tuple[Metric, list[str], float]]
    ) -> None:
        ended = run.status != "running"
        out.append((fams["up"], [run_id], 0.0 if ended else 1.0))
        out.append((fams["reporting"], [run_id], float(len(run.ranks))))
        for key, value in (("world", run.world_size), ("planned", run.planned_steps), ("eval_loss", run.eval_loss)):
            if (v := _number(value)) is not None:
                out.append((fams[key], [run_id], v))
        for (kind, sev), n in run.anomalies_total.items():
            out.append((fams["an_total"], [run_id, kind, sev], n))
        for (kind, sev), n in run.anomalies_active.items():
            out.append((fams["an_active"], [run_id, kind, sev], n))
        good = run.goodput.result(now, hang_open(run.anomalies_active))
        if good["fraction"] is not None:
            out.append((fams["goodput"], [run_id], good["fraction"]))
            for cause, secs in good["badput_seconds"].items():
                out.append((fams["badput"], [run_id, cause], secs))
            out.append((fams["recomputed"], [run_id], good["recomputed_steps"]))

    @staticmethod
    def _per_rank_families() -> list[_PerRank]:
        G, C = GaugeMetricFamily, CounterMetricFamily
        node, gpu = ("node",), ("node", "gpu")
        return [
            _PerRank(G, "trainmon_step", "Latest optimizer step."),
            _PerRank(G, "trainmon_last_step_timestamp_seconds", "Wall time of the latest step (hang alerts)."),
            _PerRank(G, "trainmon_last_seen_timestamp_seconds", "Wall time of the latest event of any kind."),
            *(_PerRank(G, name, doc) for name, doc in _STEP_GAUGES.values()),
            *(_PerRank(G, name, doc) for pair in _EXTREME_GAUGES.values() for name, doc in pair),
            _PerRank(G, "trainmon_learning_rate", "Learning rate per param group.", ("group",)),
            _PerRank(
                G,
                "trainmon_learning_rate_expected",
                "LR the declared schedule gives for the latest step (param group 0 only: one schedule is declared).",
                ("group",),
            ),
            _PerRank(G, "trainmon_phase_seconds", "Seconds per phase, latest step.", ("phase",)),
            *(_PerRank(G, name, doc) for _, name, doc in _PRECURSOR_GAUGES.values()),
            *(_PerRank(G, name, doc) for name, doc in _PRECURSOR_SCALARS.values()),
            *(_PerRank(G, name, doc, ("group",)) for name, doc in _PRECURSOR_GROUPS.values()),
            _PerRank(G, "trainmon_tokens_per_second", "Tokens per second of this rank."),
            _PerRank(C, "trainmon_tokens", "Tokens processed by this rank."),
            _PerRank(G, "trainmon_mfu_ratio", "Model FLOPs utilisation of the rank's device."),
            _PerRank(G, "trainmon_attempt", "Attempt (process restart) the rank is on."),
            _PerRank(C, "trainmon_producer_missing_events", "Events a rank's producer dropped (sequence gaps)."),
            _PerRank(
                G,
                "trainmon_process_cpu_cores",
                "CPU cores the training process kept busy over the latest health interval (1.0 = one core).",
                holders=node,
            ),
            _PerRank(G, "trainmon_process_resident_memory_bytes", "Training process RSS.", holders=node),
            _PerRank(G, "trainmon_host_memory_used_bytes", "Host memory in use.", holders=node),
            _PerRank(
                G,
                "trainmon_host_memory_total_bytes",
                "Host memory installed.",
                holders=node,
                follows="trainmon_host_memory_used_bytes",
            ),
            *(_PerRank(G, name, doc, holders=gpu) for name, doc in _GPU_GAUGES.values()),
            _PerRank(
                G, "trainmon_gpu_throttle_reasons", "NVML clock-event reasons bitmask (0: not throttled).", holders=gpu
            ),
            _PerRank(C, "trainmon_gpu_ecc_errors", "GPU ECC errors since boot.", ("type",), gpu),
        ]

    @staticmethod
    def _rank_samples(run: RunState, families: list[_PerRank]) -> dict[_PerRank, list[_Sample]]:
        """Every rank's samples, family by family; takes the scrape interval's extremes and starts the next one
        (under the live lock, like the ingest that widens them)."""
        out: dict[_PerRank, list[_Sample]] = {fam: [] for fam in families}
        by_name = {fam.name: out[fam] for fam in families}

        def put(name: str, rank: int, value: Any, key: tuple[str, ...] = (), holder: tuple[str, ...] = ()) -> None:
            if (v := _number(value)) is not None:
                by_name[name].append((rank, key, holder, v))

        for rank_id, r in run.ranks.items():
            put("trainmon_last_seen_timestamp_seconds", rank_id, r.last_seen)
            put("trainmon_attempt", rank_id, r.attempt)
            put("trainmon_producer_missing_events", rank_id, r.missing_events)
            if r.step >= 0:
                put("trainmon_step", rank_id, r.step)
                put("trainmon_last_step_timestamp_seconds", rank_id, r.last_step_time)
                put("trainmon_tokens", rank_id, r.tokens_total)
                put("trainmon_tokens_per_second", rank_id, r.tokens_per_second)
                for key, (name, _) in _STEP_GAUGES.items():
                    put(name, rank_id, r.last.get(key))
                for key, ((lowest, _), (highest, _)) in _EXTREME_GAUGES.items():
                    span = r.extremes.pop(key, None)
                    if span is not None:
                        put(lowest, rank_id, span[0])
                        put(highest, rank_id, span[1])
                    latest = _number(r.last.get(key))
                    if latest is not None:  # the next interval starts from the value current now
                        r.extremes[key] = [latest, latest]
                for i, value in enumerate(r.last.get("lr") or ()):
                    put("trainmon_learning_rate", rank_id, value, (str(i),))
                for phase, secs in (r.last.get("phases") or {}).items():
                    put("trainmon_phase_seconds", rank_id, secs, (phase,))
                put("trainmon_learning_rate_expected", rank_id, r.expected_lr(), ("0",))
                put("trainmon_mfu_ratio", rank_id, r.mfu())
                _precursor_samples(r.precursors, rank_id, put)
            h = r.health
            if not h:
                continue
            node = (r.host,)
            cores = _number(h.get("cpu_percent"))
            put("trainmon_process_cpu_cores", rank_id, None if cores is None else cores * 0.01, holder=node)
            put("trainmon_process_resident_memory_bytes", rank_id, h.get("rss_bytes"), holder=node)
            put("trainmon_host_memory_used_bytes", rank_id, h.get("host_mem_used_bytes"), holder=node)
            put("trainmon_host_memory_total_bytes", rank_id, h.get("host_mem_total_bytes"), holder=node)
            for g in h.get("gpus") or ():
                if not isinstance(g, dict):
                    continue
                where = (r.host, str(g.get("index", 0)))
                for key, (name, _) in _GPU_GAUGES.items():
                    put(name, rank_id, g.get(key), holder=where)
                put("trainmon_gpu_throttle_reasons", rank_id, g.get("throttle_reasons"), holder=where)
                put("trainmon_gpu_ecc_errors", rank_id, g.get("ecc_corrected"), ("corrected",), where)
                put("trainmon_gpu_ecc_errors", rank_id, g.get("ecc_uncorrected"), ("uncorrected",), where)
        return out


def _finite(values: Any) -> list[float]:
    return [v for v in map(_number, values) if v is not None and math.isfinite(v)]


def _precursor_samples(sampled: dict[str, Any], rank: int, put: Callable[..., None]) -> None:
    """A rank's latest sampled precursors as gauges: the maps folded to their extreme (finite values only:
    a non-finite one is ``nan_inf``'s news), the per-group ones by group, bounded."""
    for key, (fold, name, _) in _PRECURSOR_GAUGES.items():
        values = _finite((sampled.get(key) or {}).values())
        if values:
            put(name, rank, fold(values))
    for key, (name, _) in _PRECURSOR_SCALARS.items():
        put(name, rank, sampled.get(key))
    for key, (name, _) in _PRECURSOR_GROUPS.items():
        for group, value in list((sampled.get(key) or {}).items())[:MAX_PRECURSOR_GROUPS]:
            put(name, rank, value, (group,))


class DetectionCollector(Collector):
    """The detection process, read at scrape time: how often it was replaced, how far behind it is."""

    def __init__(self, detection: LocalDetection | DetectionProcess | SplitDetection) -> None:
        self._detection = detection

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "trainmon_detection_restarts",
            "Detection processes replaced after dying or not answering; the groups they held were stored "
            "but never checked by the detectors.",
            value=self._detection.generation,
        )
        yield CounterMetricFamily(
            "trainmon_detection_lost_calls",
            "Detection calls (a committed group's events, a silence check) a detection process that died or did "
            "not answer took with it: the events are stored, never checked by the detectors.",
            value=self._detection.lost,
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
