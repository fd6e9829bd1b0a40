"""The whole alerting path with real servers: reference trainer with injected faults → live collector
→ real Prometheus (1 s scrapes, alerts/trainmon.rules.yml with short `for:`) → real Alertmanager
(alerts/alertmanager.yml: grouping by run, inhibition) → a webhook receiver on loopback.

Two runs go at once to keep the test short: a single-process run with a data stall and a NaN
(on a fake NVML GPU that is hot, throttled and has an ECC error), and a two-rank torchrun run in
which rank 1 hangs. Also here: what the collector exposes (names Prometheus and promtool accept),
and a finished run's final values, still exported, raising no alert.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import start_collector
from tests.events import batch, event, step_events
from tests.prometheus import (
    PROMTOOL,
    REPO,
    Prometheus,
    WebhookReceiver,
    alertmanager_test_config,
    fake_nvml_env,
    needs_alertmanager,
    needs_prometheus,
    start_alertmanager,
    start_prometheus,
    stopping,
    wait_until,
    write_test_rules,
)

FAULTS = "obs-faults"
HANG = "obs-hang"
COMMON = ["--heartbeat-interval", "1", "--health-interval", "1", "--threads", "1", "--seq-len", "32"]

# Windows of hours make no sense in a run of seconds: the same rules with second-scale windows.
TEST_REPLACEMENTS = {
    "rate(trainmon_tokens_total[2m])": "rate(trainmon_tokens_total[4s])",
    "clamp_min(20 * trainmon:step_time_seconds:avg10m, 300)": "clamp_min(20 * trainmon:step_time_seconds:avg10m, 3)",
}

# What each run must raise in Prometheus: (alertname, identifying labels).
EXPECTED_FIRING = {
    ("TrainmonThroughputCollapse", (("run", FAULTS),)),
    ("TrainmonLossNotFinite", (("rank", "0"), ("run", FAULTS))),
    ("TrainmonAnomalyCritical", (("kind", "nan_inf"), ("run", FAULTS))),
    ("TrainmonGPUHot", (("gpu", "0"), ("run", FAULTS))),
    ("TrainmonGPUOverheating", (("gpu", "0"), ("run", FAULTS))),
    ("TrainmonGPUThrottled", (("gpu", "0"), ("run", FAULTS))),
    ("TrainmonGPUECCUncorrected", (("gpu", "0"), ("run", FAULTS))),
    ("TrainmonRankHang", (("rank", "1"), ("run", HANG))),
}
# Criticals Alertmanager must deliver (warnings of a run are inhibited while it has criticals).
EXPECTED_DELIVERED = {
    ("TrainmonLossNotFinite", FAULTS),
    ("TrainmonAnomalyCritical", FAULTS),
    ("TrainmonGPUOverheating", FAULTS),
    ("TrainmonGPUECCUncorrected", FAULTS),
    ("TrainmonRankHang", HANG),
}


def _key(alert: dict[str, Any], names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((n, alert["labels"].get(n, "")) for n in names))


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in (tmp_path / "logs").iterdir())


def _throughput(prom: Prometheus, since: float) -> str:
    """The faults run's tokens/s and half its median so far, a sample a second: what TrainmonThroughputCollapse
    compared, for a failure to say whether the stall was too shallow or the normal samples too few."""
    rate = f'trainmon:tokens_per_second:rate2m{{run="{FAULTS}"}}'
    lines = []
    for name, expr in (("tokens/s", rate), ("half median", f"0.5 * quantile_over_time(0.5, {rate}[30m])")):
        series = prom.query_range(expr, since, time.time())
        lines.append(f"{name}: " + " ".join(f"{float(v):.0f}" for _, v in (series[0]["values"] if series else ())))
    return "\n".join(lines)


def _launch(tmp_path: Path, collector_url: str) -> list[subprocess.Popen]:
    """Start both trainer runs; they run alongside the polling below."""
    env = fake_nvml_env(tmp_path / "fake_nvml", temperature_c=95, throttle=0x40, ecc_uncorrected=1)
    faults = [
        sys.executable,
        "-m",
        "trainmon.reference_trainer",
        "--run",
        FAULTS,
        "--steps",
        "270",
        "--out",
        str(tmp_path / "faults"),
        "--collector",
        collector_url,
        *COMMON,
        # TrainmonThroughputCollapse fires while the tokens/s is under half its median over the run so
        # far, one sample a second: only while the run's normal samples outnumber the stall's, and only
        # if a stalled step is far slower than a normal one. Unpaced, the steps before the stall took
        # 1-3 s here (one to three samples of normal throughput), and a loaded core makes a normal step
        # slow too. A dataloader needing 70 ms a batch gives the run 10 s or more of normal throughput
        # on any machine, and stalls of 2 s a batch stay under a quarter of it while a step's own
        # compute is under half a second.
        "--inject",
        "data_stall@0:seconds=0.07,steps=150",
        "--inject",
        "data_stall@150:seconds=2,steps=3",
        "--inject",
        "nan@160",
        # Alerts about a run resolve when it ends, and the last 105 steps take a second or two: a
        # pause keeps the run alive (and NaN) long enough for Alertmanager to deliver the NaN alerts.
        "--inject",
        "hang@165:seconds=6",
    ]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    hang = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "trainmon.reference_trainer"]
    hang += ["--run-id", HANG, "--steps", "60", "--out", str(tmp_path / "hang"), "--collector", collector_url]
    hang += [*COMMON, "--inject", "hang@20:rank=1,seconds=12"]
    hang_env = fake_nvml_env(tmp_path / "fake_nvml")  # a healthy GPU: this run only hangs
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    for name, cmd, e in (("faults", faults, env), ("hang", hang, hang_env)):
        out = (logs / f"{name}.log").open("wb")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=e, stdout=out, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
@needs_prometheus
@needs_alertmanager
@pytest.mark.timeout(300)
def test_faults_fire_alerts_and_alertmanager_delivers_them(tmp_path: Path) -> None:
    receiver = WebhookReceiver()
    collector = start_collector(tmp_path / "trainmon.sqlite")
    am = start_alertmanager(tmp_path / "am", alertmanager_test_config(receiver.url))
    rules = write_test_rules(tmp_path / "rules.yml", for_="0s", replace=TEST_REPLACEMENTS)
    prom = start_prometheus(
        tmp_path / "prom",
        [collector.url.removeprefix("http://")],
        [rules],
        alertmanager=am.url.removeprefix("http://"),
    )
    with stopping(receiver, collector, am, prom):
        assert {g["name"] for g in prom.rule_groups()} >= {"trainmon.recording", "trainmon.training"}
        launched = time.time()
        procs = _launch(tmp_path, collector.url)
        try:
            seen: dict[tuple, dict[str, Any]] = {}
            deadline = time.monotonic() + 200  # about 30 s alone, 90 s on cores loaded 6 times over
            while time.monotonic() < deadline:
                for alert in prom.alerts():
                    if alert["state"] == "firing":
                        name = alert["labels"]["alertname"]
                        wanted = next((labels for n, labels in EXPECTED_FIRING if n == name), None)
                        if wanted is not None:
                            seen.setdefault((name, _key(alert, tuple(k for k, _ in wanted))), alert)
                delivered = {(a["labels"]["alertname"], a["labels"].get("run")) for a in receiver.alerts()}
                nan_delivered = any(
                    a["labels"]["alertname"] == "TrainmonAnomalyCritical" and a["labels"].get("kind") == "nan_inf"
                    for a in receiver.alerts()
                    if a["status"] == "firing"
                )
                if set(seen) >= EXPECTED_FIRING and delivered >= EXPECTED_DELIVERED and nan_delivered:
                    break
                time.sleep(0.5)
            missing = EXPECTED_FIRING - set(seen)
            detail = f"firing: {sorted(seen)}\n{_logs(tmp_path)}"
            if ("TrainmonThroughputCollapse", (("run", FAULTS),)) in missing:
                detail += "\n" + _throughput(prom, launched)
            assert not missing, f"never firing in Prometheus: {sorted(missing)}\n{detail}"
        finally:
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)

        # Prometheus side: templated annotations, severity from the rule.
        nan = seen[("TrainmonLossNotFinite", (("rank", "0"), ("run", FAULTS)))]
        assert nan["labels"]["severity"] == "critical"
        assert nan["annotations"]["summary"] == f"Run {FAULTS} rank 0: loss is NaN"
        hang = seen[("TrainmonRankHang", (("rank", "1"), ("run", HANG)))]
        assert hang["annotations"]["summary"].startswith(f"Run {HANG} rank 1: no step for ")

        # Alertmanager side: delivered to the webhook, grouped by run, annotations intact.
        firing = [a for a in receiver.alerts() if a["status"] == "firing"]
        delivered = {(a["labels"]["alertname"], a["labels"].get("run")) for a in firing}
        assert delivered >= EXPECTED_DELIVERED, f"not delivered: {EXPECTED_DELIVERED - delivered}"
        for payload in receiver.payloads:
            names = {a["labels"]["alertname"] for a in payload["alerts"]}
            if not payload["groupLabels"] and names == {"TrainmonCollectorDown"}:
                # Every rule's ``for`` is 0 s here and the collector shares the test's process: one scrape
                # over its 1 s timeout on a loaded machine fires this, in a group of its own (it has no run).
                continue
            assert set(payload["groupLabels"]) == {"run"}, [a["labels"] for a in payload["alerts"]]
            assert {a["labels"].get("run") for a in payload["alerts"]} == {payload["groupLabels"]["run"]}
        for alert in firing:
            labels, notes = alert["labels"], alert["annotations"]
            assert labels["severity"] in ("warning", "critical"), labels
            assert {"summary", "description", "action", "runbook_url"} <= set(notes), notes
            assert all("{{" not in v and "<no value>" not in v for v in notes.values()), notes
            assert labels.get("run", "") in notes["summary"], notes["summary"]
        anomaly_kinds = {a["labels"]["kind"] for a in firing if a["labels"]["alertname"] == "TrainmonAnomalyCritical"}
        # A 3-step data stall is a collapse Prometheus' rule sees, but not one the collector calls critical
        # (critical needs size and duration: detectors' ThroughputCollapseConfig).
        assert "nan_inf" in anomaly_kinds and "throughput_collapse" not in anomaly_kinds
        # Inhibition: the faults run had criticals (its GPU) from its first health sample on, so
        # its warnings (hot GPU, throttling, throughput) fired in Prometheus but were not sent.
        assert ("TrainmonGPUHot", (("gpu", "0"), ("run", FAULTS))) in seen
        warned = {a["labels"]["alertname"] for a in firing if a["labels"].get("run") == FAULTS}
        assert not {n for n in warned if n in ("TrainmonGPUHot", "TrainmonGPUThrottled")}, warned


def _health(run: str, seq: int) -> dict[str, Any]:
    """A health event of a hot GPU (95 C: TrainmonGPUOverheating) and a busy process."""
    gpu = {"index": 0, "uuid": "GPU-1", "temperature_c": 95, "throttle_reasons": 0, "ecc_uncorrected": 0}
    return event("health", {"cpu_percent": 150.0, "rss_bytes": 2**30, "gpus": [gpu]}, run=run, seq=seq)


def test_metrics_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    """No `_created` series (one per counter, read by nothing), CPU in cores under a name that says
    so, the expected LR labelled like the actual LR it is compared with, and promtool agrees."""
    collector = start_collector(tmp_path / "trainmon.sqlite")
    with stopping(collector):
        schedule = {"name": "cosine", "peak_lr": 1e-3, "total_steps": 100, "warmup_steps": 10}
        start = event("run_start", {"world_size": 1, "schedule": schedule}, seq=0)
        assert collector.post(batch([start, *step_events(5), _health("r1", 6)]))[0] == 200
        text = collector.get("/metrics")[1].decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert any(line.startswith("trainmon_ingest_events_total{") for line in samples)  # counters are there
    assert not [line for line in samples if re.match(r"\w+_created\b", line)], "a _created series"
    assert not [line for line in text.splitlines() if re.match(r"# TYPE \w+_created ", line)]
    assert 'trainmon_learning_rate{group="0",rank="0",run="r1"} 0.001' in samples
    assert 'trainmon_learning_rate_expected{group="0",rank="0",run="r1"} 0.0004' in samples
    assert 'trainmon_process_cpu_cores{node="test-host",rank="0",run="r1"} 1.5' in samples
    assert "_cpu_ratio" not in text
    if PROMTOOL:
        proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc


RUN_ALERTS = ("TrainmonLossNotFinite", "TrainmonAnomalyCritical", "TrainmonGPUOverheating")


@pytest.mark.slow
@needs_prometheus
@pytest.mark.timeout(120)
def test_a_finished_runs_final_values_raise_no_alert(tmp_path: Path) -> None:
    """A run ends on a NaN with a critical nan_inf open and a hot GPU: the real collector keeps
    exporting those values (FINISHED_RUN_TTL_SECONDS), and the real Prometheus, with the shipped
    rules, resolves the run's alerts at run_end instead of holding them until the series expire."""
    collector = start_collector(tmp_path / "trainmon.sqlite")
    rules = write_test_rules(tmp_path / "rules.yml", for_="0s")
    prom = start_prometheus(tmp_path / "prom", [collector.url.removeprefix("http://")], [rules])
    run = "ends-on-nan"
    with stopping(collector, prom):
        start = event("run_start", {"world_size": 1}, run=run, seq=0)
        steps = step_events(30, run=run, loss=lambda i: "NaN" if i >= 25 else 4.0 - 0.01 * i)
        assert collector.post(batch([start, *steps, _health(run, 31)]))[0] == 200

        def firing() -> set[str]:
            return {
                a["labels"]["alertname"]
                for a in prom.alerts()
                if a["state"] == "firing" and a["labels"].get("run") == run
            }

        wait_until(lambda: set(RUN_ALERTS) <= firing(), 60, f"{RUN_ALERTS} firing for the running run")

        end = event("run_end", {"status": "failed", "step": 29, "error": "loss is NaN"}, run=run, seq=32)
        assert collector.post(batch([end]))[0] == 200
        wait_until(lambda: not firing() & set(RUN_ALERTS), 30, "the ended run's alerts to resolve")
        # Still exported, and scraped after the end: the alerts stopped because the run ended.
        prom.wait_scraped(f'trainmon_run_running{{run="{run}"}} == 0')
        (active,) = prom.query(f'trainmon_anomalies_active{{run="{run}", kind="nan_inf"}}')
        assert active["metric"]["severity"] == "critical" and float(active["value"][1]) == 1.0
        (loss,) = prom.query(f'trainmon_loss{{run="{run}"}}')
        assert math.isnan(float(loss["value"][1]))
        assert not firing() & set(RUN_ALERTS)


def test_extremes_between_scrapes_are_exported_and_reset_by_each_scrape(tmp_path: Path) -> None:
    """Issue 26: a loss of 157 at step 150 among losses of 0.77 never reached the scraped trainmon_loss
    (a gauge holds the latest value). The lowest and highest value since the previous scrape do."""
    collector = start_collector(tmp_path / "trainmon.sqlite")
    with stopping(collector):
        spike = step_events(200, loss=lambda i: 157.0 if i == 150 else 0.77)
        assert collector.post(batch([event("run_start", {"world_size": 1}, seq=0), *spike]))[0] == 200

        def scrape() -> dict[str, float]:
            text = collector.get("/metrics")[1].decode()
            found = re.findall(r'^(trainmon_(?:loss|step_time)\w*)\{rank="0",run="r1"\} (\S+)$', text, re.M)
            return {name: float(value) for name, value in found}

        first = scrape()
        assert first["trainmon_loss"] == 0.77 and first["trainmon_loss_max"] == 157.0
        assert first["trainmon_loss_min"] == 0.77
        assert "trainmon_step_time_max_seconds" in first
        second = scrape()  # no step since: the interval holds the value current at its start
        assert second["trainmon_loss_max"] == second["trainmon_loss_min"] == 0.77
        nan = step_events(2, start_seq=201, loss=lambda i: "NaN" if i == 0 else 0.5)
        assert collector.post(batch(nan))[0] == 200
        third = scrape()
        assert math.isnan(third["trainmon_loss_max"]) and third["trainmon_loss_min"] == 0.5  # a NaN shows


@pytest.mark.slow
@needs_prometheus
@pytest.mark.timeout(120)
def test_a_one_step_spike_between_scrapes_reaches_prometheus(tmp_path: Path) -> None:
    """A real Prometheus scrapes the real collector every second; 200 steps arrive between two scrapes,
    one of them a loss of 157. The gauge of the latest value never holds it; trainmon_loss_max does."""
    collector = start_collector(tmp_path / "trainmon.sqlite")
    prom = start_prometheus(tmp_path / "prom", [collector.url.removeprefix("http://")])
    run = "spike"
    with stopping(collector, prom):
        start = event("run_start", {"world_size": 1}, run=run, seq=0)
        assert collector.post(batch([start, *step_events(10, run=run, loss=lambda i: 0.77)]))[0] == 200
        prom.wait_scraped(f'trainmon_loss{{run="{run}"}}')
        steps = step_events(200, start_seq=11, run=run, loss=lambda i: 157.0 if i == 150 else 0.77)
        for s in steps:
            s["fields"]["step"] += 10
        assert collector.post(batch(steps))[0] == 200  # one batch: never the latest value at a scrape
        wait_until(
            lambda: prom.query(f'max_over_time(trainmon_loss_max{{run="{run}"}}[1m]) == 157'),
            30,
            "the spike in Prometheus",
        )
        time.sleep(2.0)  # more scrapes of the latest value
        (gauge,) = prom.query(f'max_over_time(trainmon_loss{{run="{run}"}}[1m])')
        assert float(gauge["value"][1]) == 0.77  # what a dashboard of trainmon_loss alone would draw
