"""Anomaly lifecycle across collector restarts: nothing lost, nothing raised twice."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import start_collector
from tests.events import batch, event, step_events


def _steps(lo: int, hi: int, nan_at: set[int] = frozenset(), stream: str = "s0") -> list[dict]:
    evs = step_events(hi, stream=stream, loss=lambda i: "NaN" if i in nan_at else 3.0)
    return evs[lo:hi]


def test_restart_keeps_the_open_anomaly_and_the_detector_state(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite"
    first = start_collector(db)
    first.post(batch([event("run_start", {"world_size": 1}, seq=0), *_steps(0, 36, nan_at={25})]))
    (opened,) = first.get_json("/v1/runs/r1/anomalies")
    assert (opened["status"], opened["first_step"]) == ("open", 25)
    first.stop()  # steps 26..35 are finite: the detector has counted 10 of the 20 it needs

    second = start_collector(db)
    try:
        second.post(batch(_steps(36, 46)))
        (same,) = second.get_json("/v1/runs/r1/anomalies")
        assert same["id"] == opened["id"]  # the same anomaly, not a new one
        assert same["status"] == "resolved"  # 20 finite steps counted across the restart: 26..45
        _, text = second.get("/metrics")  # counters survive the restart too
        exposition = text.decode()
        assert 'trainmon_anomalies_total{kind="nan_inf",run="r1",severity="critical"} 1.0' in exposition
        assert 'trainmon_anomalies_active{kind="nan_inf",run="r1",severity="critical"} 0.0' in exposition
    finally:
        second.stop()


def test_resolved_anomaly_is_not_raised_again_after_restart(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite"
    first = start_collector(db)
    first.post(batch([event("run_start", {"world_size": 1}, seq=0), *_steps(0, 40, nan_at={5})]))
    first.stop()
    second = start_collector(db)
    try:
        # the same batch again (a spool replay after the restart) and then new clean steps
        second.post(batch([event("run_start", {"world_size": 1}, seq=0), *_steps(0, 40, nan_at={5})]))
        second.post(batch(_steps(40, 60)))
        found = second.get_json("/v1/runs/r1/anomalies")
        assert [(a["kind"], a["first_step"], a["status"]) for a in found] == [("nan_inf", 5, "resolved")]
    finally:
        second.stop()


def test_a_new_fault_after_resolution_opens_a_new_anomaly(tmp_path: Path) -> None:
    lc = start_collector(tmp_path / "db.sqlite")
    try:
        lc.post(batch(_steps(0, 60, nan_at={5, 50})))
        found = lc.get_json("/v1/runs/r1/anomalies")
        assert [(a["first_step"], a["last_step"], a["status"]) for a in found] == [(5, 5, "resolved"), (50, 50, "open")]
    finally:
        lc.stop()


def test_active_gauge_follows_the_stored_severity(tmp_path: Path) -> None:
    """An anomaly opened as critical and resolved by a finding of another severity leaves 0 active."""
    from trainmon.monitor.collector.live import LiveState

    live = LiveState()
    live.anomaly("r", "throughput_collapse", "opened", "warning")
    live.anomaly("r", "throughput_collapse", "updated", "critical", "warning")  # escalated
    assert live.runs["r"].anomalies_active == {
        ("throughput_collapse", "warning"): 0,
        ("throughput_collapse", "critical"): 1,
    }
    live.anomaly("r", "throughput_collapse", "resolved", "critical", "critical")
    assert sum(live.runs["r"].anomalies_active.values()) == 0
    assert live.runs["r"].anomalies_total == {("throughput_collapse", "warning"): 1}
