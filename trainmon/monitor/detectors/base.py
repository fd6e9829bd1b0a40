"""The interface every detector implements, what it reports, and the facts it declares about itself.

What a finding's severity means, for every detector (the thresholds in each detector's config follow it):

* ``info`` -- worth knowing when reading the run afterwards; nobody needs to act. A blip that
  recovered by itself, a note about the data (a constant or all-zero series), a condition the
  evidence does not call harmful (eval loss rising while the task metric improves).
* ``warning`` -- the run is, or will be, worse off if nothing changes: someone should look at it
  today. A spike that has not recovered, an LR off its schedule, a straggler or a throughput drop
  that is sustained, an eval metric that got worse at several evals in a row.
* ``critical`` -- the run is burning compute now or is about to fail: act now (this pages). It
  needs both magnitude and duration: non-finite losses, a rank stalled for minutes, a loss that
  diverged and stays up, memory exhausted within the hour. Nothing that can clear by itself within
  a minute is critical when first seen; a finding escalates while its condition grows and
  de-escalates when it eases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainmon.wire import Event

__all__ = ["NOTHING", "PLOTS", "POSITIVE", "SEVERITIES", "Detector", "Finding"]

SEVERITIES = ("info", "warning", "critical")
"""Least to most urgent; what each means (and so when a detector may use it) is stated once, in this
module's docstring."""

POSITIVE = {"positive": True}
"""Field metadata of a detector setting that means nothing at 0 or below (a bar in sigmas its rules
compare against): ``z: float = field(default=6.5, metadata=POSITIVE)``. The configuration refuses such a
value, naming the field, instead of a detector firing on every step or never.
"""

PLOTS = ("loss", "grad", "lr", "throughput")
"""The post-mortem plots a detector's findings can be marked on (:attr:`Detector.plots`)."""


_isfinite = math.isfinite

NOTHING: list[Finding] = []
"""What an event showed when it showed nothing, shared by :meth:`Detector.observe_batch` overrides that decide many
events at once: never appended to (an output list is read, not kept, by the engine)."""


def finite(x: Any) -> bool:
    """A real number that is not NaN or infinite (fields are optional: None is not finite)."""
    if type(x) is float:  # the common case, first: detectors call this several times per event
        return _isfinite(x)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and _isfinite(x)


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
    ``DetectorsConfig``), take that section in ``__init__`` and implement :meth:`observe`. Every
    other fact about a detector is declared on its class too (the attributes below), so that adding
    one is adding its module: the package discovers it, the configuration gains its section, the
    verdict, the post-mortem and the plots place its findings.

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
    config_class: ClassVar[type]
    """The dataclass of its settings, defined in its module: ``[detectors.<kind>]`` in the TOML."""
    order: ClassVar[int]
    """Where the engine runs it among the others, lowest first: for findings at the same event, the
    order they are stored in (and so which anomaly id comes first)."""
    priority: ClassVar[int | None]
    """In a cluster of anomalies at the same steps, the one with the lowest priority is listed first,
    as the first-level symptom; the others localise or explain it (a grad-norm spike under the loss
    spike, a hot GPU under a straggler). ``None``: no place of its own, after every ranked kind."""
    plots: ClassVar[tuple[str, ...]]
    """Which of :data:`PLOTS` mark its findings: where the reader looks for them."""
    localised: ClassVar[bool]
    """Whether the post-mortem looks in the per-layer grad norms for the layer it started in."""
    batch_from: ClassVar[int] = 0
    """Events of a batch from which :meth:`observe_batch` pays: the engine hands a shorter batch (a live call's few
    steps of a rank) to :meth:`observe` one event at a time, as its screens' fixed cost (numpy's, a reading's) is
    more than observing each event costs there. Each detector sets its own, as measured."""
    consumes: ClassVar[frozenset[str] | None] = None
    """The event kinds :meth:`observe` reads (``None``: every kind). The engine hands it only those:
    most detectors read ``step`` events and a few others, and 17 detectors on every event of a long
    log were 3.4M calls for 200k events. A kind left out here must be one ``observe`` ignores."""

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        raise NotImplementedError

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """:meth:`observe` of each event in order, its outputs appended to ``out``: the engine hands a detector its
        events of a batch at once (a long log's import, a live batch of one rank).

        An override exists to be cheaper, never to find anything else: it may decide in one look at the batch
        (a column, a count) what ``observe`` would return for many of its events, and must leave the detector in
        the state ``observe`` would have, and ``out`` as ``observe`` would have made it, for every cut of a stream
        into batches (``tests/detectors/test_observe_batch.py`` checks every detector so, on fault traces, clean
        controls, real logs and hostile fields). Outputs are appended as they are known: if it raises, what it
        appended stays (the engine keeps the findings before a detector's failure). An empty output may be
        :data:`NOTHING`, shared, never appended to."""
        out.extend(map(self.observe, events, attempts))

    def tick(self, now: float) -> list[Finding]:
        return []

    def resolve(
        self, step: int | None, message: str, hint: str, evidence: dict[str, Any], *, rank: int | None = None
    ) -> Finding:
        """The finding that closes this detector's open anomaly: an ``info`` note of why it cleared (the
        anomaly keeps the worst severity it reached)."""
        return Finding(self.kind, "info", step, message, hint, evidence, resolved=True, rank=rank)
