"""The post-mortem's plots, as PNG bytes (matplotlib, no display needed).

Figures are built with ``matplotlib.figure.Figure`` directly, not ``pyplot``: no global state,
no backend to select, nothing that needs a display. Each plot draws the already-downsampled
series of :class:`trainmon.monitor.analysis.postmortem.Analysis` (about 200 step bins, a ~100k-row sample), so
drawing costs the same for a run of a thousand steps or of a million.

What a reader sees must be the data: a plot (or a panel) the input has no data for is not drawn
at all (imported logs often lack throughput or health); legends sit outside the axes; anomaly
marks carry the number the verdict and the timeline give them, placed above the axes in at most
three rows (the most important findings also named, the rest numbered, and what does not fit
left to the dashed line), and each plot marks only the kinds that concern it (a throughput
collapse on the throughput plot, not on the loss). Attempts are numbered from 1, as people count.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from matplotlib.transforms import blended_transform_factory

from trainmon.monitor.analysis.postmortem import Analysis, expected_lr
from trainmon.monitor.analysis.verdict import finding_numbers, verdict
from trainmon.monitor.core.fmt import attempt_label, fmt
from trainmon.monitor.detectors import kinds_on_plot
from trainmon.monitor.store.storage import PHASE_COLUMNS

__all__ = ["PLOTS", "render_plots"]

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
LABEL_ROWS = 3  # rows of anomaly labels above an axes
# Which anomaly kinds each plot marks: where the reader looks for them (each detector declares its plots).
LOSS_KINDS = kinds_on_plot("loss")
GRAD_KINDS = kinds_on_plot("grad")
LR_KINDS = kinds_on_plot("lr")
THROUGHPUT_KINDS = kinds_on_plot("throughput")


def _legend(ax: Axes, **kwargs: Any) -> None:
    """``ax.legend`` outside the axes, on the right, so it never covers data; its labels are never
    parsed as mathtext: they hold data (host names), and a ``$`` in them would be read as a
    formula (a parse error stops the whole report)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)
    for text in legend.get_texts():
        text.set_parse_math(False)


def _figure(rows: int = 1, height: float = 4.0) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(11, height * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _numbers(a: Analysis) -> dict[int, int]:
    """Anomaly index -> the number shown for it: a first-level finding's own, a detail's that of
    the finding it explains (the timeline's ``explains``)."""
    s = a.summary
    own = finding_numbers(s)
    out = dict(own)
    timeline = s.get("timeline") or []
    for e in timeline:
        idx, head = e.get("anomaly"), e.get("explains")
        if idx is not None and head is not None and idx not in out:
            head_idx = timeline[head].get("anomaly")
            if head_idx in own:
                out[idx] = own[head_idx]
    return out


def _mark_anomalies(ax: Axes, a: Analysis, kinds: tuple[str, ...]) -> None:
    """Shade each anomaly of ``kinds`` over its steps in its severity's colour with a dashed line at
    its first step, and label it above the axes with its number (and kind, for the verdict's top
    findings) where a label fits without overlapping another."""
    numbers = _numbers(a)
    top = {f["number"] for f in verdict(a.summary)["findings"]}
    rank = {"critical": 0, "warning": 1, "info": 2}
    marks: dict[int, tuple[int, dict[str, Any]]] = {}  # number -> (first step, worst anomaly)
    for i, an in enumerate(a.summary["anomalies"]):
        if an["first_step"] is None or an["kind"] not in kinds:
            continue
        first = an["first_step"]
        last = an["last_step"] if an["last_step"] is not None else first
        colour = SEVERITY_COLOURS.get(an["severity"], "#1f77b4")
        if last > first:
            ax.axvspan(first, last + 1, color=colour, alpha=0.12, lw=0)
        ax.axvline(first, color=colour, lw=1.1, ls="--", alpha=0.9)
        n = numbers.get(i)
        if n is not None and (n not in marks or rank.get(an["severity"], 3) < rank.get(marks[n][1]["severity"], 3)):
            marks[n] = (first, an)
    if not marks:
        return
    lo, hi = ax.get_xlim()
    width_px = ax.get_figure().get_figwidth() * DPI * 0.8
    rows: list[list[tuple[float, float]]] = [[] for _ in range(LABEL_ROWS)]
    order = sorted(marks, key=lambda n: (n not in top, rank.get(marks[n][1]["severity"], 3), n))
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    used = 0
    for n in order:
        first, an = marks[n]
        text = f"#{n} {an['kind']}" if n in top else f"#{n}"
        x = (first - lo) / (hi - lo) if hi > lo else 0.5
        span = (x - 0.004, x + len(text) * 6.0 / width_px + 0.004)
        row = next((r for r in range(LABEL_ROWS) if all(span[1] < s0 or span[0] > s1 for s0, s1 in rows[r])), None)
        if row is None:
            continue  # no room: the dashed line stays, the timeline and verdict name it
        rows[row].append(span)
        used = max(used, row + 1)
        colour = SEVERITY_COLOURS.get(an["severity"], "#1f77b4")
        label = ax.annotate(text, xy=(first, 1.0), xycoords=trans, xytext=(0, 2 + 12 * row),
                            textcoords="offset points", ha="left", va="bottom", fontsize=8, color=colour,
                            fontweight="bold" if n in top else "normal", annotation_clip=False)  # fmt: skip
        label.set_parse_math(False)
    ax.set_title(ax.get_title(), pad=6 + 12 * used, parse_math=False)


def _extremes(ax: Axes, g: pd.DataFrame, low: str, high: str, colour: str) -> None:
    """The band from each bin's ``low`` to its ``high`` column, as wide as the bin, with its upper
    edge drawn as a line: a one-step spike in a bin of many steps shows at its true height. A band
    through the bin centres (``fill_between`` without ``step``) narrows to a sliver at a lone
    extreme, so a 111.9 spike among 0.8 losses looked like 12, the height of the bin's mean.
    Bins of one step have no band: their line is the value itself."""
    several = g["count"] > 1
    lo, hi = g[low].where(several), g[high].where(several)
    ax.fill_between(g["step"], lo, hi, step="mid", color=colour, alpha=0.25, lw=0)
    ax.plot(g["step"], hi, drawstyle="steps-mid", color=colour, lw=0.8, alpha=0.8)


def _by_attempt(df: pd.DataFrame) -> list[tuple[int, pd.DataFrame]]:
    if df.empty:
        return []
    return [(int(k), g) for k, g in df.groupby("attempt", sort=True)]


def _attempt_suffix(attempt: int, attempts: int) -> str:
    return f", attempt {attempt_label(attempt)}" if attempts > 1 else ""


def plot_loss(a: Analysis) -> Figure | None:
    """Training loss per step bin (mean, min-max band: a one-step spike stays visible), eval loss,
    non-finite steps as crosses along the bottom edge, the loss kinds of anomalies marked."""
    b = a.bins
    if b.empty or b["loss"].isna().all():
        return None
    fig, (ax,) = _figure()
    groups = _by_attempt(b)
    for attempt, g in groups:
        colour = ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)]
        _extremes(ax, g, "loss_min", "loss_max", colour)
        ax.plot(g["step"], g["loss"], color=colour, lw=1.4,
                label=f"train loss{_attempt_suffix(attempt, len(groups))} (mean, min-max)")  # fmt: skip
    bad = b[b["nonfinite"] > 0]
    if len(bad):
        ax.plot(bad["step"], np.full(len(bad), 0.02), "x", color="#d62728", ms=6, clip_on=False,
                transform=ax.get_xaxis_transform(), label="non-finite loss")  # fmt: skip
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
    _mark_anomalies(ax, a, LOSS_KINDS)
    _legend(ax)
    return fig


def plot_grad_norm(a: Analysis) -> Figure | None:
    """Pre-clip grad norm (mean and max per bin) against the post-clip norm."""
    b = a.bins
    if b.empty or b["grad_norm"].isna().all():
        return None
    fig, (ax,) = _figure()
    for i, (_attempt, g) in enumerate(_by_attempt(b)):
        _extremes(ax, g, "grad_norm", "grad_norm_max", "#1f77b4")
        ax.plot(g["step"], g["grad_norm"], color="#1f77b4", lw=1.3, label=None if i else "pre-clip (mean, max)")
        if g["grad_norm_clipped"].notna().any():
            ax.plot(g["step"], g["grad_norm_clipped"], color="#ff7f0e", lw=1.3, label=None if i else "post-clip (mean)")
    if (b["grad_norm"] > 0).any():
        ax.set_yscale("log")
    ax.set_ylabel("grad norm")
    ax.set_xlabel("step")
    ax.set_title("gradient norm before and after clipping")
    ax.grid(alpha=0.3)
    _mark_anomalies(ax, a, GRAD_KINDS)
    _legend(ax)
    return fig


def plot_lr(a: Analysis) -> Figure | None:
    """The LR each step used, against the declared schedule's and their relative gap when the run
    declared one."""
    s = a.sample
    if s.empty:
        return None
    rank0 = int(s["rank"].min())
    s = s[(s["rank"] == rank0) & s["lr"].notna()].sort_values(["attempt", "step"])
    if s.empty:
        return None
    fig, axes = _figure(2 if a.schedule is not None else 1, 3.0)
    ax = axes[0]
    groups = _by_attempt(s)
    for attempt, g in groups:
        ax.plot(g["step"], g["lr"], color=ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)], lw=1.5,
                label=f"actual{_attempt_suffix(attempt, len(groups))}")  # fmt: skip
    if a.schedule is not None:
        grid = np.unique(np.linspace(s["step"].min(), s["step"].max(), 600).round().astype(int))
        ax.plot(grid, expected_lr(a.schedule, grid), color="#000000", lw=1, ls="--",
                label=f"expected ({a.schedule.name} schedule)")  # fmt: skip
        expected = expected_lr(a.schedule, s["step"])
        with np.errstate(divide="ignore", invalid="ignore"):  # the schedule is 0 at the first warmup step
            gap = np.where(expected > 0, (s["lr"].to_numpy() - expected) / expected, np.nan)
        axes[1].plot(s["step"], gap * 100, color="#d62728", lw=1)
        axes[1].axhline(0, color="#000000", lw=0.8)
        axes[1].set_ylabel("actual vs expected, %")
        axes[1].grid(alpha=0.3)
    ax.set_ylabel("learning rate")
    ax.set_title("learning rate" + (": actual vs declared schedule" if a.schedule is not None else ""))
    ax.grid(alpha=0.3)
    _legend(ax)
    axes[-1].set_xlabel("step")
    _mark_anomalies(ax, a, LR_KINDS)
    return fig


def plot_throughput(a: Analysis) -> Figure | None:
    """Tokens/s per bin over the run (every rank's tokens over the step time, the report's one
    definition; steps/s when the steps carry no token counts), and below it the step time stacked
    by phase when the steps have phases."""
    b = a.bins
    if b.empty or b["step_time"].isna().all():
        return None
    cols = [f"phase_{p}" for p in PHASE_COLUMNS]
    have_phases = bool(b[cols].notna().any().any())
    fig, axes = _figure(2 if have_phases else 1, 3.5)
    world = a.summary.get("world_size") or 1
    have_tokens = bool((b["tokens"] > 0).any())
    rate = b["tokens"] * world / b["step_time"] if have_tokens else b["count"] / b["step_time"]
    groups = _by_attempt(b.assign(rate=rate))
    for attempt, g in groups:
        axes[0].plot(g["step"], g["rate"], color=ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)], lw=1.4,
                     label=f"attempt {attempt_label(attempt)}" if len(groups) > 1 else None)  # fmt: skip
    unit = "tokens/s" if have_tokens else "steps/s"
    axes[0].set_ylabel(unit + (f" (all {world} ranks)" if have_tokens and world > 1 else ""))
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(float(v), 3)))
    axes[0].set_title("throughput" + (" and where the step time goes" if have_phases else ""))
    axes[0].grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    _legend(axes[0])
    _mark_anomalies(axes[0], a, THROUGHPUT_KINDS)
    if have_phases:
        per_step = b[cols].fillna(0.0).div(b["count"], axis=0)
        rest = (b["step_time"] / b["count"] - per_step.sum(axis=1)).clip(lower=0).fillna(0)
        per_step["phase_other"] += rest
        used = [c for c in cols if per_step[c].sum() > 0]
        order = b.sort_values(["step", "attempt"]).index
        axes[1].stackplot(b.loc[order, "step"], *[per_step.loc[order, c] for c in used],
                          labels=[c.removeprefix("phase_") for c in used],
                          colors=[PHASE_COLOURS[c.removeprefix("phase_")] for c in used], alpha=0.85)  # fmt: skip
        axes[1].set_ylabel("seconds per step")
        axes[1].grid(alpha=0.3)
        _legend(axes[1])
    axes[-1].set_xlabel("step")
    return fig


# Precursor panels: (step field, how the modules fold into the plotted line, axis label, log scale).
_PRECURSOR_PANELS = (
    ("attn_logit_max", max, "attention-logit bound", True),
    ("attn_entropy", min, "attention entropy (nats)", False),
    ("linear_out_rms", max, "linear output RMS", True),
    ("output_logz", None, "output log Z", False),
    ("adam_eps_frac", max, "share of Adam v < eps²", False),
)


def _precursor_value(v: Any) -> float:
    """A sampled value as a float: the wire's non-finite markers as NaN (a gap in the line)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def plot_precursors(a: Analysis) -> Figure | None:
    """The sampled instability precursors of the lowest rank (issue 28): per signal the extreme over the
    modules (the largest bound and RMS, the lowest entropy) and the series of every module an anomaly named
    (``evidence["modules"]``), with the loss plot's findings marked, so the lead of ``instability_precursor``
    over the loss-based findings is read off the plot. A step run again after a resume shows its last
    attempt's values. Fewer than two sampled steps: no trend, no plot."""
    if len(a.precursors) < 2:
        return None
    named = {
        module
        for an in a.summary["anomalies"]
        if an["kind"] == "instability_precursor" and isinstance(an.get("evidence"), dict)
        for module in an["evidence"].get("modules") or [an["evidence"].get("module")]
    }
    latest = [row for _, row in sorted({row.step: row for row in a.precursors}.items())]  # a rerun step: its last
    panels = []
    for key, fold, label, log in _PRECURSOR_PANELS:
        steps, folded, modules = [], [], {}
        for row in latest:
            value = (row.precursors or {}).get(key)
            if value is None:
                continue
            if isinstance(value, dict):
                values = [x for x in map(_precursor_value, value.values()) if not np.isnan(x)]
                if not values or fold is None:
                    continue
                for module in named & value.keys():
                    modules.setdefault(module, []).append((row.step, _precursor_value(value[module])))
                value = fold(values)
            steps.append(row.step)
            folded.append(_precursor_value(value))
        if len(steps) >= 2:
            panels.append((label, log, fold, steps, folded, modules))
    if not panels:
        return None
    fig, axes = _figure(len(panels), 2.4)
    axes[0].set_title("instability precursors (sampled steps, lowest rank) against the loss findings")
    for ax, (label, log, fold, steps, folded, modules) in zip(axes, panels, strict=True):
        extreme = {max: "largest module", min: "lowest module"}.get(fold, label)
        ax.plot(steps, folded, color="#1f77b4", lw=1.4, marker=".", ms=3, label=extreme)
        for i, (module, points) in enumerate(sorted(modules.items())):
            colour = ATTEMPT_COLOURS[(i + 1) % len(ATTEMPT_COLOURS)]
            ax.plot(*zip(*points, strict=True), color=colour, lw=1.0, ls=":", label=f"{module} (named by a finding)")
        if log and np.nanmin(folded) > 0:
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        _legend(ax)
        _mark_anomalies(ax, a, LOSS_KINDS)
    axes[-1].set_xlabel("step")
    return fig


def plot_rank_heatmap(a: Analysis) -> Figure | None:
    """Each rank's step time (and compute time) over the run relative to the median rank of the
    same steps: a straggler is a hot row. Nothing to compare with one rank."""
    s = a.sample
    if s.empty or s["step_time"].isna().all() or s["rank"].nunique() < 2:
        return None
    have_compute = s[["phase_forward", "phase_backward"]].notna().any().any()
    fig, axes = _figure(2 if have_compute else 1, 3.0)
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


# Health columns that can be drawn: (column, axis label, scale to the shown unit).
HEALTH_PANELS = (
    ("temperature_c", "GPU temperature, °C", 1.0),
    ("sm_clock_hz", "SM clock, GHz", 1e-9),
    ("utilization_ratio", "GPU utilisation, %", 100.0),
    ("host_mem_ratio", "host memory used, %", 100.0),
)


def plot_gpu_health(a: Analysis) -> Figure | None:
    """Node health per rank over wall time: one panel per reading the samples hold (GPU
    temperature, SM clock and utilisation; host memory as a percentage, as in the table)."""
    h = a.health
    if h.empty or h.groupby("rank")["time"].nunique().max() < 2:
        return None  # a trend needs two samples in time: one per rank is a dot that says nothing
    panels = [p for p in HEALTH_PANELS if h[p[0]].notna().any()]
    if not panels:
        return None
    fig, axes = _figure(len(panels), 2.6)
    elapsed = h["time"] - h["time"].min()
    span = float(elapsed.max()) if len(elapsed) else 0.0
    unit, per = ("hours", 3600.0) if span >= 7200 else ("minutes", 60.0) if span >= 120 else ("seconds", 1.0)
    for ax, (col, label, scale) in zip(axes, panels, strict=True):
        for rank, g in h.groupby("rank"):
            ax.plot(elapsed[g.index] / per, g[col] * scale, lw=1, label=f"rank {rank} ({g['host'].iloc[0]})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[0].set_title("node health per rank")
    _legend(axes[0])
    axes[-1].set_xlabel(f"{unit} since the first sample")
    return fig


PLOTS: dict[str, Callable[[Analysis], Figure | None]] = {
    "loss": plot_loss,
    "grad_norm": plot_grad_norm,
    "lr": plot_lr,
    "throughput": plot_throughput,
    "precursors": plot_precursors,
    "rank_heatmap": plot_rank_heatmap,
    "gpu_health": plot_gpu_health,
}


def render_plots(a: Analysis, progress: Callable[[str], Any] | None = None) -> dict[str, bytes]:
    """Every plot the input has data for, as PNG bytes by name (in :data:`PLOTS` order)."""
    out = {}
    for name, draw in PLOTS.items():
        if progress is not None:
            progress(f"plot {name}")
        fig = draw(a)
        if fig is None:
            continue
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        out[name] = buf.getvalue()
    return out
