"""Generate the Grafana dashboards (JSON model) from this file: ``python dashboards/generate.py``.

The JSON files are committed (Grafana provisioning and ``trainmon grafana provision`` read them),
but they are written from here so that panel ids, grid positions and the datasource reference
stay consistent by construction; ``tests/observability/test_dashboards.py`` checks the committed files are what
this script produces. Every query reads series of ``monitor/collector/exporter.py`` or recording rules of
``alerts/trainmon.rules.yml``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE_INPUT = "DS_PROMETHEUS"
"""The import input (``__inputs``): Grafana's import dialog asks for a Prometheus and writes its uid
wherever ``${DS_PROMETHEUS}`` appears, which is only the ``datasource`` variable's default."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""Every query goes to the Prometheus the ``datasource`` variable selects, never to a fixed uid: the
dashboards work under any datasource uid (file provisioning, the HTTP API, the import dialog), and
a Grafana with several Prometheus servers switches between them at the top of the dashboard."""
SCHEMA_VERSION = 39
WIDTH = 24  # Grafana's grid is 24 columns wide

R = 'run="$run"'
RR = 'run="$run", rank=~"$rank"'


class Layout:
    """Places panels left to right, wrapping rows, and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > WIDTH:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append(
            {
                "id": len(self.panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def add(
        self,
        kind: str,
        title: str,
        targets: list[tuple[str, str]],
        *,
        w: int = 12,
        h: int = 8,
        unit: str | None = None,
        description: str = "",
        instant: bool = False,
        fmt: str = "time_series",
        options: dict[str, Any] | None = None,
        custom: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        transformations: list[dict[str, Any]] | None = None,
        overrides: list[dict[str, Any]] | None = None,
    ) -> None:
        field_defaults: dict[str, Any] = dict(defaults or {})
        if unit:
            field_defaults["unit"] = unit
        if custom:
            field_defaults["custom"] = custom
        panel: dict[str, Any] = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DATASOURCE,
            "gridPos": self._place(w, h),
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DATASOURCE,
                    "expr": expr,
                    "legendFormat": legend,
                    "instant": instant,
                    "range": not instant,
                    "format": fmt,
                }
                for i, (expr, legend) in enumerate(targets)
            ],
            "fieldConfig": {"defaults": field_defaults, "overrides": overrides or []},
            "options": options or {},
        }
        if transformations:
            panel["transformations"] = transformations
        self.panels.append(panel)


def _datasource_variable() -> dict[str, Any]:
    """The Prometheus to query. Its default is the import input; where nothing fills it in (file
    provisioning, the HTTP API), Grafana falls back to the first Prometheus datasource."""
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "regex": "",
        "current": {"text": f"${{{DATASOURCE_INPUT}}}", "value": f"${{{DATASOURCE_INPUT}}}"},
        "options": [],
        "refresh": 1,
        "hide": 0,
        "multi": False,
        "includeAll": False,
    }


# NVML clock-event reason bits: (bit, name, harmful). Idle, application clocks and sync boost are
# left out; the harmful ones are the alert's (trainmon:gpu_throttle_harmful_reasons).
THROTTLE_REASONS = (
    (0x4, "SW power cap", False),
    (0x8, "HW slowdown", True),
    (0x20, "SW thermal", True),
    (0x40, "HW thermal", True),
    (0x80, "power brake", True),
)


def _throttle_reasons(mask: str) -> str:
    """PromQL decoding the reasons bitmask (PromQL has no bitwise AND) into one series per active
    reason, labelled ``reason``: 1 for a benign reason, 2 for one that slows the GPU."""
    parts = [
        f'label_replace((floor({mask} / {bit}) % 2 == 1){" * 2" if harmful else ""}, "reason", "{name}", "", "")'
        for bit, name, harmful in THROTTLE_REASONS
    ]
    return "max by (node, gpu, reason) (\n  " + "\nor\n  ".join(parts) + "\n)"


def _query_variable(name: str, label: str, query: str, *, multi: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,  # on time range change: runs come and go
        "sort": 3 if name == "rank" else 1,
        "multi": multi,
        "includeAll": multi,
        "allValue": ".*" if multi else None,
        "current": {},
        "options": [],
        "hide": 0,
    }


def _dashboard(
    uid: str, title: str, description: str, panels: list, variables: list, annotations: list
) -> dict[str, Any]:
    kinds = sorted({p["type"] for p in panels if p["type"] != "row"})
    return {
        "__inputs": [
            {
                "name": DATASOURCE_INPUT,
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the trainmon collector",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": kind, "name": kind, "version": ""} for kind in kinds),
        ],
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["trainmon"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: line up loss, LR and throughput at one step
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [_datasource_variable(), *variables]},
        "annotations": {"list": annotations},
        "links": [],
        "panels": panels,
    }


TS = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi", "sort": "none"}}
RED_FROM_ONE = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]}
STAT = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value"}


def run_dashboard() -> dict[str, Any]:
    """One run in depth: what the on-call engineer opens from an alert."""
    d = Layout()
    d.row("Status")
    d.add("stat", "Step", [(f"max(trainmon_step{{{R}}})", "step")], w=4, h=4, options=STAT)
    d.add(
        "gauge",
        "Progress",
        [(f"max(trainmon_step{{{R}}}) / max(trainmon_run_planned_steps{{{R}}})", "progress")],
        w=4,
        h=4,
        unit="percentunit",
        description="Latest step over the steps the run plans.",
        defaults={"min": 0, "max": 1},
        options=STAT,
    )
    d.add(
        "stat",
        "Status",
        [(f"max(trainmon_run_running{{{R}}})", "running")],
        w=4,
        h=4,
        options=STAT,
        defaults={
            "mappings": [
                {"type": "value", "options": {"0": {"text": "ended", "color": "blue"}}},
                {"type": "value", "options": {"1": {"text": "running", "color": "green"}}},
            ]
        },
    )
    d.add(
        "stat",
        "Attempt",
        [(f"max(trainmon_attempt{{{R}}})", "attempt")],
        w=4,
        h=4,
        description="Process restarts (resumes) so far.",
        options=STAT,
    )
    d.add(
        "stat",
        "Open anomalies",
        [(f"sum(trainmon_anomalies_active{{{R}}}) or vector(0)", "open")],
        w=4,
        h=4,
        options=STAT,
        defaults={"thresholds": RED_FROM_ONE},
    )
    d.add(
        "stat",
        "Since last step",
        [(f"max(time() - trainmon_last_step_timestamp_seconds{{{R}}})", "slowest rank")],
        w=4,
        h=4,
        unit="s",
        description="Seconds since the slowest rank's latest step (the hang alert's signal).",
        options=STAT,
    )

    d.row("Loss")
    d.add(
        "timeseries",
        "Loss and eval loss",
        [
            (f"trainmon_loss{{{RR}}}", "train, rank {{rank}}"),
            (f"trainmon_loss_max{{{RR}}}", "highest between scrapes, rank {{rank}}"),
            (f"trainmon_loss_min{{{RR}}}", "lowest between scrapes, rank {{rank}}"),
            (f"trainmon_eval_loss{{{R}}}", "eval"),
        ],
        w=16,
        description="Annotations mark anomalies the collector opened (kind and severity). The highest and "
        "lowest loss of the steps between two scrapes keep a one-step spike the latest value misses.",
        options=TS,
    )
    d.add(
        "bargauge",
        "Open anomalies by kind",
        [(f"sum by (kind, severity) (trainmon_anomalies_active{{{R}}}) > 0", "{{kind}} ({{severity}})")],
        w=8,
        instant=True,
        options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": STAT["reduceOptions"]},
    )

    d.row("Optimizer")
    d.add(
        "timeseries",
        "Learning rate: actual vs expected",
        [
            (f'trainmon_learning_rate{{{RR}, group="0"}}', "actual, rank {{rank}}"),
            (f'trainmon_learning_rate_expected{{{RR}, group="0"}}', "expected, rank {{rank}}"),
        ],
        w=8,
        description="Actual LR of param group 0 against the declared schedule's LR at the same step.",
        options=TS,
    )
    d.add(
        "timeseries",
        "LR actual / expected",
        [
            (
                f'trainmon_learning_rate{{{RR}, group="0"}} / trainmon_learning_rate_expected{{{RR}, group="0"}}',
                "rank {{rank}}",
            )
        ],
        w=4,
        description="1 when the scheduler follows its declared schedule.",
        options=TS,
    )
    d.add(
        "timeseries",
        "Grad norm before and after clipping",
        [
            (f"trainmon_grad_norm{{{RR}}}", "pre-clip, rank {{rank}}"),
            (f"trainmon_grad_norm_max{{{RR}}}", "pre-clip, highest between scrapes, rank {{rank}}"),
            (f"trainmon_grad_norm_clipped{{{RR}}}", "post-clip, rank {{rank}}"),
        ],
        w=8,
        description="The highest pre-clip norm of the steps between two scrapes keeps a one-step spike.",
        options=TS,
        custom={"scaleDistribution": {"type": "log", "log": 10}},
    )
    d.add(
        "timeseries",
        "Clip rate",
        [(f"avg_over_time((trainmon_grad_clip_coefficient{{{RR}}} < bool 1)[5m:])", "rank {{rank}}")],
        w=4,
        unit="percentunit",
        description="Share of the last 5 minutes' samples in which the gradients were clipped.",
        options=TS,
    )
    d.add(
        "timeseries",
        "fp16 loss scale",
        [(f"trainmon_loss_scale{{{RR}}}", "rank {{rank}}")],
        w=12,
        description="Falling repeatedly means an overflow storm (fp16 only).",
        options=TS,
        custom={"scaleDistribution": {"type": "log", "log": 2}},
    )
    d.add(
        "timeseries",
        "Device memory",
        [
            (f"trainmon_device_memory_allocated_bytes{{{RR}}}", "allocated, rank {{rank}}"),
            (f"trainmon_device_memory_peak_bytes{{{RR}}}", "peak, rank {{rank}}"),
        ],
        w=12,
        unit="bytes",
        options=TS,
    )

    d.row("Precursors")
    sampled = "Sent on sampled steps (the trainer's detail_every); the value holds until the next sample."
    d.add(
        "timeseries",
        "Attention-logit bound (largest module)",
        [(f"trainmon_attention_logit_bound_max{{{RR}}}", "rank {{rank}}")],
        w=8,
        description="A bound on max |q·k|/√d over the attention modules. Growing by an order of magnitude "
        "against its own level is attention logit growth (instability_precursor): qk-layernorm, a lower peak "
        "LR, a longer warmup. " + sampled,
        options=TS,
        custom={"scaleDistribution": {"type": "log", "log": 10}},
    )
    d.add(
        "timeseries",
        "Attention entropy (lowest module)",
        [(f"trainmon_attention_entropy_min_nats{{{RR}}}", "rank {{rank}}")],
        w=8,
        description="Entropy of one sampled head's attention, lowest over the modules: falling toward 0 is "
        "attention collapsing to one-hot. " + sampled,
        options=TS,
    )
    d.add(
        "timeseries",
        "Linear output RMS (largest layer)",
        [(f"trainmon_linear_output_rms_max{{{RR}}}", "rank {{rank}}")],
        w=8,
        description="RMS of the QKV, attention and MLP output projections' outputs, largest layer: sustained "
        "growth comes before divergence (Rybakov et al. 2024). " + sampled,
        options=TS,
        custom={"scaleDistribution": {"type": "log", "log": 10}},
    )
    d.add(
        "timeseries",
        "Output logits: log Z and largest |logit|",
        [
            (f"trainmon_output_logz{{{RR}}}", "log Z, rank {{rank}}"),
            (f"trainmon_output_logit_max{{{RR}}}", "largest |logit|, rank {{rank}}"),
        ],
        w=8,
        description="The LM head's mean log-sum-exp (what PaLM's z-loss pulls toward 0) and its largest logit. "
        + sampled,
        options=TS,
    )
    d.add(
        "timeseries",
        "Update / weight ratio per param group",
        [(f"trainmon_update_ratio{{{RR}}}", "group {{group}}, rank {{rank}}")],
        w=8,
        description="||update|| / ||param|| over the sampled parameters. " + sampled,
        options=TS,
        custom={"scaleDistribution": {"type": "log", "log": 10}},
    )
    d.add(
        "timeseries",
        "Adam second moments below eps²",
        [(f"trainmon_adam_second_moment_below_eps_ratio{{{RR}}}", "group {{group}}, rank {{rank}}")],
        w=8,
        unit="percentunit",
        description="Share of Adam's second moments under eps²: there the update is mostly eps and shrinks "
        "silently; a rising share calls for a lower eps. " + sampled,
        options=TS,
    )

    d.row("Throughput")
    d.add(
        "timeseries",
        "Tokens/s",
        [
            (f"sum(rate(trainmon_tokens_total{{{R}}}[$__rate_interval]))", "run (all ranks)"),
            (f"trainmon_tokens_per_second{{{RR}}}", "rank {{rank}}, latest step"),
        ],
        w=12,
        options=TS,
    )
    d.add(
        "timeseries",
        "MFU",
        [(f"trainmon_mfu_ratio{{{RR}}}", "rank {{rank}}")],
        w=12,
        unit="percentunit",
        description="Model FLOPs utilisation; needs flops_per_token and peak_flops in run_start.",
        options=TS,
    )
    d.add(
        "timeseries",
        "Phase times (stacked)",
        [(f"avg by (phase) (trainmon_phase_seconds{{{RR}}})", "{{phase}}")],
        w=12,
        unit="s",
        description="Seconds per phase of the latest step, averaged over the selected ranks: the phase "
        "that grows names the cause of a throughput drop.",
        options=TS,
        custom={"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60, "lineWidth": 1},
    )
    d.add(
        "heatmap",
        "Step time per rank",
        [(f"trainmon_step_time_seconds{{{RR}}}", "{{rank}}")],
        w=12,
        description="One row per rank, colour = step time. A straggler is a row that stays hot; in DDP "
        "the all-reduce evens step times out, so compare the compute time panel too.",
        options={
            "calculate": False,
            "yAxis": {"axisLabel": "rank"},
            "rowsFrame": {"layout": "auto"},
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "cellGap": 1,
            "tooltip": {"show": True, "yHistogram": False},
            "legend": {"show": True},
        },
    )
    d.add(
        "timeseries",
        "Compute time per rank (forward + backward)",
        [(f'sum by (rank) (trainmon_phase_seconds{{{RR}, phase=~"forward|backward"}})', "rank {{rank}}")],
        w=12,
        unit="s",
        description="The straggler has the highest compute time and the lowest comm wait.",
        options=TS,
    )
    d.add(
        "timeseries",
        "Step time: slowest and fastest between scrapes",
        [
            (f"trainmon_step_time_max_seconds{{{RR}}}", "slowest, rank {{rank}}"),
            (f"trainmon_step_time_min_seconds{{{RR}}}", "fastest, rank {{rank}}"),
        ],
        w=12,
        unit="s",
        description="The slowest and fastest step of each rank between two scrapes: one slow step (a "
        "checkpoint, a data stall) shows even when the latest step was quick.",
        options=TS,
    )

    d.row("GPU and host health")
    d.add(
        "timeseries",
        "GPU temperature",
        [(f"max by (node, gpu) (trainmon_gpu_temperature_celsius{{{R}}})", "{{node}} gpu {{gpu}}")],
        w=8,
        unit="celsius",
        options=TS,
        defaults={
            "thresholds": {
                "mode": "absolute",
                "steps": [
                    {"color": "green", "value": None},
                    {"color": "orange", "value": 85},
                    {"color": "red", "value": 92},
                ],
            },
        },
        custom={"thresholdsStyle": {"mode": "line"}},
    )
    d.add(
        "timeseries",
        "GPU utilization",
        [(f"max by (node, gpu) (trainmon_gpu_utilization_ratio{{{R}}})", "{{node}} gpu {{gpu}}")],
        w=8,
        unit="percentunit",
        options=TS,
    )
    d.add(
        "timeseries",
        "GPU memory used",
        [
            (
                f"max by (node, gpu) (trainmon_gpu_memory_used_bytes{{{R}}} / trainmon_gpu_memory_total_bytes{{{R}}})",
                "{{node}} gpu {{gpu}}",
            )
        ],
        w=8,
        unit="percentunit",
        options=TS,
    )
    d.add(
        "timeseries",
        "GPU power",
        [(f"max by (node, gpu) (trainmon_gpu_power_watts{{{R}}})", "{{node}} gpu {{gpu}}")],
        w=8,
        unit="watt",
        options=TS,
    )
    d.add(
        "timeseries",
        "GPU SM clock",
        [(f"max by (node, gpu) (trainmon_gpu_sm_clock_hertz{{{R}}})", "{{node}} gpu {{gpu}}")],
        w=8,
        unit="hertz",
        description="A clock that drops while the power stays under its cap: see the throttle reasons below.",
        options=TS,
    )
    d.add(
        "timeseries",
        "GPU ECC errors",
        [(f"max by (node, gpu, type) (trainmon_gpu_ecc_errors_total{{{R}}})", "{{node}} gpu {{gpu}} {{type}}")],
        w=8,
        description="Since the driver loaded. Uncorrected errors mean: drain the node; corrected ones rising "
        "precede them.",
        options=TS,
    )
    d.add(
        "state-timeline",
        "GPU throttle reasons",
        [(_throttle_reasons(f"trainmon_gpu_throttle_reasons{{{R}}}"), "{{node}} gpu {{gpu}}: {{reason}}")],
        w=24,
        h=6,
        description="NVML clock-event reasons, decoded: one row per GPU and reason that occurred, coloured "
        "while it holds. The SW power cap is benign; HW slowdown, SW/HW thermal and the power brake cost "
        "throughput (TrainmonGPUThrottled).",
        options={"mergeValues": True, "showValue": "never", "rowHeight": 0.8, "legend": {"showLegend": False}},
        defaults={
            "mappings": [
                {"type": "value", "options": {"1": {"text": "benign", "color": "yellow", "index": 0}}},
                {"type": "value", "options": {"2": {"text": "slowing the GPU", "color": "red", "index": 1}}},
            ],
        },
    )
    d.add(
        "timeseries",
        "Host memory used",
        [
            (
                f"max by (node) (trainmon_host_memory_used_bytes{{{R}}} / trainmon_host_memory_total_bytes{{{R}}})",
                "{{node}}",
            )
        ],
        w=8,
        unit="percentunit",
        options=TS,
    )
    d.add(
        "timeseries",
        "Training process RSS",
        [(f"trainmon_process_resident_memory_bytes{{{RR}}}", "rank {{rank}} on {{node}}")],
        w=8,
        unit="bytes",
        options=TS,
    )
    d.add(
        "timeseries",
        "Training process CPU",
        [(f"trainmon_process_cpu_cores{{{RR}}}", "rank {{rank}} on {{node}}")],
        w=8,
        unit="none",
        description="CPU cores the training process keeps busy (1 = one core): the dataloader and the "
        "Python loop compete for them.",
        options=TS,
    )
    d.add(
        "timeseries",
        "Events lost by the producer",
        [(f"trainmon_producer_missing_events_total{{{RR}}}", "rank {{rank}}")],
        w=8,
        description="Sequence gaps: events the trainer hooks dropped. Non-zero means detections may miss data.",
        options=TS,
    )

    variables = [
        _query_variable("run", "Run", "label_values(trainmon_run_running, run)"),
        _query_variable("rank", "Rank", 'label_values(trainmon_step{run="$run"}, rank)', multi=True),
    ]
    annotations = [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "name": "Anomalies",
            "datasource": DATASOURCE,
            "enable": True,
            "iconColor": "red",
            # A counter that moved, or one that just appeared (its first anomaly of that kind).
            "expr": f"sum by (kind, severity) (changes(trainmon_anomalies_total{{{R}}}[1m])) > 0 "
            f"or sum by (kind, severity) (trainmon_anomalies_total{{{R}}} unless trainmon_anomalies_total{{{R}}} "
            "offset 1m)",
            "step": "15s",
            "titleFormat": "{{kind}} ({{severity}})",
            "textFormat": "trainmon opened a {{kind}} anomaly; see GET /v1/runs/$run/anomalies",
            "tagKeys": "kind,severity",
            "useValueForTime": False,
        },
    ]
    return _dashboard(
        "trainmon-run",
        "trainmon: run",
        "One training run: loss, optimizer, throughput, phases, ranks, GPU and host health.",
        d.panels,
        variables,
        annotations,
    )


RUN_LINK = {
    "title": "Run ${__value.raw}",
    "url": "/d/trainmon-run/trainmon-run?var-run=${__value.raw:percentencode}&${datasource:queryparam}"
    "&${__url_time_range}",
}
"""The fleet table's link to a run: the run dashboard (its uid) for that run, same Prometheus and time."""


def fleet_dashboard() -> dict[str, Any]:
    """Every run at a glance: which one needs attention."""
    d = Layout()
    d.row("Runs")
    d.add("stat", "Runs running", [("sum(trainmon_run_running) or vector(0)", "running")], w=6, h=4, options=STAT)
    d.add(
        "stat",
        "Runs with open critical anomalies",
        [
            (
                # finished runs keep their series for a while: count only the ones still running
                'count((sum by (run) (trainmon_anomalies_active{severity="critical"}) > 0) '
                "and on (run) (max by (run) (trainmon_run_running) == 1)) or vector(0)",
                "runs",
            )
        ],
        w=6,
        h=4,
        options=STAT,
        defaults={"thresholds": RED_FROM_ONE},
    )
    d.add(
        "stat",
        "Firing trainmon alerts",
        [('count(ALERTS{alertname=~"Trainmon.*", alertstate="firing"}) or vector(0)', "alerts")],
        w=6,
        h=4,
        options=STAT,
    )
    d.add(
        "stat", "Ranks reporting", [("sum(trainmon_run_ranks_reporting) or vector(0)", "ranks")], w=6, h=4, options=STAT
    )
    d.add(
        "table",
        "Runs",
        [
            ("max by (run) (trainmon_run_running)", "running"),
            ("max by (run) (trainmon_step)", "step"),
            ("max by (run) (trainmon_run_planned_steps)", "planned"),
            ("max by (run) (trainmon_step) / max by (run) (trainmon_run_planned_steps)", "progress"),
            ("max by (run) (trainmon_run_world_size)", "ranks"),
            ("trainmon:tokens_per_second:rate2m", "tokens/s"),
            ("max by (run) (trainmon:step_age_seconds)", "since last step"),
            ("sum by (run) (trainmon_anomalies_active)", "open anomalies"),
        ],
        w=24,
        h=9,
        instant=True,
        fmt="table",
        description="One row per run (click it: the run dashboard). 'since last step' is the slowest rank's "
        "silence (hang alert signal).",
        options={"showHeader": True, "sortBy": [{"displayName": "open anomalies", "desc": True}]},
        overrides=[
            {
                "matcher": {"id": "byName", "options": "run"},
                "properties": [{"id": "links", "value": [RUN_LINK]}],
            }
        ],
        transformations=[
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        "Value #A": "running",
                        "Value #B": "step",
                        "Value #C": "planned",
                        "Value #D": "progress",
                        "Value #E": "ranks",
                        "Value #F": "tokens/s",
                        "Value #G": "since last step",
                        "Value #H": "open anomalies",
                    },
                },
            },
        ],
    )
    d.row("Progress and throughput")
    d.add(
        "timeseries",
        "Step progress vs planned",
        [("max by (run) (trainmon_step) / max by (run) (trainmon_run_planned_steps)", "{{run}}")],
        w=12,
        unit="percentunit",
        options=TS,
        defaults={"min": 0, "max": 1},
    )
    d.add(
        "timeseries",
        "Tokens/s by run",
        [("trainmon:tokens_per_second:rate2m", "{{run}}")],
        w=12,
        description="From the token counters over 2 minutes (recording rule of alerts/trainmon.rules.yml).",
        options=TS,
    )
    d.row("Goodput")
    d.add(
        "timeseries",
        "Goodput by run",
        [("trainmon_goodput_ratio", "{{run}}")],
        w=12,
        unit="percentunit",
        description="Share of wall time (rank 0's clock, all attempts) that trained the model; "
        "the rest is badput, by cause on the right (trainmon.monitor.core.goodput).",
        options=TS,
        defaults={"min": 0, "max": 1},
    )
    d.add(
        "bargauge",
        "Badput by run and cause",
        [("sum by (run, cause) (trainmon_badput_seconds) > 0", "{{run}}: {{cause}}")],
        w=12,
        unit="s",
        instant=True,
        description="Wall time lost: startup, checkpointing, evaluation, data stalls, slow steps, hangs, "
        "recomputation after failures, restarts.",
        options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": STAT["reduceOptions"]},
    )
    d.row("Anomalies and alerts")
    d.add(
        "bargauge",
        "Open anomalies by run and kind",
        [("sum by (run, kind, severity) (trainmon_anomalies_active) > 0", "{{run}}: {{kind}} ({{severity}})")],
        w=12,
        instant=True,
        options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": STAT["reduceOptions"]},
    )
    d.add(
        "timeseries",
        "Anomalies opened per hour by kind",
        [("sum by (kind) (increase(trainmon_anomalies_total[1h]))", "{{kind}}")],
        w=12,
        options=TS,
    )
    d.row("Collector")
    d.add(
        "timeseries",
        "Events ingested/s",
        [("sum by (kind) (rate(trainmon_ingest_events_total[$__rate_interval]))", "{{kind}}")],
        w=8,
        options=TS,
    )
    d.add(
        "timeseries",
        "Batches rejected/s",
        [("sum by (reason) (rate(trainmon_ingest_rejected_batches_total[$__rate_interval]))", "{{reason}}")],
        w=8,
        options=TS,
    )
    d.add(
        "timeseries",
        "Ingest latency p99",
        [
            (
                "histogram_quantile(0.99, "
                "sum by (le) (rate(trainmon_ingest_duration_seconds_bucket[$__rate_interval])))",
                "p99",
            )
        ],
        w=8,
        unit="s",
        options=TS,
    )
    d.add(
        "timeseries",
        "Detection: groups waiting, process restarts",
        [
            ("sum(trainmon_detection_inflight_groups)", "groups waiting (the writer blocks at 8)"),
            ("sum(increase(trainmon_detection_restarts_total[$__rate_interval]))", "restarts"),
        ],
        w=8,
        options=TS,
    )
    return _dashboard(
        "trainmon-fleet",
        "trainmon: fleet",
        "All training runs: status, progress, throughput, open anomalies, collector health.",
        d.panels,
        [],
        [
            {
                "builtIn": 1,
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts",
                "type": "dashboard",
            }
        ],
    )


DASHBOARDS = {"trainmon-run.json": run_dashboard, "trainmon-fleet.json": fleet_dashboard}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
