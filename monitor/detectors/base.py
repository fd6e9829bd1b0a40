"""The interface every detector implements, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hooks.wire import Event

__all__ = ["SEVERITIES", "Detector", "Finding"]

SEVERITIES = ("info", "warning", "critical")


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


class Detector:
    """Watches one rank's event stream for one failure mode.

    Subclasses set ``kind``, take their section of the typed config in ``__init__`` and
    implement :meth:`observe`. State lives on the instance; the engine makes one instance per
    (run, rank) and feeds it that stream's events in order, replaying stored events after a
    collector restart so no detector is blind for a window.
    """

    kind: ClassVar[str]

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        raise NotImplementedError
