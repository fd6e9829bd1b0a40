"""The post-mortem's first answer: is the run healthy, and if not, what went wrong and what it cost.

An on-call engineer opening a report wants the verdict before the details: the few findings that
matter, ranked by impact, each with when it happened, how bad it was and what to do, and the
steps or device time it burned. The terminal report, the HTML report and the collector's web
view all render this one structure, so they agree.

Impact order: severity first (critical, warning, info); then consequence: a finding still open at
the end (unrecovered) before one that resolved; then the steps it covers; then its size (the
ratio, slowdown or relative error in its evidence). Only first-level findings compete: what
localises a symptom (a grad-norm spike under its loss spike) is detail.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TOP", "finding_numbers", "impact_key", "verdict"]

TOP = 3  # findings the verdict names; the rest are counted and follow in the details
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
_MAGNITUDE_KEYS = ("ratio", "largest_ratio", "slowdown", "rel_err", "z")


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


def _when(a: dict[str, Any], steps: int) -> str:
    first, last = a.get("first_step"), a.get("last_step")
    if first is None:
        return "no step"
    where = f"step {first}" if last in (None, first) else f"steps {first}-{last}"
    return where + (f" ({steps:,} steps)" if steps > 1 else "")


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
            out.append(line)
    good = summary.get("goodput") if isinstance(summary.get("goodput"), dict) else None
    if good:
        from trainmon.monitor.analysis import goodput  # numpy: only for a summary that has a goodput

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
    """``{"healthy", "headline", "findings": [top findings], "more", "cost": [lines]}``.

    Healthy means no first-level warning or critical finding and no failed attempt; info findings
    are details. Each finding carries its number (as in the timeline), kind, severity, rank, status,
    when, steps, what happened (the detector's message) and what to do (its hint)."""
    anomalies = summary.get("anomalies") or []
    numbers = finding_numbers(summary)
    run_last = summary.get("last_step")
    first_level = [(numbers[i], a) for i, a in enumerate(anomalies) if i in numbers]
    serious = [(n, a) for n, a in first_level if a.get("severity") in ("critical", "warning")]
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
                "when": _when(a, steps),
                "what": a.get("message") or "",
                "todo": a.get("hint") or "",
            }
        )
    healthy = not serious and not failures
    if healthy:
        done = summary.get("steps")
        headline = "healthy: no warnings or critical findings" + (f" in {done:,} steps" if done else "")
    else:
        counts = [
            f"{k} {sev}" + ("s" if k > 1 and sev == "warning" else "")
            for sev in ("critical", "warning")
            if (k := sum(1 for _, a in serious if a["severity"] == sev))
        ]
        if failures:
            counts.append(f"{failures} failed attempt" + ("s" if failures > 1 else ""))
        headline = "problems: " + ", ".join(counts)
    return {
        "healthy": healthy,
        "headline": headline,
        "findings": findings,
        "more": max(0, len(serious) - TOP),
        "cost": _cost(summary, [a for _, a in serious]),
    }
