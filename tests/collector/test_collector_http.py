"""The collector over real HTTP on loopback: ingest, rejection, idempotency, exposition."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from sqlalchemy import func, select

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.store.replay import step_fields
from trainmon.monitor.store.storage import runs, steps, streams


def _count(lc: LiveCollector, table) -> int:
    with lc.collector.storage.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def _run_start(**kw) -> dict:
    return event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 100}, seq=0, **kw)


def test_batch_is_stored_and_exported(live_collector: LiveCollector) -> None:
    status, body = live_collector.post(batch([_run_start(), *step_events(5)]))
    assert (status, body) == (200, {"accepted": 6, "duplicates": 0})
    with live_collector.collector.storage.connect() as conn:
        rows = conn.execute(select(steps).order_by(steps.c.step)).all()
    assert [r.step for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4].loss == pytest.approx(4.06) and rows[4].phase_forward == 0.02
    assert step_fields(rows[4])["lr"] == [1e-3]  # one param group: stored in the lr column alone
    _, text = live_collector.get("/metrics")
    exposition = text.decode()
    assert 'trainmon_step{rank="0",run="r1"} 4.0' in exposition
    assert 'trainmon_loss{rank="0",run="r1"} 4.06' in exposition
    assert 'trainmon_learning_rate{group="0",rank="0",run="r1"} 0.001' in exposition
    assert 'trainmon_phase_seconds{phase="forward",rank="0",run="r1"} 0.02' in exposition
    assert 'trainmon_tokens_total{rank="0",run="r1"} 2560.0' in exposition
    assert "trainmon_ingest_batches_total 1.0" in exposition
    assert live_collector.get_json("/v1/runs")[0] | {"created_at": 0, "updated_at": 0} == {
        "run": "r1",
        "status": "running",
        "created_at": 0,
        "updated_at": 0,
        "world_size": 1,
        "planned_steps": 100,
        "attempts": 1,
        "step": 4,
        "steps_done": 5,
        "loss": pytest.approx(4.06),
        "open_anomalies": 0,
    }


def test_replayed_batch_is_stored_once(live_collector: LiveCollector) -> None:
    body = batch([_run_start(), *step_events(10)])
    assert live_collector.post(body)[1] == {"accepted": 11, "duplicates": 0}
    assert live_collector.post(body)[1] == {"accepted": 0, "duplicates": 11}
    # a retry overlapping old and new events keeps the new ones
    overlap = batch(step_events(15)[8:])
    assert live_collector.post(overlap)[1] == {"accepted": 5, "duplicates": 2}
    assert _count(live_collector, steps) == 15


def test_new_stream_for_a_rank_is_a_new_attempt(live_collector: LiveCollector) -> None:
    live_collector.post(batch([_run_start(stream="first"), *step_events(5, stream="first")]))
    resumed = [_run_start(stream="second"), *step_events(8, stream="second")]
    assert live_collector.post(batch(resumed))[0] == 200
    with live_collector.collector.storage.connect() as conn:
        attempts = dict(conn.execute(select(streams.c.stream, streams.c.attempt)).all())
        per_attempt = dict(conn.execute(select(steps.c.attempt, func.count()).group_by(steps.c.attempt)).all())
    assert attempts == {"first": 0, "second": 1}
    assert per_attempt == {0: 5, 1: 8}  # steps 0..4 exist twice, once per attempt
    assert live_collector.get_json("/v1/runs")[0]["attempts"] == 2


def test_stream_reused_by_another_rank_is_a_conflict(live_collector: LiveCollector) -> None:
    live_collector.post(batch(step_events(2, rank=0)))
    status, body = live_collector.post(batch(step_events(2, rank=1, start_seq=3)))
    assert status == 409 and "belongs to run 'r1' rank 0" in body["error"]


@pytest.mark.parametrize(
    ("body", "status", "words", "field"),
    [
        (b"{not json", 400, "not valid JSON", None),
        (b"\xff\xfe", 400, "not valid JSON", None),
        (batch(step_events(2), version=7), 422, "unsupported version 7", "version"),
        (batch([event("step", {"loss": 1.0})]), 422, "missing required field", "events[0].fields.step"),
        (
            batch([*step_events(3), event("step", {"step": "x"}, seq=9)]),
            422,
            "expected an integer",
            "events[3].fields.step",
        ),
        (batch([event("step", {"step": 1}, run="../../etc/passwd")]), 422, "invalid run id", "events[0].run"),
    ],
)
def test_malformed_batches_get_4xx_naming_the_problem_and_store_nothing(
    live_collector: LiveCollector, body: bytes | dict, status: int, words: str, field: str | None
) -> None:
    got, detail = live_collector.post(body)
    assert got == status
    assert words in detail["error"]
    assert detail.get("field") == field
    assert _count(live_collector, steps) == 0 and _count(live_collector, runs) == 0
    _, text = live_collector.get("/metrics")
    reason = {400: "json", 422: "schema"}[status]
    assert f'trainmon_ingest_rejected_batches_total{{reason="{reason}"}} 1.0' in text.decode()


def test_oversized_body_is_refused(tmp_path) -> None:
    lc = start_collector(tmp_path / "db.sqlite", max_body_bytes=10_000)
    try:
        status, detail = lc.post(batch(step_events(200)))
        assert status == 413 and "exceeds the limit of 10000 bytes" in detail["error"]
        assert _count(lc, steps) == 0
    finally:
        lc.stop()


def test_nan_loss_is_data_and_raises_an_anomaly(live_collector: LiveCollector) -> None:
    events = step_events(30, loss=lambda i: "NaN" if i == 25 else 4.0)
    assert live_collector.post(batch([_run_start(), *events]))[0] == 200
    with live_collector.collector.storage.connect() as conn:
        loss = conn.execute(select(steps.c.loss).where(steps.c.step == 25)).scalar_one()
    assert loss != loss  # NaN survives the round trip through SQLite
    (anomaly,) = live_collector.get_json("/v1/runs/r1/anomalies")
    assert (anomaly["kind"], anomaly["first_step"], anomaly["severity"]) == ("nan_inf", 25, "critical")
    assert "suspect the batch" in anomaly["hint"]
    _, text = live_collector.get("/metrics")
    assert 'trainmon_anomalies_total{kind="nan_inf",run="r1",severity="critical"} 1.0' in text.decode()
    assert live_collector.get("/v1/runs/nope/anomalies")[0] == 404


def test_healthz_and_openapi(live_collector: LiveCollector) -> None:
    assert live_collector.get_json("/healthz") == {"status": "ok", "database": "sqlite"}
    spec = live_collector.get_json("/openapi.json")
    body = spec["paths"]["/v1/events"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["title"] == "trainmon event batch"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_exposition_passes_promtool(live_collector: LiveCollector) -> None:
    live_collector.post(batch([_run_start(), *step_events(5, loss=lambda i: "NaN" if i == 4 else 2.0)]))
    live_collector.post(b"nope")
    _, text = live_collector.get("/metrics")
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert proc.returncode == 0 and proc.stdout.strip() == b"" and proc.stderr.strip() == b"", proc


def test_expected_lr_mfu_node_health_and_producer_losses_are_exported(live_collector: LiveCollector) -> None:
    schedule = {"name": "cosine", "peak_lr": 1e-3, "total_steps": 100, "warmup_steps": 10}
    start = event(
        "run_start", {"world_size": 1, "schedule": schedule, "flops_per_token": 6e9, "peak_flops": 1e15}, seq=0
    )
    steps = step_events(5)
    del steps[2]  # seq 3 never arrives: the producer dropped it
    gpu = {
        "index": 0,
        "uuid": "GPU-1",
        "temperature_c": 83,
        "utilization_ratio": 0.97,
        "mem_used_bytes": 7e10,
        "mem_total_bytes": 8e10,
        "power_w": 690.5,
        "sm_clock_hz": 1.98e9,
        "throttle_reasons": 32,
        "ecc_corrected": 4,
        "ecc_uncorrected": 0,
    }
    health = event(
        "health",
        {
            "cpu_percent": 150.0,
            "rss_bytes": 2**33,
            "host_mem_used_bytes": 10**11,
            "host_mem_total_bytes": 2 * 10**11,
            "gpus": [gpu],
        },
        seq=6,
    )
    assert live_collector.post(batch([start, *steps, health]))[0] == 200
    text = live_collector.get("/metrics")[1].decode()
    assert 'trainmon_learning_rate_expected{group="0",rank="0",run="r1"} 0.0004' in text  # 4 of a 10-step warmup
    mfu = float(re.search(r'^trainmon_mfu_ratio\{rank="0",run="r1"\} (\S+)$', text, re.M).group(1))
    assert mfu == pytest.approx(512 / 0.05 * 6e9 / 1e15)  # tokens/s * FLOPs per token / peak FLOP/s
    assert 'trainmon_producer_missing_events_total{rank="0",run="r1"} 1.0' in text
    node = 'node="test-host",rank="0",run="r1"'
    assert f"trainmon_process_cpu_cores{{{node}}} 1.5" in text
    assert f'trainmon_gpu_temperature_celsius{{gpu="0",{node}}} 83.0' in text
    assert f'trainmon_gpu_throttle_reasons{{gpu="0",{node}}} 32.0' in text
    assert f'trainmon_gpu_ecc_errors_total{{gpu="0",{node},type="corrected"}} 4.0' in text
    if shutil.which("promtool"):
        proc = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True)
        assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc
