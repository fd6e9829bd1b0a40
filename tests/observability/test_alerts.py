"""alerts/: the rules load in Prometheus's own checker, their promtool unit tests pass, every alert
is written the way on-call needs it, and the Alertmanager example is valid."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus import AMTOOL, PROMTOOL, REPO, write_test_rules

ALERTS = REPO / "alerts"
RULES = ALERTS / "trainmon.rules.yml"
RULE_TESTS = ALERTS / "trainmon.rules.test.yml"
RUNBOOK = ALERTS / "RUNBOOK.md"

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package 'prometheus')")


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def promtool(*args: str, cwd: Path = ALERTS) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", RULES.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    proc = promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
def test_the_integration_tests_rule_copy_is_valid(tmp_path: Path) -> None:
    """The short-window copy the integration test loads must still be valid rules."""
    from tests.observability.test_observability_integration import TEST_REPLACEMENTS

    copy = write_test_rules(tmp_path / "rules.yml", for_="0s", replace=TEST_REPLACEMENTS)
    proc = promtool("check", "rules", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(AMTOOL is None, reason="amtool missing (Debian package 'prometheus-alertmanager')")
def test_amtool_check_config() -> None:
    proc = subprocess.run(
        [AMTOOL, "check-config", str(ALERTS / "alertmanager.yml")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alertmanager_example_groups_by_run_and_inhibits_warnings() -> None:
    config = yaml.safe_load((ALERTS / "alertmanager.yml").read_text())
    assert config["route"]["group_by"] == ["run"]
    (rule,) = config["inhibit_rules"]
    assert rule == {
        "source_matchers": ['severity="critical"'],
        "target_matchers": ['severity="warning"'],
        "equal": ["run"],
    }
    assert any(r.get("webhook_configs") for r in config["receivers"])


def test_every_alert_is_actionable() -> None:
    """for:, a warning|critical severity, summary/description/action with values templated in, and a
    runbook_url (the annotation Grafana and Alertmanager UIs link) to the alert's RUNBOOK.md section."""
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules), "duplicate alert names"
    runbook = RUNBOOK.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", runbook, re.M)}
    bases = set()
    for rule in rules:
        name = rule["alert"]
        assert "for" in rule, name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "action", "runbook_url"}, name
        assert "$value" in notes["summary"] or "$labels" in notes["summary"], name
        assert "$value" in notes["description"] or name == "TrainmonCollectorDown", name
        assert "RUNBOOK.md" not in notes["action"], f"{name}: the link belongs in runbook_url"
        base, _, anchor = notes["runbook_url"].partition("#")
        assert base.startswith("https://") and base.endswith("/alerts/RUNBOOK.md"), name
        assert anchor == name.lower() and anchor in anchors, f"{name}: runbook_url is not its RUNBOOK.md section"
        bases.add(base)
    assert len(bases) == 1, f"one runbook base, replaced in one go: {bases}"


# Alerts about the collector itself; every other alert is about a run.
COLLECTOR_ALERTS = {"TrainmonCollectorRejectingBatches", "TrainmonDetectionRestarted", "TrainmonCollectorDown"}


def test_run_alerts_fire_only_while_the_run_runs() -> None:
    """A finished run stays exported for minutes with its final values (a NaN loss, open anomalies,
    hot GPUs); the alerts about it must not fire on them (promtool cases: the "finished run" test)."""
    run_alerts = [r for r in alert_rules() if r["alert"] not in COLLECTOR_ALERTS]
    assert len(run_alerts) == len(alert_rules()) - len(COLLECTOR_ALERTS)
    for rule in run_alerts:
        assert re.search(r"\band on \(run\) \(trainmon_run_running == 1\)\s*$", rule["expr"]), rule["alert"]


def test_every_alert_has_firing_and_silent_unit_tests() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", ())]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c.get("exp_alerts") for c in mine), f"{rule['alert']}: no firing case"
        assert any(not c.get("exp_alerts") for c in mine), f"{rule['alert']}: no not-firing case"


def test_rules_only_read_exported_names() -> None:
    """Every trainmon_* series a rule reads is one the exporter writes (or a recording rule)."""
    exporter = (REPO / "monitor" / "collector" / "exporter.py").read_text()
    exported = set(re.findall(r'"(trainmon_[a-z_]+)"', exporter))
    counters = set(re.findall(r'CounterMetricFamily\(\s*"(trainmon_[a-z_]+)"', exporter))
    counters |= set(re.findall(r'Counter\(\s*"(trainmon_[a-z_]+)"', exporter))
    counters |= set(re.findall(r'_PerRank\(\s*C,\s*"(trainmon_[a-z_]+)"', exporter))  # per-rank counters
    names = exported | {c + "_total" for c in counters} | {"trainmon_ingest_duration_seconds_bucket"}
    for rule in yaml.safe_load(RULES.read_text())["groups"]:
        for r in rule["rules"]:
            for used in re.findall(r"\btrainmon_[a-z_]+", r["expr"]):
                assert used in names, f"{r.get('alert') or r.get('record')}: {used} is not exported"
