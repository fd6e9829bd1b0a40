"""The post-mortem's plots, as PNG files (matplotlib, no display needed).

Figures are built with ``matplotlib.figure.Figure`` directly, not ``pyplot``: no global state,
no backend to select, nothing that needs a display. Each plot draws the already-downsampled
series of :class:`trainmon.monitor.analysis.postmortem.Analysis` (about 200 step bins, a ~100k-row sample), so
drawing costs the same for a run of a thousand steps or of a million. A plot whose data the
input lacks is still written, saying what is missing, so the report always has the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from trainmon.monitor.analysis.postmortem import Analysis, expected_lr
from trainmon.monitor.store.storage import PHASE_COLUMNS

__all__ = ["PLOTS", "write_plots"]

SEVERITY_COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
PHASE_COLOURS = {
    "data": "#8c564b",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "comm": "#d62728",
    "optimizer": "#9467bd",
    "checkpoint": "#ff7f0e",
    "eval": "#e377c2",
    "other": "#7f7f7f",
}
ATTEMPT_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#bcbd22", "#8c564b")
DPI = 100


def _legend(ax: Axes, **kwargs: Any) -> None:
    """``ax.legend``, its labels never parsed as mathtext: they hold data (host names), and a
    ``$`` in them would be read as a formula (a parse error stops the whole report)."""
    for text in ax.legend(**kwargs).get_texts():
        text.set_parse_math(False)


def _figure(rows: int = 1, height: float = 4.0) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(11, height * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _missing(fig: Figure, ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def _mark_anomalies(ax: Axes, a: Analysis, kinds: tuple[str, ...] | None = None) -> None:
    """Shade each anomaly's step range in its severity's colour; name the kinds starting at a step
    once, at the top (a loss spike and its grad-norm spike share a line)."""
    top = ax.get_ylim()[1]
    rank = {"critical": 0, "warning": 1, "info": 2}
    at: dict[int, list[dict[str, Any]]] = {}
    for an in a.summary["anomalies"]:
        if an["first_step"] is None or (kinds is not None and an["kind"] not in kinds):
            continue
        first, last = an["first_step"], an["last_step"] if an["last_step"] is not None else an["first_step"]
        if last > first:
            ax.axvspan(first, last + 1, color=SEVERITY_COLOURS.get(an["severity"], "#1f77b4"), alpha=0.12, lw=0)
        at.setdefault(first, []).append(an)
    for first, group in sorted(at.items()):
        worst = min(group, key=lambda an: rank.get(an["severity"], 3))
        colour = SEVERITY_COLOURS.get(worst["severity"], "#1f77b4")
        ax.axvline(first, color=colour, lw=1.2, ls="--", alpha=0.9)
        label = " " + ", ".join(dict.fromkeys(an["kind"] for an in group))
        ax.text(first, top, label, rotation=90, va="top", ha="left", fontsize=8, color=colour, parse_math=False)


def _by_attempt(df: pd.DataFrame) -> list[tuple[int, pd.DataFrame]]:
    if df.empty:
        return []
    return [(int(k), g) for k, g in df.groupby("attempt", sort=True)]


def plot_loss(a: Analysis) -> Figure:
    """Training loss per step bin (mean, min-max band: a one-step spike stays visible), eval loss,
    anomalies shaded."""
    fig, (ax,) = _figure()
    b = a.bins
    if b.empty or b["loss"].isna().all():
        _missing(fig, ax, "no training loss in this input")
        return fig
    for attempt, g in _by_attempt(b):
        colour = ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)]
        ax.fill_between(g["step"], g["loss_min"], g["loss_max"], color=colour, alpha=0.2, lw=0)
        ax.plot(g["step"], g["loss"], color=colour, lw=1.4, label=f"train loss, attempt {attempt} (mean, min-max)")
        bad = g[g["nonfinite"] > 0]
        if len(bad):
            ax.plot(bad["step"], np.full(len(bad), np.nanmax(b["loss_max"])), "x", color="#d62728", ms=7,
                    label="non-finite loss")  # fmt: skip
    ev = a.evals.dropna(subset=["loss"]) if not a.evals.empty else a.evals
    if len(ev):
        ax.plot(ev["step"], pd.to_numeric(ev["loss"], errors="coerce"), "o-", color="#2ca02c", ms=4, lw=1,
                label="eval loss")  # fmt: skip
    lo, hi = np.nanmin(b["loss_min"]), np.nanmax(b["loss_max"])
    if lo > 0 and hi / lo > 20:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.set_title(f"loss - run {a.summary['run']}", parse_math=False)
    ax.grid(alpha=0.3)
    _mark_anomalies(ax, a)
    _legend(ax, loc="upper right", fontsize=8)
    return fig


def plot_grad_norm(a: Analysis) -> Figure:
    """Pre-clip grad norm (mean and max per bin) against the post-clip norm."""
    fig, (ax,) = _figure()
    b = a.bins
    if b.empty or b["grad_norm"].isna().all():
        _missing(fig, ax, "no grad norms in this input")
        return fig
    for i, (_attempt, g) in enumerate(_by_attempt(b)):
        ax.fill_between(g["step"], g["grad_norm"], g["grad_norm_max"], color="#1f77b4", alpha=0.2, lw=0)
        ax.plot(g["step"], g["grad_norm"], color="#1f77b4", lw=1.3, label=None if i else "pre-clip (mean, max)")
        if g["grad_norm_clipped"].notna().any():
            ax.plot(g["step"], g["grad_norm_clipped"], color="#ff7f0e", lw=1.3, label=None if i else "post-clip (mean)")
    if (b["grad_norm"] > 0).any():
        ax.set_yscale("log")
    ax.set_ylabel("grad norm")
    ax.set_xlabel("step")
    ax.set_title("gradient norm before and after clipping")
    ax.grid(alpha=0.3)
    _mark_anomalies(ax, a, ("grad_explosion", "loss_spike", "nan_inf", "divergence"))
    _legend(ax, loc="upper right", fontsize=8)
    return fig


def plot_lr(a: Analysis) -> Figure:
    """The LR each step used against the declared schedule's, and their relative gap."""
    fig, axes = _figure(2, 3.0)
    s = a.sample
    rank0 = int(s["rank"].min()) if not s.empty else 0
    s = s[(s["rank"] == rank0) & s["lr"].notna()].sort_values(["attempt", "step"]) if not s.empty else s
    if s.empty:
        _missing(fig, axes[0], "no learning rate in this input")
        _missing(fig, axes[1], "")
        return fig
    ax = axes[0]
    for attempt, g in _by_attempt(s):
        ax.plot(g["step"], g["lr"], color=ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)], lw=1.5,
                label=f"actual (attempt {attempt})")  # fmt: skip
    if a.schedule is not None:
        grid = np.unique(np.linspace(s["step"].min(), s["step"].max(), 600).round().astype(int))
        ax.plot(grid, expected_lr(a.schedule, grid), color="#000000", lw=1, ls="--",
                label=f"expected ({a.schedule.name} schedule)")  # fmt: skip
        gap = (s["lr"].to_numpy() - expected_lr(a.schedule, s["step"])) / expected_lr(a.schedule, s["step"])
        axes[1].plot(s["step"], gap * 100, color="#d62728", lw=1)
        axes[1].axhline(0, color="#000000", lw=0.8)
        axes[1].set_ylabel("actual vs expected, %")
    else:
        _missing(fig, axes[1], "no declared LR schedule: nothing to compare against")
    ax.set_ylabel("learning rate")
    ax.set_title("learning rate: actual vs declared schedule")
    ax.grid(alpha=0.3)
    _legend(ax, loc="upper right", fontsize=8)
    axes[1].set_xlabel("step")
    axes[1].grid(alpha=0.3)
    _mark_anomalies(ax, a, ("lr_schedule_drift", "bad_resume"))
    return fig


def plot_throughput(a: Analysis) -> Figure:
    """Tokens/s per bin over the run, and below it the step time stacked by phase."""
    fig, axes = _figure(2, 3.5)
    b = a.bins
    if b.empty or b["step_time"].isna().all():
        _missing(fig, axes[0], "no step times in this input")
        _missing(fig, axes[1], "")
        return fig
    world = a.summary.get("world_size") or 1
    tps = b["tokens"] * world / b["step_time"]
    for attempt, g in _by_attempt(b.assign(tps=tps)):
        axes[0].plot(g["step"], g["tps"], color=ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)], lw=1.4,
                     label=f"attempt {attempt}")  # fmt: skip
    axes[0].set_ylabel("tokens/s (all ranks)")
    axes[0].set_title("throughput and where the step time goes")
    axes[0].grid(alpha=0.3)
    _legend(axes[0], loc="lower right", fontsize=8)
    _mark_anomalies(axes[0], a, ("throughput_collapse", "straggler", "hang"))
    cols = [f"phase_{p}" for p in PHASE_COLUMNS]
    if not b[cols].notna().any().any():
        _missing(fig, axes[1], "no phase times in this input")
        return fig
    per_step = b[cols].fillna(0.0).div(b["count"], axis=0)
    rest = (b["step_time"] / b["count"] - per_step.sum(axis=1)).clip(lower=0).fillna(0)
    per_step["phase_other"] += rest
    order = b.sort_values(["step", "attempt"]).index
    axes[1].stackplot(b.loc[order, "step"], *[per_step.loc[order, c] for c in cols], labels=list(PHASE_COLUMNS),
                      colors=[PHASE_COLOURS[p] for p in PHASE_COLUMNS], alpha=0.85)  # fmt: skip
    axes[1].set_ylabel("seconds per step")
    axes[1].set_xlabel("step")
    axes[1].grid(alpha=0.3)
    _legend(axes[1], loc="upper left", fontsize=8, ncol=4)
    return fig


def plot_rank_heatmap(a: Analysis) -> Figure:
    """Each rank's step time (and compute time) over the run relative to the median rank of the
    same steps: a straggler is a hot row."""
    s = a.sample
    have_compute = not s.empty and s[["phase_forward", "phase_backward"]].notna().any().any()
    fig, axes = _figure(2 if have_compute else 1, 3.0)
    if s.empty or s["step_time"].isna().all():
        _missing(fig, axes[0], "no step times in this input")
        return fig
    s = s.copy()
    lo, hi = s["step"].min(), s["step"].max()
    nb = int(min(120, max(1, s["step"].nunique())))
    s["bin"] = ((s["step"] - lo) * nb // max(1, hi - lo + 1)).astype(int)
    edges = lo + np.arange(nb + 1) * (hi - lo + 1) / nb
    panels = [("step_time", "step time")]
    if have_compute:
        s["compute"] = s[["phase_forward", "phase_backward", "phase_optimizer"]].sum(axis=1, min_count=1)
        panels.append(("compute", "compute time (forward+backward+optimizer)"))
    ranks = sorted(s["rank"].unique())
    for ax, (col, title) in zip(axes, panels, strict=False):
        grid = s.pivot_table(index="rank", columns="bin", values=col, aggfunc="median").reindex(
            index=ranks, columns=range(nb)
        )
        rel = grid / grid.median(axis=0)
        finite = rel.to_numpy()[np.isfinite(rel.to_numpy())]
        spread = max(0.05, float(np.nanmax(np.abs(finite - 1)))) if finite.size else 0.1
        norm = TwoSlopeNorm(vcenter=1.0, vmin=1 - spread, vmax=1 + spread)
        mesh = ax.pcolormesh(edges, np.arange(len(ranks) + 1) - 0.5, rel.to_numpy(), cmap="RdBu_r", norm=norm)
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_ylabel("rank")
        ax.set_title(f"{title} relative to the median rank")
        fig.colorbar(mesh, ax=ax, label="x median rank")
    axes[-1].set_xlabel("step")
    return fig


def plot_gpu_health(a: Analysis) -> Figure:
    """GPU temperature, SM clock and utilisation per rank over wall time; host memory when
    there is no GPU."""
    h = a.health
    fig, axes = _figure(3, 2.8)
    if h.empty:
        _missing(fig, axes[0], "no node-health samples in this input")
        _missing(fig, axes[1], "")
        _missing(fig, axes[2], "")
        return fig
    t0 = h["time"].min()
    hours = (h["time"] - t0) / 3600
    panels = [
        ("temperature_c", "GPU temperature, C"),
        ("sm_clock_hz", "SM clock, GHz"),
        ("utilization_ratio", "GPU utilisation"),
    ]
    if h["temperature_c"].isna().all():
        panels = [("host_mem_ratio", "host memory used"), ("temperature_c", ""), ("sm_clock_hz", "")]
    for ax, (col, label) in zip(axes, panels, strict=True):
        if h[col].isna().all():
            _missing(fig, ax, f"no {col.replace('_', ' ')} in the health samples")
            continue
        for rank, g in h.groupby("rank"):
            y = g[col] / 1e9 if col == "sm_clock_hz" else g[col]
            ax.plot(hours[g.index], y, lw=1, label=f"rank {rank} ({g['host'].iloc[0]})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("node health per rank")
    _legend(axes[0], loc="upper right", fontsize=7, ncol=4)
    axes[-1].set_xlabel("hours since the first sample")
    return fig


PLOTS: dict[str, Callable[[Analysis], Figure]] = {
    "loss": plot_loss,
    "grad_norm": plot_grad_norm,
    "lr": plot_lr,
    "throughput": plot_throughput,
    "rank_heatmap": plot_rank_heatmap,
    "gpu_health": plot_gpu_health,
}


def write_plots(a: Analysis, out: Path, progress: Callable[[str], Any] | None = None) -> dict[str, Path]:
    """Write every plot as ``out/NAME.png``; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, draw in PLOTS.items():
        if progress is not None:
            progress(f"plot {name}")
        fig = draw(a)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        paths[name] = path
    return paths
