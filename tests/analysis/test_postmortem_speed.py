"""The shortcuts that make a long foreign log's post-mortem faster give exactly what the slow way gave.

Speed itself is measured by ``bench/postmortem.py --foreign``; these tests hold the equivalences
the speed-ups rest on: exact statistics (a detector compares them with thresholds, so "close" is
not enough), a CSV column read at once equal to its cells read one by one, and a grad-norm spike
judged with or without its loss exactly as before on traces where the two interact.
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.detectors.grad_explosion import GradExplosion
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.monitor.importers.common import to_float
from trainmon.monitor.importers.csv import _column_floats, parse_csv
from trainmon.monitor.importers.hf import _policy_reward
from trainmon.wire import Event

# Integers make ties (equal deviations on both sides of the median), which is where a selection
# of the k-th deviation from two sorted runs can go wrong.
values = st.one_of(
    st.integers(-5, 5).map(float),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    st.just(1e6 + 0.015625),
)


@settings(max_examples=800)
@given(st.lists(values, min_size=1, max_size=120), st.integers(1, 60))
def test_mad_is_exactly_the_median_of_the_deviations(xs: list[float], size: int) -> None:
    w = RollingWindow(size)
    for x in xs:
        w.add(x)
    kept = xs[-size:]
    m = statistics.median(kept)
    assert w.mad() == 1.4826 * statistics.median([abs(x - m) for x in kept])


cells = st.one_of(
    st.sampled_from(["", " ", "nan", "NaN", "inf", "-Infinity", " 2.5 ", "1e-3", "1_000", "abc", "0x10", "--1", "7"]),
    st.floats(allow_nan=True).map(repr),
    st.integers(-(10**20), 10**20).map(str),
)


@settings(max_examples=400)
@given(st.lists(cells, max_size=30))
def test_a_column_read_at_once_equals_its_cells_read_one_by_one(column: list[str]) -> None:
    got, every = _column_floats(column)
    want = [to_float(c) for c in column]
    assert every == all(x is not None for x in want)
    assert [None if x is None else (math.isnan(x) or x) for x in got] == [
        None if x is None else (math.isnan(x) or x) for x in want
    ]


def test_csv_blank_text_and_padded_cells(tmp_path: Path) -> None:
    """A blank loss is missing (not 0), a text LR drops the row's LR, padded numbers are numbers."""
    path = tmp_path / "history.csv"
    path.write_text(
        "_step,train/loss,train/learning_rate,train/grad_norm\n"
        "0, 2.5 ,1e-4,0.5\n"
        "1,,1e-4,0.6\n"
        "2,nan,warmup,0.7\n"
        "3,2.25,1e-4, \n"
    )
    items, _ = parse_csv(path)
    got = [(p.step, p.loss, p.lr, p.grad_norm) for p in items]
    assert got[0] == (0, 2.5, [1e-4], 0.5)
    assert got[1] == (1, None, [1e-4], 0.6)
    assert got[2][0] == 2 and math.isnan(got[2][1]) and got[2][2:] == (None, 0.7)
    assert got[3] == (3, 2.25, [1e-4], None)


def test_reward_key_found_as_before() -> None:
    """The first numeric reward key that is not an implicit preference reward or a spread."""
    assert _policy_reward({"loss": 0.1, "rewards/chosen": 1.0, "reward_std": 0.2, "reward": 0.5}) == "reward"
    assert _policy_reward({"loss": 0.1, "reward": "n/a", "train/episode_return": 3.0}) == "train/episode_return"
    assert _policy_reward({"loss": 0.1, "grad_norm": 1.0, "learning_rate": 1e-4}) is None


def _step(step: int, loss: float, norm: float) -> Event:
    fields = {"step": step, "loss": loss, "grad_norm": norm}
    return Event("step", "r", 0, "h", "s", step + 1, 1e9 + step, fields)


def _grad_findings(loss_factor: float) -> list:
    rng = random.Random(3)
    det = GradExplosion(CollectorConfig().detectors.grad_explosion)
    found = det.observe(Event("run_start", "r", 0, "h", "s", 0, 1e9, {}), 0)
    for s in range(400):
        loss = 2.0 * (1 + 0.01 * rng.gauss(0, 1)) * (loss_factor if s == 300 else 1.0)
        norm = 0.5 * (1 + 0.02 * abs(rng.gauss(0, 1))) * (40.0 if s == 300 else 1.0)
        found += det.observe(_step(s, loss, norm), 0)
    return found


def test_a_grad_spike_with_its_loss_is_the_loss_spikes_incident() -> None:
    """Whether the loss spiked with a grad-norm spike is judged when the spike opens its episode (no
    longer on every step): a one-step burst the loss shared is loss_spike's to report, one the loss
    did not share is grad_explosion's."""
    assert not [f for f in _grad_findings(loss_factor=6.0) if not f.resolved]
    alone = [f for f in _grad_findings(loss_factor=1.0) if not f.resolved]
    assert alone and alone[0].step == 300
