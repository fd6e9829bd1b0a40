"""The post-mortem's first answer: is the run healthy, and if not, what went wrong and what it cost.

An on-call engineer opening a report wants the verdict before the details: the few findings that
matter, ranked by impact, each with when it happened, how bad it was and what to do, and the
steps or device time it burned. The terminal report, the HTML report and the collector's web
view all render this one structure, so they agree.

Impact order: severity first (critical, warning, info); then consequence: a finding still open at
the end (unrecovered) before one that resolved; then the steps it covers; then its size (the
ratio, slowdown or relative error in its evidence). Only first-level findings compete: what
localises a symptom (a grad-norm spike under its loss spike) is detail.

One story: a run's health has one definition, :func:`health`, and every view uses it (``trainmon
runs``, ``trainmon status``, the collector's web index and run page, the post-mortem). A run is
healthy when none of its first-level findings is a warning or critical, *open or recovered*, and
no attempt failed: a recovered loss spike is still a problem the post-mortem reports, so a list
that called the run "healthy, 0 open findings" told a different story. Which findings are
first-level is decided here too (:func:`clusters`); whether an attempt failed is decided in
:mod:`trainmon.monitor.core.attempts`, which goodput's accounting shares. This module stays free
of pandas: the collector imports it.
"""

from __future__ import annotations

import math
from typing import Any

from trainmon.monitor.core.fmt import steps_text
from trainmon.monitor.detectors import priority_order

__all__ = [
    "PRIORITY",
    "TOP",
    "clusters",
    "finding_numbers",
    "first_level",
    "health",
    "impact_key",
    "problems_line",
    "verdict",
]

TOP = 3  # findings the verdict names; the rest are counted and follow in the details
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
_MAGNITUDE_KEYS = ("ratio", "largest_ratio", "slowdown", "rel_err", "z")

PRIORITY = priority_order()
"""In a cluster of anomalies at the same steps, the kind listed first is the first-level symptom; the
others localise or explain it. Each detector declares its place (``Detector.priority``); kinds with
none come after these."""


def _rank_ok(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["rank"] == b["rank"] or a["rank"] < 0 or b["rank"] < 0


def _related(a: dict[str, Any], b: dict[str, Any], tol: int = 3) -> bool:
    """b belongs under a: the same rank (or the run) at the same steps."""
    if a["first_step"] is None or b["first_step"] is None or not _rank_ok(a, b):
        return False
    a_last = a["last_step"] if a["last_step"] is not None else a["first_step"]
    b_last = b["last_step"] if b["last_step"] is not None else b["first_step"]
    if {a["kind"], b["kind"]} & {"node_health"} and a["rank"] == b["rank"]:
        return b["first_step"] <= a_last + tol and a["first_step"] <= b_last + tol  # overlapping at all
    return abs(a["first_step"] - b["first_step"]) <= tol


def clusters(found: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Anomalies (``kind, rank, first_step, last_step``, and ``id`` when stored) grouped by incident,
    in step order; within a cluster the first-level symptom comes first (:data:`PRIORITY`)."""
    order = {k: i for i, k in enumerate(PRIORITY)}
    pending = sorted(
        found,
        key=lambda a: (a["first_step"] is None, a["first_step"] or 0, order.get(a["kind"], len(order)), a.get("id", 0)),
    )
    out: list[list[dict[str, Any]]] = []
    for a in pending:
        home = next((c for c in out if any(_related(m, a) for m in c)), None)
        if home is None:
            out.append([a])
        else:
            home.append(a)
    for cluster in out:
        cluster.sort(key=lambda a: (order.get(a["kind"], len(order)), a["first_step"] or 0, a.get("id", 0)))
    return out


def first_level(anomalies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The anomalies that head their incident: those a post-mortem's summary marks ``level`` 1, or,
    for rows straight from storage (the live views), the head of each of :func:`clusters`."""
    if anomalies and all("level" in a for a in anomalies):
        return [a for a in anomalies if a["level"] == 1]
    return [c[0] for c in clusters(list(anomalies))]


def health(anomalies: list[dict[str, Any]], failures: int = 0, steps: int | None = None) -> dict[str, Any]:
    """A run's health, the one definition every view shows (see the module docstring).

    ``{"word", "healthy", "headline", "counts": {"critical", "warning"}, "open", "recovered",
    "problems": [{kind, severity, rank, status, first_step, last_step}]}``: ``word`` is
    ``critical``/``warning`` (its worst first-level finding, open or recovered), ``failed`` (an
    attempt failed and nothing worse was found) or ``healthy``; ``open``/``recovered`` count the
    serious findings still open and those that resolved."""
    serious = [a for a in first_level(anomalies) if a.get("severity") in ("critical", "warning")]
    serious.sort(key=impact_key)
    counts = {sev: sum(1 for a in serious if a["severity"] == sev) for sev in ("critical", "warning")}
    healthy = not serious and not failures
    if healthy:
        headline = "healthy: no warnings or critical findings" + (f" in {steps:,} steps" if steps else "")
    else:
        parts = [f"{k} {sev}" + ("s" if k > 1 and sev == "warning" else "") for sev, k in counts.items() if k]
        if failures:
            parts.append(f"{failures} failed attempt" + ("s" if failures > 1 else ""))
        headline = "problems: " + ", ".join(parts)
    if counts["critical"]:
        word = "critical"
    elif counts["warning"]:
        word = "warning"
    else:
        word = "failed" if failures else "healthy"
    return {
        "word": word,
        "healthy": healthy,
        "headline": headline,
        "counts": counts,
        "open": sum(1 for a in serious if a.get("status") == "open"),
        "recovered": sum(1 for a in serious if a.get("status") != "open"),
        "problems": [
            {k: a.get(k) for k in ("kind", "severity", "rank", "status", "first_step", "last_step")} for a in serious
        ],
    }


def problems_line(h: dict[str, Any]) -> str:
    """The serious findings of :func:`health` in one line for a list of runs:
    ``loss_spike warning (recovered), lr_schedule_drift warning (open)``."""
    return ", ".join(
        f"{p['kind']} {p['severity']} ({'open' if p['status'] == 'open' else 'recovered'})" for p in h["problems"]
    )


def finding_numbers(summary: dict[str, Any]) -> dict[int, int]:
    """Anomaly index (in ``summary["anomalies"]``) -> its number, 1-based, among the first-level
    findings in step order: the number the timeline, the plots and the verdict show."""
    out: dict[int, int] = {}
    for i, a in enumerate(summary.get("anomalies") or []):
        if a.get("level", 1) == 1:
            out[i] = len(out) + 1
    return out


def _steps_covered(a: dict[str, Any], run_last: int | None) -> int:
    first, last = a.get("first_step"), a.get("last_step")
    if first is None:
        return 0
    if a.get("status") == "open" and run_last is not None and a.get("kind") == "nan_inf":
        last = max(last if last is not None else first, run_last)  # still non-finite at the end
    return (last if last is not None else first) - first + 1


def _magnitude(a: dict[str, Any]) -> float:
    ev = a.get("evidence") if isinstance(a.get("evidence"), dict) else {}
    for key in _MAGNITUDE_KEYS:
        v = ev.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return abs(float(v))
    return 0.0


def impact_key(a: dict[str, Any], run_last: int | None = None) -> tuple:
    """Sort key, most impact first (see the module docstring)."""
    return (
        SEVERITY_ORDER.get(a.get("severity"), 3),
        0 if a.get("status") == "open" else 1,
        -_steps_covered(a, run_last),
        -_magnitude(a),
        a.get("first_step") if a.get("first_step") is not None else math.inf,
    )


def _when(a: dict[str, Any], steps: int, run_last: int | None = None) -> str:
    """Where a finding lies, and whether it was still open when the run's last step was logged
    (a straggler open from step 23 to the end read "steps 23-23", as if it had been one step)."""
    first, last = a.get("first_step"), a.get("last_step")
    if first is None:
        return "no step"
    where = steps_text(first, last) + (f" ({steps:,} steps)" if steps > 1 else "")
    if _open_past(a, steps, run_last):
        where += f", still open at the end (step {run_last})"
    return where


def _open_past(a: dict[str, Any], steps: int, run_last: int | None) -> bool:
    """``a`` is open and the run went on past the steps it names."""
    first, last = a.get("first_step"), a.get("last_step")
    if first is None or a.get("status") != "open" or run_last is None:
        return False
    return run_last > max(first, last if last is not None else first, first + steps - 1)


def _state(a: dict[str, Any], steps: int, run_last: int | None) -> str | None:
    """``recovered`` or ``still open at the end``; None where :func:`_when` already said it is open."""
    if a.get("status") != "open":
        return "recovered"
    return None if _open_past(a, steps, run_last) else "still open at the end"


def _cost(summary: dict[str, Any], found: list[dict[str, Any]]) -> list[str]:
    """What the problems cost, in steps and device time, only where the data says it: the steps
    trained on non-finite values, then the goodput accounting (:mod:`goodput`: recomputation,
    stalls, slow steps, checkpointing) with the device time it lost; a summary without one gets
    the recomputed steps and the slow steps' lost time from the attempts and the findings."""
    out = []
    world = summary.get("world_size") or 1
    busy, logged = summary.get("busy_seconds"), summary.get("steps_logged")
    step_seconds = busy / logged if busy and logged else None
    for a in found:
        if a["kind"] == "nan_inf" and a.get("status") == "open":
            n = _steps_covered(a, summary.get("last_step"))
            line = f"{n:,} steps trained on non-finite values from step {a['first_step']} on (wasted)"
            if step_seconds:
                line += f", ~{_device_time(n * step_seconds, world)}"
            if line not in out:  # the same steps found non-finite on several ranks are one cost
                out.append(line)
    good = summary.get("goodput") if isinstance(summary.get("goodput"), dict) else None
    if good:
        from trainmon.monitor.core import goodput  # numpy: only for a summary that has a goodput

        fraction, wall = good.get("fraction"), good.get("wall_seconds")
        if isinstance(fraction, int | float) and isinstance(wall, int | float):  # else unknown: said in the overview
            line = f"goodput {goodput.headline(summary)}"
            if fraction < 1:
                line += f"; {_device_time((1 - fraction) * wall, world)} did no useful work"
            out.append(line)
        return out
    recomputed = _recomputed_steps(summary)
    if recomputed:
        line = f"{recomputed:,} steps recomputed after resuming from older checkpoints"
        if step_seconds:
            line += f", ~{_device_time(recomputed * step_seconds, world)}"
        out.append(line)
    for a in found:
        lost = (a.get("evidence") or {}).get("lost_s") if isinstance(a.get("evidence"), dict) else None
        if a["kind"] == "throughput_collapse" and isinstance(lost, int | float) and lost > 0:
            out.append(f"{_device_time(float(lost), world)} lost to slow steps at {_when(a, 0)}")
    return out


def _recomputed_steps(summary: dict[str, Any]) -> int:
    """Steps an attempt redid because it resumed from a checkpoint older than where the previous
    attempt had got to."""
    attempts = {a["attempt"]: a for a in summary.get("attempts_detail") or []}
    total = 0
    for r in summary.get("resumes") or []:
        prev = attempts.get(r["attempt"] - 1)
        if prev and prev.get("last_step") is not None and r.get("step") is not None:
            total += max(0, prev["last_step"] - r["step"])
    return total


def _device_time(seconds: float, world: int) -> str:
    """``seconds`` on each of ``world`` devices, as device time (GPU-hours once it is worth saying)."""
    total = seconds * world
    ranks = f" x {world} ranks" if world > 1 else ""
    if total >= 360:
        return f"{total / 3600:,.2f} GPU-hours"
    return f"{seconds:.2g} s{ranks}" if seconds < 10 else f"{seconds:.0f} s{ranks}"  # never "0.0 s"


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """``{"healthy", "health", "headline", "findings": [top findings], "more", "cost": [lines]}``.

    Healthy means no first-level warning or critical finding and no failed attempt; info findings
    are details. The findings are the :data:`TOP` with the most impact, most first (the views number
    them 1, 2, 3 in that order, and show beside each its number in the timeline and on the plots,
    ``number``: step order). Each carries its number, kind, severity, rank, status, when, its state at
    the end (``recovered``, ``still open at the end``, or None where ``when`` already says so), steps,
    what happened (the detector's message) and what to do (its hint)."""
    anomalies = summary.get("anomalies") or []
    numbers = finding_numbers(summary)
    run_last = summary.get("last_step")
    heads = [(numbers[i], a) for i, a in enumerate(anomalies) if i in numbers]
    serious = [(n, a) for n, a in heads if a.get("severity") in ("critical", "warning")]
    serious.sort(key=lambda na: impact_key(na[1], run_last))
    failures = summary.get("failures") or 0
    findings = []
    for n, a in serious[:TOP]:
        steps = _steps_covered(a, run_last)
        findings.append(
            {
                "number": n,
                "kind": a["kind"],
                "severity": a["severity"],
                "rank": a.get("rank"),
                "status": a.get("status"),
                "recovered": a.get("status") != "open",
                "first_step": a.get("first_step"),
                "last_step": a.get("last_step"),
                "steps": steps,
                "when": _when(a, steps, run_last),
                "state": _state(a, steps, run_last),
                "what": a.get("message") or "",
                "todo": a.get("hint") or "",
            }
        )
    h = health(anomalies, failures, summary.get("steps"))
    healthy, headline = h["healthy"], h["headline"]
    return {
        "healthy": healthy,
        "health": h["word"],
        "headline": headline,
        "findings": findings,
        "more": max(0, len(serious) - TOP),
        "cost": _cost(summary, [a for _, a in serious]),
    }
