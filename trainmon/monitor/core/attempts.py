"""How an attempt of a run ended, and whether that was a failure: the one definition the verdict
(``analysis.verdict``) and the goodput ledger (``core.goodput``) share.

An attempt that crashed, or went silent and was followed by another, failed; so did one stopped
from outside (``interrupted``: a preemption's SIGTERM, a node drain) that a later attempt had to
take over, since its work since the last checkpoint was lost. The last attempt's interruption (a
person's Ctrl-C or scancel, the scheduler's time limit) is how the run ended: not a failure.
"""

from __future__ import annotations

from typing import Any


def attempt_status(ends: set[str | None], newest: bool) -> str:
    """How an attempt ended, from its ranks' ``run_end`` statuses (None: no run_end): failed or
    interrupted when any rank said so; without a run_end, running if it is the newest attempt and
    lost otherwise; finished when every rank finished; else unknown (an imported log that just
    ends, which is not a failure)."""
    if ends & {"failed", "interrupted"}:
        return "failed" if "failed" in ends else "interrupted"
    if None in ends:
        return "running" if newest else "lost"
    if ends == {"finished"}:
        return "finished"
    return "unknown"


def attempt_failed(status: str, newest: bool) -> bool:
    """Whether an attempt that ended with ``status`` (:func:`attempt_status`) counts as a failed one: it crashed
    or was lost, or it was interrupted and a later attempt took over; the last attempt's interruption is how
    the run ended, not a failure (module docstring)."""
    return status in ("failed", "lost") or (status == "interrupted" and not newest)


def failed_attempts(stream_rows: list[dict[str, Any]]) -> int:
    """Attempts that failed (:func:`attempt_failed`), from ``streams`` rows (``attempt, end_status``)."""
    ends: dict[int, set[str | None]] = {}
    for s in stream_rows:
        ends.setdefault(s["attempt"], set()).add(s.get("end_status"))
    newest = max(ends, default=-1)
    return sum(attempt_failed(attempt_status(e, a == newest), a == newest) for a, e in ends.items())
