"""Readings of one family of real logs:
HF trainer_state.json runs whose trouble is degenerate training (81-84, 88, 91, 94).

Encoded from ``manifest.json`` as described in ``tests/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

READINGS_HF_DEGENERATE: dict[str, Expect] = {}
