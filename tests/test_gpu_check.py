"""bench/gpu_check.sh: its --cpu dry run passes where CUDA is absent, and its checks fail on what they exist for.

The device machine is lent to a session rarely and for minutes, so the script must be right before it runs
there: the dry run takes every step the device run takes (the trainer side imported from the source tree with
the daemon's packages blocked, the trainer's JSONL and post-mortem findings, both overhead runs, NVML, the
checksums), and the checks themselves are tested here on the values a broken path would produce.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


probe = _load("bench_gpu_check_probe", ROOT / "bench" / "gpu_check_probe.py")
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _headline(stdout: str) -> dict[str, str]:
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("gpu_check "), line
    return dict(pair.split("=", 1) for pair in line.split()[1:])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_cpu_dry_run_passes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    head = _headline(proc.stdout)
    assert head["ok"] == "1" and head["failed"] == "none" and head["mode"] == "cpu"
    # the CUDA tests ran and skipped, and the headline says so rather than counting them as passed
    assert head["tests_passed"] == "0" and int(head["tests_skipped"]) >= 2 and head["tests_failed"] == "0"
    tests_log = (tmp_path / "tests.log").read_text()
    assert "needs a CUDA GPU" in tests_log and "test_gpu_check" not in tests_log  # the CUDA tests, not this one
    assert head["trainer_ok"] == "1" and head["findings_ok"] == "1"  # the daemon side imports here: checked
    assert head["lost_events"] == "0" and head["sync_errors"] == "skipped_no_cuda"
    assert float(head["overhead_pct"]) > 0 and float(head["overhead_sync_debug_pct"]) > 0
    assert head["checksum_device"] == "cpu" and head["checksum_bitwise"] == "1" and head["replicas_agree"] == "1"
    assert head["nvml_ok"] in ("skipped", "1")
    assert (tmp_path / "headline.txt").read_text().strip() == proc.stdout.strip().splitlines()[-1]
    assert "daemon packages out of reach" in (tmp_path / "env.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_device_mode_without_cuda_fails_and_points_to_the_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1 and "--cpu" in proc.stderr
    assert _headline(proc.stdout) == {"ok": "0", "mode": "gpu", "failed": "no_cuda"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "--out" in proc.stderr


# -- nvml: units and plausibility ------------------------------------------------------------------------------

H100 = {
    "index": 0,
    "uuid": "GPU-8f6c1e1a-0000-0000-0000-000000000000",
    "temperature_c": 34,
    "utilization_ratio": 0.0,
    "mem_used_bytes": 1 << 29,
    "mem_total_bytes": 85520809984,
    "power_w": 71.3,
    "sm_clock_hz": 1_980_000_000,
    "throttle_reasons": 0x1,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
}
LIMITS = {"slowdown_c": 90, "power_limit_w": 700.0, "max_sm_clock_hz": 1.98e9, "torch_total_bytes": 84_929_609_728}


def test_a_plausible_sample_passes() -> None:
    assert probe.nvml_problems(H100, LIMITS) == []


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("power_w", 71300, "power_w"),  # NVML's milliwatts passed through
        ("temperature_c", 34000, "temperature_c"),
        ("sm_clock_hz", 1980, "sm_clock_hz"),  # NVML's MHz passed through
        ("utilization_ratio", 45, "utilization_ratio"),  # a percentage, not a ratio
        ("mem_used_bytes", 90_000_000_000, "mem_used_bytes"),
        ("ecc_uncorrected", None, "ecc_uncorrected missing"),
        ("throttle_reasons", -1, "throttle_reasons"),
        ("uuid", "8f6c1e1a", "uuid"),
    ],
)
def test_a_wrong_unit_or_a_missing_field_is_named(field: str, value: Any, says: str) -> None:
    problems = probe.nvml_problems({**H100, field: value}, LIMITS)
    assert any(says in p for p in problems), problems


def test_values_beyond_the_drivers_own_limits_are_named() -> None:
    hot = probe.nvml_problems({**H100, "temperature_c": 95, "sm_clock_hz": 2.5e9}, LIMITS)
    assert any("slowdown_c" in p for p in hot) and any("max_sm_clock_hz" in p for p in hot)
    assert any("total_memory" in p for p in probe.nvml_problems(H100, {**LIMITS, "torch_total_bytes": 40 << 30}))


# -- the trainer's JSONL -----------------------------------------------------------------------------------------


def _run(nan_at: int | None = 6, steps: int = 10, cuda: bool = True) -> list[dict[str, Any]]:
    start = {"planned_steps": steps, "device": "cuda:0" if cuda else "cpu", "config": {"precision": "bf16"}}
    start["config"]["checksum_every"] = 5
    events = [{"kind": "run_start", "fields": start}]
    for i in range(steps):
        f = {
            "step": i,
            "step_time": 0.02,
            "loss": "NaN" if nan_at is not None and i >= nan_at else 3.0 - 0.1 * i,
            "phases": {"data": 0.001, "forward": 0.005, "backward": 0.01, "optimizer": 0.002},
            "mem_allocated_bytes": 1 << 30,
            "mem_peak_bytes": 1 << 31,
        }
        if i % 5 == 0:
            f["weights_checksum"] = [1.0, 2.0, 3.0, 0.0]
        events.append({"kind": "step", "fields": f})
    events.append({"kind": "health", "fields": {"gpus": [H100]}})
    events.append({"kind": "run_end", "fields": {"status": "finished", "step": steps - 1, "dropped_events": 0}})
    return events


NAN_LABEL = [{"kind": "nan", "first_step": 6, "last_step": 9}]


def test_a_complete_cuda_run_passes() -> None:
    problems, figures = probe.events_problems(_run(), NAN_LABEL, cuda=True)
    assert problems == [] and figures["trainer_steps"] == 10 and figures["trainer_health_gpus"] == 1


def test_what_a_broken_path_leaves_in_the_jsonl_is_named() -> None:
    def problems(events: list[dict[str, Any]], cuda: bool = True) -> str:
        return "; ".join(probe.events_problems(events, NAN_LABEL, cuda=cuda)[0])

    early = _run(nan_at=5)  # a read-back that gave a step another step's loss
    assert "losses finite/NaN at the wrong steps: [5]" in problems(early)
    lost = _run()
    del lost[4]  # step 3 never arrived
    assert "steps logged 9 of 10" in problems(lost)
    untimed = _run()
    untimed[3]["fields"]["phases"] = {"data": 0.02}  # no CUDA-event phases at step 2
    assert "no forward/backward/optimizer time at steps [2]" in problems(untimed)
    assert "trained on cpu" in problems(_run(cuda=False))  # a device run that fell back to the CPU
    fp32 = _run()
    fp32[0]["fields"]["config"]["precision"] = "fp32"
    assert "not bf16" in problems(fp32)


# -- the findings, on the CPU side ---------------------------------------------------------------------------------

LABELS = [
    {
        "kind": "data_stall",
        "spec": "data_stall@50",
        "first_step": 50,
        "last_step": 52,
        "expected_detection": "throughput_collapse",
    },
    {
        "kind": "loss_spike",
        "spec": "loss_spike@100",
        "first_step": 100,
        "last_step": 100,
        "expected_detection": "loss_spike",
    },
    {"kind": "nan", "spec": "nan@140", "first_step": 140, "last_step": 159, "expected_detection": "nan_inf"},
]
FOUND = [
    {"kind": "throughput_collapse", "severity": "info", "first_step": 51, "message": "throughput down"},
    {"kind": "loss_spike", "severity": "warning", "first_step": 100, "message": "loss spike"},
    {"kind": "grad_explosion", "severity": "warning", "first_step": 100, "message": "grad norm"},  # related
    {"kind": "nan_inf", "severity": "critical", "first_step": 140, "message": "loss nan"},
]


def test_every_fault_found_at_its_step_passes() -> None:
    assert probe.findings_problems({"anomalies": FOUND}, LABELS) == ([], [])


def test_a_missed_or_late_fault_and_an_unrelated_warning_fail() -> None:
    late = [a if a["kind"] != "nan_inf" else {**a, "first_step": 175} for a in FOUND]
    missed, _ = probe.findings_problems({"anomalies": late}, LABELS)
    assert missed == ["nan@140 (nan_inf from step 140)"]
    noisy = [*FOUND, {"kind": "memory_leak", "severity": "warning", "first_step": 20, "message": "rss grows"}]
    quiet = [*FOUND, {"kind": "memory_leak", "severity": "info", "first_step": 20, "message": "rss grows"}]
    assert probe.findings_problems({"anomalies": noisy}, LABELS)[1][0].startswith("memory_leak warning at step 20")
    assert probe.findings_problems({"anomalies": quiet}, LABELS) == ([], [])


# -- checksums and the sync count --------------------------------------------------------------------------------


def test_checksum_report_on_cpu_agrees_and_sees_one_ulp() -> None:
    r = probe.checksum_report("cpu", steps=1)
    assert r["bitwise"] and r["replicas_agree"] and r["stable"] and r["ulp_detected"]


def test_sync_watch_counts_torchs_sync_warnings_by_call_site() -> None:
    hook_overhead = _load("bench_hook_overhead", ROOT / "bench" / "hook_overhead.py")
    watch = hook_overhead.SyncWatch()
    watch.start()
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    warnings.warn("something else", UserWarning, stacklevel=1)
    watch.stop()
    assert list(watch.sites.values()) == [1] and next(iter(watch.sites)).startswith("test_gpu_check.py:")


def test_syncs_torch_makes_in_the_baseline_too_are_not_trainmons() -> None:
    hook_overhead = _load("bench_hook_overhead", ROOT / "bench" / "hook_overhead.py")

    def variant(steps: int, **sites: int) -> Any:
        v = SimpleNamespace(steps_run=steps, syncs=hook_overhead.SyncWatch())
        v.syncs.sites.update({k.replace("_", ".") + ":1": n for k, n in sites.items()})
        return v

    base = variant(10, hook_overhead_py=10)  # an op of torch's syncs once per step, in every variant
    assert hook_overhead.trainmon_syncs(variant(20, hook_overhead_py=20), base) == 0
    assert hook_overhead.trainmon_syncs(variant(20, hook_overhead_py=23), base) == 3  # 3 more at the same site
    assert hook_overhead.trainmon_syncs(variant(20, hook_overhead_py=20, train_monitor_py=2), base) == 2
