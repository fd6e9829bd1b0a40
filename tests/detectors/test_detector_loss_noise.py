"""loss_noise: a sustained rise of the loss's step-to-step noise at a steady LR fires; warmup, decay, a
spike, a re-warm, a memorising descent and a resume do not."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from tests.detectors.helpers import ev, feed, run_reference, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.schedules import Schedule
from trainmon.wire import Event

STEPS = 1200
SCHEDULE = Schedule("cosine", 1e-3, STEPS, 50)


def _det() -> LossNoise:
    return LossNoise(DetectorsConfig().loss_noise)


def _run(
    seed: int,
    noise: float = 0.03,
    *,
    louder_from: int | None = None,
    factor: float = 3.0,
    lr=SCHEDULE.lr,
    level=None,
    fingerprints: bool = False,
) -> list[Event]:
    """A loss decaying to a floor with multiplicative noise (``factor`` x from ``louder_from``), a declared
    warmup + cosine schedule followed exactly."""
    rng = random.Random(seed)
    level = level or (lambda t: 1.8 + 3.7 * math.exp(-t / 120))
    evs = [start(schedule=SCHEDULE.to_dict())]
    for t in range(STEPS):
        sigma = noise * (factor if louder_from is not None and t >= louder_from else 1.0)
        fields = {"step": t, "loss": level(t) * math.exp(sigma * rng.gauss(0, 1)), "lr": [lr(t)]}
        if fingerprints:
            fields["batch_fingerprint"] = f"{seed}-{t}"
        evs.append(ev("step", fields, float(t)))
    return evs


def _opened(findings) -> list:
    return [f for f in findings if not f.resolved]


@pytest.mark.parametrize(("seed", "noise"), [(1, 0.01), (2, 0.03), (3, 0.08)])
def test_noise_tripling_fires_within_a_window(seed: int, noise: float) -> None:
    """3x: clean real logs wander up to 2x for 100+ entries, so a doubling is not told from them."""
    found = _opened(feed(_det(), _run(seed, noise, louder_from=600)))
    assert found, "a tripled noise at a steady LR must be found"
    first = found[0]
    # the recent window's MAD passes 2.2x once about half of it is louder, then the streak holds 80 entries
    # (it restarts when the window's MAD dips under 1.6x, which a 50-entry MAD of a 3x noise now and then does)
    assert 600 + 80 <= first.step <= 600 + 300
    assert first.severity == "warning"
    assert first.evidence["relative_ratio"] >= 2.2 and first.evidence["absolute_ratio"] >= 1.6
    assert 600 <= first.evidence["rise_first_seen"] <= first.step
    assert "sequence-level shuffling" in first.hint and "no batch fingerprints" in first.hint
    assert all(f.severity == "warning" for f in found)


@pytest.mark.parametrize("seed", range(6))
def test_clean_run_with_warmup_and_cosine_decay_is_silent(seed: int) -> None:
    assert feed(_det(), _run(seed, noise=[0.005, 0.03, 0.08][seed % 3])) == []


def test_a_single_spike_is_silent() -> None:
    evs = _run(7)
    evs[700].fields["loss"] *= 4.0  # loss_spike's job
    assert feed(_det(), evs) == []


def test_noise_from_a_higher_lr_is_silent() -> None:
    """A re-warm to twice the LR is noisier by itself (here 3x): not a data problem."""
    evs = _run(8, louder_from=600, lr=lambda t: 1e-3 if t < 600 else 2e-3)
    assert feed(_det(), evs) == []


def test_memorising_descent_is_silent() -> None:
    """A loss falling towards zero with a constant absolute noise: its relative noise grows, its absolute does not."""
    rng = random.Random(9)
    evs = [start()]
    for t in range(STEPS):
        level = 0.05 + 1.5 * math.exp(-t / 300)
        evs.append(ev("step", {"step": t, "loss": max(1e-4, level + 0.01 * rng.gauss(0, 1)), "lr": [1e-4]}, t))
    assert feed(_det(), evs) == []


def test_fingerprints_tell_new_batches_from_replayed_ones() -> None:
    found = _opened(feed(_det(), _run(2, louder_from=600, fingerprints=True)))
    assert found and "all distinct" in found[0].hint
    assert found[0].evidence["batch_fingerprints"]["repeated"] == 0
    replay = _run(2, louder_from=600, fingerprints=True)
    for e in replay[700:]:  # a sampler cycling over the same 10 batches
        e.fields["batch_fingerprint"] = f"b{e.fields['step'] % 10}"
    found = _opened(feed(_det(), replay))
    assert found and "replayed" in found[0].hint


def test_noise_back_to_baseline_resolves() -> None:
    evs = _run(2, louder_from=600)
    rng = random.Random(5)
    for e in evs[901:]:  # quiet again from step 900
        t = e.fields["step"]
        e.fields["loss"] = (1.8 + 3.7 * math.exp(-t / 120)) * math.exp(0.03 * rng.gauss(0, 1))
    found = feed(_det(), evs)
    assert found[0].step >= 600 and not found[0].resolved
    assert found[-1].resolved and found[-1].step > 900


def test_a_resume_is_judged_afresh() -> None:
    """A resumed attempt with louder noise has no baseline of its own yet: the earlier attempt's is not used."""
    first = _run(3)[:700]
    resumed = _run(3, louder_from=0)[700:]
    resume = start(resumed=True, schedule=SCHEDULE.to_dict())
    assert feed(_det(), [*first, resume, *resumed[:200]]) == []


def test_reference_trainer_unshuffled_fires_and_its_clean_twin_does_not(tmp_path: Path) -> None:
    """The reference trainer with ``--inject unshuffled@280`` (every batch one document), analysed like
    ``trainmon postmortem``: loss_noise fires after 280; the same run without the fault is silent."""
    anomalies, labels = run_reference(tmp_path, "unshuffled", "--inject", "unshuffled@280", steps=440)
    assert labels == [
        {
            "kind": "unshuffled",
            "rank": 0,
            "first_step": 280,
            "last_step": 439,
            "expected_detection": "loss_noise",
            "spec": "unshuffled@280",
            "params": {"docs": 1},
        }
    ]
    noise = [a for a in anomalies if a["kind"] == "loss_noise"]
    assert len(noise) == 1 and 280 <= noise[0]["first_step"] <= 439, noise
    assert noise[0]["severity"] == "warning" and "all distinct" in noise[0]["hint"]
    clean, _ = run_reference(tmp_path, "shuffled", steps=440)
    assert [a for a in clean if a["kind"] == "loss_noise"] == []
