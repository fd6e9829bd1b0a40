"""The collector's notifier: anomaly changes in, deduplicated and grouped messages out.

Ingest must never wait on a chat service, so :meth:`Notifier.submit` only puts the changes on
a bounded queue (dropping and counting them when it is full). One dispatcher thread applies
the notification policy:

- dedupe: an anomaly's ``opened`` is sent once, ``updated`` only when its severity changed,
  ``resolved`` once (and only for anomalies whose opening was sent);
- grouping: changes of one run are collected for ``group_wait`` seconds and go out as one
  message per target, so a NaN that trips three detectors on eight ranks is one page;
- cooldown: an anomaly that re-opens within ``cooldown`` seconds of its resolve (a flap) is not
  announced again, unless it is still open when the cooldown ends;
- Alertmanager targets get the open anomalies again every ``resend_interval`` seconds;
- a deleted run is forgotten (:meth:`Notifier.forget`): its open anomalies are ended at
  Alertmanager at once (they would otherwise be re-posted for as long as the collector runs) and
  nothing more is said about it to the other targets (a person deleted it: that is not news).

Each target has its own sender thread and queue, so a dead webhook delays only itself. A
failed delivery (connection error, timeout, 5xx, 429) is retried with exponential backoff up
to ``max_attempts`` times, then dropped and counted in ``trainmon_notifications_failed_total``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from trainmon.monitor.collector.engine import AnomalyChange
from trainmon.monitor.config import ConfigError, NotifyConfig
from trainmon.monitor.detectors.base import SEVERITIES
from trainmon.monitor.notify.targets import Alert, Target, make_target
from trainmon.monitor.store.queries import open_anomaly_rows
from trainmon.monitor.store.storage import Storage

__all__ = ["Notifier", "open_anomalies"]

log = logging.getLogger("trainmon.notify")

_LEVEL = {s: i for i, s in enumerate(SEVERITIES)}
_RESEND_CHUNK = 200
"""Alerts per re-post to Alertmanager (its API takes lists; keep each request small)."""
_PRUNE_EVERY = 60.0

Key = tuple[str, str, int]


@dataclass
class _State:
    """What the notifier remembers of one (run, kind, rank), to decide what is news."""

    alert: Alert
    open: bool
    notified: bool = False
    """Receivers were told this anomaly is open (so its resolve and severity changes are news)."""
    notified_severity: str | None = None
    resolved_at: float | None = None
    """Monotonic time of the last resolve that was sent: the start of the cooldown."""
    hold_until: float | None = None
    """A re-open inside the cooldown waits until then; sent only if still open by then."""


@dataclass
class _Group:
    deadline: float
    alerts: dict[Key, Alert]


@dataclass(frozen=True)
class _Message:
    body: bytes
    what: str
    """For logs: what the message announces (never the body: evidence can be long)."""


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    retryable: bool = False
    retry_after: float | None = None
    detail: str = ""


_STOP = object()
_WAKE = object()  # wakes the dispatcher for work that is not a change (a run to forget)
_LOG_EVERY = 10.0
"""Seconds between two log lines about a full queue: a storm is counted, not logged line by line."""


def _log_allowed(owner: object, attr: str) -> bool:
    now = time.monotonic()
    if now - getattr(owner, attr, -_LOG_EVERY) < _LOG_EVERY:
        return False
    setattr(owner, attr, now)
    return True


def _post(target: Target, body: bytes) -> _Outcome:
    request = urllib.request.Request(target.endpoint(), data=body, headers=target.headers(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=target.timeout) as response:
            response.read(65536)
        return _Outcome(True)
    except urllib.error.HTTPError as err:
        retry_after = None
        header = err.headers.get("Retry-After") if err.headers else None
        if header is not None and header.strip().isdigit():
            retry_after = float(header.strip())
        try:
            text = err.read(300).decode("utf-8", "replace").strip()
        except (OSError, http.client.HTTPException):
            text = ""
        detail = f"HTTP {err.code}" + (f": {text}" if text else "")
        return _Outcome(False, err.code >= 500 or err.code == 429, retry_after, detail)
    except (OSError, http.client.HTTPException) as err:
        # URLError (refused, DNS), timeouts, resets and a receiver hanging up without a response.
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        return _Outcome(False, True, None, f"{type(reason).__name__}: {reason}")


class _Sender:
    """One target's queue and thread: delivers messages in order, retrying with backoff."""

    def __init__(self, notifier: Notifier, target: Target, queue_size: int) -> None:
        self.notifier = notifier
        self.target = target
        self.queue: queue.Queue[_Message | object] = queue.Queue(queue_size)
        self.thread = threading.Thread(target=self._run, name=f"trainmon-notify-{target.type}", daemon=True)

    def put(self, message: _Message) -> None:
        n = self.notifier
        n._busy(1)
        try:
            self.queue.put_nowait(message)
        except queue.Full:
            n._busy(-1)
            n._failed.labels(self.target.type).inc()
            if _log_allowed(self, "_full_logged_at"):
                log.warning("notification to %s dropped: its queue is full (%s)", self.target.label, message.what)

    def _run(self) -> None:
        while True:
            message = self.queue.get()
            if message is _STOP:
                return
            assert isinstance(message, _Message)
            try:
                self._deliver(message)
            except Exception:
                log.exception("notification to %s failed unexpectedly", self.target.label)
                self.notifier._failed.labels(self.target.type).inc()
            finally:
                self.notifier._busy(-1)

    def _deliver(self, message: _Message) -> None:
        n, target, config = self.notifier, self.target, self.notifier.config
        delay = config.backoff
        attempt = 0
        while True:
            attempt += 1
            outcome = _post(target, message.body)
            if outcome.ok:
                n._sent.labels(target.type).inc()
                log.info("notified %s: %s", target.label, message.what)
                return
            detail = target.scrub(outcome.detail)
            wait = min(config.max_backoff, outcome.retry_after if outcome.retry_after is not None else delay)
            delay *= 2
            give_up = not outcome.retryable or attempt >= config.max_attempts or not n._may_wait(wait)
            if give_up:
                n._failed.labels(target.type).inc()
                log.error(
                    "notification to %s dropped after %d attempt(s): %s (%s)",
                    target.label,
                    attempt,
                    detail,
                    message.what,
                )
                return
            log.warning(
                "notification to %s failed (attempt %d of %d, retry in %.1fs): %s",
                target.label,
                attempt,
                config.max_attempts,
                wait,
                detail,
            )
            if n._abort.wait(wait):
                n._failed.labels(target.type).inc()
                return


class Notifier:
    """Sends anomaly changes to the configured targets without ever blocking the caller.

    With no targets it is inert: :meth:`submit` returns at once and no thread is started.
    """

    def __init__(
        self,
        config: NotifyConfig,
        registry: CollectorRegistry | None = None,
        open_alerts: Iterable[Alert] = (),
        environ: dict[str, str] | None = None,
    ) -> None:
        """``open_alerts``: anomalies still open from before a collector restart (:func:`open_anomalies`).

        They count as announced already (no second page after a restart), so their severity
        changes and resolves are news, and Alertmanager keeps getting them re-posted.
        """
        _check(config)
        self.config = config
        self.targets = [make_target(t, i, config.collector_url, environ) for i, t in enumerate(config.targets)]
        self._sent = Counter(
            "trainmon_notifications_sent",
            "Notification messages delivered, by target type.",
            ["target"],
            registry=registry,
        )
        self._failed = Counter(
            "trainmon_notifications_failed",
            "Notification messages dropped after their last attempt (or a full queue), by target type.",
            ["target"],
            registry=registry,
        )
        self._dropped = Counter(
            "trainmon_notifications_dropped_changes",
            "Anomaly changes dropped because the notifier's queue was full.",
            registry=registry,
        )
        for target in self.targets:
            self._sent.labels(target.type)
            self._failed.labels(target.type)
        self._inbox: queue.Queue[Any] = queue.Queue(config.queue_size)
        self._states: dict[Key, _State] = {}
        self._groups: dict[str, _Group] = {}
        self._held: set[Key] = set()
        for alert in open_alerts if config.targets else ():
            loud = self._loud(alert.severity)
            self._states[(alert.run, alert.kind, alert.rank)] = _State(
                alert, True, loud, alert.severity if loud else None
            )
        self._pending = 0
        self._forgotten: set[str] = set()  # runs deleted since the dispatcher last looked (under _idle)
        self._idle = threading.Condition()
        self._closing = threading.Event()
        self._abort = threading.Event()
        self._close_deadline = float("inf")
        self._senders = [_Sender(self, t, config.queue_size) for t in self.targets]
        self._resend_to = [s for s in self._senders if type(s.target).render_resend is not Target.render_resend]
        self._thread = threading.Thread(target=self._run, name="trainmon-notifier", daemon=True)
        if self.targets:
            for sender in self._senders:
                sender.thread.start()
            self._thread.start()
            log.info("notifications to %s", ", ".join(t.label for t in self.targets))

    @property
    def enabled(self) -> bool:
        return bool(self.targets)

    # --- the caller's side -------------------------------------------------------------

    def submit(self, changes: Iterable[AnomalyChange]) -> None:
        """Queue anomaly changes for notification; never blocks (a full queue drops and counts)."""
        if not self.targets or self._closing.is_set():
            return
        wall, mono = time.time(), time.monotonic()
        for change in changes:
            self._busy(1)
            try:
                self._inbox.put_nowait((change, wall, mono))
            except queue.Full:
                self._busy(-1)
                self._dropped.inc()
                if _log_allowed(self, "_dropped_logged_at"):
                    log.warning(
                        "notifier queue full: %s of run %s not notified (and more are counted, not logged)",
                        change.finding.kind,
                        change.run,
                    )

    def forget(self, run: str) -> None:
        """Drop a deleted run: end its open alerts at Alertmanager, keep no state of it. Never blocks
        (the dispatcher applies it after the changes queued before it)."""
        if not self.targets or self._closing.is_set():
            return
        with self._idle:
            if run in self._forgotten:
                return
            self._forgotten.add(run)
            self._pending += 1  # one unit per run: the dispatcher takes them off together
        with contextlib.suppress(queue.Full):
            self._inbox.put_nowait(_WAKE)  # a full inbox is drained soon anyway: the run is applied then

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted change is handled and every message delivered or dropped.

        Held re-opens (cooldown) do not count as work. For tests and orderly shutdown.
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is grouped so far, let the senders finish within ``timeout``, then stop."""
        if not self.targets or self._closing.is_set():
            return
        self._close_deadline = time.monotonic() + timeout
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._inbox.put_nowait(_STOP)  # wake the dispatcher now rather than at its next timeout
        self._thread.join(max(0.0, self._close_deadline - time.monotonic()))
        for sender in self._senders:
            sender.thread.join(max(0.0, self._close_deadline - time.monotonic()))
        self._abort.set()

    # --- bookkeeping shared with the senders ---------------------------------------------

    def _busy(self, delta: int) -> None:
        with self._idle:
            self._pending += delta
            if self._pending <= 0:
                self._idle.notify_all()

    def _may_wait(self, seconds: float) -> bool:
        """While closing, a retry is only worth it if it fits before the close deadline."""
        return not self._closing.is_set() or time.monotonic() + seconds < self._close_deadline

    # --- the dispatcher thread -----------------------------------------------------------

    def _run(self) -> None:
        resend = self.config.resend_interval
        next_resend = time.monotonic() + resend
        next_prune = time.monotonic() + _PRUNE_EVERY
        while True:
            now = time.monotonic()
            wake = min([now + 1.0, next_resend if self._resend_to else now + 1.0, *self._deadlines()])
            try:
                item = self._inbox.get(timeout=max(0.0, wake - now))
            except queue.Empty:
                item = None
            while item is not None:
                if item is not _STOP and item is not _WAKE:
                    self._handle_safely(*item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            closing = self._closing.is_set()
            try:
                self._forget_deleted(time.time())
                self._release_holds(now)
                self._flush(now, everything=closing)
                if self._resend_to and now >= next_resend:
                    next_resend = now + resend
                    self._resend()
                if now >= next_prune:
                    next_prune = now + _PRUNE_EVERY
                    self._prune(now)
            except Exception:
                log.exception("notifier failed to dispatch; continuing")
            if closing and self._inbox.empty():
                break
        for sender in self._senders:
            with contextlib.suppress(queue.Full):
                sender.queue.put(_STOP, timeout=max(0.0, self._close_deadline - time.monotonic()))

    def _forget_deleted(self, wall: float) -> None:
        with self._idle:
            runs, self._forgotten = self._forgotten, set()
        if not runs:
            return
        try:
            keys = [k for k in self._states if k[0] in runs]
            ended = [
                dataclasses.replace(st.alert, action="resolved", ended_at=wall)
                for k in keys
                if (st := self._states[k]).open and st.notified
            ]
            for key in keys:
                del self._states[key]
                self._held.discard(key)
            for run in runs & self._groups.keys():
                del self._groups[run]
                self._busy(-1)  # the group's own unit of work: it will not be flushed
            self._repost(ended, "anomalies of deleted runs ended")
        finally:
            self._busy(-len(runs))

    def _deadlines(self) -> list[float]:
        out = [g.deadline for g in self._groups.values()]
        out.extend(h for k in self._held if (h := self._states[k].hold_until) is not None)
        return out

    def _handle_safely(self, change: AnomalyChange, wall: float, mono: float) -> None:
        try:
            self._handle(change, wall, mono)
        except Exception:
            log.exception("notifier could not handle a %s change of run %s", change.action, change.run)
        finally:
            self._busy(-1)

    def _handle(self, change: AnomalyChange, wall: float, mono: float) -> None:
        f = change.finding
        key: Key = (change.run, f.kind, change.rank)
        st = self._states.get(key)
        if change.action == "resolved":
            if st is None:
                # Opened before a collector restart: it may have been announced, so its end is news.
                alert = _alert(change, "resolved", wall)
                alert.ended_at = wall
                if self._loud(change.severity):
                    self._emit(key, alert, mono)
                    self._states[key] = _State(alert, False, resolved_at=mono)
                return
            st.alert = dataclasses.replace(
                _merge(st.alert, change), severity=st.alert.severity, action="resolved", ended_at=wall
            )
            if st.notified:
                self._emit(key, st.alert, mono)
                st.resolved_at = mono
            st.open, st.notified, st.notified_severity, st.hold_until = False, False, None, None
            self._held.discard(key)
            return
        if st is None and change.action == "updated":
            # Opened before a collector restart: assume it was announced then, and say nothing now.
            self._states[key] = _State(_alert(change, "opened", wall), True, True, change.severity)
            return
        if st is not None and st.open:
            # An update (or an opening seen twice): news only if the severity changed.
            st.alert = _merge(st.alert, change)
            if st.notified:
                if change.severity != st.notified_severity:
                    previous, st.notified_severity = st.notified_severity, change.severity
                    self._emit(key, dataclasses.replace(st.alert, action="updated", previous_severity=previous), mono)
            elif st.hold_until is None and self._loud(change.severity):
                self._announce(key, st, mono)  # it rose to min_severity
            return
        # Opened (again).
        resolved_at = None if st is None else st.resolved_at
        st = self._states[key] = _State(_alert(change, "opened", wall), True, resolved_at=resolved_at)
        if resolved_at is not None and mono - resolved_at < self.config.cooldown:
            st.hold_until = resolved_at + self.config.cooldown
            self._held.add(key)
            log.info(
                "%s of run %s re-opened within the cooldown; held until it lasts %.0fs",
                f.kind,
                change.run,
                st.hold_until - mono,
            )
        elif self._loud(change.severity):
            self._announce(key, st, mono)

    def _loud(self, severity: str) -> bool:
        return _LEVEL.get(severity, len(SEVERITIES)) >= _LEVEL[self.config.min_severity]

    def _announce(self, key: Key, st: _State, now: float) -> None:
        st.notified, st.notified_severity = True, st.alert.severity
        self._emit(key, dataclasses.replace(st.alert, action="opened"), now)

    def _emit(self, key: Key, alert: Alert, now: float) -> None:
        group = self._groups.get(alert.run)
        if group is None:
            self._busy(1)
            group = self._groups[alert.run] = _Group(now + self.config.group_wait, {})
        earlier = group.alerts.pop(key, None)
        if earlier is not None and earlier.action == "opened" and alert.action == "updated":
            alert = dataclasses.replace(alert, action="opened", previous_severity=None)  # not announced yet
        elif earlier is not None and earlier.action == "updated" and alert.action != "opened":
            # Two changes in one message: receivers still know the severity from before the first.
            previous = earlier.previous_severity
            alert = dataclasses.replace(alert, previous_severity=None if previous == alert.severity else previous)
        group.alerts[key] = dataclasses.replace(alert, evidence=dict(alert.evidence))

    def _release_holds(self, now: float) -> None:
        for key in [k for k in self._held if (self._states[k].hold_until or 0.0) <= now]:
            self._held.discard(key)
            st = self._states[key]
            st.hold_until = None
            if st.open and self._loud(st.alert.severity):
                self._announce(key, st, now)

    def _flush(self, now: float, everything: bool = False) -> None:
        for run in [r for r, g in self._groups.items() if everything or g.deadline <= now]:
            group = self._groups.pop(run)
            alerts = list(group.alerts.values())
            what = f"{len(alerts)} anomal{'y' if len(alerts) == 1 else 'ies'} of run {run}: " + ", ".join(
                f"{a.kind} {a.action}" for a in alerts
            )
            for sender in self._senders:
                try:
                    sender.put(_Message(sender.target.render(run, alerts), what))
                except Exception:
                    log.exception("could not render a notification for %s", sender.target.label)
            self._busy(-1)

    def _resend(self) -> None:
        self._repost([st.alert for st in self._states.values() if st.open and st.notified], "open anomalies re-posted")

    def _repost(self, alerts: list[Alert], what: str) -> None:
        """``alerts`` as they stand to the targets that take re-posts (Alertmanager), a chunk per request."""
        for i in range(0, len(alerts), _RESEND_CHUNK):
            chunk = alerts[i : i + _RESEND_CHUNK]
            for sender in self._resend_to:
                body = sender.target.render_resend(chunk)
                if body is not None:
                    sender.put(_Message(body, f"{len(chunk)} {what}"))

    def _prune(self, now: float) -> None:
        """Forget resolved anomalies whose cooldown is over (bounded memory on long-lived collectors)."""
        cooldown = self.config.cooldown
        for key in [k for k, st in self._states.items() if not st.open and (st.resolved_at or 0.0) + cooldown < now]:
            del self._states[key]


def open_anomalies(storage: Storage) -> list[Alert]:
    """The anomalies stored as open, as the notifier's starting point after a restart."""
    with storage.connect() as conn:
        rows = open_anomaly_rows(conn)
    return [
        Alert(
            id=r.id,
            run=r.run,
            kind=r.kind,
            rank=r.rank,
            severity=r.severity,
            action="opened",
            first_step=r.first_step,
            last_step=r.last_step,
            message=r.message,
            hint=r.hint,
            evidence=dict(r.evidence or {}),
            started_at=r.opened_at,
        )
        for r in rows
    ]


def _alert(change: AnomalyChange, action: str, wall: float) -> Alert:
    f = change.finding
    return Alert(
        id=change.id,
        run=change.run,
        kind=f.kind,
        rank=change.rank,
        severity=change.severity,
        action=action,
        first_step=f.step,
        last_step=f.step,
        message=f.message,
        hint=f.hint,
        evidence=dict(f.evidence),
        started_at=wall,
    )


def _merge(alert: Alert, change: AnomalyChange) -> Alert:
    """The alert with a later finding's step, severity and text (the step range only grows)."""
    f = change.finding
    first, last = alert.first_step, alert.last_step
    if f.step is not None:
        first = f.step if first is None else min(first, f.step)
        last = f.step if last is None else max(last, f.step)
    return dataclasses.replace(
        alert,
        id=change.id,
        severity=change.severity,
        first_step=first,
        last_step=last,
        message=f.message or alert.message,
        hint=f.hint or alert.hint,
        evidence=dict(f.evidence) or alert.evidence,
    )


def _check(config: NotifyConfig) -> None:
    """Reject values the dispatcher cannot work with, naming the field."""
    if config.min_severity not in _LEVEL:
        raise ConfigError(f"notify.min_severity: expected one of {list(SEVERITIES)}, got {config.min_severity!r}")
    for name in ("group_wait", "cooldown", "backoff", "max_backoff"):
        if getattr(config, name) < 0:
            raise ConfigError(f"notify.{name}: expected a number of seconds >= 0, got {getattr(config, name)!r}")
    if config.resend_interval <= 0:
        raise ConfigError(f"notify.resend_interval: expected seconds > 0, got {config.resend_interval!r}")
    if config.max_attempts < 1:
        raise ConfigError(f"notify.max_attempts: expected at least 1, got {config.max_attempts!r}")
    if config.queue_size < 1:
        raise ConfigError(f"notify.queue_size: expected at least 1, got {config.queue_size!r}")
