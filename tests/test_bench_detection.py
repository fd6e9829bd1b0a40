"""bench/detection.py's diagnosis check: a detection that names the wrong cause is not a right diagnosis."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


detection = _load("bench_detection", ROOT / "bench" / "detection.py")

# Texts as the detectors write them (loss_spike's LR and batch causes, straggler's GPU advice).
LR_HINT = (
    "Not recoverable on its own: roll back to the checkpoint before step 80 with the LR fixed. Cause: the LR of "
    "param group 0 jumped 97x (0.00112 -> 0.109) at step 80, just before the spike: the step size, not the batch, "
    "is the likely cause"
)
BATCH_HINT = "The grad norm did not rise first: most likely the data of this batch; inspect the batch of step 80."
GPU_HINT = (
    "Rank 1 (host vm) is a straggler and every other rank waits for it in the all-reduce. Check that node: GPU "
    "clocks, temperature and throttle reasons (node_health, nvidia-smi -q -d PERFORMANCE)."
)


def _label(kind: str, expected: str, first: int, last: int, rank: int | None = 0) -> dict[str, Any]:
    return {"kind": kind, "rank": rank, "first_step": first, "last_step": last, "expected_detection": expected}


def _anomaly(kind: str, step: int, hint: str, evidence: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    message = f"rank {rank} {kind} at step {step}"
    return {"kind": kind, "rank": rank, "first_step": step, "message": message, "hint": hint, "evidence": evidence}


def test_every_fault_kind_states_its_diagnosis() -> None:
    from trainmon.reference_trainer.faults import CATALOG

    synthetic = {lab["kind"] for trace in detection.fault_traces(1) for lab in trace.labels}
    assert set(CATALOG) | synthetic <= set(detection.DIAGNOSIS)


def test_an_lr_jump_blamed_on_the_batch_is_detected_but_misdiagnosed() -> None:
    label = _label("lr_burst", "loss_spike", 80, 81)
    right = detection.Result(
        "right", [label], [_anomaly("loss_spike", 81, LR_HINT, {"lr_jump": [0, 0.00112, 0.109, 80]})], False
    )
    wrong = detection.Result("wrong", [label], [_anomaly("loss_spike", 81, BATCH_HINT, {})], False)
    scores, clean_alerts, misses, by_fault = detection.score([right, wrong])
    spike = scores["loss_spike"]
    assert (spike.tp, spike.diagnosed, spike.diagnosis_ok) == (2, 2, 1)
    assert by_fault["lr_burst"] == [1, 2]
    assert clean_alerts == 0 and len(misses) == 1 and misses[0].startswith("wrong: lr_burst@80 misdiagnosed")


def test_gpu_advice_is_a_wrong_diagnosis_only_on_a_cpu_run() -> None:
    label = _label("straggler", "straggler", 20, 59, rank=1)
    finding = _anomaly("straggler", 31, GPU_HINT, {"rank": 1}, rank=1)
    cpu = detection.Result("cpu", [label], [finding], False, source="trainer", device="cpu")
    unknown = detection.Result("unknown", [label], [finding], False)  # a log that does not name its device
    scores, _, _, by_fault = detection.score([cpu, unknown])
    assert (scores["straggler"].tp, scores["straggler"].diagnosis_ok) == (2, 1)
    assert by_fault["straggler"] == [1, 2]


def test_a_nan_from_the_first_step_must_be_blamed_on_the_setup() -> None:
    label = _label("nan", "nan_inf", 0, 29)
    setup = _anomaly("nan_inf", 0, "it is the setup or the initialisation", {"cause": "setup"})
    batch = _anomaly("nan_inf", 0, "No build-up preceded it: suspect the batch at step 0", {"cause": "sudden"})
    scores, _, _, _ = detection.score(
        [detection.Result(n, [label], [a], False) for n, a in (("s", setup), ("b", batch))]
    )
    assert (scores["nan_inf"].diagnosed, scores["nan_inf"].diagnosis_ok) == (2, 1)


def test_the_hang_scenario_outlasts_its_lowered_timeout_floor() -> None:
    (spec,) = [s for s, _ in detection.DDP_FAULTS if s.startswith("hang@")]
    seconds = float(spec.split("seconds=")[1])
    assert detection.HANG_CONFIG.detectors.hang.min_timeout < seconds
    assert detection.HangConfig().min_timeout > seconds  # the defaults stay honest: a live pause is not a hang


class _Probe(detection.HostProbe):
    """A host probe with given samples: (wall time, seconds of its fixed work)."""

    def __init__(self, rows: list[tuple[float, float]]) -> None:
        self._rows = rows

    def samples(self) -> list[tuple[float, float]]:
        return self._rows


def test_a_slowdown_of_the_host_itself_is_the_environment_not_a_false_alarm() -> None:
    """At load 3-4.5 the quick run fell to min_f1 0.79 and 0.92: real host slowdowns ("every phase slowed
    together") counted as false throughput alarms. Confirmed by the trainer's clock (its steps were slow)
    and by the independent probe (the host ran slow then), it is the environment; at a time the probe ran
    at its normal pace, the same finding stays a false alarm."""
    clock = {s: (1000.0 + 0.1 * s + (2.0 if s >= 50 else 0.0), 0.1 if not 40 <= s < 50 else 0.3) for s in range(120)}
    finding = {"kind": "throughput_collapse", "rank": 0, "first_step": 40, "last_step": 49, "message": "m",
               "hint": "h", "evidence": {"cause": "host"}}  # fmt: skip
    clean = detection.Result("t-clean-0", [], [finding], True, source="trainer", device="cpu", clock=clock)
    busy = _Probe([(1000.0 + 0.05 * i, 0.004 if 1004.0 <= 1000.0 + 0.05 * i <= 1005.1 else 0.001) for i in range(300)])
    calm = _Probe([(1000.0 + 0.05 * i, 0.001) for i in range(300)])
    env: list[str] = []
    _, clean_alerts, _, _ = detection.score([clean], busy, env)
    assert clean_alerts == 0 and len(env) == 1 and "the host was slow" in env[0]
    _, clean_alerts, misses, _ = detection.score([clean], calm, [])
    assert clean_alerts == 1 and "false alarm throughput_collapse" in misses[0]
    # a stall of one phase is never the environment, however busy the host
    data = {**finding, "evidence": {"cause": "data"}}
    _, clean_alerts, _, _ = detection.score([detection.Result("c", [], [data], True, device="cpu", clock=clock)], busy)
    assert clean_alerts == 1


def test_the_host_probe_measures_while_the_trainers_run(tmp_path) -> None:
    with detection.HostProbe(tmp_path / "probe.txt") as probe:
        deadline = time.monotonic() + 20
        while len(probe.samples()) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
            probe._samples = None  # read again while it runs
    rows = probe.samples()
    assert len(rows) >= 5 and all(d > 0 for _, d in rows)
    assert probe.slowdown(rows[0][0], rows[-1][0]) is None  # fewer than 20 samples: nothing to compare with


def test_steps_that_waited_for_a_core_are_the_environment_by_the_trainers_own_cpu_clock() -> None:
    """Under a steady load the host's runnable count does not change, yet the trainer is descheduled in
    stretches: its CPU seconds per wall second fall while its steps are slow. That is the environment; a
    slowdown at the trainer's usual CPU rate (it was working, just slower) is not."""
    clock = {s: (1000.0 + 0.1 * s + (2.0 if s >= 50 else 0.0), 0.1 if not 40 <= s < 50 else 0.3) for s in range(120)}
    finding = {"kind": "throughput_collapse", "rank": 0, "first_step": 40, "last_step": 49, "message": "m",
               "hint": "h", "evidence": {"cause": "compute"}}  # fmt: skip
    times = [1000.0 + 0.02 * i for i in range(700)]
    cpu, used = [], 0.0  # CPU seconds: a full core, a third of one while the slow steps ran
    for t in times:
        used += 0.02 * (0.3 if 1003.7 <= t <= 1005.0 else 1.0)
        cpu.append((t, used))
    res = detection.Result("t-clean-0", [], [finding], True, source="trainer", device="cpu", clock=clock, cpu=cpu)
    env: list[str] = []
    assert detection.score([res], None, env)[1] == 0 and len(env) == 1
    working = [(t, 0.02 * i) for i, t in enumerate(times)]
    busy = detection.Result("t-clean-1", [], [finding], True, source="trainer", device="cpu", clock=clock, cpu=working)
    assert detection.score([busy], None, [])[1] == 1
