"""``/metrics`` stays bounded whatever the world size (issue 27, part 2).

Before: every rank of every run had its own series of every metric: five runs of 1,000 ranks gave
92,653 series (6.4 MB a scrape). Now a run wider than ``SeriesLimits.rank_detail`` is exported as
cross-rank aggregates (min, median, max: the series of the rank holding each, with its node and GPU;
counters summed) plus the ranks its open findings name, and a global cap leaves whole runs out,
counted. The events are the wire format's, folded by the collector's own ``LiveState``; the scrape is
``prometheus_client``'s exposition of the real ``TrainingCollector``.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainmon.monitor.collector.engine import AnomalyChange
from trainmon.monitor.collector.exporter import TrainingCollector
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.collector.open_findings import OpenFindings
from trainmon.monitor.config import SeriesLimits
from trainmon.monitor.detectors import Finding
from trainmon.wire import Event

RUNS, RANKS, GPUS_PER_NODE = 5, 1000, 8


def _events(run: str, ranks: int, rng: random.Random, slow_rank: int) -> list[tuple[Event, int]]:
    """What a run's ranks send: run_start, a health sample with their GPU, and a few steps each."""
    out = []
    for rank in range(ranks):
        host, gpu = f"{run}-node{rank // GPUS_PER_NODE:04d}", rank % GPUS_PER_NODE
        stream = f"{run}-{rank}"

        def ev(kind: str, seq: int, fields: dict, t: float, rank=rank, host=host, stream=stream) -> tuple[Event, int]:
            return Event(kind, run, rank, host, stream, seq, t, fields), 0

        out.append(ev("run_start", 0, {"world_size": ranks, "planned_steps": 1000}, 1000.0))
        health = {
            "cpu_percent": 100.0,
            "rss_bytes": 8 << 30,
            "host_mem_used_bytes": int((400 + rng.random() * 100) * 2**30),
            "host_mem_total_bytes": 1 << 40,
            "gpus": [
                {
                    "index": gpu,
                    "temperature_c": 60.0 + rng.random() * 10,
                    "utilization_ratio": 0.9,
                    "mem_used_bytes": 60 << 30,
                    "mem_total_bytes": 80 << 30,
                    "power_w": 500.0,
                    "sm_clock_hz": 1.98e9,
                    "throttle_reasons": 0x40 if rank == slow_rank else 0,  # HW thermal on the straggler
                    "ecc_corrected": 0,
                    "ecc_uncorrected": 0,
                }
            ],
        }
        out.append(ev("health", 1, health, 1001.0))
        for step in range(3):
            fields = {
                "step": step,
                "loss": 2.0 + rng.random() * 0.1,
                "grad_norm": 1.0 + rng.random(),
                "lr": [3e-4, 3e-5],
                "step_time": 2.0 if rank == slow_rank else 1.0 + rng.random() * 0.01,
                "tokens": 4096,
                "phases": {"data": 0.01, "forward": 0.3, "backward": 0.6, "optimizer": 0.05, "comm": 0.1},
                "mem_allocated_bytes": 40 << 30,
                "mem_peak_bytes": 50 << 30,
            }
            out.append(ev("step", 2 + step, fields, 1002.0 + step))
    return out


def _scrape(collector: TrainingCollector) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {fam.name: fam.samples for fam in text_string_to_metric_families(generate_latest(registry).decode())}


def _fleet(ranks: int, runs: int) -> tuple[LiveState, OpenFindings]:
    rng = random.Random(0)
    live, findings = LiveState(), OpenFindings()
    slow = 417 % ranks
    for i in range(runs):
        live.apply(_events(f"run{i}", ranks, rng, slow_rank=slow))
    # The straggler detector named the slow rank of run0.
    finding = Finding(kind="straggler", severity="warning", step=2, message=f"rank {slow} is slow", hint="", rank=slow)
    findings.apply([AnomalyChange("opened", 1, "run0", slow, finding, "warning")])
    return live, findings


@pytest.fixture(scope="module")
def fleet() -> tuple[LiveState, OpenFindings]:
    return _fleet(RANKS, RUNS)


def test_five_runs_of_a_thousand_ranks_stay_under_the_bound(fleet: tuple[LiveState, OpenFindings]) -> None:
    live, findings = fleet
    scraped = _scrape(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    series = sum(len(samples) for samples in scraped.values())
    assert series < 50_000, series
    (exported,) = scraped["trainmon_exporter_series"]
    assert exported.value == series - 2  # all but the exporter's own two
    (left_out,) = scraped["trainmon_exporter_series_left_out"]
    assert left_out.value == 0


def test_aggregates_hold_the_true_extremes_and_name_their_rank(fleet: tuple[LiveState, OpenFindings]) -> None:
    live, findings = fleet
    scraped = _scrape(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    step_time = {s.labels["rank"]: s for s in scraped["trainmon_step_time_seconds"] if s.labels["run"] == "run1"}
    truth = {r: st.last["step_time"] for r, st in live.runs["run1"].ranks.items()}
    assert set(step_time) == {"min", "median", "max"}  # no finding in run1: aggregates only
    assert step_time["max"].value == max(truth.values()) == 2.0
    assert step_time["min"].value == min(truth.values())
    assert step_time["median"].value == sorted(truth.values())[(len(truth) - 1) // 2]
    holder = {s.labels["metric"]: s.value for s in scraped["trainmon_rank_holding_max"] if s.labels["run"] == "run1"}
    assert holder["trainmon_step_time_seconds"] == 417
    # The hottest GPU is the max series, with the node and GPU an operator must go to.
    temps = [s for s in scraped["trainmon_gpu_temperature_celsius"] if s.labels["run"] == "run1"]
    hottest = max(temps, key=lambda s: s.value)
    assert hottest.labels["rank"] == "max"
    rank = int(holder["trainmon_gpu_temperature_celsius"])
    assert hottest.labels["node"] == live.runs["run1"].ranks[rank].host
    assert hottest.labels["gpu"] == str(rank % GPUS_PER_NODE)
    # used / total divides one rank's pair: the installed memory follows the ranks chosen for memory in use.
    used = {s.labels["rank"]: s for s in scraped["trainmon_host_memory_used_bytes"] if s.labels["run"] == "run1"}
    total = {s.labels["rank"]: s for s in scraped["trainmon_host_memory_total_bytes"] if s.labels["run"] == "run1"}
    assert set(used) == set(total) == {"min", "median", "max"}
    assert all(used[k].labels["node"] == total[k].labels["node"] for k in used)
    # Counters are summed, so rates over ranks add up as before.
    (tokens,) = [s for s in scraped["trainmon_tokens"] if s.labels["run"] == "run1"]
    assert tokens.labels["rank"] == "all" and tokens.value == RANKS * 3 * 4096
    # Phases are aggregated phase by phase.
    phases = {
        (s.labels["phase"], s.labels["rank"]) for s in scraped["trainmon_phase_seconds"] if s.labels["run"] == "run1"
    }
    assert ("comm", "max") in phases and len(phases) == 5 * 3


def test_a_rank_named_by_an_open_finding_keeps_its_own_series(fleet: tuple[LiveState, OpenFindings]) -> None:
    live, findings = fleet
    scraped = _scrape(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    ranks = {s.labels["rank"] for s in scraped["trainmon_step_time_seconds"] if s.labels["run"] == "run0"}
    assert ranks == {"min", "median", "max", "417"}
    (ranks_reporting,) = [s for s in scraped["trainmon_run_ranks_reporting"] if s.labels["run"] == "run0"]
    assert ranks_reporting.value == RANKS


def test_a_run_within_the_rank_limit_keeps_a_series_per_rank() -> None:
    live, findings = _fleet(8, 1)
    scraped = _scrape(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    assert {s.labels["rank"] for s in scraped["trainmon_loss"]} == {str(r) for r in range(8)}
    assert not scraped["trainmon_rank_holding_max"]


def test_the_global_cap_leaves_whole_runs_out_and_says_how_many_series(
    fleet: tuple[LiveState, OpenFindings],
) -> None:
    live, findings = fleet
    full = _scrape(TrainingCollector(live, clock=lambda: 1010.0, findings=findings))
    per_run = full["trainmon_exporter_series"][0].value / RUNS  # about the same for each run
    capped = TrainingCollector(
        live, clock=lambda: 1010.0, findings=findings, limits=SeriesLimits(max_series=int(2.5 * per_run))
    )
    scraped = _scrape(capped)
    runs = {s.labels["run"] for s in scraped["trainmon_run_running"]}
    assert len(runs) == 2
    for name, samples in scraped.items():  # no run in halves: every series of a kept run, none of the others
        if name.startswith("trainmon_exporter"):
            continue
        assert {s.labels["run"] for s in samples} <= runs, name
    exported = scraped["trainmon_exporter_series"][0].value
    assert exported <= 2.5 * per_run
    assert scraped["trainmon_exporter_series_left_out"][0].value == full["trainmon_exporter_series"][0].value - exported


def test_the_collector_takes_its_series_limits_from_the_config(tmp_path) -> None:
    """``[series]`` in the config reaches the exporter the collector serves: three ranks past a
    ``rank_detail`` of 2 are exported as aggregates, within it one series per rank."""
    from tests.conftest import start_collector
    from tests.events import batch, event, step_events

    def scrape(rank_detail: int) -> set[str]:
        lc = start_collector(tmp_path / f"db{rank_detail}.sqlite", series=SeriesLimits(rank_detail=rank_detail))
        try:
            events = []
            for rank in range(3):
                events.append(event("run_start", {"world_size": 3}, run="w", rank=rank, stream=f"s{rank}", seq=0))
                events += step_events(3, run="w", rank=rank, stream=f"s{rank}")
            assert lc.post(batch(events))[0] == 200
            status, body = lc.get("/metrics")
            assert status == 200
            return {
                s.labels["rank"]
                for f in text_string_to_metric_families(body.decode())
                if f.name == "trainmon_loss"
                for s in f.samples
                if s.labels.get("run") == "w"
            }
        finally:
            lc.stop()

    assert scrape(2) == {"min", "median", "max"}
    assert scrape(64) == {"0", "1", "2"}
