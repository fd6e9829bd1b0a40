"""LR schedules: the shapes the monitor will hold the trainer to."""

from __future__ import annotations

import math

import pytest

from trainmon.hooks.schedules import Schedule


def test_cosine_warms_up_linearly_then_decays_to_the_floor() -> None:
    s = Schedule("cosine", peak_lr=1e-3, total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert s.lr(0) == pytest.approx(1e-4)
    assert s.lr(9) == pytest.approx(1e-3)
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
    assert Schedule("inverse_sqrt", 1.0, 1000, 100).lr(399) == pytest.approx(math.sqrt(100 / 400))


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
    ],
)
def test_bad_schedule_names_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Schedule.from_dict(raw)
