"""Every fault kind, run briefly: visible in the raw JSONL stream, ground truth in labels.json."""

from __future__ import annotations

import math
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.trainer_helpers import (
    TINY,
    attempts,
    of_kind,
    read_events,
    read_labels,
    run_trainer,
    step_fields,
)
from trainmon.fingerprint import compare_fingerprints
from trainmon.reference_trainer.config import TrainConfig
from trainmon.reference_trainer.data import MarkovSource
from trainmon.reference_trainer.faults import CATALOG, FaultError, FaultPlan, parse_fault
from trainmon.schedules import Schedule

LN_V = math.log(TrainConfig().vocab_size)
FLOOR = MarkovSource(64, 1337, 4).entropy_floor


class Run:
    """What one faulty run left behind, with shortcuts for the assertions."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.events = read_events(out / "events.jsonl")
        self.steps = step_fields(self.events)
        self.labels = read_labels(out)

    def loss(self, s: int):
        return self.steps[s]["loss"]

    def lr(self, s: int) -> float:
        return self.steps[s]["lr"][0]

    def phase(self, s: int, name: str) -> float:
        return self.steps[s]["phases"].get(name, 0.0)

    @property
    def declared(self) -> Schedule:
        return Schedule.from_dict(of_kind(self.events, "run_start")[0]["schedule"])

    def label(self, kind: str) -> dict:
        (lab,) = [lab for lab in self.labels if lab["kind"] == kind]
        return lab


def check_loss_spike(r: Run) -> None:
    assert r.loss(6) > 5 * r.loss(5)
    assert r.steps[6]["grad_norm"] > 3 * r.steps[5]["grad_norm"]
    assert r.loss(7) < r.loss(5) + 0.5  # one bad batch: recoverable


def check_lr_burst(r: Run) -> None:
    assert r.lr(6) == pytest.approx(100 * r.declared.lr(6))
    assert r.lr(7) == pytest.approx(100 * r.declared.lr(7))
    assert r.lr(8) == pytest.approx(r.declared.lr(8))
    assert r.loss(8) > r.loss(5) + 2


def check_weight_scale(r: Run) -> None:
    assert r.loss(6) > r.loss(5) + 2


def check_nan(r: Run) -> None:
    assert isinstance(r.loss(5), float)
    assert [r.loss(s) for s in range(6, 10)] == ["NaN"] * 4  # the wire encoding of a NaN loss
    assert r.steps[6]["grad_norm"] == "NaN"


def check_divergence(r: Run) -> None:
    before = statistics.mean(r.loss(s) for s in range(25, 30))
    after = statistics.mean(r.loss(s) for s in range(50, 60))
    assert after > before + 1.5
    rising = sum(r.loss(s + 5) > r.loss(s) for s in range(30, 50))
    assert rising >= 16  # a trend over many steps, not one jump
    assert all(f["clip_coef"] == 1.0 for s, f in r.steps.items() if s >= 30)  # clipping is off


def check_lr_per_microbatch(r: Run) -> None:
    d = r.declared
    assert d.warmup_steps == 8
    for s in range(12):
        assert r.steps[s]["micro_batches"] == 4
        assert r.lr(s) == pytest.approx(d.lr(4 * s + 3))  # the trace runs 4x fast
    assert all(r.steps[s]["scheduler_steps"] == 4 for s in range(12))  # TrainMonitor counts the calls
    assert r.lr(2) < r.lr(1)  # past the peak by step 2: the warmup ended there instead of at step 8
    assert r.lr(1) > 3 * d.lr(1)


def check_lr_wrong_total(r: Run) -> None:
    d = r.declared
    assert d.total_steps == 20  # the declared schedule is the intended one...
    wrong = Schedule(d.name, d.peak_lr, 5, 5, d.min_ratio, d.decay_fraction)
    for s in range(20):
        assert r.lr(s) == pytest.approx(wrong.lr(s))  # ...the scheduler ran a 5-step one
    assert r.lr(12) == pytest.approx(d.peak_lr * d.min_ratio)
    assert r.lr(12) < 0.5 * d.lr(12)


def check_lr_frozen(r: Run) -> None:
    assert all(r.lr(s) == r.lr(5) for s in range(5, 15))
    assert all(r.steps[s].get("scheduler_steps", 0) == 0 for s in range(5, 15))  # no scheduler.step() calls
    assert r.declared.lr(12) != pytest.approx(r.lr(12))


def check_data_stall(r: Run) -> None:
    for s in (4, 5):
        assert r.phase(s, "data") >= 0.9
        assert r.steps[s]["step_time"] >= 0.9
    for s in (3, 6):
        assert r.phase(s, "data") < 0.3


def check_checkpoint_stall(r: Run) -> None:
    (save,) = [c for c in of_kind(r.events, "checkpoint") if c["step"] == 4]
    assert save["duration"] >= 0.9 and save["bytes"] > 0
    assert r.phase(5, "checkpoint") >= 0.9  # the save's time lands in the next step's record
    assert r.steps[5]["step_time"] >= 0.9


def check_memory_leak(r: Run) -> None:
    grown = r.steps[9]["mem_allocated_bytes"] - r.steps[0]["mem_allocated_bytes"]
    assert grown >= 0.8 * 9 * 16 * 2**20
    mem = [r.steps[s]["mem_allocated_bytes"] for s in range(1, 10)]
    assert mem == sorted(mem)


def check_gc_pause(r: Run) -> None:
    pauses = [r.phase(s, "other") for s in (2, 5, 8)]
    calm = [r.phase(s, "other") for s in (1, 3, 4, 6, 7)]
    assert min(pauses) > 0.04
    assert min(pauses) > 5 * statistics.median(calm)


def check_straggler(r: Run) -> None:
    assert all(r.phase(s, "forward") >= 0.1 for s in (3, 4, 5))
    assert r.phase(2, "forward") < 0.1


def check_hang(r: Run) -> None:
    assert r.steps[3]["step_time"] >= 2.0
    kinds = [(e["kind"], e["fields"].get("step")) for e in r.events if e["kind"] in ("step", "heartbeat")]
    between = kinds[kinds.index(("step", 2)) + 1 : kinds.index(("step", 3))]
    assert len(between) >= 2 and set(between) == {("heartbeat", 2)}  # alive (TrainMonitor's beat), not stepping


def check_labels_unshifted(r: Run) -> None:
    assert max(r.loss(s) for s in range(45, 50)) < FLOOR - 0.3  # below what the data allows


def check_lr_too_high(r: Run) -> None:
    d = r.declared
    assert d.peak_lr == pytest.approx(100 * 3e-3) and d.warmup_steps == 20  # the peak raised, in the declaration
    assert all(r.lr(s) == pytest.approx(d.lr(s)) for s in range(20))  # a configuration, not a schedule drift
    assert r.lr(19) > 30 * 3e-3
    # The capture the precursor detector reads: sampled every --detail-every steps.
    assert [s for s in range(20) if "attn_logit_max" in r.steps[s]] == [0, 5, 10, 15]


def check_bad_init(r: Run) -> None:
    assert r.loss(0) > LN_V + 2


CASES: list[tuple[str, list[str], int, tuple[int, int], Callable[[Run], None]]] = [
    ("loss_spike@6", [], 10, (6, 6), check_loss_spike),
    ("lr_burst@6", [], 10, (6, 7), check_lr_burst),
    ("weight_scale@6", [], 8, (6, 6), check_weight_scale),
    ("nan@6", [], 10, (6, 9), check_nan),
    ("divergence@30", [], 60, (30, 59), check_divergence),
    ("lr_per_microbatch@0", ["--accum", "4", "--warmup-steps", "8"], 12, (0, 11), check_lr_per_microbatch),
    ("lr_wrong_total@0", [], 20, (1, 19), check_lr_wrong_total),  # step 0: LR 0 in both (warmup from 0)
    ("lr_frozen@5", [], 15, (6, 14), check_lr_frozen),
    ("data_stall@4:seconds=1,steps=2", [], 8, (4, 5), check_data_stall),
    ("checkpoint_stall@4:seconds=1", [], 8, (4, 5), check_checkpoint_stall),
    ("memory_leak@1:mb=16", [], 10, (1, 9), check_memory_leak),
    ("gc_pause@2:objects=200000,every=3", [], 9, (2, 8), check_gc_pause),
    ("straggler@3:ms=100", [], 6, (3, 5), check_straggler),
    ("hang@3:seconds=2", ["--heartbeat-interval", "0.5"], 6, (3, 3), check_hang),
    ("labels_unshifted@0", [], 50, (0, 49), check_labels_unshifted),
    ("bad_init@0", [], 3, (0, 0), check_bad_init),
    ("lr_too_high@0", ["--detail-every", "5"], 20, (0, 19), check_lr_too_high),
]


def check_label(r: Run, spec: str, window: tuple[int, int]) -> None:
    kind = spec.split("@")[0]
    lab = r.label(kind)
    assert {"kind", "rank", "first_step", "last_step", "expected_detection"} <= set(lab)
    assert lab["expected_detection"] == CATALOG[kind].detection
    assert lab["rank"] == 0  # single-process run
    assert (lab["first_step"], lab["last_step"]) == window
    assert lab["spec"] == spec


@pytest.mark.parametrize(("spec", "args", "steps", "window", "check"), CASES, ids=[c[0].split("@")[0] for c in CASES])
def test_fault_visible_in_stream(tmp_path, spec, args, steps, window, check):
    run_trainer(tmp_path, *TINY, *args, "--inject", spec, steps=steps)
    r = Run(tmp_path)
    check(r)
    check_label(r, spec, window)
    assert of_kind(r.events, "run_end")[-1]["status"] == "finished"


# -- resume faults: one interrupted fp16 run, resumed with each fault ---------------------------

# fp16 with the loss scale starting above where it settles (2^24 backs off to 2^18 in a few
# skipped steps), so a fresh scaler after the resume overflows again, as in transformers#34053.
BASE = [*TINY, "--precision", "fp16", "--init-scale", str(2**24), "--checkpoint-every", "5"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """20 planned steps, crashed after step 11; the latest checkpoint is step 9 (resume at 10)."""
    out = tmp_path_factory.mktemp("base")
    run_trainer(out, *BASE, "--stop-at", "11", "--inject", "loss_spike@3", steps=20)
    return out


def resume_with(interrupted: Path, tmp_path: Path, spec: str, *args: str) -> tuple[Run, dict, dict, list, list]:
    out = tmp_path / "run"
    shutil.copytree(interrupted, out)
    run_trainer(out, *BASE, *args, "--resume", str(out), "--inject", spec, steps=20)
    r = Run(out)
    first, second = attempts(r.events)
    saved = next(c for c in of_kind(first, "checkpoint") if c["step"] == 9)["fingerprint"]
    restored = of_kind(second, "resume")[0]["fingerprint"]
    return r, saved, restored, first, second


def check_no_scheduler(r, saved, restored, first, second):
    assert saved["scheduler"]["last_epoch"] == 10 and restored["scheduler"]["last_epoch"] == 0
    d = r.declared
    assert r.lr(10) == pytest.approx(d.lr(10))  # right for one step (the optimizer kept its LR)...
    assert r.lr(11) == pytest.approx(d.lr(1))  # ...then back to the start of warmup
    assert set(compare_fingerprints(saved, restored)) == {"scheduler.last_epoch", "scheduler.lrs"}


def check_no_optimizer(r, saved, restored, first, second):
    assert saved["optimizer"]["adam_step_max"] > 0
    assert restored["optimizer"]["adam_step_max"] == 0 and restored["optimizer"]["params_with_state"] == 0
    assert restored["optimizer"]["exp_avg_norm"] == 0.0
    assert r.lr(10) == pytest.approx(r.declared.lr(10))  # only the moments were lost


def check_data_replay(r, saved, restored, first, second):
    assert saved["data_position"] == 10 and restored["data_position"] == 0
    before = [f["batch_fingerprint"] for f in of_kind(first, "step")]
    after = [f["batch_fingerprint"] for f in of_kind(second, "step")]
    # every batch after the resume is a replay (but step 3's, which loss_spike replaced in attempt 1)
    assert [fp for i, fp in enumerate(after) if i != 3] == [fp for i, fp in enumerate(before[: len(after)]) if i != 3]
    assert after[3] != before[3]


def check_no_rng(r, saved, restored, first, second):
    # Python and NumPy RNGs are never drawn from while training, so only torch's (dropout) differs
    assert set(compare_fingerprints(saved, restored)) == {"rng.torch"}


def check_step_reset(r, saved, restored, first, second):
    assert saved["next_step"] == 10 and restored["next_step"] == 0
    assert of_kind(second, "resume")[0]["step"] == 9
    assert [f["step"] for f in of_kind(second, "step")][:3] == [0, 1, 2]  # step ids restart


def check_no_scaler(r, saved, restored, first, second):
    assert saved["loss_scale"] <= 2**18 and restored["loss_scale"] == 2**24
    resumed = of_kind(second, "step")
    assert resumed[0]["loss_scale"] == 2**24  # the fresh scaler's scale, which this step used and overflowed
    assert resumed[1]["loss_scale"] == 2**23  # halved by the overflow
    assert [f["skipped"] for f in resumed[:3]] == [True] * 3  # an overflow burst right after the resume
    assert sum(f["skipped"] for f in of_kind(first, "step")[6:]) <= 1  # it had settled before the crash


def check_batch_change(r, saved, restored, first, second):
    assert restored["global_batch_tokens"] == 2 * saved["global_batch_tokens"]
    assert restored["config_hash"] != saved["config_hash"]
    assert of_kind(second, "step")[0]["tokens"] == 2 * of_kind(first, "step")[0]["tokens"]


RESUME_CASES = [
    ("resume_no_scheduler@0", check_no_scheduler),
    ("resume_no_optimizer@0", check_no_optimizer),
    ("resume_data_replay@0", check_data_replay),
    ("resume_no_rng@0", check_no_rng),
    ("resume_step_reset@0", check_step_reset),
    ("resume_no_scaler@0", check_no_scaler),
    ("resume_batch_change@0", check_batch_change),
]


@pytest.mark.parametrize(("spec", "check"), RESUME_CASES, ids=[c[0].split("@")[0] for c in RESUME_CASES])
def test_resume_fault_visible_in_fingerprints(interrupted, tmp_path, spec, check):
    r, saved, restored, first, second = resume_with(interrupted, tmp_path, spec)
    check(r, saved, restored, first, second)
    assert compare_fingerprints(saved, restored)  # a bad resume never matches the checkpoint
    kind = spec.split("@")[0]
    lab = r.label(kind)
    assert lab["expected_detection"] == "bad_resume"
    assert (lab["rank"], lab["first_step"], lab["last_step"]) == (0, 10, 10)
    # the first attempt's labels survive the resumed invocation
    assert r.label("loss_spike")["first_step"] == 3


def test_every_catalog_kind_is_tested():
    tested = {c[0].split("@")[0] for c in CASES} | {c[0].split("@")[0] for c in RESUME_CASES}
    tested |= {"replica_desync", "tp_same_seed"}  # multi-rank: under torchrun in test_detector_replica_divergence.py
    tested |= {"unshuffled"}  # needs a 440-step run: in test_detector_loss_noise.py
    assert tested == set(CATALOG)
    assert {k.detection for k in CATALOG.values()} <= {
        "nan_inf", "loss_spike", "grad_explosion", "divergence", "throughput_collapse", "lr_schedule_drift",
        "bad_resume", "straggler", "hang", "node_health", "memory_leak", "init_loss", "loss_scale_collapse",
        "eval_regression", "replica_divergence", "loss_noise", "instability_precursor",
    }  # fmt: skip


def test_resume_guard_step(interrupted, tmp_path):
    """A resume fault whose guard STEP is past the resume point does nothing."""
    out = tmp_path / "run"
    shutil.copytree(interrupted, out)
    run_trainer(out, *BASE, "--resume", str(out), "--inject", "resume_no_optimizer@15", steps=20)
    r = Run(out)
    first, second = attempts(r.events)
    saved = next(c for c in of_kind(first, "checkpoint") if c["step"] == 9)["fingerprint"]
    assert compare_fingerprints(saved, of_kind(second, "resume")[0]["fingerprint"]) == {}
    assert [lab["kind"] for lab in r.labels] == ["loss_spike"]


# -- bad specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nope@3", "unknown fault kind 'nope'"),
        ("nan", "missing @STEP"),
        ("nan@x", "STEP must be an integer"),
        ("nan@-1", "STEP must be 0 or more"),
        ("straggler@3:msec=5", "unknown parameter 'msec' for straggler, expected one of: ms, steps, rank"),
        ("straggler@3:ms", "is not key=value"),
        ("straggler@3:ms=fast", "ms must be a number"),
        ("straggler@3:rank=2", "rank=2 but the run has 1 rank"),
        ("data_stall@3:seconds=-1", "seconds must be positive"),
    ],
)
def test_bad_inject_spec_is_explained(spec, needle):
    with pytest.raises(FaultError, match=needle) as info:
        parse_fault(spec)
    assert repr(spec) in str(info.value)


def test_fault_defaults_and_ranks():
    assert parse_fault("straggler@10:rank=1,ms=30", world_size=2).params == {"ms": 30.0, "steps": None}
    assert parse_fault("hang@15", world_size=4).rank == 3  # one rank: the last by default
    assert parse_fault("loss_spike@20:scale=50").params["scale"] == 50.0
    plan = FaultPlan.parse(["data_stall@30:seconds=2,steps=5"], rank=0, world_size=2, total_steps=100)
    (lab,) = plan.planned_labels(Schedule("constant", 1e-3, 100), 0, 1)
    assert (lab["rank"], lab["first_step"], lab["last_step"]) == (None, 30, 34)  # every rank stalls


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--inject", "resume_no_rng@0"], "a resume_* fault needs --resume"),
        (["--inject", "lr_per_microbatch@0"], "needs --accum > 1"),
        (["--inject", "bogus@1"], "unknown fault kind 'bogus'"),
    ],
)
def test_cli_rejects_bad_injection(tmp_path, args, needle):
    proc = run_trainer(tmp_path, *args, steps=3, run="x", check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
