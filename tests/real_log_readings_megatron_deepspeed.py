"""Readings of one family of real logs:
Megatron-LM, Megatron-DeepSpeed and DeepSpeed(-Chat) stdout (96-100, 106-109).

Encoded from ``manifest.json`` as described in ``tests/importers/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

READINGS_MEGATRON_DEEPSPEED: dict[str, Expect] = {
    "96_megatron-lm-fp16-skipped-iters-early-spike-scancel.out": Expect(
        allowed=(
            Allow(
                "loss_spike",
                20,
                60,
                "manifest: at iteration 30, when the delayed warmup reaches the 1.5e-4 peak, lm loss jumps 12.11 -> "
                "26.48 (2.2x, far above ln V) with grad norm 67-81, recovered by iteration 50-60",
                ("info", "warning", "critical"),
            ),
            Allow("grad_explosion", 30, 60, "manifest: grad norm 67.0 (30), 81.0 (40) vs 3-5 later, recovered"),
        ),
        required=(
            Need(
                "loss_spike",
                30,
                10,
                "manifest: a recovered early loss explosion 12.11 -> 26.48 at 30 (2 finite entries before it: "
                "spike detection must not depend on a full window)",
            ),
        ),
    ),
    "97_megatron-ds-3d-static-scale-explode-rediverge.out": Expect(
        allowed=(
            Allow(
                "loss_spike",
                3,
                31,
                "manifest: the loss explosion at iterations 3-4 (12.45 -> 44.24 -> 48.14, 3.9x, far above ln V) "
                "during the 8-iteration warmup, decaying slowly back to 11.65 by iteration 31",
                ("info", "warning", "critical"),
            ),
            Allow("grad_explosion", 1, 31, "manifest: grad norm 62-77 through the explosion, falling to 6.2 by 31"),
            Allow(
                "divergence",
                31,
                62,
                "manifest: from iteration 31 the loss rises monotonically for 31 iterations to 20.44 (+75%) at the "
                "peak LR, the file ends still rising",
                ("warning", "critical"),
            ),
        ),
        required=(
            Need("loss_spike", 3, 1, "manifest: 12.45 -> 44.24 -> 48.14 at iterations 3-4 (3.9x)"),
            Need(
                "divergence",
                32,
                6,
                "manifest: the rise starts at 32 (trainmon opened it at 55: right but late)",
                recovered=False,
            ),
        ),
    ),
    "98_megatron-ds-3d-lm-loss-hyphen-spike-recovered.out": Expect(
        allowed=(
            Allow(
                "loss_spike",
                3,
                27,
                "manifest: the early explosion 12.45 -> 41.03 -> 43.06 (iterations 3-4, 3.5x), back to 10.83 by 16; "
                "small bumps 16 -> 17 and 24 -> 26, each gone within 2-3 entries",
                ("info", "warning", "critical"),
            ),
        ),
        required=(
            Need("loss_spike", 3, 1, "manifest: report the early explosion as a recovered spike (read from 'lm-loss')"),
        ),
    ),
    "99_megatron-lm-all-iters-skipped-time-limit.out": Expect(
        allowed=(
            Allow(
                "loss_scale_collapse",
                1,
                4,
                "manifest: a loss-scale-collapse detector may say 'every step skipped so far' but must not call a "
                "scale of 5e8 collapsed",
                ("warning",),
            ),
        ),
        required=(
            Need(
                "loss_scale_collapse",
                4,
                3,
                "manifest: report a run that never trained: all 4 iterations skipped by the fp16 scaler",
                recovered=False,
            ),
        ),
    ),
    # manifest: silent on loss and LR; the scaler doubling every 500 clean iterations, the slow interval after
    # every evaluation and the token-dropping drift are not incidents; Ctrl-C is an interruption
    "100_megatron-ds-gpt125m-fp16-eval-slow-intervals-ctrlc.log": Expect(),
    # manifest: no training loss printed (say so, do not call it healthy by default); the fp16 overflows are the
    # routine sawtooth (6 skips at start-up, then a 2-skip cycle each time the scale regrows to 65536: 139 of 7,360,
    # the scale never below 2048); the LR lags the step counter by the skipped count; no throughput incident
    "106_deepspeed-chat-sft-overflow-sawtooth-no-loss.log": Expect(
        allowed=(
            Allow(
                "eval_regression",
                6440,
                7360,
                "manifest: the last two epochs' eval perplexity rise (1.8033 -> 1.8085, +0.3%) is at most an "
                "info-level eval regression (mild overfitting in epochs 15-16)",
                ("info",),
            ),
        ),
    ),
    # manifest: flag the mid-run loss-scale trouble (512 -> 8 at steps 480-560), a warning, recovered (doubling
    # back to 4096 by 1460, then oscillating 1024-4096), not critical: 20 of 1,840 steps skipped, accuracy improved
    "107_deepspeed-chat-rm-loss-scale-down-to-8.log": Expect(
        allowed=(
            Allow(
                "loss_scale_collapse",
                470,
                700,
                "manifest: overflows at ~480-560 drive the dynamic scale 512 -> 8 (warning, not critical)",
                ("warning",),
            ),
        ),
        required=(
            Need(
                "loss_scale_collapse",
                520,
                40,
                "manifest: scale 512 -> 256 -> 128 -> 64 (480) -> 32 -> 16 (550) -> 8 (560), then back to 4096 by "
                "1460: a warning, recovered",
            ),
        ),
    ),
    # manifest: no false alarm on a healthy PPO run (reward 0.30 -> 4.45); act_loss and cri_loss are signed, noisy
    # RL terms (at most an info note for the excursions at 99-112); the 14 overflow skips (actor 7, critic 7) are
    # routine; two engines' step/skipped/lr lines kept apart. The manifest counts 476 entries (0-475) from the
    # latency lines; the log prints 477 PPO steps (0-476, 'Total Generation Batches 477'): the last one's loss and
    # reward lines are printed, its latency line is not.
    "108_deepspeed-chat-ppo-two-engines-overflow.log": Expect(
        allowed=(
            Allow(
                "loss_spike",
                80,
                121,
                "manifest: act_loss/cri_loss excursions up to 30x the median at 99-112 (end of warmup), back within "
                "2 steps: at most info",
                ("info",),
            ),
        ),
        entries=477,
        last_step=476,
    ),
    # manifest: a transient eval regression (perplexity 61.8 -> 131.6 at step 220, back below the start at 350,
    # ending at its best 24.0): recovered, not a failed run; no training loss, no loss scale (fp32)
    "109_deepspeed-gpt2-ft-eval-ppl-doubles-then-recovers.log": Expect(
        allowed=(
            Allow(
                "eval_regression",
                20,
                400,
                "manifest: perplexity doubles from 61.8 to 131.6 at step 220, back below the start at 350: a "
                "transient, recovered eval regression",
            ),
        ),
        required=(
            Need(
                "eval_regression",
                220,
                120,
                "manifest: eval perplexity 61.8 -> 131.6 (2.13x) at step 220, recovered by 350, ends at 24.0",
            ),
        ),
    ),
}
