"""degenerate: a saturated objective, no-op steps, a model stuck at chance, a classifier collapsed to one class."""

from __future__ import annotations

import math
import random

from tests.detectors.helpers import ev, feed, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.degenerate import Degenerate


def _det() -> Degenerate:
    return Degenerate(DetectorsConfig().degenerate)


def _steps(rows) -> list:
    return [
        ev("step", {"step": s, "loss": loss, **({"grad_norm": gn} if gn is not None else {})}) for s, loss, gn in rows
    ]


def test_a_preference_loss_at_exactly_zero_with_a_vanishing_gradient_is_saturated() -> None:
    # 81: DPO 0.6931 (ln 2, the normal start), 0.1628, then exactly 0.0 with grad norms ~1e-8
    rows = [(1, 0.6931, 1628.4), (10, 0.1628, 0.0139), (20, 0.0, 1.7e-8), (30, 0.0, 8.1e-8)]
    found = feed(_det(), [start(config={"preference": {"rewards/accuracies": [[20, 1.0], [30, 1.0]]}}), *_steps(rows)])
    assert [(f.step, f.severity) for f in found] == [(20, "warning")]
    assert "saturated" in found[0].message and "rewards/accuracies 1" in found[0].message
    assert "not NaN" in found[0].hint


def test_a_loss_that_rounds_to_zero_while_its_gradient_stays_is_not_saturated() -> None:
    # 38: 0.0002, 0.0001, then 0.0 (4 printed digits), grad norm still 5e-4
    rows = [
        (10 * i, max(0.0, 0.85 * math.exp(-i / 3) - 0.0001 * (i > 20)), 0.001 * math.exp(-i / 60)) for i in range(1, 60)
    ]
    rows = [(s, round(v, 4), g) for s, v, g in rows]
    assert sum(v == 0.0 for _, v, _ in rows) > 10
    assert feed(_det(), [start(), *_steps(rows)]) == []


def test_zeros_without_a_gradient_logged_are_left_to_nan_inf() -> None:
    rows = [(1, 2.0, None), (2, 0.5, None), (3, 0.0, None), (4, 0.0, None), (5, 0.0, None)]
    assert feed(_det(), [start(), *_steps(rows)]) == []


def test_exactly_zero_grad_norms_on_a_fifth_of_the_steps_are_no_op_steps() -> None:
    rng = random.Random(0)
    rows = [(10 * i, 0.3 + 0.05 * rng.random(), 0.0 if rng.random() < 0.5 else 5 + rng.random()) for i in range(1, 101)]
    first_zero = next(s for s, _, g in rows if g == 0.0)
    found = feed(_det(), [start(), *_steps(rows)])
    assert found and found[0].step == first_zero and found[0].severity == "warning"
    assert "no gradient" in found[0].message and not any(f.resolved for f in found)


def test_a_grad_norm_always_zero_is_a_placeholder_not_no_op_steps() -> None:
    rows = [(i, 3.0 - 0.01 * i, 0.0) for i in range(1, 200)]
    assert feed(_det(), [start(), *_steps(rows)]) == []


def test_near_zero_grad_norms_are_not_no_op_steps() -> None:
    # 88 GRPO: groups with identical rewards give grad norms of 0.002, not 0.0
    rng = random.Random(1)
    rows = [(5 * i, 3e-4, 0.002 if rng.random() < 0.3 else 0.6) for i in range(1, 200)]
    assert feed(_det(), [start(), *_steps(rows)]) == []


def _evals(losses, accs=None, start_step=50, every=50):
    out = []
    for i, loss in enumerate(losses):
        metrics = {"accuracy": accs[i]} if accs else {}
        out.append(ev("eval", {"step": start_step + every * i, "loss": loss, "metrics": metrics}))
    return out


def test_eval_loss_at_ln4_for_every_eval_is_stuck_at_chance() -> None:
    rng = random.Random(2)
    losses = [math.log(4) - rng.uniform(0, 0.0007) for _ in range(20)]
    accs = [0.25 + rng.uniform(-0.02, 0.05) for _ in range(20)]
    train = [ev("step", {"step": s, "loss": 1.39 + 0.01 * rng.random()}) for s in range(1, 40)]
    found = feed(_det(), [start(), *train, *_evals(losses, accs)])
    assert found and found[0].step == 50 and "ln 4" in found[0].message
    assert not any(f.resolved for f in found)


def test_a_huge_eval_loss_is_no_class_count_and_does_not_crash() -> None:
    # the API fuzz sent an eval loss of 1e300: exp() overflowed inside the detector (a traceback in the collector)
    assert feed(_det(), [start(), *_evals([1e300, 750.0, 1e300, 750.0, 1e300, 750.0])]) == []


def test_a_flat_eval_loss_near_the_log_of_a_large_integer_is_not_chance() -> None:
    # 109: 4.12-4.13 is within 0.2% of ln 62 (and of ln 61, ln 63): it identifies no K
    rng = random.Random(3)
    assert feed(_det(), [start(), *_evals([4.127 + rng.uniform(-0.004, 0.004) for _ in range(8)])]) == []


def test_a_model_that_learns_away_from_chance_is_not_stuck() -> None:
    losses = [math.log(4) * (1 - 0.02 * i) for i in range(20)]
    assert feed(_det(), [start(), *_evals(losses, [0.25 + 0.03 * i for i in range(20)])]) == []


def test_recall_one_and_accuracy_equal_to_precision_is_a_collapse_to_one_class() -> None:
    # 84: every example predicted positive at the first eval; the trainer's best is that checkpoint
    evs = [
        start(config={"best_model_checkpoint": "./out/checkpoint-43"}),
        ev(
            "eval",
            {
                "step": 43,
                "loss": 0.6676,
                "metrics": {"accuracy": 0.6056, "precision": 0.6056, "recall": 1.0, "f1": 0.7544},
            },
        ),
        ev(
            "eval", {"step": 87, "loss": 0.6604, "metrics": {"accuracy": 0.6056, "precision": 0.6119, "recall": 0.9535}}
        ),
    ]
    found = feed(_det(), evs)
    assert [f.step for f in found] == [43, 87] and not any(f.resolved for f in found)
    assert "best checkpoint is this one" in found[0].message and "entropy" in found[0].message


def test_a_perfect_or_a_working_classifier_is_not_collapsed() -> None:
    evs = [
        ev("eval", {"step": 10, "loss": 0.01, "metrics": {"accuracy": 1.0, "precision": 1.0, "recall": 1.0}}),
        ev("eval", {"step": 20, "loss": 0.3, "metrics": {"accuracy": 0.88, "precision": 0.86, "recall": 1.0}}),
    ]
    assert feed(_det(), [start(), *evs]) == []


def test_without_a_grad_norm_the_preference_margins_show_the_zeros_are_a_saturated_loss() -> None:
    # an older transformers logs no grad_norm: accuracies 1.0 and margins of 120 say the 0.0 was computed, not NaN
    pref = {"rewards/accuracies": [[1, 0.0], [10, 0.89], [20, 1.0], [30, 1.0]],
            "rewards/margins": [[1, 0.0], [10, 26.7], [20, 119.6], [30, 141.7]]}  # fmt: skip
    rows = [(1, 0.6931, None), (10, 0.1628, None), (20, 0.0, None), (30, 0.0, None)]
    found = feed(_det(), [start(config={"preference": pref}), *_steps(rows)])
    assert [(f.step, f.severity) for f in found] == [(20, "warning")] and "margins of 141.7" in found[0].message


def test_steps_the_scaler_skipped_are_not_no_op_steps() -> None:
    evs = [start()]
    for i in range(1, 101):
        skipped = i % 2 == 0
        evs.append(ev("step", {"step": i, "loss": 2.0, "grad_norm": 0.0 if skipped else 1.0, "skipped": skipped}))
    assert feed(_det(), evs) == []


def test_an_accuracy_stuck_at_the_majority_rate_with_the_loss_at_its_entropy_is_a_collapse() -> None:
    # a Lightning classifier logging val_loss and val_acc only: 0.6056 at every eval, loss at H(0.6056) = 0.6708
    evs = [ev("eval", {"step": 43 * i, "loss": 0.671 - 0.002 * i, "metrics": {"val_acc": 0.6056}}) for i in range(1, 6)]
    found = feed(_det(), [start(), *evs])
    assert found and found[0].step == 129 and "majority class" in found[0].message
    assert found[0].evidence["eval_step"] == 43


def test_a_constant_accuracy_with_a_loss_far_from_that_entropy_is_not_a_collapse() -> None:
    # a coarse accuracy (few eval examples) that repeats while the loss falls well below the base-rate entropy
    evs = [ev("eval", {"step": 10 * i, "loss": 0.4 - 0.02 * i, "metrics": {"val_acc": 0.75}}) for i in range(1, 6)]
    assert feed(_det(), [start(), *evs]) == []


def test_a_model_that_settles_at_chance_after_its_first_eval_is_stuck_from_there() -> None:
    rng = random.Random(8)
    losses = [1.43, 1.40] + [math.log(4) - rng.uniform(0, 0.0007) for _ in range(10)]
    found = feed(_det(), [start(), *_evals(losses)])
    assert found and found[0].step == 150 and "5 evals in a row since step 150" in found[0].message


def test_a_model_that_learnt_and_fell_back_to_uniform_is_not_nothing_learnt() -> None:
    losses = [1.38, 1.2, 1.0, 0.9] + [math.log(4)] * 8
    assert feed(_det(), [start(), *_evals(losses)]) == []


def test_a_long_saturated_stretch_is_one_finding_restated_now_and_then() -> None:
    rows = [(1, 0.6931, 100.0), (2, 0.2, 1.0)] + [(s, 0.0, 1e-9) for s in range(3, 203)]
    found = feed(_det(), [start(), *_steps(rows)])
    assert found[0].step == 3 and len(found) <= 6 and found[-1].step > 150
    assert found[-1].evidence["zero_loss_entries"] >= 150 and len(found[-1].evidence["zero_loss_steps"]) == 50
