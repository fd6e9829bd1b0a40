"""LR schedules: the shapes the monitor will hold the trainer to."""

from __future__ import annotations

import math

import pytest

from trainmon.schedules import Schedule, declared_schedule


def test_cosine_warms_up_linearly_from_zero_then_decays_to_the_floor() -> None:
    s = Schedule("cosine", peak_lr=1e-3, total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert s.lr(0) == 0.0  # step / warmup_steps, as transformers warms up
    assert s.lr(9) == pytest.approx(0.9e-3)
    assert s.lr(10) == pytest.approx(1e-3)
    assert s.lr(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway through the decay
    assert s.lr(110) == pytest.approx(1e-4)
    assert s.lr(500) == pytest.approx(1e-4)  # past the end: stays at the floor


def test_wsd_is_flat_until_the_decay_window() -> None:
    s = Schedule("wsd", peak_lr=2e-3, total_steps=100, warmup_steps=10, min_ratio=0.0, decay_fraction=0.2)
    assert s.lr(50) == s.lr(79) == pytest.approx(2e-3)
    assert s.lr(90) == pytest.approx(1e-3)
    assert s.lr(100) == pytest.approx(0.0)


def test_linear_constant_and_inverse_sqrt() -> None:
    assert Schedule("linear", 1.0, 100, 0, 0.0).lr(50) == pytest.approx(0.5)
    assert Schedule("constant", 1.0, 100, 5).lr(99) == 1.0
    assert Schedule("inverse_sqrt", 1.0, 1000, 100).lr(400) == pytest.approx(math.sqrt(100 / 400))
    assert Schedule("cosine", 1.0, 100).lr(100) == 0.0  # to 0 by default, as transformers and torch


def test_warmup_from_a_start_factor_and_half_cosine_warmup() -> None:
    s = Schedule("linear", 1.0, 100, 10, warmup_start=0.2)
    assert s.lr(0) == pytest.approx(0.2) and s.lr(5) == pytest.approx(0.6) and s.lr(10) == 1.0
    c = Schedule("cosine", 1.0, 100, 10, warmup_start=0.2, warmup_shape="cosine")
    assert c.lr(0) == pytest.approx(0.2) and c.lr(5) == pytest.approx(0.6) and c.lr(2) < 0.2 + 0.8 * 0.2


def test_round_trip_through_a_dict() -> None:
    s = Schedule("wsd", 3e-4, 1000, 50, 0.05, 0.1)
    assert Schedule.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"name": "cosine", "peak_lr": 1e-3, "total_steps": 10, "warmup": 3}, "schedule.warmup"),
        ({"name": "step", "peak_lr": 1e-3, "total_steps": 10}, "schedule.name"),
        ({"name": "cosine", "peak_lr": -1.0, "total_steps": 10}, "schedule.peak_lr"),
        ({"name": "cosine", "peak_lr": 1e-3, "total_steps": 10, "warmup_steps": 11}, "schedule.warmup_steps"),
        ({"name": "cosine", "peak_lr": "1e-3", "total_steps": 10}, "schedule.peak_lr"),
        ({"name": "cosine", "peak_lr": 1e-3, "total_steps": 10.5}, "schedule.total_steps"),
        ({"name": "cosine", "peak_lr": 1e-3, "total_steps": 10, "warmup_start": 2}, "schedule.warmup_start"),
        ({"name": "cosine", "peak_lr": 1e-3, "total_steps": 10, "warmup_shape": "exp"}, "schedule.warmup_shape"),
        ({"name": "cosine", "total_steps": 10}, "schedule.peak_lr"),
    ],
)
def test_bad_schedule_names_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Schedule.from_dict(raw)


# -- the schedule a scheduler follows ------------------------------------------------------------

torch = pytest.importorskip("torch")
hf_optim = pytest.importorskip("transformers.optimization")
L = torch.optim.lr_scheduler
N, W, PEAK = 60, 7, 3e-3


def _opt(groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": PEAK / (g + 1)} for g in range(groups)]
    return torch.optim.AdamW(params, lr=PEAK)


def _cosine_then_warmup(o: torch.optim.Optimizer) -> L.LRScheduler:
    warm = L.LinearLR(o, start_factor=0.01, total_iters=W)
    return L.SequentialLR(o, [warm, L.CosineAnnealingLR(o, T_max=N - W, eta_min=PEAK / 20)], milestones=[W])


def _linear_after_warmup(o: torch.optim.Optimizer) -> L.LRScheduler:
    warm = L.LinearLR(o, start_factor=0.25, total_iters=W)
    return L.SequentialLR(o, [warm, L.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=N - W)], [W])


SUPPORTED = {
    "LambdaLR(Schedule.factor)": lambda o: L.LambdaLR(o, Schedule("wsd", 1.0, N, W, 0.05, 0.3).factor),
    "hf cosine": lambda o: hf_optim.get_cosine_schedule_with_warmup(o, W, N),
    "hf cosine, 3 groups": lambda o: hf_optim.get_cosine_schedule_with_warmup(o, W, N),
    "hf cosine_with_min_lr": lambda o: hf_optim.get_cosine_with_min_lr_schedule_with_warmup(o, W, N, min_lr_rate=0.1),
    "hf linear": lambda o: hf_optim.get_linear_schedule_with_warmup(o, W, N),
    "hf constant": lambda o: hf_optim.get_constant_schedule(o),
    "hf constant with warmup": lambda o: hf_optim.get_constant_schedule_with_warmup(o, W),
    "hf polynomial power 1": lambda o: hf_optim.get_polynomial_decay_schedule_with_warmup(o, W, N, lr_end=1e-5),
    "hf inverse_sqrt": lambda o: hf_optim.get_inverse_sqrt_schedule(o, W),
    "hf wsd linear": lambda o: hf_optim.get_wsd_schedule(o, W, 20, num_training_steps=N, decay_type="linear"),
    "hf wsd cosine warmup": lambda o: hf_optim.get_wsd_schedule(
        o, W, 20, num_stable_steps=30, warmup_type="cosine", decay_type="linear", min_lr_ratio=0.1
    ),
    "hf get_scheduler cosine": lambda o: hf_optim.get_scheduler("cosine", o, W, N),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=N, eta_min=1e-5),
    "CosineAnnealingLR, 3 groups": lambda o: L.CosineAnnealingLR(o, T_max=N),
    "LinearLR decay": lambda o: L.LinearLR(o, start_factor=1.0, end_factor=0.2, total_iters=N),
    "LinearLR warmup": lambda o: L.LinearLR(o, start_factor=0.1, total_iters=W),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=PEAK, total_steps=50, pct_start=0.2),  # warmup 0.2 * 50 - 1
    "OneCycleLR, 3 groups": lambda o: L.OneCycleLR(o, max_lr=[PEAK, PEAK / 2, PEAK / 3], total_steps=50),
    "OneCycleLR linear": lambda o: L.OneCycleLR(o, PEAK, total_steps=50, pct_start=0.2, anneal_strategy="linear"),
    "SequentialLR(LinearLR, CosineAnnealingLR)": _cosine_then_warmup,
    "SequentialLR(LinearLR, LinearLR)": _linear_after_warmup,
}


@pytest.mark.parametrize("name", SUPPORTED)
def test_declared_schedule_is_the_lr_the_scheduler_gives_at_every_step(name: str) -> None:
    o = _opt(3 if "3 groups" in name else 1)
    sched = SUPPORTED[name](o)
    declared = Schedule.from_scheduler(sched, planned_steps=N)
    assert declared is not None
    assert Schedule.from_dict(declared.to_dict()) == declared  # the wire form carries all of it
    ratios = [g["initial_lr"] / o.param_groups[0]["initial_lr"] for g in o.param_groups]
    end = declared.total_steps  # the end of the decay (OneCycleLR cannot step further)
    for step in range(end + 1):
        for g, ratio in zip(o.param_groups, ratios, strict=True):
            assert g["lr"] == pytest.approx(declared.lr(step) * ratio, rel=1e-9, abs=1e-15), (name, step)
        o.step()
        if step < end:
            sched.step()


def test_presets_are_the_transformers_schedules() -> None:
    """Schedule("cosine"/"linear", ...) with defaults is get_*_schedule_with_warmup, step for step."""
    for name, make in (
        ("cosine", hf_optim.get_cosine_schedule_with_warmup),
        ("linear", hf_optim.get_linear_schedule_with_warmup),
    ):
        o = _opt()
        sched, declared = make(o, 30, 300), Schedule(name, PEAK, 300, 30)
        for step in range(301):
            assert o.param_groups[0]["lr"] == pytest.approx(declared.lr(step), rel=1e-9, abs=1e-15), (name, step)
            o.step()
            sched.step()


UNREADABLE = {
    "a plain lambda": lambda o: L.LambdaLR(o, lambda s: 1 - s / N),
    "different lambdas for 3 groups": lambda o: L.LambdaLR(
        o, [Schedule("cosine", 1.0, N).factor, Schedule("linear", 1.0, N).factor, Schedule("linear", 1.0, N).factor]
    ),
    "hf cosine with 2 cycles": lambda o: hf_optim.get_cosine_schedule_with_warmup(o, W, N, num_cycles=2.0),
    "hf hard restarts": lambda o: hf_optim.get_cosine_with_hard_restarts_schedule_with_warmup(o, W, N),
    "hf polynomial power 2": lambda o: hf_optim.get_polynomial_decay_schedule_with_warmup(o, W, N, power=2.0),
    "hf inverse_sqrt, own timescale": lambda o: hf_optim.get_inverse_sqrt_schedule(o, W, timescale=100),
    "hf wsd cosine decay": lambda o: hf_optim.get_wsd_schedule(o, W, 20, num_training_steps=N),
    "eta_min with groups at other LRs": lambda o: L.CosineAnnealingLR(o, T_max=N, eta_min=1e-5),
    "LinearLR between two factors": lambda o: L.LinearLR(o, start_factor=0.5, end_factor=0.1, total_iters=N),
    "OneCycleLR three_phase": lambda o: L.OneCycleLR(o, PEAK, total_steps=N, three_phase=True),
    "OneCycleLR warmup ending between steps": lambda o: L.OneCycleLR(o, PEAK, total_steps=10, pct_start=0.25),
    "StepLR": lambda o: L.StepLR(o, step_size=10),
    "SequentialLR with a short warmup": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, 0.1, total_iters=3), L.CosineAnnealingLR(o, T_max=N)], milestones=[W]
    ),
    "a subclass": lambda o: type("Mine", (L.CosineAnnealingLR,), {})(o, T_max=N),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_a_scheduler_that_cannot_be_said_exactly_declares_nothing(name: str) -> None:
    o = _opt(3 if "groups" in name else 1)
    assert Schedule.from_scheduler(UNREADABLE[name](o), planned_steps=N) is None


def test_declared_schedule_takes_the_object_or_its_wire_dict() -> None:
    s = Schedule("cosine", 1e-3, 100, 10)
    assert declared_schedule(s) == declared_schedule(s.to_dict()) == s
    assert declared_schedule(None) is None
    o = _opt()
    assert declared_schedule(None, hf_optim.get_linear_schedule_with_warmup(o, 5, 50)) == Schedule(
        "linear", PEAK, 50, 5
    )
    assert declared_schedule(s, L.CosineAnnealingLR(o, T_max=3)) == s  # what the user says wins
    with pytest.raises(ValueError, match=r"schedule\.total_steps"):
        declared_schedule({**s.to_dict(), "total_steps": "100"})
    with pytest.raises(ValueError, match=r"schedule\.name: missing"):
        declared_schedule({"peak_lr": 1e-3, "total_steps": 10})
    with pytest.raises(ValueError, match=r"schedule: expected a Schedule or its dict"):
        declared_schedule([1, 2])  # type: ignore[arg-type]
