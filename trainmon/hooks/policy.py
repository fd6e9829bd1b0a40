"""Acting on the collector's findings: stop a run that is burning GPU hours on a NaN or a divergence.

The verdict travels with the acknowledgements the transport already receives: each ``POST
/v1/events`` asks (``?findings=SEVERITY&run=RUN&after=REV``) for the run's open findings at or
above a severity that were opened or updated since the previous answer (the first request:
since it arrived, so an anomaly left open by an earlier attempt of the run does not stop a
resumed one). The sender thread files them here (``receive``); the training thread only tests
a plain attribute (``pending``) at each step boundary, so delivery never blocks training.
How soon a finding stops the run is the sender's tick (``flush_interval``) plus one round trip.

Standard library only: the transport imports this module.
"""

from __future__ import annotations

import collections
import json
import logging
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CollectorFinding", "StopPolicy", "TrainingStopped"]

log = logging.getLogger("trainmon.policy")

_PENDING_MAX = 64  # findings waiting for a step boundary; a loop that never reaches one keeps the newest


@dataclass(frozen=True, slots=True)
class CollectorFinding:
    """One open anomaly of the run as the collector reported it."""

    kind: str
    severity: str
    rank: int  # -1: the run as a whole
    step: int | None  # the first step it covers
    last_step: int | None
    message: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CollectorFinding:
        return cls(
            kind=str(d["kind"]),
            severity=str(d["severity"]),
            rank=int(d.get("rank", -1)),
            step=d.get("first_step"),
            last_step=d.get("last_step"),
            message=str(d.get("message", "")),
        )

    def describe(self) -> str:
        where = "the run" if self.rank < 0 else f"rank {self.rank}"
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.severity} {self.kind} on {where}{at}: {self.message}"


def worth_saving(finding: CollectorFinding) -> bool:
    """Whether the state is worth a checkpoint before stopping on ``finding``.

    After a non-finite loss or gradient the optimizer step may have written NaN or inf into the
    weights and the moments: saving them would make the poisoned state the newest checkpoint, the
    one a resume picks, and could rotate an older good one out."""
    return finding.kind != "nan_inf"


class TrainingStopped(RuntimeError):
    """Training was stopped at a step boundary because the collector reported ``finding``.

    ``step`` is the last optimizer step that ran; ``checkpoint`` what the loop's checkpoint
    callable returned (None when there was none)."""

    def __init__(self, finding: CollectorFinding, step: int, checkpoint: Any = None) -> None:
        self.finding = finding
        self.step = step
        self.checkpoint = checkpoint
        if checkpoint is not None:
            saved = f"; checkpoint saved ({checkpoint})"
        elif not worth_saving(finding):
            saved = "; no checkpoint saved (the weights may hold non-finite values): resume from an earlier one"
        else:
            saved = ""
        super().__init__(f"trainmon stopped training after step {step}: {finding.describe()}{saved}")


class StopPolicy:
    """What a run does when the collector reports a finding at or above ``stop_on``.

    Args:
        run: the run whose findings are asked for.
        on_critical: ``"stop"`` (save through ``checkpoint`` if given, then raise
            ``TrainingStopped``) or a callable that receives each new ``CollectorFinding`` on the
            training thread, at a step boundary.
        stop_on: the least severity acted on: ``"critical"`` (default) or ``"warning"``.
        checkpoint: called before stopping; its return value (a path, say) goes into the error.
    """

    def __init__(
        self,
        run: str,
        on_critical: str | Callable[[CollectorFinding], Any],
        stop_on: str = "critical",
        checkpoint: Callable[[], Any] | None = None,
    ) -> None:
        if on_critical != "stop" and not callable(on_critical):
            raise ValueError(f"on_critical: 'stop' or a callable, got {on_critical!r}")
        if stop_on not in ("warning", "critical"):
            raise ValueError(f"stop_on: 'critical' or 'warning', got {stop_on!r}")
        self.on_critical = on_critical
        self.stop_on = stop_on
        self.checkpoint = checkpoint
        self._query = {"findings": stop_on, "run": run}
        self._after: int | None = None  # the collector's revision of the last answer (sender thread)
        self._handled: set[tuple[str, int, int | None, str]] = set()  # training thread
        # Filled by the sender thread, emptied by the training thread (deque: thread-safe ends).
        self.pending: collections.deque[CollectorFinding] = collections.deque(maxlen=_PENDING_MAX)

    # -- sender thread --------------------------------------------------------------------

    def query(self) -> str:
        """The query string of the next ``POST /v1/events``."""
        query = self._query if self._after is None else {**self._query, "after": str(self._after)}
        return urllib.parse.urlencode(query)

    def receive(self, body: bytes) -> None:
        """File the findings of an acknowledgement (a collector that does not know the query sends none)."""
        try:
            reply = json.loads(body)
            revision = reply.get("findings_rev")
            findings = [CollectorFinding.from_json(d) for d in reply.get("findings", ())]
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("trainmon: unreadable findings in the collector's acknowledgement: %r", body[:200])
            return
        if isinstance(revision, int):
            self._after = revision
        self.pending.extend(findings)

    # -- training thread ------------------------------------------------------------------

    def at_boundary(self, step: int) -> None:
        """Act on what arrived since the last boundary: each finding once (per anomaly and severity)."""
        while self.pending:
            finding = self.pending.popleft()
            key = (finding.kind, finding.rank, finding.step, finding.severity)
            if key in self._handled:
                continue  # the same anomaly updated (a NaN that goes on): acted on already
            self._handled.add(key)
            if callable(self.on_critical):  # else "stop": __init__ accepts nothing else
                self.on_critical(finding)
                continue
            log.error("trainmon: stopping training after step %d: %s", step, finding.describe())
            saved = self.checkpoint() if self.checkpoint is not None and worth_saving(finding) else None
            raise TrainingStopped(finding, step, saved)
