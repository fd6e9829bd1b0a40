"""Readings of one family of real logs:
nanochat and modded-nanogpt stdout (101-105, 110).

Encoded from ``manifest.json`` as described in ``tests/importers/test_real_logs.py``. A nanochat pipeline log
(base, mid, SFT) is one run per stage: ``runs`` and ``stage_entries`` say how many and how long, and
the findings of all its runs are judged together (a step range names steps of any stage).
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Need

_EMA = "nanochat's loss is a debiased EMA (beta 0.9): its bumps are data"

READINGS_NANOCHAT: dict[str, Expect] = {
    "101_nanochat-speedrun-keystrokes-midtrain-slowdown.log": Expect(
        runs=3,  # base, mid, SFT: stages of one pipeline, not attempts of one run
        stage_entries=(21400, 765, 650),
        allowed=(
            Allow(
                "throughput_collapse",
                56,
                335,
                "manifest: mid-stage throughput degradation (steps 56-335, -11% tokens/s, up to 1.8x step time, "
                "then resolved), reported at warning or info level",
            ),
            Allow(
                "throughput_collapse",
                251,
                500,
                "manifest: optionally the base-stage jitter at 251-500 (68 steps at 1.3-2.5x, ~20 s lost)",
                ("info",),
            ),
        ),
        required=(
            Need(
                "throughput_collapse",
                195,
                140,
                "manifest: mid stage 56-335, median 536 ms vs 471 ms before and 477 ms after, -11% tokens/s, resolved",
            ),
        ),
    ),
    "102_nanochat-base-jitter-then-disk-full.log": Expect(
        # the later stages failed at launch (disk full) before logging a step: named in the base run's
        # notes (config.failed_launches_after), not a run of their own and not a failure of the base run
        allowed=(
            Allow(
                "throughput_collapse",
                169,
                721,
                "manifest: intermittent slow steps 169-721 (up to 3.5x on isolated steps, median unchanged), "
                "to be reported as intermittent slow steps rather than a collapse",
            ),
            Allow(
                "throughput_collapse",
                16357,
                16605,
                "manifest: the late jitter episode 16357-16605 (68 slow steps up to 1202 ms, ~20 s lost)",
            ),
        ),
        required=(
            Need(
                "throughput_collapse",
                16480,
                125,
                "manifest: the late episode 16357-16605 must be reported too (trainmon today: nothing)",
            ),
        ),
    ),
    "103_nanochat-failed-launch-then-cut-off.log": Expect(),  # silent: a failed launch, then one run cut off at 11%
    "104_nanochat-4x3090-73h-bf16mfu-key.log": Expect(
        runs=2,  # base, then chat SFT (it saves to chatsft_checkpoints; the manifest calls it the mid stage)
        stage_entries=(5742, 502),
        allowed=(
            Allow(
                "loss_spike",
                5498,
                5500,
                f"manifest: an info spike at 5498 (2.81 vs 2.51, 1.12x, back within 3 steps) is acceptable; {_EMA}",
                ("info",),
            ),
            Allow(
                "loss_spike",
                312,
                382,
                "manifest: EMA wiggles of 1.29x at 312-378 of the SFT stage that recover within 7 steps: silent or "
                "info only (the importer says the loss is a mean over ~19 steps: config.loss_mean_over_steps)",
                ("info",),
            ),
        ),
    ),
    "105_modded-nanogpt-2gpu-24k-timer-reset.txt": Expect(
        allowed=(
            Allow(
                "loss_spike",
                *_ANY,
                "manifest: heavy-tailed per-step loss (1.4-1.6x single-step excursions everywhere, each gone at the "
                "next step) while the validation loss improves at every evaluation: at most info-level notes",
                ("info",),
            ),
        ),
    ),
    "110_nanochat-speedrun-clean-3-stages.log": Expect(
        runs=3,  # silent: the clean control of 101/102, base, mid and SFT split into runs
        stage_entries=(21400, 770, 681),
    ),
}
