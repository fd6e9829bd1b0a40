"""Readings of one family of real logs:
CSV, TensorBoard, ms-swift and LLaMA-Factory logs (85-87, 89, 90, 92, 93, 95).

Encoded from ``manifest.json`` as described in ``tests/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

READINGS_STRUCTURED: dict[str, Expect] = {}
