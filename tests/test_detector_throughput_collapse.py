"""throughput_collapse: synthetic stalls and controls, then real reference-trainer runs."""

from __future__ import annotations

import random

import pytest
from trainer_helpers import TINY, read_labels, run_trainer

from trainmon.hooks.wire import Event
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.config import ThroughputCollapseConfig
from trainmon.monitor.detectors.throughput_collapse import ThroughputCollapse
from trainmon.monitor.store.storage import Storage

KIND = "throughput_collapse"


def _ev(kind: str, fields: dict, t: float) -> Event:
    return Event(kind, "r", 0, "host", "s0", 0, t, fields)


def trace(
    steps: int = 300,
    *,
    seed: int = 0,
    base: float = 0.2,
    noise: float = 0.05,
    edit=None,
    eval_every: int = 40,
    ckpt_every: int = 50,
    ckpt_event_seconds: dict[int, float] | None = None,
) -> list[Event]:
    """One rank's steps: jittered phases, slow first steps, eval and checkpoint windows as phases."""
    rng = random.Random(seed)
    t = 1e9
    out = [_ev("run_start", {"world_size": 1}, t)]
    for s in range(steps):
        b = base * rng.lognormvariate(0, noise) * (3.0 if s < 3 else 1.0)
        ph = {"data": 0.05 * b, "forward": 0.3 * b, "backward": 0.5 * b, "optimizer": 0.1 * b, "other": 0.05 * b}
        if eval_every and s and s % eval_every == 0:
            ph["eval"] = 4 * base
        if ckpt_every and s and s % ckpt_every == 0:
            ph["checkpoint"] = 6 * base
        if edit:
            edit(s, ph)
        dt = sum(ph.values())
        t += dt
        out.append(_ev("step", {"step": s, "tokens": 4096, "step_time": dt, "phases": ph}, t))
        if ckpt_event_seconds and s in ckpt_event_seconds:
            t += ckpt_event_seconds[s]
            out.append(_ev("checkpoint", {"step": s, "duration": ckpt_event_seconds[s]}, t))
    out.append(_ev("run_end", {"status": "finished", "step": steps - 1}, t))
    return out


def run(events: list[Event], config: ThroughputCollapseConfig | None = None):
    det = ThroughputCollapse(config or ThroughputCollapseConfig())
    return [f for e in events for f in det.observe(e, 0)]


def opened(findings):
    return [f for f in findings if not f.resolved]


@pytest.mark.parametrize("extra", [0.2, 0.6, 2.0])  # the data phase adds 1x, 3x, 10x the step
def test_data_stall_fires_within_window_names_data(extra: float) -> None:
    def stall(s, ph):
        if 150 <= s < 210:
            ph["data"] += extra

    found = run(trace(edit=stall))
    first = opened(found)[0]
    assert 150 <= first.step <= 158
    assert first.evidence["phase"] == "data" and "dataloader" in first.hint
    assert first.severity == "warning"  # escalates once the window is mostly slow
    assert ("critical" in {f.severity for f in opened(found)}) == (extra >= 0.6)
    resolved = [f for f in found if f.resolved]
    assert resolved and 210 <= resolved[0].step <= 230
    assert all(f.step < 210 for f in opened(found))


@pytest.mark.parametrize(
    ("phase", "cause"),
    [("comm", "NCCL"), ("forward", "throttling"), ("backward", "throttling"), ("optimizer", "optimizer")],
)
def test_names_the_phase_that_grew(phase: str, cause: str) -> None:
    def slow(s, ph):
        if s >= 120:
            ph[phase] = ph.get(phase, 0.0) + 0.3

    first = opened(run(trace(edit=slow)))[0]
    assert 120 <= first.step <= 128
    assert first.evidence["phase"] == phase and cause in first.hint


def test_periodic_gc_pauses_fire_and_stay_open() -> None:
    def gc(s, ph):
        if s >= 100 and (s - 100) % 5 == 0:
            ph["other"] += 1.5

    found = run(trace(edit=gc))
    first = opened(found)[0]
    assert 100 <= first.step <= 110
    assert first.evidence["phase"] == "other" and "GC" in first.hint
    assert not [f for f in found if f.resolved]


def test_one_long_step_is_not_a_collapse() -> None:
    def blip(s, ph):
        if s == 150:
            ph["other"] += 30.0  # e.g. a hang that cleared: hang's business, not a collapse

    assert run(trace(edit=blip)) == []


def test_slow_checkpoint_fires_at_its_step_and_routine_saves_do_not() -> None:
    saves = {49: 0.3, 99: 0.35, 149: 0.32, 175: 5.0, 199: 0.3}
    found = run(trace(ckpt_every=0, ckpt_event_seconds=saves))
    assert len(opened(found)) == 1
    f = opened(found)[0]
    assert f.step == 175 and f.severity == "warning" and f.evidence["phase"] == "checkpoint"
    assert "storage" in f.hint
    assert next(g.step for g in found if g.resolved) > 175


def test_first_save_stall_without_history() -> None:
    found = run(trace(ckpt_every=0, ckpt_event_seconds={60: 8.0}))
    assert [f.step for f in opened(found)] == [60]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("noise", [0.02, 0.1, 0.3])
def test_clean_traces_are_silent(seed: int, noise: float) -> None:
    saves = {49: 0.3, 99: 0.5, 149: 0.3}
    assert run(trace(seed=seed, noise=noise)) == []
    assert run(trace(seed=seed, noise=noise, ckpt_every=0, ckpt_event_seconds=saves)) == []


def test_no_verdict_without_baseline() -> None:
    def early(s, ph):
        if 4 <= s < 12:
            ph["data"] += 2.0

    assert run(trace(steps=20, edit=early)) == []


# -- the reference trainer -------------------------------------------------------------------------


def _anomalies(out, run_id: str) -> list[dict]:
    storage = Storage("sqlite://")
    import_file(out / "events.jsonl", storage)
    return [a for a in summarize(storage, run_id)["anomalies"] if a["kind"] == KIND]


COMMON = [*TINY, "--threads", "1", "--eval-every", "25", "--checkpoint-every", "30"]


@pytest.mark.parametrize(
    ("spec", "steps"),
    [
        ("data_stall@40:seconds=0.5,steps=3", 70),
        ("checkpoint_stall@40:seconds=2", 60),
        ("gc_pause@40", 60),  # the default 300,000 objects: pauses that dominate a step on any machine
    ],
)
def test_reference_trainer_fault(tmp_path, spec: str, steps: int) -> None:
    run_trainer(tmp_path, *COMMON, "--inject", spec, steps=steps, run="tc")
    (label,) = read_labels(tmp_path)
    found = _anomalies(tmp_path, "tc")
    assert found, f"no {KIND} for {spec}"
    first = min(a["first_step"] for a in found)
    assert label["first_step"] <= first <= label["first_step"] + 10, (spec, found)


def test_reference_trainer_clean_run_is_silent(tmp_path) -> None:
    run_trainer(tmp_path, *COMMON, steps=100, run="tc")
    assert _anomalies(tmp_path, "tc") == []
