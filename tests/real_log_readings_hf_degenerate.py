"""Readings of one family of real logs:
HF trainer_state.json runs whose trouble is degenerate training (81-84, 88, 91, 94).

Encoded from ``manifest.json`` as described in ``tests/importers/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

_LOW = ("info", "warning")
_ALL = ("info", "warning", "critical")

READINGS_HF_DEGENERATE: dict[str, Expect] = {
    "81_hf-dpo-saturated-zero-loss.json": Expect(
        allowed=(Allow("degenerate", 20, 30, "manifest: a degenerate/saturated preference run from step 20", _LOW),),
        required=(
            Need(
                "degenerate",
                20,
                10,
                "manifest: DPO loss exactly 0.0 by step 20 with rewards/accuracies 1.0, margins 120-142, "
                "logps/rejected -1784, grad_norm ~1e-8: a saturated preference run (zeros are not NaN; ln 2 at "
                "step 1 is normal)",
                recovered=False,
            ),
        ),
    ),
    "82_hf-resume-lr-rewarm-divergence.json": Expect(
        attempts=2,  # one resume at 1500 (epoch 3.0 -> 1.501, global_step continuous): an attempt, not a new run
        allowed=(
            Allow("loss_spike", 40, 90, "manifest: (lower severity) a recovered early spike burst at 40-90", _LOW),
            Allow(
                "grad_explosion",
                358,
                1217,
                "manifest: before the resume, isolated single-step gn spikes (358, 524, 1056, 1217) that recover "
                "at once",
                _LOW,
            ),
            Allow("grad_explosion", 1501, 3500, "manifest: after the resume a sustained grad-norm explosion", _ALL),
            Allow("loss_spike", 1501, 3500, "manifest: loss 1.1 -> 8.6 (1705) and 15.7 (1994), never back", _ALL),
            Allow("divergence", 1501, 3500, "manifest: divergence after the resume", _ALL),
            Allow("bad_resume", 1501, 3500, "manifest: the resume shock (LR 0 -> 1.38e-3, plan 1500 -> 4000)", _ALL),
            Allow("eval_regression", 1501, 3500, "manifest: eval_loss 1.156 -> 6.66, never back to best", _ALL),
            Allow("lr_schedule_drift", 1501, 3500, "manifest: LR discontinuity at 1500 -> 1501", _ALL),
        ),
        required=(
            Need("bad_resume", 1501, 1, "manifest: resume with an LR discontinuity 0.0 -> 1.38e-3", recovered=False),
            Need("lr_schedule_drift", 1501, 1, "manifest: LR jumps 0.0 -> 1.38e-3 at the resume", recovered=False),
            Need(
                "eval_regression",
                1600,
                100,
                "manifest: eval_loss 1.156 (best, 1500) -> 4.95 (1700) -> 6.66 (2000) -> 1.87 at 3500: unrecovered",
                recovered=False,
            ),
        ),
    ),
    "83_hf-mcqa-stuck-at-chance-in-init-py.json": Expect(
        allowed=(Allow("degenerate", 50, 3140, "manifest: no learning, stuck at chance for all 20 epochs", _LOW),),
        required=(
            Need(
                "degenerate",
                50,
                100,
                "manifest: 'no learning / stuck at chance': eval_loss 1.38560-1.38630 = ln 4 for all 20 epochs, "
                "accuracy 0.233-0.306; not the 16 rolling-rule 'spikes' of a flat line",
                recovered=False,
            ),
        ),
    ),
    "84_hf-cls-majority-class-early-stop.json": Expect(
        allowed=(Allow("degenerate", 43, 130, "manifest: a degenerate classifier from the first eval (43)", _LOW),),
        required=(
            Need(
                "degenerate",
                43,
                5,
                "manifest: accuracy = precision = 0.6056 = the positive rate, recall 1.0 at step 43: predicts "
                "'Hallucination' for everything; best_metric selects that checkpoint",
                recovered=False,
            ),
        ),
    ),
    "88_hf-grpo-kl-spikes.json": Expect(
        allowed=(
            Allow(
                "loss_spike",
                130,
                1025,
                "manifest: at most low-severity 'recovered KL/loss spike' notes for 130, 205 and 1025",
                _LOW,
            ),
            Allow("grad_explosion", 205, 205, "manifest: the only grad-norm spike, 39x, with a KL excursion", _LOW),
        ),
    ),
    "91_hf-chatglm-zero-loss-zero-gradnorm.json": Expect(
        allowed=(
            Allow(
                "degenerate",
                10,
                3000,
                "manifest: warn (low-medium severity, uncertain cause): 56% of grad norms exactly 0.0, 4 loss windows "
                "exactly 0.0, no nan logged: no-op steps hidden by HF's nan filter",
                ("warning",),
            ),
        ),
        required=(Need("degenerate", 10, 10, "manifest: 168 of 300 grad norms exactly 0.0", recovered=False),),
    ),
    "94_hf-unsloth-60steps-memorize.json": Expect(
        allowed=(Allow("grad_explosion", 42, 42, "manifest: the single grad-norm blip at 42 is low severity", _LOW),),
    ),
}
