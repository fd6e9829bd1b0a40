"""Showing stored data in the terminal as data: never as rich markup, never as terminal control.

Run status, error text, host names, layer names, config keys and the anomaly messages built from
them come from producers (the wire, imported logs). Printed raw, an ESC sequence in them clears
the screen or paints a fake "all runs healthy"; put into a rich markup string or a table cell, a
``[link=...]`` in them becomes a clickable link, and a ``[/]`` crashes the view (MarkupError).

:func:`escape_for_terminal` is the one way to put a value into a rich markup string or a ``str``
table cell. Plain text outputs (``print``, ``rich.text.Text``, which are not parsed as markup)
need only its first half, :func:`visible_controls`. The consoles trainmon creates have
``emoji=False``, so that a ``:name:`` in data is not replaced by an emoji either.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

__all__ = ["escape_for_terminal", "visible_controls"]

# C0 controls but newline and tab (layout, not control: error text has several lines), DEL and
# the C1 controls (U+0080-U+009F; some terminals read U+009B as CSI), shown as \x1b, \x7f, \x9b.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\t"}


def visible_controls(text: str) -> str:
    """``text`` with every terminal control character written out as a visible ``\\xNN`` escape."""
    return text.translate(_CONTROLS)


def escape_for_terminal(value: Any) -> str:
    """``value`` as text to embed in a rich markup string or a table cell: shown literally,
    control characters visibly escaped (``\\x1b``), markup brackets escaped."""
    return escape(visible_controls(value if isinstance(value, str) else str(value)))
