"""Exported series, scrape time and memory for a wide fleet (issue 27, part 2).

Five runs of 1,000 ranks (a health sample with one GPU and three steps per rank, the wire format's
events folded by the collector's own ``LiveState``), one straggler named by an open finding, scraped
by the real ``TrainingCollector`` through ``prometheus_client``'s exposition, as ``/metrics`` does.
The bound to meet: under 50,000 series, +300 MiB of RSS, a scrape under 1 s.

    .venv/bin/python bench/series_bound.py [--runs 5] [--ranks 1000] [--scrapes 5]

Headline lines (key=value): ``series``, ``scrape_bytes``, ``scrape_s_median``, ``rss_growth_mib``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.collector.test_series_bound import _fleet
from trainmon.monitor.collector.exporter import TrainingCollector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=5)
    args = ap.parse_args()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    live, findings = _fleet(args.ranks, args.runs)
    registry = CollectorRegistry()
    registry.register(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    times = []
    for _ in range(args.scrapes):
        t0 = time.perf_counter()
        body = generate_latest(registry)
        times.append(time.perf_counter() - t0)
    rss1 = proc.memory_info().rss
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    print(f"runs={args.runs} ranks={args.ranks}")
    print(f"series={series}")
    print(f"scrape_bytes={len(body)}")
    print(f"scrape_s_median={statistics.median(times):.3f}")
    print(f"rss_growth_mib={(rss1 - rss0) / 2**20:.0f}")


if __name__ == "__main__":
    main()
