"""Readings of one family of real logs:
CSV, TensorBoard, ms-swift and LLaMA-Factory logs (85-87, 89, 90, 92, 93, 95).

Encoded from ``manifest.json`` as described in ``tests/importers/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Need

READINGS_STRUCTURED: dict[str, Expect] = {
    "85_lightning-pinn-sudden-nan.csv": Expect(
        allowed=(
            Allow(
                "nan_inf",
                218,
                261,
                "manifest: all five loss columns nan from epoch 218 to the end (44 rows), sudden, no blow-up before",
                ("critical",),
            ),
        ),
        required=(Need("nan_inf", 218, 0, "manifest: non-finite loss at epoch 218, to the end", recovered=False),),
    ),
    "86_lightning-gan-nan-from-first-row.csv": Expect(
        allowed=(
            Allow(
                "nan_inf",
                0,
                319,
                "manifest: generator loss nan from the first row, discriminator 1.6e24 then nan, for the whole run",
                ("critical",),
            ),
        ),
        required=(Need("nan_inf", 0, 1, "manifest: flag non-finite loss immediately (row 0/1)", recovered=False),),
    ),
    "87_ms-swift-duplicated-lines-two-writers.jsonl": Expect(
        allowed=(
            Allow(
                "loss_spike",
                *_ANY,
                "manifest: one-step loss 'spikes' that are ratios on a ~3e-4 baseline (low severity at most)",
                ("info",),
            ),
            Allow(
                "grad_explosion",
                *_ANY,
                "manifest: one-step grad-norm 'spikes' on a ~0.01 median in epochs 6-8 (low severity at most)",
                ("info",),
            ),
            Allow(
                "eval_regression",
                6000,
                14776,
                "manifest: mild overfitting note allowed: eval_loss 0.462 (6000) -> 0.534 (12000) while eval_acc "
                "stays 0.912-0.915",
                ("info",),
            ),
            Allow(
                "loss_spike",
                8445,
                8795,
                "manifest: one-step 'spikes' in the memorisation phase are ratios on a ~3e-4 baseline: low "
                "severity at most",
                ("info",),
            ),
        ),
    ),
    "89_tb-yolov5-detection-300ep.tfevents": Expect(
        allowed=(
            Allow(
                "eval_regression",
                80,
                299,
                "manifest: at most a mild note that val/cls_loss and val/box_loss bottom out mid-run (87, 137) "
                "while mAP still improves",
                ("info",),
            ),
        ),
    ),
    "90_wandb-history-marl-mappo.csv": Expect(),
    "92_ms-swift-init-loss-20.jsonl": Expect(
        allowed=(
            Allow(
                "init_loss",
                1,
                20,
                "manifest: at most one low-severity init_loss note: 20.5 at step 1 above ln(vocab) 11.9, explained "
                "by the template, gone by step 20",
                ("info",),
            ),
        ),
    ),
    "93_llamafactory-lora-3epoch-short.jsonl": Expect(),
    "95_lightning-rl4co-reinforce-negative-loss.csv": Expect(),
}
