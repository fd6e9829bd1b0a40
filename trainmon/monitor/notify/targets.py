"""Where notifications go and what each receiver expects to be sent.

A target turns a group of :class:`Alert` (the anomalies of one run that changed together) into
one HTTP request. Its URL and token come from the config or from environment variables, and
neither ever appears in a log line: targets describe themselves by :func:`redact`, and error
texts pass through :meth:`Target.scrub` before they are logged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

from trainmon.monitor.config import ConfigError, NotifyTargetConfig
from trainmon.wire import json_safe

__all__ = [
    "TARGET_TYPES",
    "Alert",
    "AlertmanagerTarget",
    "SlackTarget",
    "Target",
    "WebhookTarget",
    "make_target",
    "redact",
]

ALERTNAME = "TrainmonAnomaly"
_SLACK_MAX_SECTIONS = 45
"""Slack refuses messages of more than 50 blocks; the rest is summarised in one line."""
_SLACK_EMOJI = {"critical": ":red_circle:", "warning": ":large_orange_circle:", "info": ":large_blue_circle:"}


@dataclass
class Alert:
    """One anomaly as the notifier last saw it: what every payload is rendered from."""

    id: int
    run: str
    kind: str
    rank: int
    severity: str
    action: str
    """The change being notified: ``opened``, ``updated`` (severity changed) or ``resolved``."""
    first_step: int | None
    last_step: int | None
    message: str
    hint: str
    evidence: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    """Wall time the anomaly opened (as first seen by the notifier)."""
    ended_at: float | None = None
    """Wall time it resolved; None while open."""
    previous_severity: str | None = None
    """The severity receivers knew before this change, when it changed (Alertmanager keys alerts by it)."""

    @property
    def status(self) -> str:
        return "resolved" if self.action == "resolved" else "open"

    def steps_text(self) -> str:
        if self.first_step is None:
            return "step unknown"
        if self.last_step is None or self.last_step == self.first_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}-{self.last_step}"

    def rank_text(self) -> str:
        return "all ranks" if self.rank < 0 else f"rank {self.rank}"


def redact(url: str) -> str:
    """The URL with everything after the host cut off: Slack and many webhooks carry the secret in the path."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    rest = parts.path not in ("", "/") or parts.query or parts.fragment
    return f"{parts.scheme}://{host}/…" if rest else f"{parts.scheme}://{host}"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _dumps(value: Any) -> bytes:
    # Evidence may hold NaN or inf (the very values that raised the anomaly): strict JSON out.
    return json.dumps(json_safe(value), allow_nan=False, default=str).encode()


class Target:
    """One configured destination: a resolved URL, an optional bearer token, a timeout."""

    type: ClassVar[str]

    def __init__(self, url: str, token: str, timeout: float, collector_url: str = "") -> None:
        self.url = url
        self.token = token
        self.timeout = timeout
        self.collector_url = collector_url.rstrip("/")
        self.label = f"{self.type} {redact(url)}"
        """How logs name this target: its type and redacted URL, never the secret parts."""

    def endpoint(self) -> str:
        return self.url

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": "trainmon-notifier"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def scrub(self, text: str) -> str:
        """Remove the URL and token from an error text (a receiver may echo them back)."""
        for secret, shown in ((self.endpoint(), redact(self.url)), (self.url, redact(self.url)), (self.token, "…")):
            if secret:
                text = text.replace(secret, shown)
        return text

    def run_link(self, run: str) -> str | None:
        if not self.collector_url:
            return None
        return f"{self.collector_url}/v1/runs/{quote(run, safe='')}/anomalies"

    def render(self, run: str, alerts: list[Alert]) -> bytes:
        """The request body announcing ``alerts``, all of run ``run``."""
        raise NotImplementedError

    def render_resend(self, alerts: list[Alert]) -> bytes | None:
        """The body that re-asserts still-open alerts, for receivers that expire them; None: not needed."""
        return None


class WebhookTarget(Target):
    """Generic JSON webhook: one object per run with the changed anomalies and all their fields."""

    type = "webhook"

    def render(self, run: str, alerts: list[Alert]) -> bytes:
        body: dict[str, Any] = {
            "source": "trainmon",
            "run": run,
            "anomalies": [
                {
                    "id": a.id,
                    "run": a.run,
                    "kind": a.kind,
                    "rank": a.rank,
                    "severity": a.severity,
                    "previous_severity": a.previous_severity,
                    "status": a.status,
                    "action": a.action,
                    "steps": {"first": a.first_step, "last": a.last_step},
                    "message": a.message,
                    "hint": a.hint,
                    "evidence": a.evidence,
                    "started_at": _iso(a.started_at),
                    "ended_at": None if a.ended_at is None else _iso(a.ended_at),
                }
                for a in alerts
            ],
        }
        link = self.run_link(run)
        if link is not None:
            body["collector_url"] = self.collector_url
            body["anomalies_url"] = link
        return _dumps(body)


def _slack_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class SlackTarget(Target):
    """Slack-compatible incoming webhook (also Mattermost, Rocket.Chat): ``text`` plus Block Kit ``blocks``."""

    type = "slack"

    def render(self, run: str, alerts: list[Alert]) -> bytes:
        esc = _slack_escape
        lines = [
            f"[{a.severity.upper()}] {a.kind} {a.action} on run {run} ({a.rank_text()}): {a.message}" for a in alerts
        ]
        count = f"{len(alerts)} anomal{'y' if len(alerts) == 1 else 'ies'}"
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": f"trainmon: {count} on run {run}"[:150]}}
        ]
        for a in alerts[:_SLACK_MAX_SECTIONS]:
            emoji = ":white_check_mark:" if a.action == "resolved" else _SLACK_EMOJI.get(a.severity, "")
            was = f" (was {a.previous_severity.upper()})" if a.previous_severity else ""
            text = (
                f"{emoji} *{a.severity.upper()} {esc(a.kind)}* {a.action}{was} on run `{esc(run)}`, "
                f"{a.rank_text()}, {a.steps_text()}\n{esc(a.message)}"
            )
            if a.hint:
                text += f"\n_Hint:_ {esc(a.hint)}"
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}})
        if len(alerts) > _SLACK_MAX_SECTIONS:
            rest = len(alerts) - _SLACK_MAX_SECTIONS
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"and {rest} more"}]})
        link = self.run_link(run)
        if link is not None:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|All anomalies>"}]})
        return _dumps({"text": "\n".join(lines)[:3000], "blocks": blocks})


class AlertmanagerTarget(Target):
    """Alertmanager API v2: alerts it routes, groups and inhibits like Prometheus's own.

    An alert without ``endsAt`` is resolved by Alertmanager after its ``resolve_timeout``
    (5 minutes by default) unless it is posted again, so open anomalies are re-posted every
    ``resend_interval``; a resolved one is posted once with ``endsAt``. Severity is a label, so
    Alertmanager sees a severity change as a new alert: the one under the old severity is
    resolved in the same request rather than left to time out.
    """

    type = "alertmanager"

    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/api/v2/alerts"

    def _alert(self, a: Alert) -> dict[str, Any]:
        out: dict[str, Any] = {
            "labels": {
                "alertname": ALERTNAME,
                "run": a.run,
                "kind": a.kind,
                "rank": str(a.rank),
                "severity": a.severity,
            },
            "annotations": {
                "summary": f"{a.kind} on run {a.run} ({a.rank_text()}): {a.message}",
                "description": f"{a.message} ({a.steps_text()}). Evidence: {_dumps(a.evidence).decode()}",
                "hint": a.hint,
            },
            "startsAt": _iso(a.started_at),
        }
        if a.ended_at is not None:
            out["endsAt"] = _iso(a.ended_at)
        link = self.run_link(a.run)
        if link is not None:
            out["generatorURL"] = link
        return out

    def render(self, run: str, alerts: list[Alert]) -> bytes:
        out = [self._alert(a) for a in alerts]
        for a in alerts:
            if a.previous_severity is not None and a.previous_severity != a.severity:
                ended = a.ended_at if a.ended_at is not None else time.time()
                out.append(self._alert(dataclasses.replace(a, severity=a.previous_severity, ended_at=ended)))
        return _dumps(out)

    def render_resend(self, alerts: list[Alert]) -> bytes | None:
        return _dumps([self._alert(a) for a in alerts]) if alerts else None


TARGET_TYPES: dict[str, type[Target]] = {t.type: t for t in (WebhookTarget, SlackTarget, AlertmanagerTarget)}


def _secret(value: str, env: str, name: str, env_name: str, environ: dict[str, str]) -> str:
    if env:
        from_env = environ.get(env, "")
        if from_env:
            return from_env
        if not value:
            raise ConfigError(f"{env_name}: environment variable {env} is not set (and {name} is empty)")
    return value


def make_target(
    config: NotifyTargetConfig, index: int, collector_url: str = "", environ: dict[str, str] | None = None
) -> Target:
    """Build target ``index`` of ``notify.targets``; a bad type or a missing URL names the field."""
    environ = dict(os.environ) if environ is None else environ
    prefix = f"notify.targets[{index}]."
    cls = TARGET_TYPES.get(config.type)
    if cls is None:
        raise ConfigError(f"{prefix}type: expected one of {sorted(TARGET_TYPES)}, got {config.type!r}")
    url = _secret(config.url, config.url_env, f"{prefix}url", f"{prefix}url_env", environ)
    if not url:
        raise ConfigError(f"{prefix}url: no URL (set url, or url_env to the name of an environment variable)")
    if urlsplit(url).scheme not in ("http", "https"):
        # Do not echo the value: it may be a secret pasted into the wrong field.
        raise ConfigError(f"{prefix}url: expected an http:// or https:// URL")
    token = _secret(config.token, config.token_env, f"{prefix}token", f"{prefix}token_env", environ)
    if config.timeout <= 0:
        raise ConfigError(f"{prefix}timeout: expected a positive number of seconds, got {config.timeout!r}")
    return cls(url, token, config.timeout, collector_url)
