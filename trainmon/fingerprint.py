"""Resume and checkpoint fingerprints for a hand-written loop.

Send ``state_fingerprint(...)`` with ``TrainMonitor.checkpoint(..., fingerprint=...)`` when saving and
with ``TrainMonitor.resume(..., fingerprint=...)`` after restoring, so the collector can tell a faithful
resume from one that lost its optimizer, scheduler, RNG or data position; ``batch_fingerprint`` (a
``step_end`` field) spots replayed data."""

from trainmon.hooks.fingerprint import batch_fingerprint, state_fingerprint

__all__ = ["batch_fingerprint", "state_fingerprint"]
