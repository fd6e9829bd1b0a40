"""node_health: synthetic NVML/psutil samples, and real psutil-only samples that must stay silent."""

from __future__ import annotations

import pytest

from tests.trainer_helpers import TINY, of_kind, read_events, run_trainer
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors.node_health import NodeHealth, NodeHealthConfig, decode_throttle
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

GIB = 1 << 30


def gpu(**over) -> dict:
    """An H100 under load: realistic NVML values (SW power cap set, as it usually is under load)."""
    g = {
        "index": 0,
        "uuid": "GPU-8f6c1f1e-0000-0000-0000-000000000000",
        "temperature_c": 68,
        "utilization_ratio": 0.97,
        "mem_used_bytes": 71 * GIB,
        "mem_total_bytes": 80 * GIB,
        "power_w": 690.0,
        "sm_clock_hz": 1_980_000_000,
        "throttle_reasons": 0x4,
        "ecc_corrected": 0,
        "ecc_uncorrected": 0,
    }
    g.update(over)
    return g


def sample(gpus=None, **over) -> dict:
    f = {
        "cpu_percent": 101.0,
        "rss_bytes": 24 * GIB,
        "host_mem_used_bytes": 300 * GIB,
        "host_mem_total_bytes": 2048 * GIB,
    }
    if gpus is not None:
        f["gpus"] = gpus
    f.update(over)
    return f


def feed(samples: list[dict], config: NodeHealthConfig | None = None):
    det = NodeHealth(config or NodeHealthConfig())
    out = []
    for i, fields in enumerate(samples):
        t = 1e9 + 10 * i
        out += det.observe(Event("step", "r", 0, "node7", "s", 2 * i, t, {"step": 100 + i}), 0)
        out += det.observe(Event("health", "r", 0, "node7", "s", 2 * i + 1, t + 1, fields), 0)
    return out


def test_decode_throttle_names_nvml_bits() -> None:
    assert decode_throttle(0x4 | 0x40 | 0x80) == ["sw_power_cap", "hw_thermal_slowdown", "hw_power_brake_slowdown"]
    assert decode_throttle(0) == []


def test_uncorrected_ecc_pages_at_once() -> None:
    out = feed([sample([gpu()])] * 5 + [sample([gpu(ecc_uncorrected=2)])] + [sample([gpu(ecc_uncorrected=2)])] * 3)
    assert len(out) == 1
    f = out[0]
    assert f.severity == "critical" and f.step == 105 and "uncorrected ECC" in f.message
    assert "drain the node" in f.hint and f.evidence["ecc_uncorrected:0"]["ecc_uncorrected"] == 2


def test_rising_corrected_ecc_warns() -> None:
    out = feed([sample([gpu(ecc_corrected=3 * i)]) for i in range(10)])
    assert out and out[0].severity == "warning" and "corrected ECC" in out[0].message
    assert "row remaps" in out[0].hint
    assert feed([sample([gpu(ecc_corrected=7)]) for _ in range(20)]) == []  # an old, flat count


@pytest.mark.parametrize(
    ("mask", "severity", "name"),
    [
        (0x4 | 0x20, "warning", "sw_thermal_slowdown"),
        (0x40, "critical", "hw_thermal_slowdown"),
        (0x80, "critical", "hw_power_brake_slowdown"),
    ],
)
def test_throttle_reasons_that_matter(mask: int, severity: str, name: str) -> None:
    out = feed([sample([gpu()])] * 3 + [sample([gpu(throttle_reasons=mask, sm_clock_hz=1_200_000_000)])] * 4)
    assert out[0].step == 104 and out[0].severity == severity  # two samples in a row
    assert name in out[0].message and "cooling" in out[0].hint


def test_hot_gpu_then_resolves() -> None:
    out = feed([sample([gpu()])] * 3 + [sample([gpu(temperature_c=88)])] * 5 + [sample([gpu()])] * 5)
    assert [(f.severity, f.resolved) for f in out] == [("warning", False), ("info", True)]
    assert "88 C" in out[0].message and "airflow" in out[0].hint
    out = feed([sample([gpu(temperature_c=95)])] * 3)
    assert out[0].severity == "critical"


def test_one_hot_reading_is_noise() -> None:
    assert feed([sample([gpu()]), sample([gpu(temperature_c=90)]), sample([gpu()])] * 4) == []


def test_memory_pressure() -> None:
    full = sample([gpu(mem_used_bytes=int(79.6 * GIB))])
    out = feed([full] * 3)
    assert "GPU 0: memory" in out[0].message and "out-of-memory" in out[0].hint
    host = sample(host_mem_used_bytes=int(0.97 * 2048 * GIB))
    out = feed([host] * 3)
    assert out[0].severity == "warning" and "host memory 97" in out[0].message and "OOM killer" in out[0].hint
    rss = sample(
        rss_bytes=int(0.93 * 64 * GIB), host_mem_used_bytes=int(0.99 * 64 * GIB), host_mem_total_bytes=64 * GIB
    )
    out = feed([rss] * 3)
    assert out[0].severity == "critical" and "RSS" in out[0].message


def test_escalation_updates_but_same_conditions_do_not_repeat() -> None:
    samples = [sample([gpu(temperature_c=87)])] * 4 + [sample([gpu(temperature_c=87, ecc_uncorrected=1)])] * 4
    out = feed(samples)
    assert [f.severity for f in out] == ["warning", "critical"]


@pytest.mark.parametrize("seed", range(3))
def test_healthy_nodes_are_silent(seed: int) -> None:
    import random

    rng = random.Random(seed)
    samples = [
        sample(
            [
                gpu(
                    index=i,
                    temperature_c=rng.uniform(55, 82),
                    throttle_reasons=rng.choice([0, 0x1, 0x4, 0x4 | 0x1]),
                    mem_used_bytes=int(rng.uniform(0.5, 0.97) * 80 * GIB),
                )
                for i in range(8)
            ],
            host_mem_used_bytes=int(rng.uniform(0.2, 0.9) * 2048 * GIB),
        )
        for _ in range(50)
    ]
    assert feed(samples) == []
    assert feed([sample() for _ in range(20)]) == []  # psutil only, no NVML


def test_reference_trainer_psutil_samples_stay_silent(tmp_path) -> None:
    run_trainer(
        tmp_path,
        *TINY,
        "--threads",
        "1",
        "--health-interval",
        "0.05",  # a few samples even when the 60 tiny steps take 0.4 s on a quiet machine
        "--inject",
        "memory_leak@10:mb=4",
        steps=60,
        run="nh",
    )
    storage = Storage("sqlite://")
    import_file(tmp_path / "events.jsonl", storage)
    assert len(of_kind(read_events(tmp_path / "events.jsonl"), "health")) >= 3
    assert [a for a in summarize(storage, "nh")["anomalies"] if a["kind"] == "node_health"] == []
