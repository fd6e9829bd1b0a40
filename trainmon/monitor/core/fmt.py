"""The one number format of everything trainmon shows people (terminal, HTML, the web view).

Thousands separated (``17,520``), never ``1.752e+04``; smaller values to a few significant digits.
A module of its own so the light views (``trainmon status``, ``trainmon runs``) share it without
importing the report.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt", "steps_text"]


def fmt(value: Any, digits: int = 4) -> str:
    """``value`` for people: ints and floats of 1,000 or more thousands separated (``31,470``),
    smaller floats to ``digits`` significant digits (``2.636``, ``0.0003``), ``-`` for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if 1000 <= abs(value) < 1e15:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def steps_text(first: Any, last: Any, still_open: bool = False) -> str:
    """Where a finding lies, for people: ``step 23``, ``steps 23-40``, or ``since step 23`` for one
    still open (its last step is only where it was last renewed: "steps 23-23" read as over)."""
    if first is None:
        return "no step"
    if still_open:
        return f"since step {first}"
    return f"step {first}" if last in (None, first) else f"steps {first}-{last}"


def attempt_label(attempt: int | None) -> str:
    """An attempt as people count it: the store's attempt 0 is attempt 1."""
    return "-" if attempt is None else str(attempt + 1)
