"""Equality to the bit, for tests that hold two paths to the same values (a fast path and the rule it stands for,
an encoding and its decoding)."""

from __future__ import annotations

import struct
from typing import Any


def same(a: Any, b: Any) -> bool:
    """Equal and indistinguishable: the same type (1 is not 1.0), floats by their bits (NaN's sign, -0.0), dicts in
    the same key order, and slotted objects (events, parsed points) field by field."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    slots = getattr(type(a), "__slots__", None)
    if slots is not None and not isinstance(a, (str, int)):
        return all(same(getattr(a, f), getattr(b, f)) for f in slots)
    return bool(a == b)
