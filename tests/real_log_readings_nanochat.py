"""Readings of one family of real logs:
nanochat and modded-nanogpt stdout (101-105, 110).

Encoded from ``manifest.json`` as described in ``tests/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

READINGS_NANOCHAT: dict[str, Expect] = {}
