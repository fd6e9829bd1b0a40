"""The interface every detector implements, and what it reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainmon.wire import Event

__all__ = ["SEVERITIES", "Detector", "Finding"]

SEVERITIES = ("info", "warning", "critical")
"""Least to most urgent; what each means (and so when a detector may use it) is stated once, in
``trainmon.monitor.config``'s docstring."""


def finite(x: Any) -> bool:
    """A real number that is not NaN or infinite (fields are optional: None is not finite)."""
    if type(x) is float:  # the common case, first: detectors call this several times per event
        return math.isfinite(x)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's statement about one step: the condition holds (or has cleared).

    The engine turns findings into stored anomalies, one per (run, kind, rank): the first
    finding opens it, later ones extend it, a ``resolved`` finding closes it.
    """

    kind: str
    severity: str
    step: int | None
    message: str
    hint: str
    evidence: dict[str, Any] = field(default_factory=dict)
    resolved: bool = False
    rank: int | None = None
    """Which rank the anomaly belongs to, for run-scope detectors (default: the run, -1)."""


class Detector:
    """Watches event streams for one failure mode.

    Subclasses set ``kind`` (the anomaly kind, also the name of their section of
    ``DetectorsConfig``), take that section in ``__init__`` and implement :meth:`observe`.

    ``scope = "rank"``: the engine makes one instance per (run, rank) and feeds it that rank's
    events in order (every attempt of the rank: a resume shows up as a new ``run_start`` with a
    higher ``attempt``). ``scope = "run"``: one instance per run, fed every rank's events in
    arrival order; its findings name the rank they are about (``Finding.rank``) or the run.

    :meth:`tick` is called about once a second with the wall time (live) or with event times
    (when a log is imported), for detectors that fire on silence. State must stay bounded
    (fixed windows). After a collector restart the engine replays the stored tail of the
    streams into fresh instances and drops what they find, so ``observe`` must be
    deterministic given the events.
    """

    kind: ClassVar[str]
    scope: ClassVar[str] = "rank"

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        raise NotImplementedError

    def tick(self, now: float) -> list[Finding]:
        return []
