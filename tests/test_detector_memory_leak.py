"""memory_leak: synthetic device/RSS traces with leaks and benign growth, then the reference trainer."""

from __future__ import annotations

import random

import pytest
from trainer_helpers import TINY, read_labels, run_trainer

from trainmon.hooks.wire import Event
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.config import MemoryLeakConfig
from trainmon.monitor.detectors.memory_leak import MemoryLeak, theil_sen
from trainmon.monitor.store.storage import Storage

MIB = 1 << 20
GIB = 1 << 30


def gpu_trace(steps: int = 2000, *, seed: int = 0, leak=None, jumps=(), noise: float = 0.02, step_s: float = 0.5):
    """A GPU rank: allocator fills over 5 steps to 40 GiB, then flat with noise; health every 20 steps."""
    rng = random.Random(seed)
    t = 1e9
    out = [Event("run_start", "r", 0, "h", "s", 0, t, {"device": "cuda:0", "world_size": 1})]
    for s in range(steps):
        t += step_s
        mem = 40 * GIB * min(1.0, (s + 1) / 5) * (1 + noise * rng.uniform(-1, 1))
        mem += sum(size for at, size in jumps if s >= at)
        if leak:
            mem += leak(s)
        out.append(Event("step", "r", 0, "h", "s", s, t, {"step": s, "mem_allocated_bytes": int(mem)}))
        if s % 20 == 0:
            gpus = [{"index": 0, "mem_total_bytes": 80 * GIB, "mem_used_bytes": int(mem)}]
            fields = {"rss_bytes": 20 * GIB, "host_mem_used_bytes": 200 * GIB, "host_mem_total_bytes": 1024 * GIB}
            out.append(Event("health", "r", 0, "h", "s", s, t, {**fields, "gpus": gpus}))
    return out


def run(events, config: MemoryLeakConfig | None = None):
    det = MemoryLeak(config or MemoryLeakConfig())
    return [f for e in events for f in det.observe(e, 0)]


def test_theil_sen_ignores_outliers() -> None:
    pts = [(float(x), 2.0 * x + (1000.0 if x in (3, 7) else 0.0)) for x in range(30)]
    assert theil_sen(pts) == pytest.approx(2.0)


@pytest.mark.parametrize(("mib_per_step", "severity"), [(8, "warning"), (60, "critical")])
def test_device_leak_fires_with_projection(mib_per_step: float, severity: str) -> None:
    found = run(gpu_trace(leak=lambda s: max(0, s - 300) * mib_per_step * MIB))
    first = found[0]
    assert 300 < first.step < 1000 and not first.resolved
    assert "device memory" in first.message and "reaches 90% of memory" in first.message
    assert "detach" in first.hint
    assert first.evidence["bytes_per_step"] == pytest.approx(mib_per_step * MIB, rel=0.3)
    assert severity in {f.severity for f in found}


def test_leak_that_stops_resolves() -> None:
    found = run(gpu_trace(steps=3000, leak=lambda s: min(max(0, s - 100), 600) * 20 * MIB))
    assert [f.resolved for f in found][:1] == [False] and found[-1].resolved


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("noise", [0.0, 0.02, 0.05])
def test_benign_memory_is_silent(seed: int, noise: float) -> None:
    assert run(gpu_trace(seed=seed, noise=noise)) == []
    # one step-like increase (an eval buffer, a bigger batch): flat again afterwards
    assert run(gpu_trace(seed=seed, noise=noise, jumps=[(700, 6 * GIB)])) == []
    # two separate increases are not a trend either
    assert run(gpu_trace(seed=seed, noise=noise, jumps=[(500, 3 * GIB), (1200, 3 * GIB)])) == []


def test_slow_growth_far_from_the_limit_is_silent() -> None:
    # +1 GiB over 2000 steps of 0.5 s on an 80 GiB GPU: ~38 h to the limit
    assert run(gpu_trace(leak=lambda s: s * (GIB // 2000))) == []


def test_host_rss_from_health_events_when_steps_carry_no_memory() -> None:
    t = 1e9
    det = MemoryLeak(MemoryLeakConfig())
    found = det.observe(Event("run_start", "r", 0, "h", "s", 0, t, {"device": "cpu"}), 0)
    for s in range(400):
        t += 0.2
        found += det.observe(Event("step", "r", 0, "h", "s", s, t, {"step": s}), 0)
        if s % 5 == 0:
            rss = 2 * GIB + max(0, s - 50) * 30 * MIB
            fields = {"rss_bytes": rss, "host_mem_used_bytes": rss + 4 * GIB, "host_mem_total_bytes": 64 * GIB}
            found += det.observe(Event("health", "r", 0, "h", "s", s, t, fields), 0)
    assert found and found[0].evidence["series"] == "process RSS" and 50 < found[0].step < 400


def test_unknown_memory_size_needs_big_growth() -> None:
    events = [e for e in gpu_trace(leak=lambda s: max(0, s - 300) * 30 * MIB) if e.kind != "health"]
    found = run(events)
    assert found and found[0].evidence["hours_to_limit"] == "inf" and found[0].evidence["growth_fraction"] >= 0.5


# -- the reference trainer (CPU: step memory is the process RSS) -----------------------------------------


def _anomalies(out, run_id: str) -> list[dict]:
    storage = Storage("sqlite://")
    import_file(out / "events.jsonl", storage)
    return [a for a in summarize(storage, run_id)["anomalies"] if a["kind"] == "memory_leak"]


def test_reference_trainer_leak_and_clean(tmp_path) -> None:
    fault, clean = tmp_path / "fault", tmp_path / "clean"
    run_trainer(
        fault,
        *TINY,
        "--threads",
        "1",
        "--health-interval",
        "0.5",
        "--inject",
        "memory_leak@20:mb=8",
        steps=80,
        run="ml",
    )
    (label,) = read_labels(fault)
    found = _anomalies(fault, "ml")
    assert found and label["first_step"] <= found[0]["first_step"] <= label["last_step"], found
    run_trainer(
        clean,
        *TINY,
        "--threads",
        "1",
        "--health-interval",
        "0.5",
        "--eval-every",
        "20",
        "--checkpoint-every",
        "25",
        steps=100,
        run="mc",
    )
    assert _anomalies(clean, "mc") == []
