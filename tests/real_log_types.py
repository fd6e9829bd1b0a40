"""The shapes a reading of a real log is encoded in (``tests/importers/test_real_logs.py`` explains each).

The readings themselves live in ``test_real_logs.py`` (logs 01-60) and in one module per family
of the newer logs (``real_log_readings_*.py``), so each family's importer and its readings change
together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The real logs: ../shared/real-logs beside the checkout (CI clones main next to a copy of shared/), else the
# workplace's own copy.
_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "real-logs"
REAL_LOGS = next((p for p in (_BESIDE, Path("/work/shared/real-logs")) if p.exists()), _BESIDE)


@dataclass(frozen=True)
class Allow:
    kind: str
    lo: int
    hi: int
    why: str
    severities: tuple[str, ...] = ("info", "warning")


@dataclass(frozen=True)
class Need:
    kind: str
    step: int
    tol: int
    why: str
    recovered: bool = True  # the reading says the incident passed (a spike), so the anomaly must be resolved


@dataclass(frozen=True)
class Known:
    """A detector problem on this file: ``kind`` fires in [lo, hi] (false alarm) or misses ``missed``."""

    kind: str
    lo: int
    hi: int
    problem: str
    missed: bool = False


@dataclass(frozen=True)
class Expect:
    runs: int = 1  # runs the file holds (several runs written into one log are imported apart)
    attempts: int = 1
    allowed: tuple[Allow, ...] = ()
    required: tuple[Need, ...] = ()
    known: tuple[Known, ...] = ()
    entries: int | None = None
    """The logged steps when the manifest's ``entries`` miscounts them (the reading says why); None: the manifest's."""
    last_step: int | None = None
    """Likewise the last logged step; None: the manifest's ``last_step``."""
    stage_entries: tuple[int, ...] = ()
    """A pipeline of stages, one run each (nanochat's base, mid, SFT): the logged steps of each run. The
    manifest's ``entries``, ``first_step`` and ``last_step`` describe the first stage only."""


_ANY = (0, 10**9)
