"""The dashboards and recording rules work on a wide run's aggregated series (issue 27, part 2).

A real Prometheus scrapes the real ``TrainingCollector`` holding two runs past the per-rank limit
(``rank="min"|"median"|"max"``, counters as ``rank="all"``, one rank named by a finding); every panel
query of both shipped dashboards is evaluated as Grafana would send it, and each one whose series
the fleet has must return data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from tests.collector.test_series_bound import _fleet
from tests.prometheus import REPO, free_port, needs_prometheus, start_prometheus, wait_until
from trainmon.monitor.collector.exporter import TrainingCollector
from trainmon.monitor.config import SeriesLimits

RANKS = 100  # past the default 64-rank limit: the aggregated shape


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, with the dashboard's variables as Grafana fills them."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"].replace("$__rate_interval", "15s").replace("$run", "run0").replace("$rank", ".*")
            out.append((panel["title"], expr))
    return out


@pytest.mark.slow
@needs_prometheus
@pytest.mark.timeout(120)
def test_every_panel_shows_a_wide_run(tmp_path: Path) -> None:
    live, findings = _fleet(RANKS, 2)
    collector = TrainingCollector(live, clock=lambda: 1010.0, findings=findings)
    registry = CollectorRegistry()
    registry.register(collector)
    assert SeriesLimits().rank_detail < RANKS
    port = free_port()
    server, _ = start_http_server(port, "127.0.0.1", registry=registry)
    prom = start_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], [REPO / "alerts" / "trainmon.rules.yml"])
    try:
        exported = {s.name for m in registry.collect() for s in m.samples}
        prom.wait_scraped('trainmon_step{run="run0", rank="max"}')
        wait_until(lambda: prom.query("trainmon:tokens_per_second:rate2m"), 30, "two scrapes for a rate")
        shown, empty = [], []
        for name in ("trainmon-run.json", "trainmon-fleet.json"):
            for title, expr in _queries(json.loads((REPO / "dashboards" / name).read_text())):
                result = prom.query(expr)  # raises on a PromQL error
                needs = set(re.findall(r"\btrainmon_[a-z_]+", expr))
                if "ALERTS" in expr or "trainmon:" in expr or not needs <= exported:
                    continue  # series this fleet does not have (evals, anomalies, alerts, recorded windows)
                (shown if result else empty).append(f"{name}: {title}: {expr}")
        assert not empty, "panels with no data on a wide run:\n" + "\n".join(empty)
        assert len(shown) >= 20
        # The run dashboard's rank picker lists the aggregates and the named rank.
        ranks = {r["metric"]["rank"] for r in prom.query('trainmon_step{run="run0"}')}
        assert ranks == {"min", "median", "max", str(417 % RANKS)}
    finally:
        prom.stop()
        server.shutdown()
