"""degenerate's observe_batch moves a run of quiet steps' histories in one go (issue 24): it ends every batch in the
state, and with the outputs, of the detector fed one step at a time, on streams that switch between quiet stretches
and saturation (exact zero losses with vanishing grad norms), no-op steps (zero grad norms), non-finite and missing
losses and norms, skipped overflows and evals, with resumes, under the default and a tiny configuration."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.batch_state import check_batches
from tests.detectors.helpers import ev, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.degenerate import Degenerate
from trainmon.wire import Event


def _stream(seed: int, n: int = 4000) -> list[Event]:
    rng = random.Random(seed)
    evs = [start()]
    regime = "quiet"
    for t in range(n):
        if rng.random() < 0.02:
            regime = rng.choice(["quiet", "quiet", "saturated", "noop", "nonfinite", "mixed", "no_norm"])
        loss: Any = 2.0 * math.exp(0.1 * rng.gauss(0, 1))
        norm: Any = math.exp(rng.gauss(0, 1))
        if regime == "saturated":
            loss, norm = rng.choice([(0.0, 1e-9), (0.0, 2e-9), (-0.0, 1e-9), (0.0, None), (loss, norm)])
        elif regime == "noop":
            norm = rng.choice([0.0, 0.0, -0.0, norm])
        elif regime == "nonfinite":
            loss, norm = rng.choice([(math.nan, norm), (loss, math.inf), (math.inf, 0.0), (None, 0.0)])
        elif regime == "mixed":
            loss = rng.choice([loss, 0.0, math.nan, None, -1.0])
            norm = rng.choice([norm, 0.0, -1.0, math.nan, math.inf, -math.inf, None])
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
            evs.append(start(resumed=rng.random() < 0.5))
        if rng.random() < 0.005:
            evs.append(ev("eval", {"step": t, "loss": math.log(4) * (1 + 0.0001 * rng.gauss(0, 1))}, float(t)))
        evs.append(ev("step", fields, float(t)))
    return evs


_CONFIGS = [
    DetectorsConfig().degenerate,
    dataclasses.replace(DetectorsConfig().degenerate, saturated_entries=1, noop_min=3, noop_update=4),
]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=["default", "tiny"])
def test_degenerate_batches_keep_the_state_of_one_step_at_a_time(cfg: Any) -> None:
    rng = random.Random(24)
    found = sum(check_batches(Degenerate, cfg, _stream(seed), rng) for seed in range(12))
    assert found > 20  # the streams open and close findings: the check is not only of quiet steps
