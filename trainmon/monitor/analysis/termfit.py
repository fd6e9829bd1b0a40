"""Terminal tables that fit the width without cutting a cell.

rich shrinks a table that is wider than the terminal by cutting its cells ("ux-run-with-a-rather-
long-name-00…", "finish…", "20/…"): the name, the status, the step count and the loss were all
lost at 80 columns. A run name, a host or a number that is cut is worse than one that is missing:
it reads as another value. Here a table that does not fit drops columns by priority (the caller
says which go first) and their values are said below the table, one line per row; what is left is
never cut (``no_wrap``; a cell wider than the whole terminal folds rather than ends in "…").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from trainmon.monitor.core.escape import visible_controls

__all__ = ["FittedTable"]


def _natural_width(console: Console, renderable: Any) -> int:
    """The width ``renderable`` takes when nothing constrains it."""
    return Measurement.get(console, console.options.update(max_width=10_000), renderable).maximum


class _Fit(NamedTuple):
    table: Table
    below: list[str]
    width: int
    dropped: list[str]


class FittedTable:
    """A table of ``rows`` (plain text, data: controls are made visible) that fits the width it is
    given, followed by the lines that say the values of the columns it had to drop.

    Columns named in ``drop`` go in that order until the table fits; each row's dropped values
    follow as ``"{first header} {first cell}: {header} {value}, ..."`` (``rank 3: host gpu-17``).
    ``right`` names right-justified columns; ``options`` go to :class:`rich.table.Table` (title,
    box...). Rendered where the width is known (a terminal, a panel), so it fits there."""

    def __init__(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        drop: Sequence[str] = (),
        *,
        right: Sequence[str] = (),
        row_styles: Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        self.headers, self.rows, self.drop, self.right = list(headers), rows, drop, right
        self.row_styles, self.options = row_styles, options
        self._fitted: dict[int, _Fit] = {}  # width -> its fit (measured, then drawn)

    def _table(self, keep: list[int]) -> Table:
        table = Table(**self.options)
        for i in keep:
            justify = "right" if self.headers[i] in self.right else "left"
            table.add_column(self.headers[i], no_wrap=True, overflow="fold", justify=justify)
        for n, row in enumerate(self.rows):
            style = self.row_styles[n] if self.row_styles else ""
            table.add_row(*[Text(visible_controls(row[i])) for i in keep], style=style)
        return table

    def fit(self, console: Console, width: int) -> _Fit:
        """The table with the columns that fit ``width``, the lines saying the dropped ones, the width
        the two take, and the columns dropped."""
        if width not in self._fitted:
            self._fitted[width] = self._fit(console, width)
        return self._fitted[width]

    def _fit(self, console: Console, width: int) -> _Fit:
        keep = list(range(len(self.headers)))
        pending = [self.headers.index(h) for h in self.drop if h in self.headers]
        table = self._table(keep)
        natural = _natural_width(console, table)
        while pending and natural > width:
            keep.remove(pending.pop(0))
            table = self._table(keep)
            natural = _natural_width(console, table)
        gone = [i for i in range(len(self.headers)) if i not in keep]
        below = []
        for row in self.rows if gone else []:
            said = ", ".join(f"{self.headers[i]} {row[i]}" for i in gone if row[i] not in ("", "-"))
            if said:
                below.append(visible_controls(f"{self.headers[0]} {row[0]}: {said}"))
        return _Fit(table, below, max([natural, *[2 + len(line) for line in below]]), [self.headers[i] for i in gone])

    def fits(self, console: Console, width: int) -> bool:
        """Every column fits ``width``: nothing dropped, nothing squeezed."""
        fit = self.fit(console, width)
        return not fit.dropped and fit.width <= width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        fit = self.fit(console, options.max_width)
        yield fit.table
        for line in fit.below:
            yield Text("  " + line, style="dim")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = min(self.fit(console, options.max_width).width, options.max_width)
        return Measurement(widest, widest)
