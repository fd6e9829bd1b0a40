"""nan_inf's observe_batch moves a run of quiet steps' histories in one go (issue 24): it ends every batch in the
state, and with the outputs, of the detector fed one step at a time, on streams that switch between quiet stretches
and everything else a step can carry (exact zeros and -0.0, non-finite and missing losses and norms, skipped
overflows, norms at or below zero), with resumes, under the default and a tiny configuration."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.batch_state import check_batches
from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.nan_inf import NanInf
from trainmon.wire import Event


def _stream(seed: int, n: int = 4000) -> list[Event]:
    rng = random.Random(seed)
    evs = [start(framework=rng.choice(["hf", "csv"]))]
    regime = "quiet"
    for t in range(n):
        if rng.random() < 0.02:
            regime = rng.choice(["quiet", "quiet", "zeros", "nonfinite", "mixed", "no_norm"])
        loss: Any = rng.choice([2.0, 0.05, 30.0]) * math.exp(0.1 * rng.gauss(0, 1))
        norm: Any = math.exp(rng.gauss(0, 1))
        if regime == "zeros":
            loss = rng.choice([0.0, 0.0, -0.0, loss])
        elif regime == "nonfinite":
            loss, norm = rng.choice([(math.nan, norm), (loss, math.inf), (math.inf, math.nan), (loss, loss)])
        elif regime == "mixed":
            loss = rng.choice([loss, 0.0, math.nan, None, -1.0])
            norm = rng.choice([norm, 0.0, -1.0, math.nan, math.inf, None, 5e-324])
        elif regime == "no_norm":
            norm = None
        fields: dict[str, Any] = {"step": t}
        if loss is not None:
            fields["loss"] = loss
        if norm is not None:
            fields["grad_norm"] = norm
        if rng.random() < 0.05:
            fields["skipped"] = rng.random() < 0.5
        if rng.random() < 0.002:
            evs.append(start(resumed=rng.random() < 0.5, framework="hf"))
        evs.append(ev("step", fields, float(t)))
    return evs


_CONFIGS = [
    DetectorsConfig().nan_inf,
    dataclasses.replace(DetectorsConfig().nan_inf, precursor_window=3, resolve_after=2, zero_confirm=1, early_steps=2),
]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=["default", "tiny"])
def test_nan_inf_batches_keep_the_state_of_one_step_at_a_time(cfg: Any) -> None:
    rng = random.Random(24)
    found = sum(check_batches(NanInf, cfg, _stream(seed), rng) for seed in range(12))
    assert found > 50  # the streams open and close anomalies: the check is not only of quiet steps
