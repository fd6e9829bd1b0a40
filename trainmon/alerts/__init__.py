"""Prometheus alerting rules, their promtool tests, the runbook and an Alertmanager example.

Shipped inside the package as ``trainmon.alerts`` (data files only): a deployment can copy the
rules from ``importlib.resources.files("trainmon.alerts") / "trainmon.rules.yml"``."""
