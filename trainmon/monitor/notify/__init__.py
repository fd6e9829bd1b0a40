"""Notifications straight from the collector: generic webhook, Slack-compatible webhook, Alertmanager API v2.

For users without Prometheus/Alertmanager routing (and for those who want the collector's
hints in the page). See :mod:`trainmon.monitor.notify.notifier` for the policy (dedupe, grouping,
cooldown, retry) and :mod:`trainmon.monitor.notify.targets` for the payloads.
"""

from trainmon.monitor.notify.notifier import Notifier, open_anomalies
from trainmon.monitor.notify.targets import TARGET_TYPES, Alert, redact

__all__ = ["TARGET_TYPES", "Alert", "Notifier", "open_anomalies", "redact"]
