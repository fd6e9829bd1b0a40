"""bad_resume: every failed check named at the first step after the resume; clean resumes silent."""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_helpers import TINY, run_trainer
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors import Finding
from trainmon.monitor.detectors.bad_resume import BadResume, BadResumeConfig
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

KIND = "bad_resume"


def fingerprint(next_step: int, *, skipped: int = 0) -> dict[str, Any]:
    """What the reference trainer saves (trainmon.hooks.fingerprint.state_fingerprint), with made-up values."""
    return {
        "next_step": next_step,
        "tokens": 256 * next_step,
        "samples": 8 * next_step,
        "data_position": next_step,
        "world_size": 1,
        "global_batch_tokens": 256,
        "accum_steps": 1,
        "config_hash": "c0ffee",
        "optimizer": {
            "params": 10,
            "params_with_state": 10,
            "adam_step_min": next_step - skipped,
            "adam_step_max": next_step - skipped,
            "exp_avg_norm": 0.4 + 0.001 * next_step,
            "exp_avg_sq_norm": 0.015,
        },
        "scheduler": {"last_epoch": next_step, "lrs": [1e-3, 1e-3]},
        "model": {"model_hash": f"m{next_step}", "param_norm": 30.0 + next_step / 100},
        "rng": {"python": "p0", "numpy": "n0", "torch": f"t{next_step}"},
    }


class Trace:
    """A rank's stream: a first attempt with checkpoints, then a resumed attempt."""

    def __init__(self, seed: int = 0, noise: float = 0.02) -> None:
        self.det = BadResume(BadResumeConfig())
        self.findings: list[Finding] = []
        self.seq = 0
        self.attempt = 0
        self.rng = random.Random(seed)
        self.noise = noise

    def send(self, kind: str, fields: dict) -> list[Finding]:
        self.seq += 1
        ev = Event(kind, "r", 0, "h", f"s{self.attempt}", self.seq, 1e9 + self.seq, fields)
        out = self.det.observe(ev, self.attempt)
        self.findings += out
        return out

    def loss(self, step: int) -> float:
        return 2.0 + 2.0 / (1 + step / 10) + self.rng.gauss(0, self.noise)

    def start(self, *, resumed: bool = False, gbt: int = 256) -> None:
        self.send(
            "run_start",
            {
                "world_size": 1,
                "global_batch_tokens": gbt,
                "accum_steps": 1,
                "config_hash": "c0ffee",
                "resumed": resumed,
            },
        )

    def steps(self, steps: range, *, batch_of=lambda s: s, loss_of=None) -> None:
        for s in steps:
            loss = self.loss(s) if loss_of is None else loss_of(s)
            self.send("step", {"step": s, "loss": loss, "lr": [1e-3, 1e-3], "batch_fingerprint": f"b{batch_of(s)}"})

    def first_attempt(self, n: int = 30, every: int = 10) -> None:
        self.start()
        for s in range(n):
            self.steps(range(s, s + 1))
            if (s + 1) % every == 0:
                self.send("checkpoint", {"step": s, "fingerprint": fingerprint(s + 1)})

    def resume(self, ckpt: int, restored: dict | None, **start) -> list[Finding]:
        self.attempt += 1
        self.start(resumed=True, **start)
        if restored is None:
            return []
        return self.send("resume", {"step": ckpt, "fingerprint": restored})


def _set(fp: dict, key: str, value: Any) -> dict:
    fp = copy.deepcopy(fp)
    *path, last = key.split(".")
    d = fp
    for p in path:
        d = d[p]
    d[last] = value
    return fp


FAULTS = {
    # name: (restored-fingerprint edits, step ids after the resume, batch ids, severity, failed, hint words)
    "no_optimizer": (
        {"optimizer.adam_step_max": 0, "optimizer.adam_step_min": 0, "optimizer.params_with_state": 0},
        None,
        None,
        "critical",
        ["optimizer"],
        "optimizer.load_state_dict was not called (or loaded into a rebuilt optimizer): "
        "Adam step count 0 restored vs 30",
    ),
    "no_scheduler": (
        {"scheduler.last_epoch": 0, "scheduler.lrs": [1e-5, 1e-5]},
        None,
        None,
        "warning",
        ["scheduler"],
        "scheduler.load_state_dict was not called",
    ),
    "data_replay": ({"data_position": 0}, None, lambda s: s - 30, "warning", ["data"], "replayed"),
    "no_rng": ({"rng.torch": "zz"}, None, None, "warning", ["rng"], "RNG states were not restored (rng.torch)"),
    "step_reset": ({"next_step": 0}, lambda s: s - 30, None, "critical", ["step"], "run restarts at step 0"),
    "no_scaler": ({"loss_scale": 65536.0}, None, None, "warning", ["loss_scale"], "GradScaler was not restored"),
    "batch_change": (
        {"global_batch_tokens": 512, "config_hash": "beef"},
        None,
        None,
        "warning",
        ["topology"],
        "global_batch_tokens 256 -> 512",
    ),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_resume_fault_fires_at_the_resume_with_the_cause(name):
    edits, step_of, batch_of, severity, failed, words = FAULTS[name]
    t = Trace()
    t.first_attempt()
    saved = fingerprint(30)
    if name == "no_scaler":
        saved["loss_scale"] = 1024.0
        t.send("checkpoint", {"step": 29, "fingerprint": saved})  # an fp16 run's checkpoint carries its scale
    restored = copy.deepcopy(saved)
    for key, value in edits.items():
        restored = _set(restored, key, value)
    fired = t.resume(29, restored, gbt=512 if name == "batch_change" else 256)
    (f,) = fired
    assert f.step == 30 and f.severity == severity and f.evidence["failed"] == failed
    assert words in f.hint, f.hint
    assert f.evidence["checkpoint_step"] == 29
    t.steps(range(30, 40), batch_of=batch_of or (lambda s: s))
    if step_of is not None:  # the step ids restart too: same anomaly, nothing new to say
        t.steps(range(0, 5))
    assert [x for x in t.findings if x.resolved] == []


def test_data_replay_is_also_seen_in_the_batches_without_a_fingerprint():
    t = Trace()
    t.first_attempt()
    t.resume(29, None)
    t.send("resume", {"step": 29})  # an adapter that does not fingerprint
    t.steps(range(30, 40), batch_of=lambda s: s - 30)
    (f,) = t.findings
    assert f.step == 30 and f.evidence["failed"] == ["data"] and f.evidence["data"]["first_seen_at_step"] == 0
    assert "data loader / sampler position was not restored" in f.hint


def test_step_reset_without_a_resume_event_fires_at_the_first_step():
    t = Trace()
    t.first_attempt()
    t.resume(29, None)
    t.steps(range(0, 5), batch_of=lambda s: s + 30)
    (f,) = t.findings
    assert f.step == 0 and f.severity == "critical" and f.evidence["failed"] == ["step"]
    assert "reset" in f.hint


@pytest.mark.parametrize(("scale", "fires"), [(65536.0, True), (512.0, False), (1024.0, False), (2048.0, False)])
def test_loss_scale_of_the_first_step_without_a_resume_fingerprint(scale, fires):
    t = Trace()
    t.first_attempt()
    saved = {**fingerprint(30), "loss_scale": 1024.0}
    t.send("checkpoint", {"step": 29, "fingerprint": saved})
    t.resume(29, None)
    t.send("resume", {"step": 29})
    t.send("step", {"step": 30, "loss": 2.5, "loss_scale": scale, "batch_fingerprint": "b30"})
    if not fires:  # one overflow halves the scale, one growth interval doubles it: both are fine
        assert t.findings == []
        return
    (f,) = t.findings
    assert f.step == 30 and f.evidence["failed"] == ["loss_scale"] and "GradScaler was not restored" in f.hint


def test_off_by_one_step_after_resume():
    t = Trace()
    t.first_attempt()
    t.resume(29, fingerprint(30))
    t.steps(range(31, 40))
    (f,) = t.findings
    assert f.step == 31 and f.evidence["step"]["first_step"] == [30, 31]
    assert "continues at 31 instead of 30" in f.hint


def test_without_the_saved_fingerprint_the_self_checks_still_catch_a_lost_optimizer():
    t = Trace()
    t.first_attempt(every=1000)  # no checkpoint event seen (an older log, a restarted collector)
    restored = _set(fingerprint(30), "optimizer.adam_step_max", 0)
    (f,) = t.resume(29, restored)
    assert f.evidence["failed"] == ["optimizer"] and f.evidence["saved_fingerprint"] is False
    assert "Adam step count 0" in f.hint


def test_loss_jump_after_resume():
    t = Trace(noise=0.01)
    t.first_attempt()
    t.resume(29, fingerprint(30))
    t.steps(range(30, 40), loss_of=lambda s: 6.0)
    (f,) = t.findings
    assert f.step == 30 and f.evidence["failed"] == ["loss"] and f.evidence["loss"]["loss_after"] == 6.0
    assert "loss jumped" in f.hint


def test_several_failures_are_listed_together():
    t = Trace()
    t.first_attempt()
    restored = _set(_set(fingerprint(30), "optimizer.adam_step_max", 0), "rng.torch", "x")
    (f,) = t.resume(29, restored)
    assert f.evidence["failed"] == ["optimizer", "rng"] and "2 check(s) failed" in f.message


def test_a_later_clean_resume_resolves_the_anomaly():
    t = Trace()
    t.first_attempt()
    t.resume(29, _set(fingerprint(30), "rng.torch", "x"))
    t.steps(range(30, 40))
    t.send("checkpoint", {"step": 39, "fingerprint": fingerprint(40)})
    t.resume(39, fingerprint(40))
    t.steps(range(40, 45))
    opened, resolved = t.findings
    assert not opened.resolved and resolved.resolved and resolved.step == 40


# -- clean resumes: silence ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("noise", [0.0, 0.05, 0.3])
def test_exact_continuation_is_silent(seed, noise):
    t = Trace(seed, noise)
    t.first_attempt()
    t.resume(29, fingerprint(30))
    t.steps(range(30, 60))
    assert t.findings == []


@pytest.mark.parametrize("seed", range(3))
def test_resume_from_an_older_checkpoint_is_not_a_replay_or_a_reset(seed):
    t = Trace(seed, 0.05)
    t.first_attempt(n=36)  # crashed at 35; the newest checkpoint that survived is step 19
    t.resume(19, fingerprint(20))
    t.steps(range(20, 60))  # steps 20..35 again, with the same batches: correct
    assert t.findings == []


def test_epochs_that_repeat_batches_are_not_a_replay():
    t = Trace()
    t.start()
    for s in range(40):
        t.steps(range(s, s + 1), batch_of=lambda s: s % 12)
        if (s + 1) % 10 == 0:
            t.send("checkpoint", {"step": s, "fingerprint": fingerprint(s + 1)})
    t.resume(39, fingerprint(40))
    t.steps(range(40, 50), batch_of=lambda s: s % 12)
    assert t.findings == []


def test_a_fresh_restart_is_not_a_resume():
    t = Trace()
    t.first_attempt()
    t.attempt += 1
    t.start(resumed=False)
    t.steps(range(0, 20))
    assert t.findings == []


# -- the reference trainer: resume faults and clean resumes -----------------------------------------

BASE = [*TINY, "--threads", "1", "--precision", "fp16", "--init-scale", str(2**24), "--checkpoint-every", "5"]
STEPS = 30


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """30 planned steps, crashed after step 16; the newest checkpoint is step 14 (resume at 15)."""
    out = tmp_path_factory.mktemp("base")
    run_trainer(out, *BASE, "--stop-at", "16", steps=STEPS)
    return out


def _resumed(interrupted: Path, tmp_path: Path, *inject: str, drop_newest: bool = False) -> Path:
    out = tmp_path / "run"
    shutil.copytree(interrupted, out)
    if drop_newest:  # resume from an older checkpoint: steps 10..16 are re-done, legitimately
        shutil.rmtree(sorted((out / "checkpoints").glob("step_*"))[-1])
    args = [a for spec in inject for a in ("--inject", spec)]
    run_trainer(out, *BASE, "--resume", str(out), *args, steps=STEPS)
    return out


def _anomalies(out: Path) -> list[dict]:
    storage = Storage(f"sqlite:///{out / 'pm.db'}")
    (run,) = import_file(out / "events.jsonl", storage)
    return [a for a in summarize(storage, run)["anomalies"] if a["kind"] == KIND]


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("resume_no_optimizer", "optimizer.load_state_dict was not called"),
        ("resume_data_replay", "data loader restarted at position 0"),
        ("resume_no_scaler", "GradScaler was not restored"),
    ],
)
def test_reference_trainer_resume_faults(interrupted, tmp_path, fault, words):
    out = _resumed(interrupted, tmp_path, f"{fault}@0")
    (lab,) = [x for x in json.loads((out / "labels.json").read_text()) if x["kind"] == fault]
    (a,) = _anomalies(out)
    assert a["first_step"] == lab["first_step"] == 15  # delay 0: at the first step after the resume
    assert words in a["hint"], a["hint"]


@pytest.mark.parametrize("older", [False, True], ids=["newest", "older-checkpoint"])
def test_reference_trainer_clean_resume_is_silent(interrupted, tmp_path, older):
    out = _resumed(interrupted, tmp_path, drop_newest=older)
    assert _anomalies(out) == []


# -- a resume seen only in a log (an imported file: no fingerprint, no checkpoint event) ------------------------------


def _log_event(kind: str, fields: dict[str, Any], seq: int) -> Event:
    return Event(kind, "r", 0, "h", "s", seq, float(seq), fields)


def _log_run(rows_before: list[tuple[int, float, float, float]], rows_after: list[tuple[int, float, float, float]]):
    """(step, loss, grad norm, lr) rows of an imported log, with a resumed attempt between them."""
    det = BadResume(BadResumeConfig())
    out: list[Finding] = []
    seq = 0
    for attempt, rows in enumerate((rows_before, rows_after)):
        if attempt == 0 and not rows:
            continue
        out += det.observe(_log_event("run_start", {"resumed": attempt > 0 or not rows_before}, seq), attempt)
        for step, loss, gn, lr in rows:
            seq += 1
            out += det.observe(
                _log_event("step", {"step": step, "loss": loss, "grad_norm": gn, "lr": [lr]}, seq), attempt
            )
    return out


def _cosine(step: int, total: int, peak: float = 2e-3) -> float:
    return 0.5 * peak * (1 + __import__("math").cos(__import__("math").pi * min(step, total) / total))


def test_a_resume_in_a_log_that_restarts_the_lr_schedule_is_flagged_at_its_first_step() -> None:
    # 82: a 1500-step cosine decayed to 0.0, resumed into a 4000-step plan: 0.0 -> 1.38e-3 at step 1501
    rng = random.Random(0)
    before = [(s, 1.15 + 0.05 * rng.random(), 0.8 + 0.3 * rng.random(), _cosine(s, 1500)) for s in range(1400, 1501)]
    after = [(s, 1.2 + 0.05 * rng.random(), 0.9 + 0.3 * rng.random(), _cosine(s, 4000)) for s in range(1501, 1520)]
    found = _log_run(before, after)
    assert [(f.step, f.severity, f.resolved) for f in found] == [(1501, "warning", False)]
    assert found[0].evidence["failed"] == ["lr"] and "schedule did not continue" in found[0].hint


def test_a_resume_in_a_log_whose_lr_and_loss_carry_on_is_silent() -> None:
    # 04: HF's epoch reset mid-run, the constant LR and the loss carry on
    rng = random.Random(1)
    before = [(s, 1.41 + 0.01 * rng.random(), 1.0 + 0.2 * rng.random(), 3e-6) for s in range(4000, 5051, 50)]
    after = [(s, 1.40 + 0.01 * rng.random(), 1.0 + 0.2 * rng.random(), 3e-6) for s in range(5100, 6000, 50)]
    assert _log_run(before, after) == []


def test_the_first_updates_after_a_resume_far_above_the_norms_before_are_a_shock() -> None:
    rng = random.Random(2)
    before = [(s, 3.0 + 0.02 * rng.random(), 0.5 + 0.1 * rng.random(), 3e-4) for s in range(100, 200)]
    after = [(200, 3.0, 12.5, 3e-4), (201, 3.3, 4.0, 3e-4), (202, 3.1, 1.0, 3e-4)] + [
        (s, 3.0, 0.5, 3e-4) for s in range(203, 220)
    ]
    found = _log_run(before, after)
    assert found and found[0].step == 200 and "shock" in found[0].evidence["failed"]


def test_a_log_that_starts_at_a_resume_with_a_shock_is_not_healthy() -> None:
    # issue 22: the first update's grad norm 25x the median of the steps after it, the loss 3.0 -> 4.0
    rng = random.Random(3)
    after = [(5001, 3.0, 25.0, 6e-4)] + [
        (s, 4.0 + 0.05 * rng.random(), 1.0 + 0.1 * rng.random(), 6e-4) for s in range(5002, 5040)
    ]
    found = _log_run([], after)
    assert found and found[0].step == 5001
    assert set(found[-1].evidence["failed"]) == {"shock", "loss"}


def test_a_log_that_starts_at_a_clean_resume_is_silent() -> None:
    rng = random.Random(4)
    after = [
        (s, 3.0 - 0.001 * (s - 5001) + 0.03 * rng.random(), 1.0 + 0.2 * rng.random(), 6e-4) for s in range(5001, 5060)
    ]
    assert _log_run([], after) == []


def test_a_resume_from_an_older_checkpoint_that_replays_its_lrs_is_not_a_shock() -> None:
    # the log went to step 200 (LR decayed 50x), then a restart from checkpoint 100 re-logs steps 101...
    rng = random.Random(5)

    def lr(s: int) -> float:
        return 1e-3 * (1 - s / 204)

    before = [(s, 2.0 + 0.02 * rng.random(), 1.0 + 0.1 * rng.random(), lr(s)) for s in range(1, 201)]
    after = [(s, 2.0 + 0.02 * rng.random(), 1.0 + 0.1 * rng.random(), lr(s)) for s in range(101, 130)]
    assert _log_run(before, after) == []


def _titan_line(t: float, msg: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(t))) + ",000"
    return f"[rank0]:[titan] {stamp} - root - INFO - {msg}\n"


def test_a_log_that_starts_right_after_loading_a_checkpoint_gets_its_resume_checked(tmp_path: Path) -> None:
    # issue 22: a torchtitan log that begins at 'Loading the checkpoint at step 5000': the first update's grad norm
    # 25x the median of the steps after it and the loss 3.0 -> 4.0 got HEALTHY
    rng = random.Random(7)
    t = 1.7e9
    text = _titan_line(t, "Starting job: Llama 3 8B training")
    text += _titan_line(t + 10, "Loading the checkpoint at step 5000.")
    text += _titan_line(t + 13, "Finished loading the checkpoint in 3.21 seconds.")
    text += _titan_line(t + 15, "Training starts at step 5001.")
    for step in range(5001, 5061):
        loss, gn = (3.0, 25.0) if step == 5001 else (4.0 + 0.05 * rng.random(), 1.0 + 0.1 * rng.random())
        text += _titan_line(
            t + 15 + 1.5 * (step - 5000),
            f"step: {step}  loss: {loss:7.4f}  grad_norm: {gn:7.4f}  memory: 45.67GiB(57.71%)  tps: 5,461  "
            "tflops: 316.25  mfu: 31.98%",
        )
    path = tmp_path / "titan.log"
    path.write_text(text)
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    (found,) = [a for a in summarize(storage, run)["anomalies"] if a["kind"] == KIND]
    assert found["first_step"] == 5001 and found["severity"] == "warning"
    assert "the log starts at this resume" in found["message"] and "first updates" in found["message"]
