"""nan_inf: names the first non-finite step and what went non-finite, reads NaN-from-the-start as a
setup bug, keeps an open anomaly's message current, and reads HF's hidden NaNs (a large loss followed
by exact zeros) without taking a converged loss for one."""

from __future__ import annotations

import math

from tests.detectors.helpers import ev, feed, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.nan_inf import NanInf
from trainmon.wire import Event


def _det() -> NanInf:
    return NanInf(DetectorsConfig().nan_inf)


def _run(rows: list[dict], **start_fields) -> list[Event]:
    """A run_start, then one step event per row (``step`` defaults to the row's index)."""
    evs = [start(**start_fields)]
    for i, row in enumerate(rows):
        evs.append(ev("step", {"step": i, **row}, float(i)))
    return evs


def _open_findings(found):
    return [f for f in found if not f.resolved]


# --- non-finite values ------------------------------------------------------------------------------


def test_nan_from_the_first_step_is_a_setup_bug_named_at_the_first_step() -> None:
    """The job ran 903 steps of NaN until the scheduler cancelled it: the reading is the first step,
    both values, and a setup/initialisation bug, not a bad batch at the cancel step or the hardware."""
    found = feed(_det(), _run([{"loss": math.nan, "grad_norm": math.nan}] * 903))
    assert found and all(not f.resolved and f.severity == "critical" for f in found)
    assert found[0].step == 0
    last = found[-1]
    assert last.step == 902  # the anomaly's last_step stays current
    assert "from the first logged step (step 0)" in last.message
    assert "loss" in last.message and "grad norm" in last.message
    assert "902" not in last.message.split(":")[0]  # the headline names the first step, not the last
    assert "903" in last.message and "nothing finite" in last.message
    hint = last.hint.lower()
    assert "setup" in hint and "initiali" in hint
    for wrong in ("bad data", "suspect the batch", "drain the node", "silent corruption"):
        assert wrong not in hint
    assert last.evidence["first_step"] == 0 and last.evidence["nonfinite_steps"] == 903
    assert last.evidence["values"] == {"loss": "nan", "grad_norm": "nan"}
    assert last.evidence["cause"] == "setup"


def test_nan_from_the_first_step_of_a_resumed_attempt_points_at_the_checkpoint() -> None:
    evs = _run([{"loss": 3.0 - 0.001 * i, "grad_norm": 1.0} for i in range(50)])
    evs.append(ev("run_start", {"resumed": True, "world_size": 1}, 60.0))
    evs += [ev("step", {"step": 40 + i, "loss": math.nan, "grad_norm": math.nan}, 61.0 + i) for i in range(5)]
    found = feed(_det(), evs)
    assert found[0].step == 40 and found[-1].evidence["cause"] == "resume"
    assert "checkpoint" in found[-1].hint and "suspect the batch" not in found[-1].hint


def test_nan_after_finite_steps_names_the_first_nan_step_and_stays_current() -> None:
    """55 (nanochat SFT): loss rises 5.47 -> 9.55 over steps 1-6, NaN from step 9 to 133, no grad norm.
    Today the message says 'at step 133'; it must say since step 9, how many steps, still going."""
    finite = [5.472, 7.252, 8.044, 8.468, 8.182, 9.553, 9.522, 8.991]
    rows = [{"step": s, "loss": v} for s, v in enumerate(finite, 1)]
    rows += [{"step": s, "loss": math.nan} for s in range(9, 134)]
    evs = [start()] + [ev("step", r, float(r["step"])) for r in rows]
    found = feed(_det(), evs)
    assert [f.step for f in found][:1] == [9] and found[-1].step == 133
    last = found[-1]
    assert last.message.startswith("loss (nan) non-finite since step 9")
    assert "125" in last.message and "still" in last.message and "133" in last.message
    assert "grad norm" not in last.message  # only the loss is logged, and only the loss went NaN
    assert last.evidence["first_step"] == 9 and last.evidence["nonfinite_steps"] == 125
    # The loss was climbing before the NaN: a numerical blow-up (LR), not "no grad-norm build-up".
    assert last.evidence["cause"] == "numerical"
    assert "loss was climbing" in last.hint and "Lower the LR" in last.hint
    assert "grad-norm build-up" not in last.hint


def test_sudden_nan_after_a_healthy_run_keeps_the_batch_and_hardware_advice() -> None:
    rows = [{"loss": 3.0 - 0.002 * i + 0.01 * math.sin(i), "grad_norm": 1.0 + 0.05 * math.cos(i)} for i in range(100)]
    rows += [{"loss": math.nan, "grad_norm": 1.0}] * 3 + [{"loss": 2.8, "grad_norm": 1.0}] * 25
    found = feed(_det(), _run(rows))
    opened = _open_findings(found)
    assert opened[0].step == 100 and opened[-1].step == 102
    assert opened[-1].message.startswith("loss (nan) non-finite since step 100")
    assert "suspect the batch" in opened[-1].hint and "checkpoint" in opened[-1].hint
    assert opened[-1].evidence["cause"] == "sudden"
    resolved = [f for f in found if f.resolved]
    assert len(resolved) == 1 and resolved[0].step == 122
    assert "100" in resolved[0].message and "102" in resolved[0].message


def test_grad_norm_climbing_before_the_nan_keeps_the_overflow_advice() -> None:
    rows = [{"loss": 3.0, "grad_norm": 1.0 + 0.01 * (i % 3)} for i in range(60)]
    rows += [{"loss": 3.0, "grad_norm": g} for g in (5.0, 40.0, 300.0)]
    rows += [{"loss": math.inf, "grad_norm": math.inf}]
    found = feed(_det(), _run(rows))
    assert found[0].step == 63 and found[0].evidence["cause"] == "numerical"
    assert "grad norm was climbing" in found[0].hint and "loss scale" in found[0].hint
    assert found[0].message.startswith("loss (inf) and grad norm (inf) non-finite at step 63")


def test_nan_a_few_steps_in_is_not_blamed_on_a_batch() -> None:
    """Three finite steps are no history: too early to call it a sudden fault (batch, hardware)."""
    rows = [{"loss": 10.0, "grad_norm": 2.0}] * 3 + [{"loss": math.nan, "grad_norm": math.nan}] * 4
    found = feed(_det(), _run(rows))
    assert found[0].step == 3 and found[-1].evidence["cause"] == "early"
    assert "suspect the batch" not in found[-1].hint and "warmup" in found[-1].hint


def test_an_fp16_overflow_the_scaler_skipped_is_not_a_nan() -> None:
    """GradScaler: an inf grad norm on a step it skipped (finite loss) is the scaler working."""
    rows = [{"loss": 3.0 - 0.001 * i, "grad_norm": 1.0, "skipped": False} for i in range(50)]
    rows[20] = {"loss": 2.98, "grad_norm": math.inf, "skipped": True}
    assert feed(_det(), _run(rows)) == []
    rows[30] = {"loss": math.nan, "grad_norm": math.inf, "skipped": True}  # a NaN loss still is one
    assert [f.step for f in feed(_det(), _run(rows)) if not f.resolved] == [30]


def test_hf_nan_grad_norm_with_the_loss_logged_as_zero_is_a_nan_loss() -> None:
    """HF logs the grad norm unfiltered (nan) and the loss through logging_nan_inf_filter (0.0): that is a
    NaN loss, critical, not 'only the grad norm, maybe an fp16 overflow'."""
    rows = [{"step": 10 * (i + 1), "loss": 2.3 - 0.01 * i, "grad_norm": 1.5} for i in range(30)]
    rows += [{"step": 10 * (i + 31), "loss": 0.0, "grad_norm": math.nan} for i in range(5)]
    evs = [start(framework="hf")] + [ev("step", r, float(i)) for i, r in enumerate(rows)]
    found = feed(_det(), evs)
    assert found[0].step == 310 and {f.severity for f in found} == {"critical"}
    assert "the loss logged as exactly 0.0" in found[-1].message
    assert "logging_nan_inf_filter" in found[-1].hint and "Only the grad norm" not in found[-1].hint


def test_a_grad_norm_alone_with_a_finite_loss_is_a_warning() -> None:
    rows = [{"loss": 3.0 - 0.001 * i, "grad_norm": 1.0 + 0.01 * (i % 3)} for i in range(60)]
    rows[40] = {"loss": 2.96, "grad_norm": math.inf}
    found = feed(_det(), _run(rows))
    assert found[0].step == 40 and found[0].severity == "warning"
    assert found[0].message == "grad norm (inf) non-finite at step 40"
    assert "Only the grad norm is non-finite" in found[0].hint


# --- degenerate loss: exact zeros -------------------------------------------------------------------


def _hf_rows(losses: list[float | None], every: int = 10) -> list[dict]:
    return [{"step": every * (i + 1), **({"loss": v} if v is not None else {})} for i, v in enumerate(losses)]


def test_hf_zero_after_a_large_loss_is_a_hidden_nan_from_its_step() -> None:
    """47 (LLaMA-Factory): 122.14 at step 10, then exactly 0.0 at every logging window (36 rows):
    HF's logging_nan_inf_filter logs an all-NaN window as 0.0. Flagged from step 20, not as convergence."""
    rows = _hf_rows([122.1416] + [0.0] * 36)
    evs = [start(framework="llamafactory")] + [ev("step", r, float(i)) for i, r in enumerate(rows)]
    found = feed(_det(), evs)
    assert found and not any(f.resolved for f in found)
    assert {f.severity for f in found} == {"warning"}
    assert found[0].step == 20 and found[-1].step == 370
    last = found[-1]
    assert last.message.startswith("loss exactly 0.0 since step 20")
    assert "122.1" in last.message and "36" in last.message
    assert "logging_nan_inf_filter" in last.hint and "non-finite" in last.hint
    assert last.evidence["zero_since"] == 20 and last.evidence["zero_steps"] == 36
    assert last.evidence["loss_before"] == 122.1416 and last.evidence["loss_before_step"] == 10


def test_zero_after_a_large_loss_outside_hf_names_both_readings() -> None:
    rows = [{"loss": 2.3 - 0.01 * i} for i in range(30)] + [{"loss": 0.0}] * 10
    found = feed(_det(), _run(rows, framework="plain"))
    assert found[0].step == 30 and found[0].severity == "warning"
    assert "logging_nan_inf_filter" not in found[-1].hint
    assert "masked" in found[-1].hint and "non-finite" in found[-1].hint


def test_a_converging_loss_that_reaches_exact_zero_is_silent() -> None:
    """38 (HF classification): 0.85 -> 0.0001 by step 380, then 54 exact zeros (rounded to 4 digits)."""
    losses = [0.8496, 0.2712, 0.045, 0.0098, 0.0039, 0.0023, 0.0017, 0.0013, 0.0011, 0.001]
    losses += [0.0009, 0.0008, 0.0006, 0.0006, 0.0005, 0.0005, 0.0004, 0.0004, 0.0004, 0.0003]
    losses += [0.0003] * 6 + [0.0002] * 12 + [0.0001] * 59 + [0.0] * 54
    rows = _hf_rows(losses)
    for i, r in enumerate(rows):
        r["grad_norm"] = 6.17 * math.exp(-i / 12) + 5e-4
    evs = [start(framework="hf")] + [ev("step", r, float(i)) for i, r in enumerate(rows)]
    assert feed(_det(), evs) == []


def test_a_zero_or_two_after_a_real_loss_is_not_enough() -> None:
    rows = [{"loss": 2.0}] * 20 + [{"loss": 0.0}, {"loss": 0.0}] + [{"loss": 2.0}] * 20
    assert feed(_det(), _run(rows)) == []


def test_zeros_resolve_once_the_loss_is_real_again_and_a_nan_takes_over_with_its_own_step() -> None:
    rows = [{"loss": 2.0}] * 20 + [{"loss": 0.0}] * 5 + [{"loss": 1.9}] * 20
    found = feed(_det(), _run(rows))
    assert [(f.step, f.resolved) for f in found if f.resolved] == [(44, True)]
    assert found[0].step == 20
    rows = [{"loss": 2.0}] * 20 + [{"loss": 0.0}] * 5 + [{"loss": math.nan}] * 3
    found = feed(_det(), _run(rows))
    closing = [f for f in found if f.resolved]
    assert len(closing) == 1 and closing[0].step == 25  # the zero note closes, the NaN opens its own
    nan = [f for f in found if not f.resolved and f.severity == "critical"]
    assert nan[0].step == 25 and nan[-1].message.startswith("loss (nan) non-finite since step 25")


def test_zero_loss_from_the_first_step_is_flagged() -> None:
    found = feed(_det(), _run([{"loss": 0.0, "grad_norm": 0.0}] * 10))
    assert found[0].step == 0 and found[0].severity == "warning"
    assert "from the first logged step" in found[-1].message


def test_one_noisy_step_before_a_sudden_nan_is_not_a_climb() -> None:
    """Synthetic nan-71: the last finite grad norm is 1.46x the run's level, 4.3 sigma on a quiet
    series; the NaN is injected at once. It was called numerical instability (lower the LR)."""
    norms = [0.213, 0.206, 0.211, 0.218, 0.233, 0.227, 0.231, 0.227, 0.216, 0.247, 0.202, 0.245, 0.202, 0.179]
    norms += [0.228, 0.232, 0.184, 0.188, 0.216, 0.316]
    rows = [{"loss": 2.85 + 0.05 * math.sin(i), "grad_norm": 0.21 + 0.02 * math.cos(i)} for i in range(300)]
    rows += [{"loss": 2.85, "grad_norm": g} for g in norms]
    rows += [{"loss": math.nan, "grad_norm": math.nan}] * 5
    found = feed(_det(), _run(rows))
    assert found[0].step == 320 and found[0].evidence["cause"] == "sudden"
    assert "numerical instability" not in found[0].hint and "suspect the batch" in found[0].hint


def test_a_noisy_loss_at_its_lowest_then_nan_is_sudden_not_a_climb() -> None:
    """85 (a PINN's metrics.csv): the loss swings 1.3-9x from one epoch to the next while it falls, the last
    finite value is the lowest of the run, then every column is nan to the end. 1.7x its recent low is
    its own scatter, not a climb: it was called numerical instability (lower the LR)."""
    window = [5.93, 8.897, 8.109, 8.407, 9.131, 6.572, 2.102, 1.32, 4.343, 6.323, 5.091, 3.069, 2.564, 2.353]
    window += [1.962, 2.104, 3.116, 3.492, 2.248, 1.043]
    rows = [{"loss": 1e6 / (i + 1) ** 2} for i in range(198)] + [{"loss": v} for v in window]
    rows += [{"loss": math.nan}] * 44
    config = {"column_mapping": {"step": "step", "loss": "mean_loss"}}
    found = feed(_det(), _run(rows, config=config))
    opened = _open_findings(found)
    assert opened[0].step == 218 and opened[0].evidence["cause"] == "sudden"
    assert "suspect the batch at step 218" in opened[-1].hint and "numerical instability" not in opened[-1].hint
    # the message names the column the loss came from, and says how long the run went on after it
    assert opened[-1].message.startswith("loss (mean_loss: nan) non-finite since step 218: 44 logged steps")
    assert "still at step 261" in opened[-1].message
