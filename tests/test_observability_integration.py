"""The whole alerting path with real servers: reference trainer with injected faults → live collector
→ real Prometheus (1 s scrapes, alerts/trainmon.rules.yml with short `for:`) → real Alertmanager
(alerts/alertmanager.yml: grouping by run, inhibition) → a webhook receiver on loopback.

Two runs go at once to keep the test short: a single-process run with a data stall and a NaN
(on a fake NVML GPU that is hot, throttled and has an ECC error), and a two-rank torchrun run in
which rank 1 hangs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import start_collector
from prometheus import (
    REPO,
    WebhookReceiver,
    alertmanager_test_config,
    fake_nvml_env,
    needs_alertmanager,
    needs_prometheus,
    start_alertmanager,
    start_prometheus,
    stopping,
    write_test_rules,
)

pytestmark = [pytest.mark.slow, needs_prometheus, needs_alertmanager, pytest.mark.timeout(240)]

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
        "420",
        "--out",
        str(tmp_path / "faults"),
        "--collector",
        collector_url,
        *COMMON,
        "--inject",
        "data_stall@300:seconds=1,steps=6",
        "--inject",
        "nan@310",
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


def test_faults_fire_alerts_and_alertmanager_delivers_them(tmp_path: Path) -> None:
    t0 = time.monotonic()
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
        procs = _launch(tmp_path, collector.url)
        try:
            seen: dict[tuple, dict[str, Any]] = {}
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                for alert in prom.alerts():
                    if alert["state"] == "firing":
                        name = alert["labels"]["alertname"]
                        wanted = next((labels for n, labels in EXPECTED_FIRING if n == name), None)
                        if wanted is not None:
                            seen.setdefault((name, _key(alert, tuple(k for k, _ in wanted))), alert)
                delivered = {(a["labels"]["alertname"], a["labels"].get("run")) for a in receiver.alerts()}
                if set(seen) >= EXPECTED_FIRING and delivered >= EXPECTED_DELIVERED:
                    break
                time.sleep(0.5)
            missing = EXPECTED_FIRING - set(seen)
            detail = f"firing: {sorted(seen)}\n{_logs(tmp_path)}"
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
            assert set(payload["groupLabels"]) == {"run"}, payload["groupLabels"]
            assert {a["labels"].get("run") for a in payload["alerts"]} == {payload["groupLabels"]["run"]}
        for alert in firing:
            labels, notes = alert["labels"], alert["annotations"]
            assert labels["severity"] in ("warning", "critical"), labels
            assert {"summary", "description", "runbook"} <= set(notes), notes
            assert all("{{" not in v and "<no value>" not in v for v in notes.values()), notes
            assert labels.get("run", "") in notes["summary"], notes["summary"]
        anomaly_kinds = {a["labels"]["kind"] for a in firing if a["labels"]["alertname"] == "TrainmonAnomalyCritical"}
        # A 6-step data stall is a collapse Prometheus' rule sees, but not one the collector calls critical
        # (critical needs size and duration: detectors' ThroughputCollapseConfig).
        assert "nan_inf" in anomaly_kinds and "throughput_collapse" not in anomaly_kinds
        # Inhibition: the faults run had criticals (its GPU) from its first health sample on, so
        # its warnings (hot GPU, throttling, throughput) fired in Prometheus but were not sent.
        assert ("TrainmonGPUHot", (("gpu", "0"), ("run", FAULTS))) in seen
        warned = {a["labels"]["alertname"] for a in firing if a["labels"].get("run") == FAULTS}
        assert not {n for n in warned if n in ("TrainmonGPUHot", "TrainmonGPUThrottled")}, warned
    assert time.monotonic() - t0 < 150
