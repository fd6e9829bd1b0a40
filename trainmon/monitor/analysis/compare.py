"""Two runs side by side: where and how B departs from the reference A.

The case this is for is the tensor-parallel seeding bug of Hugging Face's SmolLM3 training story
(2025): a 1.7B run with tensor parallelism was "consistently worse" than the same run without
it, and only a careful side-by-side showed it.
A loss gap means something only against the runs' own noise, so each run's step-to-step
noise is estimated first; the gap ``B - A`` is smoothed and compared with ``k`` times the
noise of the smoothed gap. Positive gaps mean B's loss is higher (worse).

The report names:

* the loss gap: the first step from which the smoothed gap stays beyond noise with one sign,
  and its size ("B is consistently worse than A by 0.08 +/- 0.01 nats from step 1,200": verdict
  ``worse`` or ``better``), or a transient difference that closed again, or ``within noise``;
* LR differences: the first step where the LRs differ by more than 1 %, and whether B's LR is
  a constant multiple of A's (a different peak) or the schedules differ in shape;
* throughput: the tokens/s ratio and the phase whose time per token changed the most;
* the eval loss gap at the evaluations both runs made;
* the configuration keys whose values differ.

Runs come from a store (``--db``), a collector (``--url``: the run's export, as ``trainmon export`` writes it) or
from log files/folders, which are imported into an in-memory store first
(:func:`trainmon.monitor.analysis.open_run.open_run`), so every path shares one query.
Runs are aligned by optimizer step, or by tokens consumed (a run with a different batch size).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.monitor.analysis.live_view import HttpSource, SourceError
from trainmon.monitor.analysis.open_run import OpenRunError, open_run
from trainmon.monitor.core.escape import escape_for_terminal
from trainmon.monitor.detectors.loss_noise import shuffling_hint
from trainmon.monitor.importers.common import BOOKKEEPING_KEYS
from trainmon.monitor.store.event_reads import eval_losses
from trainmon.monitor.store.queries import run_row
from trainmon.monitor.store.step_reads import lowest_step_rank, step_series
from trainmon.monitor.store.storage import PHASE_COLUMNS, Storage

__all__ = ["CompareError", "RunSeries", "compare", "load_run", "noise_sigma", "render", "series_from_arrays"]

LR_TOLERANCE = 0.01  # relative LR difference that counts as "different"
K_SIGMA = 3.0  # how far beyond the smoothed gap's noise a gap must be
_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)  # noise of a median over that of a mean (normal data)
# Differ between any two runs (names, paths), or say how a log was imported rather than how it trained.
_IGNORED_CONFIG = {"run", "run_id", "out", "collector", "resume"} | BOOKKEEPING_KEYS


class CompareError(ValueError):
    """A run that cannot be found or loaded, or two runs that cannot be aligned."""


@dataclass
class RunSeries:
    """One run's per-step series (latest attempt of each step, lowest rank), plus evals and config."""

    label: str
    run: str
    world_size: int
    config: dict[str, Any]
    step: np.ndarray
    loss: np.ndarray
    lr: np.ndarray
    tokens: np.ndarray  # global tokens of each step (rank's tokens x world size); NaN if unknown
    step_time: np.ndarray
    phases: dict[str, np.ndarray] = field(default_factory=dict)
    eval_step: np.ndarray = field(default_factory=lambda: np.zeros(0))
    eval_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def cum_tokens(self) -> np.ndarray:
        """Tokens consumed by the end of each step."""
        return np.cumsum(np.nan_to_num(self.tokens, nan=0.0))


def series_from_arrays(
    label: str,
    step: Any,
    loss: Any,
    lr: Any = None,
    tokens: Any = None,
    step_time: Any = None,
    *,
    eval_step: Any = (),
    eval_loss: Any = (),
    config: dict[str, Any] | None = None,
    phases: dict[str, Any] | None = None,
) -> RunSeries:
    """A :class:`RunSeries` from plain sequences (tests, notebooks, foreign data)."""
    n = len(step)

    def arr(x: Any) -> np.ndarray:
        return np.full(n, np.nan) if x is None else np.asarray(x, dtype=float)

    return RunSeries(
        label,
        label,
        1,
        config or {},
        np.asarray(step, dtype=float),
        arr(loss),
        arr(lr),
        arr(tokens),
        arr(step_time),
        {k: arr(v) for k, v in (phases or {}).items()},
        np.asarray(eval_step, dtype=float),
        np.asarray(eval_loss, dtype=float),
    )


# -- loading ---------------------------------------------------------------------------------------


def _from_storage(storage: Storage, run: str, label: str) -> RunSeries:
    with storage.connect() as conn:
        row = run_row(conn, run)
        if row is None:
            raise CompareError(f"{label}: no run {run!r} in {storage.url}")
        rank = lowest_step_rank(conn, run)
        if rank is None:
            raise CompareError(f"{label}: run {run!r} has no steps")
        rows = step_series(conn, run, rank)
        eval_rows = eval_losses(conn, run)
    latest: dict[int, Any] = {}
    for r in rows:  # a resumed run re-does steps: the latest attempt is the one that counts
        latest[r.step] = r
    ordered = [latest[s] for s in sorted(latest)]
    world = row.world_size or 1

    def col(name: str, scale: float = 1.0) -> np.ndarray:
        return np.array([np.nan if getattr(r, name) is None else getattr(r, name) * scale for r in ordered], float)

    phases = {p: col(f"phase_{p}") for p in PHASE_COLUMNS}
    phases = {p: v for p, v in phases.items() if np.isfinite(v).any()}
    ev: dict[int, float] = {}
    for r in eval_rows:
        ev[r.step] = r.loss  # latest attempt wins, as for steps
    return RunSeries(
        label=label,
        run=run,
        world_size=world,
        config=row.config or {},
        step=col("step"),
        loss=col("loss"),
        lr=col("lr"),
        tokens=col("tokens", world),
        step_time=col("step_time"),
        phases=phases,
        eval_step=np.array(sorted(ev), float),
        eval_loss=np.array([ev[s] for s in sorted(ev)], float),
    )


def load_run(
    spec: str, db: str | None = None, run: str | None = None, collector: HttpSource | None = None
) -> RunSeries:
    """A run by id in ``db`` or on ``collector``, or the run held by a log file or folder (imported into memory).

    ``run`` picks one run of a multi-run file. A run on a collector is read through its export, imported as a
    file would be: a comparison reads the same series wherever the run is.
    """
    if collector is not None and not Path(spec).exists():
        with tempfile.TemporaryDirectory(prefix="trainmon-compare-") as tmp:
            path = Path(tmp) / "export.jsonl"
            try:
                collector.export_to(spec, path)
            except KeyError as exc:
                where = f"{spec}: not a log file or folder, nor a run on {collector.where}"
                raise CompareError(f"{where} ({exc.args[0]})") from None
            except SourceError as exc:
                raise CompareError(f"{spec}: {exc}") from None
            return _opened(path, None, spec, spec)
    return _opened(spec, db, run, spec)


def _opened(target: str | Path, db: str | None, run: str | None, label: str) -> RunSeries:
    try:
        opened = open_run(target, db, run, choose="--run-a/--run-b")
    except OpenRunError as exc:
        raise CompareError(str(exc)) from None
    with opened:
        return _from_storage(opened.storage, opened.run, label)


# -- statistics ------------------------------------------------------------------------------------


def noise_sigma(values: np.ndarray) -> float:
    """Step-to-step noise of a series, robust to its trend and to spikes.

    Second differences ``x[t+1] - 2x[t] + x[t-1]`` cancel any locally linear trend (the loss
    curve) and have variance ``6 sigma^2`` for independent noise; the MAD (x 1.4826) keeps a few
    spikes from inflating the estimate.
    """
    x = values[np.isfinite(values)]
    if len(x) < 5:
        return float(np.std(x)) if len(x) > 1 else 0.0
    d2 = x[2:] - 2 * x[1:-1] + x[:-2]
    mad = float(np.median(np.abs(d2 - np.median(d2))))
    return 1.4826 * mad / math.sqrt(6)


def _smooth(x: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Rolling median over ``window`` points, centred except at the ends, where the window stays
    inside the series (same noise everywhere: an end value is not judged on half the points).
    Also returns the number of points behind each value.

    A median, not a mean: one loss spike in either run must not read as a gap for a whole window.
    """
    n = len(x)
    if n <= window:
        return np.full(n, float(np.median(x))), np.full(n, n)
    lo = np.clip(np.arange(n) - window // 2, 0, n - window)
    medians = np.median(np.lib.stride_tricks.sliding_window_view(x, window), axis=1)
    return medians[lo], np.full(n, window)


def _segments(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def _x(v: float) -> int | float:
    """Steps and token counts as ints when whole (JSON readers expect ``1200``, not ``1200.0``)."""
    v = float(v)
    return int(v) if v.is_integer() else v


# -- alignment -------------------------------------------------------------------------------------


@dataclass
class _Aligned:
    x: np.ndarray  # step or tokens
    step_a: np.ndarray
    step_b: np.ndarray
    loss_a: np.ndarray
    loss_b: np.ndarray
    lr_a: np.ndarray
    lr_b: np.ndarray


def _interp(x_new: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    ok = np.isfinite(y)
    if ok.sum() < 2:
        return np.full(len(x_new), np.nan)
    return np.interp(x_new, x[ok], y[ok])


def _align(a: RunSeries, b: RunSeries, by: str) -> _Aligned:
    if by == "step":
        common, ia, ib = np.intersect1d(a.step, b.step, assume_unique=True, return_indices=True)
        if len(common) == 0:
            raise CompareError("the runs have no step in common")
        return _Aligned(common, common, common, a.loss[ia], b.loss[ib], a.lr[ia], b.lr[ib])
    if by != "tokens":
        raise CompareError(f"--by must be step or tokens, not {by!r}")
    for r in (a, b):
        if not np.isfinite(r.tokens).any():
            raise CompareError(f"{r.label}: no tokens per step logged; align with --by step")
    ta, tb = a.cum_tokens, b.cum_tokens
    lo, hi = max(ta[0], tb[0]), min(ta[-1], tb[-1])
    # Put the denser run on the sparser run's grid: interpolating the other way would invent points.
    in_a, in_b = (ta >= lo) & (ta <= hi), (tb >= lo) & (tb <= hi)
    if min(in_a.sum(), in_b.sum()) < 2:
        raise CompareError("the runs share too few tokens to align")
    if in_a.sum() <= in_b.sum():
        x = ta[in_a]
        return _Aligned(
            x,
            a.step[in_a],
            _interp(x, tb, b.step),
            a.loss[in_a],
            _interp(x, tb, b.loss),
            a.lr[in_a],
            _interp(x, tb, b.lr),
        )
    x = tb[in_b]
    return _Aligned(
        x,
        _interp(x, ta, a.step),
        b.step[in_b],
        _interp(x, ta, a.loss),
        b.loss[in_b],
        _interp(x, ta, a.lr),
        b.lr[in_b],
    )


# -- the parts of the report -----------------------------------------------------------------------


def _loss_report(al: _Aligned, a: RunSeries, b: RunSeries, k: float) -> dict[str, Any]:
    ok = np.isfinite(al.loss_a) & np.isfinite(al.loss_b)
    x, sa, gap = al.x[ok], al.step_a[ok], (al.loss_b - al.loss_a)[ok]
    sigma_a, sigma_b = noise_sigma(a.loss), noise_sigma(b.loss)
    out: dict[str, Any] = {"points": int(ok.sum()), "noise_a": sigma_a, "noise_b": sigma_b}
    if len(gap) < 5:
        out["verdict"] = "too short"
        return out
    window = int(np.clip(len(gap) // 10, 5, 50))
    smooth, count = _smooth(gap, window)
    sigma_pair = math.hypot(sigma_a, sigma_b)
    # The median of w points has ~1.2533 sigma/sqrt(w) noise; fewer points behind it at the ends.
    threshold = k * _MEDIAN_EFFICIENCY * max(sigma_pair, 1e-12) / np.sqrt(count)
    out.update(window=window, threshold=float(k * _MEDIAN_EFFICIENCY * sigma_pair / math.sqrt(window)))
    beyond = np.abs(smooth) > threshold
    sign = np.sign(smooth)
    imax = int(np.argmax(np.abs(smooth)))
    out["max_gap"] = {"x": _x(x[imax]), "step": _x(sa[imax]), "gap": float(smooth[imax])}
    tail = gap[-window:]
    out["final_gap"] = float(tail.mean())
    out["first_beyond"] = None
    segs = [(s, e) for s, e in _segments(beyond) if e - s >= window]  # a full window: not one noisy cluster
    segs = [(s, e) for s, e in segs if abs(sign[s:e].sum()) == e - s]  # one sign throughout
    if segs:
        out["first_beyond"] = {"x": _x(x[segs[0][0]]), "step": _x(sa[segs[0][0]])}
    last = segs[-1] if segs else None
    if last is not None and last[1] == len(gap):
        s = last[0]
        held = smooth[s:]
        out["direction"] = "worse" if held.mean() > 0 else "better"
        out["verdict"] = out["direction"]
        out["from_x"] = _x(x[s])
        out["from_step"] = _x(sa[s])
        out["gap"] = float(held.mean())
        out["gap_spread"] = float(held.std())
    elif segs:
        s, e = max(segs, key=lambda se: float(np.abs(smooth[se[0] : se[1]]).max()))
        out["verdict"] = "transient"
        out["transient"] = {
            "from_step": _x(sa[s]),
            "to_step": _x(sa[e - 1]),
            "from_x": _x(x[s]),
            "to_x": _x(x[e - 1]),
            "direction": "worse" if smooth[s:e].mean() > 0 else "better",
            "peak_gap": float(smooth[s:e][np.argmax(np.abs(smooth[s:e]))]),
        }
    else:
        out["verdict"] = "within noise"
    return out


NOISE_RATIO = 2.0  # B's loss noise this many times A's over the shared range is worth a line
LEVEL_RATIO = 1.5  # ...when the two losses sit within this factor of each other (else noise is not comparable)


def _noise_report(a: RunSeries, b: RunSeries, al: _Aligned, by: str) -> dict[str, Any] | None:
    """Each run's own step-to-step loss noise over the range both cover (the same steps or tokens).

    Measured on each run's points, not the aligned ones: interpolating one run at the other's
    positions would smooth its noise away."""
    if len(al.x) < 2:
        return None
    lo, hi = float(al.x[0]), float(al.x[-1])

    def shared(r: RunSeries) -> np.ndarray:
        x = r.step if by == "step" else r.cum_tokens
        return r.loss[(x >= lo) & (x <= hi)]

    def noise(r: RunSeries) -> float:
        return noise_sigma(shared(r))

    def level(r: RunSeries) -> float:
        v = shared(r)
        v = v[np.isfinite(v)]
        return float(np.median(v)) if len(v) else math.nan

    na, nb = noise(a), noise(b)
    if not (na > 0 and nb > 0):
        return None
    la, lb = level(a), level(b)
    # Noise in nats scales with the loss: a run at a tenth of the other's loss (another model, another
    # task, an overfit fine-tune) is quieter for that alone, and blaming B's data loader misleads.
    comparable = la > 0 and lb > 0 and 1 / LEVEL_RATIO <= lb / la <= LEVEL_RATIO
    return {"a": na, "b": nb, "ratio": nb / na, "level_a": la, "level_b": lb, "comparable": comparable}


def _lr_report(al: _Aligned) -> dict[str, Any] | None:
    ok = np.isfinite(al.lr_a) & np.isfinite(al.lr_b)
    if not ok.any():
        return None
    la, lb, sa, x = al.lr_a[ok], al.lr_b[ok], al.step_a[ok], al.x[ok]
    scale = np.maximum(np.abs(la), np.abs(lb))
    differs = np.abs(lb - la) > LR_TOLERANCE * np.where(scale > 0, scale, 1.0)
    out: dict[str, Any] = {"differs": bool(differs.any()), "steps_differing": int(differs.sum()), "points": len(la)}
    if not differs.any():
        return out
    i = int(np.argmax(differs))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = lb / la
    first_ratio = float(ratio[i]) if la[i] != 0 else math.inf
    later = ratio[i:][np.isfinite(ratio[i:])]
    constant = bool(len(later) and np.all(np.abs(later - first_ratio) <= LR_TOLERANCE * abs(first_ratio)))
    out.update(
        first_step=_x(sa[i]),
        first_x=_x(x[i]),
        a=float(la[i]),
        b=float(lb[i]),
        ratio=first_ratio,
        constant_ratio=constant,
    )
    return out


def _throughput_report(a: RunSeries, b: RunSeries) -> dict[str, Any] | None:
    def rate(r: RunSeries) -> tuple[float | None, dict[str, float]]:
        ok = np.isfinite(r.tokens) & np.isfinite(r.step_time) & (r.step_time > 0)
        if not ok.any():
            return None, {}
        tokens = float(r.tokens[ok].sum())
        per_token = {p: float(np.nansum(v[ok])) / tokens for p, v in r.phases.items()}
        return tokens / float(r.step_time[ok].sum()), per_token

    ra, pa = rate(a)
    rb, pb = rate(b)
    if ra is None or rb is None:
        return None
    out: dict[str, Any] = {"tokens_per_second_a": ra, "tokens_per_second_b": rb, "ratio": rb / ra}
    phases = sorted(set(pa) & set(pb))
    if phases:
        out["phase_seconds_per_mtoken_a"] = {p: pa[p] * 1e6 for p in phases}
        out["phase_seconds_per_mtoken_b"] = {p: pb[p] * 1e6 for p in phases}
        worst = max(phases, key=lambda p: abs(pb[p] - pa[p]))
        out["phase"] = worst
        out["phase_ratio"] = pb[worst] / pa[worst] if pa[worst] > 0 else None
    return out


def _eval_report(a: RunSeries, b: RunSeries, by: str) -> dict[str, Any] | None:
    if not len(a.eval_step) or not len(b.eval_step):
        return None
    if by == "step":
        common, ia, ib = np.intersect1d(a.eval_step, b.eval_step, assume_unique=True, return_indices=True)
        pairs = [
            (float(s), float(s), float(a.eval_loss[i]), float(b.eval_loss[j]))
            for s, i, j in zip(common, ia, ib, strict=True)
        ]
    else:  # the token count at the end of each eval's step; B interpolated at A's evaluations
        ta = np.interp(a.eval_step, a.step, a.cum_tokens)
        tb = np.interp(b.eval_step, b.step, b.cum_tokens)
        pairs = []
        for s, t, la in zip(a.eval_step, ta, a.eval_loss, strict=True):
            if len(tb) >= 2 and tb[0] <= t <= tb[-1]:
                pairs.append((float(s), float(t), float(la), float(np.interp(t, tb, b.eval_loss))))
            elif np.any(np.isclose(tb, t, rtol=0.01)):
                pairs.append((float(s), float(t), float(la), float(b.eval_loss[np.isclose(tb, t, rtol=0.01)][0])))
    if not pairs:
        return {"common": 0}
    rows = [{"step": _x(s), "x": _x(x), "a": la, "b": lb, "gap": lb - la} for s, x, la, lb in pairs]
    return {"common": len(rows), "evals": rows, "final_gap": rows[-1]["gap"], "final_step": rows[-1]["step"]}


def _config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = (flat({k: v for k, v in (c or {}).items() if k not in _IGNORED_CONFIG}) for c in (a, b))
    keys = sorted(set(fa) | set(fb))
    return {k: [fa.get(k), fb.get(k)] for k in keys if fa.get(k) != fb.get(k)}


# -- the comparison ------------------------------------------------------------------------------


def _num(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}"


def _where(by: str, step: float, x: float) -> str:
    return f"step {_num(step)}" if by == "step" else f"{_num(x)} tokens (step {_num(step)} of A)"


def compare(a: RunSeries, b: RunSeries, by: str = "step", k: float = K_SIGMA) -> dict[str, Any]:
    """Compare B with the reference A; a JSON-ready dict with a ``summary`` list of sentences."""
    al = _align(a, b, by)
    loss = _loss_report(al, a, b, k)
    lr = _lr_report(al)
    tput = _throughput_report(a, b)
    ev = _eval_report(a, b, by)
    noise = _noise_report(a, b, al, by)
    cfg = _config_diff(a.config, b.config)
    summary: list[str] = []
    v = loss.get("verdict")
    if v in ("worse", "better"):
        summary.append(
            f"B is consistently {loss['direction']} than A by {abs(loss['gap']):.3g} +/- {loss['gap_spread']:.2g} nats "
            f"from {_where(by, loss['from_step'], loss['from_x'])} "
            f"(noise A {loss['noise_a']:.2g}, B {loss['noise_b']:.2g} per step)"
        )
    elif v == "transient":
        t = loss["transient"]
        summary.append(
            f"B was {t['direction']} than A by up to {abs(t['peak_gap']):.3g} nats between "
            f"{_where(by, t['from_step'], t['from_x'])} and {_where(by, t['to_step'], t['to_x'])}, "
            f"then within noise (final gap {loss['final_gap']:+.3g})"
        )
    elif v == "within noise":
        summary.append(
            f"within noise: the loss gap stays inside ({K_SIGMA:g} sigma of the smoothed gap = "
            f"{loss['threshold']:.2g} nats; final gap {loss['final_gap']:+.3g})"
        )
    else:
        summary.append(f"too few aligned steps to judge the loss ({loss['points']})")
    if noise is not None and noise["ratio"] >= NOISE_RATIO and noise["comparable"]:
        summary.append(
            f"loss noise: B's step-to-step noise is {noise['ratio']:.1f}x A's over the same {by} "
            f"({noise['b']:.3g} vs {noise['a']:.3g} nats). " + shuffling_hint(None, than="in A")
        )
    if lr is None:
        summary.append("LR: not logged by both runs")
    elif lr["differs"]:
        how = (
            f"B's LR is {lr['ratio']:.3g}x A's from there on (a different peak LR)"
            if lr["constant_ratio"]
            else "the schedules differ in shape"
        )
        where = _where(by, lr["first_step"], lr["first_x"])
        summary.append(f"LR differs first at {where}: A {lr['a']:.3g}, B {lr['b']:.3g}; {how}")
    else:
        summary.append("LR: the same at every aligned step (within 1 %)")
    if tput is not None:
        line = (
            f"throughput: B {tput['tokens_per_second_b']:,.0f} tokens/s vs A {tput['tokens_per_second_a']:,.0f} "
            f"({tput['ratio']:.2f}x)"
        )
        if abs(tput["ratio"] - 1) > 0.05 and tput.get("phase") and tput.get("phase_ratio"):
            line += f"; the {tput['phase']} phase changed most: {tput['phase_ratio']:.2f}x its time per token"
        summary.append(line)
    if ev and ev.get("common"):
        summary.append(
            f"eval loss at step {_num(ev['final_step'])}: A {ev['evals'][-1]['a']:.4g}, B {ev['evals'][-1]['b']:.4g} "
            f"(gap {ev['final_gap']:+.3g})"
        )
    if cfg:
        summary.append("config differs: " + ", ".join(f"{k} {va!r} -> {vb!r}" for k, (va, vb) in cfg.items()))
    return {
        "a": {"label": a.label, "run": a.run, "steps": len(a.step), "world_size": a.world_size},
        "b": {"label": b.label, "run": b.run, "steps": len(b.step), "world_size": b.world_size},
        "by": by,
        "aligned_points": len(al.x),
        "differs": v in ("worse", "better"),
        "loss": loss,
        "lr": lr,
        "noise": noise,
        "throughput": tput,
        "eval": ev,
        "config_differences": cfg,
        "summary": summary,
    }


def render(result: dict[str, Any], console: Any = None) -> None:
    """Print a comparison: the summary sentences, then the numbers behind them.

    Labels and summary sentences hold data (file names, config keys and values): escaped, never markup.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console(emoji=False)
    a, b, by = (escape_for_terminal(v) for v in (result["a"]["label"], result["b"]["label"], result["by"]))
    console.print(f"[bold]A[/bold] {a}  vs  [bold]B[/bold] {b}  (by {by})")
    for line in result["summary"]:
        console.print(f"- {escape_for_terminal(line)}")
    loss = result["loss"]
    table = Table(title="loss gap (B - A)", show_header=False, box=None)
    for key in ("points", "noise_a", "noise_b", "window", "threshold", "final_gap", "verdict"):
        if key in loss:
            val = loss[key]
            table.add_row(key.replace("_", " "), f"{val:.4g}" if isinstance(val, float) else escape_for_terminal(val))
    console.print(table)
    ev = result.get("eval")
    if ev and ev.get("common"):
        t = Table(title="eval loss")
        for col in ("step", "A", "B", "gap"):
            t.add_column(col)
        for r in ev["evals"]:
            t.add_row(_num(r["step"]), f"{r['a']:.4f}", f"{r['b']:.4f}", f"{r['gap']:+.4f}")
        console.print(t)
