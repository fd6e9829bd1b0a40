"""The shortcuts of divergence (its EMA in lanes) and nan_inf (grad norms asked whether absent only where not
finite) hold to the values of the plain definition, bit for bit, including where they must give up and hand over
to it."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from tests.detectors.batch_state import check_batches
from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import divergence
from trainmon.monitor.detectors.divergence import _LANES_FROM, _medians, _smoothed, _smoothed_all
from trainmon.monitor.detectors.nan_inf import NanInf


def _bits(values: np.ndarray) -> list[int]:
    bits: list[int] = np.asarray(values, dtype=np.float64).view(np.int64).tolist()
    return bits


def _series(n: int, seed: int, kind: str) -> np.ndarray:
    rng = random.Random(seed)
    if kind == "falling":
        raw = [(2.0 + 8.0 * math.exp(-i / 3000)) * math.exp(0.05 * rng.gauss(0, 1)) for i in range(n + 4)]
    elif kind == "spiky":  # jumps of many orders of magnitude: the lanes' approximate starts are far off
        raw = [10.0 ** rng.choice([-3, 0, 2, 5]) * (1 + 0.1 * rng.random()) for _ in range(n + 4)]
    elif kind == "tiny":  # subnormal losses: roundings are not relative there
        raw = [5e-324 * rng.randint(1, 40) for _ in range(n + 4)]
    else:  # "huge": the EMA overflows
        raw = [1e308 * (1 + rng.random()) / 1.5 for _ in range(n + 4)]
    return _medians(np.array(raw), 5)


@pytest.mark.parametrize("kind", ["falling", "spiky", "tiny", "huge"])
@pytest.mark.parametrize("n", [_LANES_FROM - 1, _LANES_FROM, 5000, 5017])
def test_the_lanes_give_the_loops_ema_bit_for_bit(kind: str, n: int) -> None:
    med = _series(n, n, kind)
    for ema in (float(med[0]), 3.25, 1e300):
        for alpha in (0.3, 0.5, 0.05):
            want = np.array(_smoothed(ema, alpha, med.tolist()))
            got = _smoothed_all(ema, alpha, med)
            assert _bits(got) == _bits(want)


def test_a_real_looking_loss_is_smoothed_in_lanes_not_by_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lanes meet on a noisy falling loss (else the shortcut would only ever cost): the loop is not called."""
    med = _series(5000, 1, "falling")
    want = _bits(np.array(_smoothed(4.0, 0.3, med.tolist())))
    calls: list[object] = []

    def loop(*args: object) -> list[float]:
        calls.append(args)
        return []

    monkeypatch.setattr(divergence, "_smoothed", loop)
    assert _bits(_smoothed_all(4.0, 0.3, med)) == want
    assert not calls


def test_lanes_that_do_not_meet_hand_the_whole_run_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lead too short to meet (one entry, from a start far off) is caught by the bitwise check."""
    med = _series(5000, 2, "spiky")
    monkeypatch.setattr(divergence, "_LEAD", 1)
    want = _bits(np.array(_smoothed(1.0, 0.3, med.tolist())))
    calls: list[float] = []

    def loop(ema: float, alpha: float, medians: list[float]) -> list[float]:
        calls.append(ema)
        return _smoothed(ema, alpha, medians)

    monkeypatch.setattr(divergence, "_smoothed", loop)
    assert _bits(_smoothed_all(1.0, 0.3, med)) == want
    assert len(calls) == 1


@pytest.mark.parametrize("norms", ["none", "all", "some", "nan"])
def test_nan_inf_reads_grad_norms_absent_from_a_batch_or_only_from_some_steps_as_one_step_at_a_time(norms: str) -> None:
    """Whether a step's grad norm is fine is asked only of those not finite (absent: fine; NaN: not), and of none in
    a batch that carries no grad norm at all: the same state and outputs as observe either way."""
    rng = random.Random(16)
    events = [start()]
    for t in range(6000):
        fields: dict[str, Any] = {"step": t, "loss": 2.0 * math.exp(0.1 * rng.gauss(0, 1))}
        if norms == "all" or (norms != "none" and rng.random() < 0.5):
            fields["grad_norm"] = math.nan if norms == "nan" and rng.random() < 0.001 else rng.random() + 0.5
        events.append(ev("step", fields, float(t)))
    found = check_batches(NanInf, DetectorsConfig().nan_inf, events, rng)
    assert found if norms == "nan" else not found
