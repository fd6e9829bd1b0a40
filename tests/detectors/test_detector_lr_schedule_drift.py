"""lr_schedule_drift: declared and inferred schedules, the diagnoses, silence on clean schedules."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.trainer_helpers import TINY, run_trainer
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors import Finding
from trainmon.monitor.detectors.lr_schedule_drift import LrScheduleDrift, LrScheduleDriftConfig
from trainmon.monitor.store.storage import Storage
from trainmon.schedules import SCHEDULE_NAMES, Schedule
from trainmon.wire import Event

KIND = "lr_schedule_drift"
REAL_LOGS = Path("/work/shared/real-logs")


class Feed:
    """Builds events for one rank and feeds them to a fresh detector, collecting findings."""

    def __init__(self) -> None:
        self.det = LrScheduleDrift(LrScheduleDriftConfig())
        self.findings: list[Finding] = []
        self.seq = 0
        self.attempt = 0

    def send(self, kind: str, fields: dict) -> list[Finding]:
        self.seq += 1
        ev = Event(kind, "r", 0, "h", f"s{self.attempt}", self.seq, 1e9 + self.seq, fields)
        out = self.det.observe(ev, self.attempt)
        self.findings += out
        return out

    def start(self, schedule: Schedule | None, *, accum: int = 1, resumed: bool = False, planned: int | None = None):
        fields = {"accum_steps": accum, "world_size": 1, "resumed": resumed}
        if schedule is not None:
            fields["schedule"] = schedule.to_dict()
            fields["planned_steps"] = schedule.total_steps
        if planned is not None:
            fields["planned_steps"] = planned
        self.send("run_start", fields)

    def step(self, step: int, lrs: list[float], **extra) -> list[Finding]:
        return self.send("step", {"step": step, "loss": 3.0, "lr": lrs, **extra})

    @property
    def opened(self) -> list[Finding]:
        """The findings that opened an anomaly (later ones restate it until it resolves)."""
        out, is_open = [], False
        for f in self.findings:
            if not f.resolved and not is_open:
                out.append(f)
            is_open = not f.resolved
        return out


def run_trace(
    schedule: Schedule | None,
    lr: Callable[[int], float],
    steps: range,
    *,
    groups: tuple[float, ...] = (1.0,),
    accum: int = 1,
    planned: int | None = None,
) -> Feed:
    feed = Feed()
    feed.start(schedule, accum=accum, planned=planned)
    for s in steps:
        feed.step(s, [lr(s) * g for g in groups])
    return feed


COSINE = Schedule("cosine", 3e-3, 200, 20, 0.1)


def first_drift(actual: Callable[[int], float], expected: Callable[[int], float] = COSINE.lr) -> int:
    """The first step more than 1% off: the anomaly's first step (it is confirmed one step later)."""
    return next(s for s in range(10_000) if abs(actual(s) - expected(s)) > 0.01 * expected(s))


# -- (a) faults: the step it fires, the severity, the diagnosis in the hint ----------------------


def test_scheduler_stepped_per_microbatch_is_named_from_the_lr_alone():
    accum, k = 4, 50
    feed = run_trace(COSINE, lambda s: COSINE.lr(s if s < k else k + (s - k) * accum + accum - 1), range(120), accum=4)
    (f,) = feed.opened
    assert f.step == k and f.severity == "warning"
    assert f.evidence["diagnosis"] == "per_microbatch" and f.evidence["factor"] == 4
    assert "micro-batch" in f.hint and "4x too fast" in f.hint


def test_scheduler_steps_counter_fires_even_where_the_lr_is_flat():
    sched = Schedule("constant", 1e-3, 200, 0)
    feed = Feed()
    feed.start(sched, accum=8)
    for s in range(40):
        feed.step(s, [1e-3], scheduler_steps=8 if s >= 20 else 1)
    (f,) = feed.opened
    assert f.step == 20 and f.evidence["diagnosis"] == "per_microbatch"
    assert "scheduler.step() ran 8 times" in f.message and "micro-batch" in f.hint


def test_warmup_restarted_at_the_resume():
    feed = Feed()
    feed.start(COSINE)
    for s in range(100):
        feed.step(s, [COSINE.lr(s)])
    feed.attempt = 1
    feed.start(COSINE, resumed=True)
    feed.send("resume", {"step": 99})
    # the optimizer kept the LR for one step, then the fresh scheduler starts again from 1
    for s in range(100, 140):
        feed.step(s, [COSINE.lr(s if s == 100 else s - 100)])
    (f,) = feed.opened
    assert f.step == 101 and f.evidence["diagnosis"] == "restarted" and f.evidence["restart_step"] == 100
    assert "not restored" in f.hint and "restarted" in f.hint


def test_frozen_scheduler():
    feed = run_trace(COSINE, lambda s: COSINE.lr(min(s, 80)), range(150))
    (f,) = feed.opened
    assert f.step == first_drift(lambda s: COSINE.lr(min(s, 80))) and f.evidence["diagnosis"] == "frozen"
    assert "scheduler.step() is no longer called" in f.hint


def test_wrong_total_length_is_estimated():
    built = Schedule("cosine", 3e-3, 50, 20, 0.1)
    feed = run_trace(COSINE, built.lr, range(200))
    f = feed.opened[0]
    assert f.evidence["diagnosis"] == "wrong_length"
    assert abs(f.evidence["estimated_total_steps"] - 50) <= 1
    assert f.step == first_drift(built.lr)
    assert "~50 steps instead of the declared 200" in f.hint


def test_one_param_group_diverging():
    feed = Feed()
    feed.start(COSINE)
    for s in range(150):
        feed.step(s, [COSINE.lr(s), 0.1 * COSINE.lr(min(s, 60))])  # group 1 stops following at 60
    (f,) = feed.opened
    assert f.evidence["diagnosis"] == "group" and f.evidence["group"] == 1
    assert (
        f.step == first_drift(lambda s: COSINE.lr(min(s, 60)))
        and "Param group 1" in f.hint
        and "param group 1" in f.message
    )


def test_step_counter_reset_while_the_scheduler_kept_its_position():
    feed = Feed()
    feed.start(COSINE)
    for s in range(60):
        feed.step(s, [COSINE.lr(s)])
    feed.attempt = 1
    feed.start(COSINE, resumed=True)
    feed.send("resume", {"step": 59})
    for s in range(30):
        feed.step(s, [COSINE.lr(s + 60)])
    (f,) = feed.opened
    assert f.step == 0 and f.evidence["diagnosis"] == "step_offset" and f.evidence["shift_steps"] == 60
    assert "step counter restarted at 0" in f.hint


def test_resolves_when_the_lr_is_back_on_schedule():
    feed = run_trace(COSINE, lambda s: COSINE.lr(s) * (3.0 if 100 <= s < 105 else 1.0), range(150))
    (opened,) = feed.opened
    *_, last, resolved = feed.findings
    assert last.evidence["step"] == 104 and last.evidence["off_schedule_steps"] == 5
    assert opened.step == 100 and opened.evidence["diagnosis"] == "scaled" and opened.evidence["factor"] == 3.0
    assert resolved.resolved and resolved.step == 107


def test_inferred_schedule_restart_after_resume():
    sched = Schedule("cosine", 1e-4, 1000, 50, 0.0)
    feed = Feed()
    feed.start(None)
    for s in range(0, 400, 10):
        feed.step(s, [sched.lr(s)])
    feed.attempt = 1
    feed.start(None, resumed=True)
    for s in range(400, 600, 10):  # the warmup starts again from the resume
        feed.step(s, [sched.lr(s - 400)])
    (f,) = feed.opened
    assert f.step == 410 and f.evidence["schedule"] == "inferred" and f.evidence["diagnosis"] == "restarted"
    assert "inferred" in f.message and "No schedule was declared" in f.hint


def test_inferred_schedule_frozen_mid_decay():
    sched = Schedule("linear", 1e-4, 1000, 50, 0.0)
    feed = run_trace(None, lambda s: sched.lr(min(s, 300)), range(1000), planned=1000)
    (f,) = feed.opened
    assert f.step == 301 and f.evidence["diagnosis"] == "frozen" and f.evidence["schedule"] == "inferred"


# -- (b) clean traces: silence -----------------------------------------------------------------


def _clean_cases() -> Iterator[tuple[str, Schedule, int]]:
    for name in SCHEDULE_NAMES:
        for seed in range(3):
            rng = random.Random(seed)
            total = rng.choice([40, 150, 1000])
            warm = rng.choice([0, 1, 10, total // 10])
            yield name, Schedule(name, rng.choice([1e-2, 3e-4, 6e-5]), total, warm, rng.choice([0.0, 0.1])), seed


@pytest.mark.parametrize(("name", "sched", "seed"), list(_clean_cases()))
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "inferred"])
def test_clean_schedules_are_silent(name, sched, seed, declared):
    rng = random.Random(seed)
    feed = Feed()
    feed.start(sched if declared else None, planned=sched.total_steps)
    every = rng.choice([1, 1, 5])
    for s in range(0, sched.total_steps + 20, every):  # and a little past the planned end
        if s % 25 == 0:
            feed.send("eval", {"step": s, "loss": 3.0})
            feed.send("checkpoint", {"step": s, "duration": 1.0})
        lr = float(f"{sched.lr(s):.7g}")  # JSON logs round
        feed.step(s, [lr, 0.5 * lr], phases={"eval": 0.5} if s % 25 == 0 else {"forward": 0.1})
    assert feed.findings == []


def test_correct_resume_from_an_older_checkpoint_is_silent():
    feed = Feed()
    feed.start(COSINE)
    for s in range(130):
        feed.step(s, [COSINE.lr(s)])
    feed.attempt = 1
    feed.start(COSINE, resumed=True)
    feed.send("resume", {"step": 99})
    for s in range(100, 200):
        feed.step(s, [COSINE.lr(s)])
    assert feed.findings == []


def test_skipped_fp16_steps_that_also_skip_the_scheduler_are_tolerated():
    feed = Feed()
    feed.start(COSINE)
    skipped = 0
    for s in range(200):
        skip = s in (3, 4, 5, 90)
        feed.step(s, [COSINE.lr(s - skipped)], skipped=skip)
        skipped += skip
    assert feed.findings == []


def _hf_steps(path: Path) -> list[tuple[int, float]]:
    data = json.loads(path.read_text())
    out = []
    for row in data.get("log_history", []):
        lr = row.get("learning_rate", row.get("lr"))
        if "loss" in row and isinstance(lr, (int, float)) and math.isfinite(lr):
            out.append((int(row["step"]), float(lr)))
    return out


# HF logs whose reading (manifest.json) names an LR-schedule problem: file -> step where it shows.
_LR_FAULTS = {"52_wav2vec2-bangla-lr-restart.json": 800}
# ... and the one resumed into a new plan: the LR decayed to 0 at 1500, then a fresh 4000-step cosine from 1501
_LR_NEW_PLAN = {"82_hf-resume-lr-rewarm-divergence.json": 1501}


@pytest.mark.parametrize(
    "name",
    sorted(
        p.name
        for p in REAL_LOGS.glob("*.json")
        if p.name != "manifest.json" and p.name not in _LR_FAULTS and p.name not in _LR_NEW_PLAN
    ),
)
def test_real_hf_logs_are_silent_with_an_inferred_schedule(name):
    points = _hf_steps(REAL_LOGS / name)
    if not points:
        pytest.skip("no LR in this log")
    data = json.loads((REAL_LOGS / name).read_text())
    feed = Feed()
    feed.start(None, planned=data.get("max_steps") or None)
    for s, lr in points:
        feed.step(s, [lr])
    assert feed.findings == [], feed.findings[0].message


@pytest.mark.parametrize("name", sorted(n for n in _LR_NEW_PLAN if (REAL_LOGS / n).exists()))
def test_real_hf_log_resumed_into_a_new_plan_is_flagged_where_the_lr_rose(name):
    """82: resumed from the finished 1500-step run into a 4000-step plan: the LR rises from 0 to 1.38e-3 at 1501."""
    data = json.loads((REAL_LOGS / name).read_text())
    feed = Feed()
    feed.start(None, planned=data.get("max_steps") or None)
    for s, lr in _hf_steps(REAL_LOGS / name):
        feed.step(s, [lr])
    assert feed.findings, "the LR rise after the decay to 0 was not flagged"
    assert feed.findings[0].step == _LR_NEW_PLAN[name], feed.findings[0].message


@pytest.mark.parametrize("name", sorted(n for n in _LR_FAULTS if (REAL_LOGS / n).exists()))
def test_real_hf_log_with_a_restarted_schedule_is_flagged_where_it_restarted(name):
    """52: resumed from checkpoint-800 with the scheduler restarted (LR 6.0e-5 back up to 9.9e-5)."""
    data = json.loads((REAL_LOGS / name).read_text())
    feed = Feed()
    feed.start(None, planned=data.get("max_steps") or None)
    for s, lr in _hf_steps(REAL_LOGS / name):
        feed.step(s, [lr])
    assert feed.findings, "the LR restart was not flagged"
    first = feed.findings[0]
    logging_interval = 50
    assert _LR_FAULTS[name] <= first.step <= _LR_FAULTS[name] + logging_interval, first.message
    # from 61% of the peak, mid-decay: a reset (warning), not the floor-to-peak rise of warm restarts
    assert "jumped back up" in first.message and "mid-decay" in first.message and first.severity == "warning"


# -- (c) the reference trainer: a real fault and a clean run ------------------------------------


def _anomalies(out: Path, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    storage = Storage(f"sqlite:///{tmp_path / 'pm.db'}")
    (run,) = import_file(out / "events.jsonl", storage)
    found = [a for a in summarize(storage, run)["anomalies"] if a["kind"] == KIND]
    labels = json.loads((out / "labels.json").read_text()) if (out / "labels.json").exists() else []
    return found, labels


def test_reference_trainer_frozen_scheduler_and_clean_run(tmp_path):
    fault, clean = tmp_path / "fault", tmp_path / "clean"
    run_trainer(fault, *TINY, "--threads", "1", "--inject", "lr_frozen@25", steps=50)
    run_trainer(clean, *TINY, "--threads", "1", "--schedule", "wsd", "--checkpoint-every", "10", steps=50)
    found, labels = _anomalies(fault, tmp_path / "a")
    (lab,) = labels
    (a,) = found
    assert lab["first_step"] <= a["first_step"] <= lab["first_step"] + 1
    assert a["severity"] == "warning" and "scheduler.step() is no longer called" in a["hint"]
    found, _ = _anomalies(clean, tmp_path / "b")
    assert found == []


def test_a_schedule_read_off_the_scheduler_learns_its_cadence_from_the_first_counted_step():
    """A step without ``scheduler_steps`` (an event from an older producer) says nothing about the
    cadence: a per-step scheduler counted from the next step on is per step, and its freeze fires."""
    sched = Schedule("cosine", 1e-3, 300, 0)
    feed = Feed()
    feed.send("run_start", {"world_size": 1, "schedule": sched.to_dict(), "planned_steps": 300,
                            "schedule_source": "scheduler", "scheduler": "CosineAnnealingLR"})  # fmt: skip
    feed.step(0, [sched.lr(0)])  # no scheduler_steps
    for s in range(1, 200):
        feed.step(s, [sched.lr(min(s, 120))], scheduler_steps=1 if s <= 120 else 0)
    assert [f.step for f in feed.opened] in ([121], [122]), [f.message for f in feed.findings]


@pytest.mark.parametrize(
    ("actual", "expected", "words"),
    [
        (0.000302, 3.38e-08, "8,935x the expected"),
        (3.38e-08, 0.000302, "1/8,935 of the expected"),
        (0.00101, 0.001, "+1.0% off"),
        (0.0009, 0.001, "-10.0% off"),
    ],
)
def test_the_size_of_a_drift_is_recomputed_from_the_numbers_printed(actual: float, expected: float, words: str) -> None:
    """'is 0.000302 at step 299, the declared cosine schedule expects 3.38e-08 (30192.6% off)': the
    percentage came from an error floored for the tolerance; the ratio of the printed numbers is ~8,900x."""
    from trainmon.monitor.detectors.lr_schedule_drift import _off

    assert _off(actual, expected) == words
