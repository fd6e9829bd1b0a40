"""The loss-spike rules other projects ship, as plain functions, for the detection benchmark.

Each takes the loss of every step in order (index = step; ``None`` or non-finite for a step
without a usable loss) and returns the steps it flags. They are reimplemented from the
projects' published code and descriptions (quoted in ``failure-modes.md`` §2), with the
projects' defaults, so ``bench/detection.py`` can score them on the same traces as
``loss_spike``. Where a rule stops the run on a spike (Lightning, llm-foundry with
``log_only=False``) the function keeps going, so every spike of a trace can be scored. None of
this is used by the collector.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence

__all__ = [
    "ANCHOR_RULES",
    "lightning_spike_detection",
    "llm_foundry_kill_loss_spike",
    "olmo_core_stability",
    "seed_notebook_rolling_median",
    "trainpulse_loss_spike",
]

Losses = Sequence[float | None]


def _ok(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def olmo_core_stability(losses: Losses, window: int = 128, sigmas: float = 6.0) -> list[int]:
    """OLMo-core ``StabilityMonitorCallback``: a spike is a value more than 6sigma above the mean of the last 128.

    Source: allenai/OLMo-core ``src/olmo_core/train/callbacks/stability_monitor.py`` ("a spike
    is a value above the mean of the last 128 by more than 6sigma"; SpikeScore = spike rate over
    10,000 steps). The window holds every finite value, spikes included, which is what lets an
    earlier spike inflate sigma. Needs a full window before it flags.
    """
    win: deque[float] = deque(maxlen=window)
    out = []
    for step, x in enumerate(losses):
        if not _ok(x):
            continue
        if len(win) == window:
            mean = statistics.fmean(win)
            std = statistics.pstdev(win, mean)
            if x > mean + sigmas * std:
                out.append(step)
        win.append(x)
    return out


def llm_foundry_kill_loss_spike(
    losses: Losses, window: int = 100, outlier_multiplier: float = 2.0, patience: int = 4
) -> list[int]:
    """llm-foundry ``KillLossSpike``: more than ``patience`` consecutive losses ≥ 2x the window mean.

    Source: mosaicml/llm-foundry ``llmfoundry/callbacks/kill_loss_spike_callback.py``: once the
    window (100) is full, a loss ≥ ``outlier_multiplier`` x the window mean is an outlier; the
    spike is declared when the outlier counter exceeds ``patience`` (4), i.e. on the 5th
    consecutive outlier; a non-outlier resets the counter. Every loss, outliers included, enters
    the window. (Its separate "persistently high loss > loss_cap" rule is not a spike rule.)
    Flags every step on which the counter exceeds the patience.
    """
    win: deque[float] = deque(maxlen=window)
    counter = 0
    out = []
    for step, x in enumerate(losses):
        if not _ok(x):
            continue
        if len(win) == window:
            avg = statistics.fmean(win)
            if x >= avg * outlier_multiplier:
                counter += 1
                if counter > patience:
                    out.append(step)
            else:
                counter = 0
        win.append(x)
    return out


def lightning_spike_detection(
    losses: Losses, window: int = 10, warmup: int = 1, rtol: float | None = 2.0, atol: float | None = None
) -> list[int]:
    """Lightning Fabric ``SpikeDetection`` (mode "min"): ``|loss - mean| ≥ rtol·mean`` over a 10-step running mean.

    Source: Lightning-AI/pytorch-lightning ``src/lightning/fabric/utilities/spike.py``: from
    batch ``warmup`` on, a non-finite loss is a spike (``finite_only=True``); a loss that did not
    increase over the previous accepted one is never a spike; otherwise it is a spike when it
    differs from the running mean of the last ``window`` accepted losses by ≥ ``rtol`` x mean
    (and ≥ ``atol`` when set). Spikes are not added to the running mean. Lightning raises
    ``TrainingSpikeException`` there; this keeps scanning.
    """
    win: deque[float] = deque(maxlen=window)
    last = 0.0
    out = []
    for step, x in enumerate(losses):
        if x is None:
            continue
        if step >= warmup:
            if not math.isfinite(x):
                out.append(step)
                continue
            if win and x - last > 0:
                mean = statistics.fmean(win)
                ok_atol = atol is None or abs(x - mean) >= abs(atol)
                ok_rtol = rtol is None or abs(x - mean) >= abs(rtol * mean)
                if ok_atol and ok_rtol:
                    out.append(step)
                    continue
        if math.isfinite(x):
            win.append(x)
            last = x
    return out


def seed_notebook_rolling_median(losses: Losses, window: int = 20, threshold: float = 0.2) -> list[int]:
    """The seed notebook's toy rule (``/work/shared/seeds/001_*.txt``, §14 "Loss spike detection").

    Verbatim logic: ``median = np.median(loss[max(0, i-window):i+1])`` (the window *includes*
    the current value) and ``spikes = np.where(loss > median + 0.20)``: an absolute 0.2-nat
    threshold over a 20(+1)-step rolling median. Non-finite or missing losses are skipped.
    """
    out = []
    hist: list[float | None] = list(losses)
    for i, x in enumerate(hist):
        if not _ok(x):
            continue
        seg = [v for v in hist[max(0, i - window) : i + 1] if _ok(v)]
        if x > statistics.median(seg) + threshold:
            out.append(i)
    return out


def trainpulse_loss_spike(losses: Losses, threshold: float = 5.0, window: int = 50) -> list[int]:
    """The ``trainpulse`` package's ``LossSpikeDetector`` (PyPI trainpulse 0.4.0, ``trainpulse/detectors.py``).

    Its rule: once 50 values are in the window, a loss > 5 x the window mean is a spike; every
    value (spikes too) enters the window. Runs the installed package itself; raises
    ``ImportError`` when it is not installed (``pip install trainpulse``, pure Python, no torch).
    """
    from trainpulse.detectors import LossSpikeDetector

    det = LossSpikeDetector(threshold=threshold, window_size=window)
    out = []
    for step, x in enumerate(losses):
        if _ok(x) and det.check(step, x) is not None:
            out.append(step)
    return out


def _trainpulse_available() -> bool:
    try:
        import trainpulse.detectors  # noqa: F401
    except ImportError:
        return False
    return True


ANCHOR_RULES: dict[str, Callable[[Losses], list[int]]] = {
    "olmo_core": olmo_core_stability,
    "llm_foundry": llm_foundry_kill_loss_spike,
    "lightning": lightning_spike_detection,
    "seed_notebook": seed_notebook_rolling_median,
}
"""Rule name → function(losses) → flagged steps; ``trainpulse`` only when it is installed."""
if _trainpulse_available():
    ANCHOR_RULES["trainpulse"] = trainpulse_loss_spike
