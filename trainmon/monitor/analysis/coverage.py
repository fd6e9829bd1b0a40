"""What a post-mortem could not check, and why: so that "healthy" never claims more than it saw.

A run is called healthy when no detector found a problem, but a detector can only look at what the
input carries: a log without grad norms cannot show a gradient explosion, one without evals an
eval regression, a synthetic clock a hang, a log written every 100 steps a one-step spike between
its entries. DESIGN.md ("How a finding earns trust"): a verdict of healthy lists the signals the
run did not carry. This module says which, from what the post-mortem already read (its summary,
which signals the lowest rank's steps carry and what the importer recorded about the log), so it
costs no query.

Each entry is ``{"signal", "unchecked", "why"}``: the signal missing, the checks it would have fed,
and why it is missing. Only what is missing is listed: a signal that is there says nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pandas as pd

__all__ = ["not_checked"]

_GPU_READINGS = ("max_temperature_c", "min_sm_clock_hz", "max_ecc_corrected", "max_ecc_uncorrected")


def not_checked(
    summary: dict[str, Any], carried: Collection[str], evals: pd.DataFrame, config: Any
) -> list[dict[str, str]]:
    """The checks the input did not allow (see the module docstring), in the order a reader needs
    them: the training signals first, then time, ranks and hardware.

    ``summary`` is the post-mortem's (before ``json_safe``), ``carried`` the signals some step of the
    lowest rank holds (``loss``, NaN or not; a finite ``grad_norm``; ``lr``), ``evals`` its
    evaluations (one row each, with a loss or only metrics such as a WER), ``config`` the run's stored
    config (an importer records there the signals the log format never has, and whether each logged
    loss is a mean over several steps)."""
    if not summary.get("steps_logged"):
        return [{"signal": "steps", "unchecked": "everything", "why": "the input holds no training step"}]
    imported = isinstance(config, dict) and bool(config.get("imported_from"))
    source = "the log" if imported else "the run"
    out: list[dict[str, str]] = []

    def missing(signal: str, checks: str, why: str) -> None:
        out.append({"signal": signal, "unchecked": checks, "why": why})

    if "loss" not in carried:
        missing("loss", "loss spikes, divergence, non-finite losses, the first loss", f"no loss in {source}")
    mean_over = config.get("loss_mean_over_steps") if imported else None
    every = _entries_every(summary)
    if isinstance(mean_over, int | float) and mean_over >= 2:
        missing(
            "per-step loss",
            f"a loss spike of one step (diluted about {mean_over:g} times)",
            f"each logged loss is the mean over {mean_over:g} steps",
        )
    elif every >= 2:
        missing(
            "per-step values",
            "a spike of one step (averaged into its entry, or between two entries)",
            f"{source} holds one entry per {every:,.0f} steps",
        )
    if "grad_norm" not in carried:
        missing(
            "grad norm",
            "gradient explosions, and whether a loss spike started in the gradients",
            f"no grad norm in {source}",
        )
    if evals.empty:
        missing(
            "eval metric",
            "eval regressions (overfitting), and the task metric a divergence is weighed against",
            f"no evaluation {'read from' if imported else 'in'} {source}",
        )
    if "lr" not in carried:
        missing("learning rate", "learning-rate schedule drift", f"no learning rate in {source}")
    clock = (summary.get("unknown") or {}).get("duration_seconds")
    if clock:
        missing("wall clock", "hangs, wall time, checkpoint cost and the failure rate", clock)
    if not summary.get("busy_seconds"):
        missing("step time", "throughput collapses, slow steps and stragglers", f"no step durations in {source}")
    world = summary.get("world_size") or 1
    ranks = summary.get("ranks") or []
    if world > 1 and 0 < len(ranks) < world:
        shown = ", ".join(str(r["rank"]) for r in ranks)
        missing(
            "ranks",
            "stragglers and replicas that drift apart",
            f"the input holds rank{'s' if len(ranks) > 1 else ''} {shown} of {world}",
        )
    if not any(any(h.get(k) is not None for k in _GPU_READINGS) for h in summary.get("health") or []):
        missing(
            "GPU health",
            "overheating, clock throttling and ECC errors",
            "no GPU readings" + ("" if summary.get("health") else " or host samples") + f" in {source}",
        )
    if imported and "memory" in (config.get("missing_signals") or []):
        missing("device memory", "memory leaks", "no memory readings in this log format")
    return out


def _entries_every(summary: dict[str, Any]) -> float:
    """Steps per logged entry: 1 for a run logged at every step, 100 for a log written every 100."""
    steps, logged = summary.get("steps"), summary.get("steps_logged")
    if not isinstance(steps, int) or not logged:
        return 1.0
    return steps / logged
