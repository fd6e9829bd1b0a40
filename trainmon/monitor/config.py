"""The collector's configuration, typed, with defaults that work on a laptop.

A TOML file may override any field (``trainmon serve --config FILE``); an unknown or mistyped
field is named in the error instead of being silently ignored.

Each detector's own settings live beside it, in its module (``NanInfConfig`` in
``detectors/nan_inf.py``): ``DetectorsConfig`` is assembled here from the detectors the package finds,
one section per detector, named by its kind. What each severity means is stated in ``detectors/base.py``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.monitor.detectors import ALL_DETECTORS, Detector

__all__ = [
    "CollectorConfig",
    "ConfigError",
    "DetectorsConfig",
    "NotifyConfig",
    "NotifyTargetConfig",
    "RetentionConfig",
    "SeriesLimits",
    "detectors_config",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration file or flag is wrong; the message names the field."""


@dataclass
class _DetectorsSettings:
    """What every detector shares; the sections of each detector follow (see ``DetectorsConfig``)."""

    replay_window: int = 512
    """Stored steps per rank replayed into fresh detectors after a collector restart."""


def _assemble(detectors: tuple[type[Detector], ...]) -> type:
    """The ``[detectors]`` section: the shared settings, then one field per detector, named by its kind,
    holding its ``config_class`` (so ``config.detectors.loss_spike`` and ``[detectors.loss_spike]``)."""
    sections = [(cls.kind, cls.config_class, field(default_factory=cls.config_class)) for cls in detectors]
    return dataclasses.make_dataclass(
        "DetectorsConfig",
        sections,
        bases=(_DetectorsSettings,),
        namespace={"__doc__": "Every detector's settings, one section per detector found.", "__module__": __name__},
    )


DetectorsConfig = _assemble(ALL_DETECTORS)


@dataclass
class NotifyTargetConfig:
    """One destination of the collector's own notifications (``[[notify.targets]]`` in TOML)."""

    type: str = "webhook"
    """``webhook`` (generic JSON), ``slack`` (Slack-compatible incoming webhook) or ``alertmanager`` (API v2)."""
    url: str = ""
    """Endpoint; for Alertmanager its base URL (``http://alertmanager:9093``). Secret URLs belong in ``url_env``."""
    url_env: str = ""
    """Environment variable holding the URL; wins over ``url`` when set, so a Slack hook stays out of the file."""
    token: str = ""
    """Sent as ``Authorization: Bearer TOKEN``; empty sends no header."""
    token_env: str = ""
    """Environment variable holding the token; wins over ``token`` when set."""
    timeout: float = 5.0
    """Seconds one delivery attempt may take: a slow receiver must not hold the queue for long."""


@dataclass
class NotifyConfig:
    """Notifications sent by the collector itself, for users without Alertmanager routing."""

    targets: list[NotifyTargetConfig] = field(default_factory=list, metadata={"item": NotifyTargetConfig})
    """Where to send; none (the default) turns notifications off."""
    min_severity: str = "info"
    """Anomalies below this severity (``info`` < ``warning`` < ``critical``) are not sent."""
    group_wait: float = 10.0
    """Seconds changes of one run are collected before they go out as one message per target."""
    cooldown: float = 300.0
    """An anomaly that re-opens within this many seconds of its resolve is not notified again (a flap)
    unless it is still open when the cooldown ends."""
    max_attempts: int = 5
    """Delivery attempts on connection errors, 5xx and 429 before the message is dropped and counted."""
    backoff: float = 1.0
    """Seconds before the first retry; doubled after each failed attempt."""
    max_backoff: float = 30.0
    """Longest wait between two attempts."""
    resend_interval: float = 60.0
    """Open anomalies are re-posted to Alertmanager this often, so its resolve_timeout does not close them."""
    queue_size: int = 10000
    """Anomaly changes waiting for the notifier; more are dropped (and counted) rather than slowing ingest."""
    collector_url: str = ""
    """This collector's external URL, for links in the messages; empty leaves links out."""


@dataclass
class SeriesLimits:
    """How many series ``/metrics`` holds, whatever the world size (issue 27: five runs of 1,000 ranks were
    92,653 series, 6.4 MB a scrape; Prometheus' guidance is the low hundreds of thousands per target)."""

    rank_detail: int = 64
    """A run of up to this many ranks is exported one series per rank. A wider one is exported as cross-rank
    aggregates (``rank="min"``, ``"median"``, ``"max"``: the series of the rank holding that value, with its
    ``node`` and ``gpu``; counters as ``rank="all"``, their sum) plus one series per rank for the ranks its
    open findings name (at most ``open_findings.MAX_FINDINGS``), and ``trainmon_rank_holding_max`` says
    which rank holds each maximum. Per-rank detail of every rank stays in the API and the post-mortem."""
    max_series: int = 200_000
    """Training series a scrape holds at most. Runs are taken most recently heard from first; a run that
    would not fit is left out whole, and ``trainmon_exporter_series_left_out`` counts its series."""


@dataclass
class RetentionConfig:
    """How long the store keeps runs (``[retention]`` in the TOML): without it a collector serving a team
    for months fills its disk, and a full disk refuses all ingest. Only finished runs are deleted (ended,
    or silent past ``evict_idle_seconds``), whole, least recently updated first; archive one first with
    ``trainmon export RUN FILE``."""

    max_age_days: float = 90.0
    """Delete a finished run this many days after its last event; 0 keeps runs whatever their age."""
    max_bytes: int = 50 << 30
    """While the store's data exceeds this many bytes, delete the least recently updated finished run;
    0: no size limit. SQLite: the pages in use; PostgreSQL: the live rows' estimated size."""
    check_seconds: float = 300.0
    """How often the collector applies the limits (and once at start)."""


@dataclass
class CollectorConfig:
    db: str = "trainmon.sqlite"
    """SQLite file path or SQLAlchemy URL (``postgresql+psycopg://...``)."""
    host: str = "127.0.0.1"
    port: int = 9400
    max_body_bytes: int = 8 << 20
    """Largest accepted POST body; bigger batches get 413 and the sender splits them."""
    max_pending_batches: int = 4096
    """Batches received and waiting for the writer beyond which new ones get 503 (the producers spool and
    retry): bounds the collector's memory when it cannot keep up."""
    token: str = field(default="", repr=False)
    """Bearer token every endpoint but ``/healthz`` requires when set (``--token``, ``$TRAINMON_TOKEN``).
    Required to bind a non-loopback address unless ``insecure`` is set. Never logged or printed."""
    insecure: bool = False
    """Allow a non-loopback bind without a token (trusted network only); must be asked for explicitly."""
    metrics_public: bool = False
    """Serve ``/metrics`` without the token (for scrapers that cannot send one); Prometheus can:
    ``authorization: {credentials: TOKEN}`` in the scrape config, so it stays protected by default."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Extra names the ``Host`` header may carry on a loopback bind (a local reverse proxy). Any other
    name is refused: a web page whose DNS name was rebound to 127.0.0.1 must not read or write runs."""
    shutdown_grace_seconds: float = 20.0
    """On SIGTERM/SIGINT the collector stops within this long whatever its parts do: half of it for the
    requests in flight to be answered, half for the queued batches to be committed and detected. A
    detection that is not done by then is dropped (logged); acknowledged events are always stored."""
    evict_after_seconds: float = 600.0
    """A run that ended (rank 0 sent ``run_end``) leaves memory (detectors, live state) this long
    after its last event; it stays in storage. Keep it above the exporter's 300 s final-scrape window."""
    evict_idle_seconds: float = 3600.0
    """A run that sent nothing for this long leaves memory too (crashed without ``run_end``). A hung
    rank is found long before (the hang detector's timeout); the run stays in storage."""
    clash_window_seconds: float = 15.0
    """A new job (launch id) under a run name whose earlier job was heard from within this long, and has
    not ended, is a second job (stored apart, ``run_clash``); silent longer, it may have died without a
    word and the newcomer is its restart. A live job is heard at least every heartbeat (5 s by default);
    the bound shrinks to a few of the job's own intervals between events when it sends more often
    (``trainmon.monitor.collector.launches``)."""
    web_cache_seconds: float = 2.0
    """The web view (``GET /``, ``GET /runs/{run}``) serves a rendered page again for this long (or three
    times its render time, if longer) before rendering it anew: open tabs cost no extra work."""
    web_refresh_seconds: int = 5
    """How often the web view's list of runs, and the page of a running run, reload themselves."""
    max_live_runs: int = 256
    """Runs held in memory (detectors, live state, exported series) at once; a batch that would start
    one more is answered 429 (its producer spools and retries) until finished runs are evicted."""
    max_ranks_per_run: int = 8192
    """Ranks of one run; a 1,024-rank job fits eight times over. Beyond: 429."""
    max_runs_per_batch: int = 16
    """Distinct runs in one batch (a producer sends one): creating runs costs detector priming, and a
    batch of thousands of new runs would stall every other producer. Beyond: 413, and the producer's transport
    (or its node's forwarder) sends the batch again in halves."""
    max_inflight_bytes: int = 256 << 20
    """Request bytes being received plus waiting for the writer; beyond, new bodies get 503 at once.
    Bounds the memory stalled or slow uploads can hold."""
    header_timeout_seconds: float = 10.0
    """A connection must send its request headers within this long, or it is closed (slow-header)."""
    body_timeout_seconds: float = 30.0
    """A request body must arrive within this long, or it is answered 408 and dropped (slow-body)."""
    series: SeriesLimits = field(default_factory=SeriesLimits)
    """What ``/metrics`` exports of wide runs (``[series]`` in the TOML)."""
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    """What the store keeps (``[retention]`` in the TOML)."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)


def _apply(obj: Any, raw: dict, prefix: str) -> None:
    known = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown field, expected one of {sorted(known)}")
        current = getattr(obj, key)
        item = known[key].metadata.get("item")
        if item is not None:
            # A list of tables (``[[notify.targets]]``): each entry is checked like a section.
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{name}: expected a list of tables, got {value!r}")
            entries = []
            for i, table in enumerate(value):
                entry = item()
                _apply(entry, table, f"{name}[{i}].")
                entries.append(entry)
            setattr(obj, key, entries)
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a table, got {value!r}")
            _apply(current, value, f"{name}.")
            continue
        expected = type(current)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{name}: expected {expected.__name__}, got {value!r}")
        if known[key].metadata.get("positive") and not value > 0:
            raise ConfigError(f"{name}: must be greater than 0, got {value!r}")
        setattr(obj, key, value)


def detectors_config(raw: dict[str, Any]) -> DetectorsConfig:
    """A ``DetectorsConfig`` from its dict form (``dataclasses.asdict``), checked like a config file."""
    config = DetectorsConfig()
    _apply(config, raw, "detectors.")
    return config


def load_config(path: str | Path | None = None, **overrides: Any) -> CollectorConfig:
    """Defaults, then the TOML file, then explicit overrides (command-line flags)."""
    config = CollectorConfig()
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        _apply(config, raw, "")
    _apply(config, {k: v for k, v in overrides.items() if v is not None}, "")
    _check_retention(config.retention)
    return config


def _check_retention(retention: RetentionConfig) -> None:
    """Limits that cannot mean anything are refused, naming the field (0 turns a limit off)."""
    for name in ("max_age_days", "max_bytes"):
        if getattr(retention, name) < 0:
            raise ConfigError(f"retention.{name}: 0 (off) or more, got {getattr(retention, name)!r}")
    if not retention.check_seconds > 0:
        raise ConfigError(f"retention.check_seconds: more than 0, got {retention.check_seconds!r}")
