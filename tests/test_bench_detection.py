"""bench/detection.py's diagnosis check: a detection that names the wrong cause is not a right diagnosis."""

from __future__ import annotations

import importlib.util
import sys
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
