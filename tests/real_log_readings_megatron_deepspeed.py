"""Readings of one family of real logs:
Megatron-LM, Megatron-DeepSpeed and DeepSpeed(-Chat) stdout (96-100, 106-109).

Encoded from ``manifest.json`` as described in ``tests/test_real_logs.py``.
"""

from __future__ import annotations

from tests.real_log_types import _ANY, Allow, Expect, Known, Need  # noqa: F401  (the shapes every reading uses)

READINGS_MEGATRON_DEEPSPEED: dict[str, Expect] = {}
