"""A fixed-size window with cheap robust statistics, shared by the detectors.

Detectors run on every event of every rank, so the per-event cost matters (the collector
targets 100k samples/s on two cores). The window keeps its values in arrival order and in a
sorted list: adding is one ``insort`` and one ``bisect`` removal (C memmove of at most ``size``
pointers), median and quantiles are O(1), the MAD is O(size) and computed only on demand.
"""

from __future__ import annotations

import bisect
import collections
import math

__all__ = ["RollingWindow"]


class RollingWindow:
    """The last ``size`` finite values; non-finite values are never admitted."""

    __slots__ = ("_order", "_sorted", "_sum", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be at least 1, got {size}")
        self.size = size
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self._sum = 0.0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) == self.size

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            return
        if len(self._order) == self.size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._sum -= old
        self._order.append(x)
        bisect.insort(self._sorted, x)
        self._sum += x

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()
        self._sum = 0.0

    def values(self) -> list[float]:
        """Values oldest first."""
        return list(self._order)

    def last(self) -> float:
        return self._order[-1]

    def mean(self) -> float:
        return self._sum / len(self._order)

    def std(self) -> float:
        """Population standard deviation, two-pass: sum-of-squares shortcuts lose all precision when
        the values are large and close together (1e6 +- 0.01), which is exactly a converged metric."""
        m = self.mean()
        return math.sqrt(math.fsum((x - m) ** 2 for x in self._order) / len(self._order))

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile, ``q`` in [0, 1]."""
        s = self._sorted
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    def median(self) -> float:
        s = self._sorted
        n = len(s)
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def mad(self) -> float:
        """Median absolute deviation, scaled by 1.4826 to estimate sigma for normal data."""
        m = self.median()
        dev = sorted(abs(x - m) for x in self._sorted)
        n = len(dev)
        mid = n // 2
        raw = dev[mid] if n % 2 else 0.5 * (dev[mid - 1] + dev[mid])
        return 1.4826 * raw
