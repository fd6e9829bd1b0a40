"""trainmon.hooks.fingerprint: cheap state summaries whose save/load round trip compares equal."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from trainmon.fingerprint import compare_fingerprints
from trainmon.hooks.fingerprint import (
    batch_fingerprint,
    optimizer_summary,
    rng_hashes,
    scheduler_summary,
    state_fingerprint,
)
from trainmon.monitor.detectors.bad_resume import BadResume, BadResumeConfig
from trainmon.wire import Event


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_batch_fingerprint_is_stable_and_sensitive():
    x = torch.arange(64).view(4, 16)
    assert batch_fingerprint(x) == batch_fingerprint(x.clone())
    assert len(batch_fingerprint(x)) == 16
    y = x.clone()
    y[3, 15] += 1
    assert batch_fingerprint(x) != batch_fingerprint(y)
    assert batch_fingerprint(x) != batch_fingerprint(x.view(16, 4))  # the shape is part of it
    assert batch_fingerprint(x, y) != batch_fingerprint(y, x)
    assert batch_fingerprint(x.t()) == batch_fingerprint(x.t().contiguous())
    assert batch_fingerprint(torch.ones(3, dtype=torch.bfloat16))


def test_rng_hashes_follow_the_state():
    state = torch.get_rng_state()
    py = random.getstate()
    before = rng_hashes()
    assert set(before) >= {"python", "numpy", "torch"}
    torch.rand(3)
    random.random()
    after = rng_hashes()
    assert after["torch"] != before["torch"] and after["python"] != before["python"]
    assert after["numpy"] == before["numpy"]
    torch.set_rng_state(state)
    random.setstate(py)
    assert rng_hashes() == before


def test_optimizer_and_scheduler_summaries():
    model, opt, sched = _setup()
    fresh = optimizer_summary(opt)
    assert fresh == {
        "params": 4,
        "params_with_state": 0,
        "adam_step_min": 0,
        "adam_step_max": 0,
        "exp_avg_norm": 0.0,
        "exp_avg_sq_norm": 0.0,
    }
    _train(model, opt, sched, 3)
    s = optimizer_summary(opt)
    assert (s["params_with_state"], s["adam_step_min"], s["adam_step_max"]) == (4, 3, 3)
    assert s["exp_avg_norm"] > 0 and s["exp_avg_sq_norm"] > 0
    assert scheduler_summary(sched) == {"last_epoch": 3, "lrs": [1e-2 * 0.4]}


def test_round_trip_through_state_dicts_compares_equal():
    model, opt, sched = _setup()
    _train(model, opt, sched, 5)
    saved_state = (model.state_dict(), opt.state_dict(), sched.state_dict(), torch.get_rng_state())
    saved = state_fingerprint(next_step=5, tokens=50, data_position=5, optimizer=opt, scheduler=sched, model=model)
    assert saved["model"]["param_norm"] > 0

    model2, opt2, sched2 = _setup(seed=1)  # different init and RNG
    model2.load_state_dict(saved_state[0])
    opt2.load_state_dict(saved_state[1])
    sched2.load_state_dict(saved_state[2])
    torch.set_rng_state(saved_state[3])
    restored = state_fingerprint(
        next_step=5, tokens=50, data_position=5, optimizer=opt2, scheduler=sched2, model=model2
    )
    assert compare_fingerprints(saved, restored) == {}

    # a resume that forgets the optimizer and the data position is named key by key
    model3, opt3, sched3 = _setup()
    model3.load_state_dict(saved_state[0])
    sched3.load_state_dict(saved_state[2])
    torch.set_rng_state(saved_state[3])
    bad = state_fingerprint(next_step=5, tokens=50, data_position=0, optimizer=opt3, scheduler=sched3, model=model3)
    diff = compare_fingerprints(saved, bad)
    assert diff["optimizer.adam_step_max"] == (5, 0)
    assert diff["data_position"] == (5, 0)
    assert "model.model_hash" not in diff and "rng.torch" not in diff


def test_compare_fingerprints_rules():
    a = {"x": 1.0, "nested": {"n": [1.0, 2.0], "s": "h"}, "nan": float("nan"), "only_a": 1}
    b = {"x": 1.0 + 1e-9, "nested": {"n": [1.0, 2.5], "s": "h"}, "nan": float("nan"), "only_b": 2}
    assert compare_fingerprints(a, b) == {
        "nested.n": ([1.0, 2.0], [1.0, 2.5]),
        "only_a": (1, None),
        "only_b": (None, 2),
    }
    assert compare_fingerprints(a, b, ignore=["nested", "only_a", "only_b"]) == {}


def test_import_does_not_pull_torch_or_the_trainer_side():
    code = (
        "import sys, trainmon.fingerprint as f; f.compare_fingerprints({}, {}); "
        "assert not {'torch', 'trainmon.hooks'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_RNG_ROUND_TRIP = """
import json, sys
import numpy, torch
from trainmon.hooks.fingerprint import state_fingerprint

phase, path, use_numpy = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if phase == "save":
    torch.manual_seed(0)
    torch.randn(4)  # the run uses torch's RNG
    if use_numpy:
        numpy.random.rand(3)
    torch.save(torch.get_rng_state(), path + ".pt")
    print(json.dumps(state_fingerprint(next_step=10)))
else:  # a new process: torch's RNG restored, NumPy's neither seeded nor restored
    torch.set_rng_state(torch.load(path + ".pt"))
    print(json.dumps(state_fingerprint(next_step=10)))
"""


@pytest.mark.parametrize("use_numpy", [False, True], ids=["numpy-unused", "numpy-used"])
def test_an_rng_the_run_never_used_is_not_a_bad_resume(tmp_path, use_numpy):
    """Two real processes: a save and a resume that restores torch's RNG only."""

    def fingerprint(phase: str) -> dict:
        args = [sys.executable, "-c", _RNG_ROUND_TRIP, phase, str(tmp_path / "rng"), "1" if use_numpy else "0"]
        return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)

    saved, restored = fingerprint("save"), fingerprint("load")
    det = BadResume(BadResumeConfig())
    events = [
        ("run_start", {"resumed": False}, 0),
        ("checkpoint", {"step": 9, "fingerprint": saved}, 0),
        ("run_start", {"resumed": True}, 1),
        ("resume", {"step": 9, "fingerprint": restored}, 1),
    ]
    found = []
    for seq, (kind, fields, attempt) in enumerate(events):
        found += det.observe(Event(kind, "r", 0, "h", f"s{attempt}", seq, 1e9 + seq, fields), attempt)
    if use_numpy:  # used and not restored: still the bug it is
        (f,) = found
        assert "rng.numpy" in f.message and "rng.torch" not in f.message
    else:
        assert found == [], found[0].message
        assert saved["rng_unused"] == ["numpy", "python"]
