"""A fixed-size window with cheap robust statistics, shared by the detectors.

Detectors run on every event of every rank, so the per-event cost matters (the collector
targets 100k samples/s on two cores). The window keeps its values in arrival order and in a
sorted list: adding is one ``insort`` and one ``bisect`` removal (C memmove of at most ``size``
pointers), median and quantiles are O(1), the MAD is O(log size), computed on demand and kept until
the next add.
"""

from __future__ import annotations

import bisect
import collections
import math

__all__ = ["RollingWindow"]

_isfinite, _bisect_left, _insort = math.isfinite, bisect.bisect_left, bisect.insort


class RollingWindow:
    """The last ``size`` finite values; non-finite values are never admitted."""

    __slots__ = ("_mad", "_order", "_sorted", "_sum", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be at least 1, got {size}")
        self.size = size
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self._sum = 0.0
        self._mad: float | None = None  # cached until the window changes: detectors ask again before it does

    def __len__(self) -> int:
        return len(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) == self.size

    def add(self, x: float) -> None:
        if not _isfinite(x):
            return
        self._mad = None
        order, ordered = self._order, self._sorted  # locals: called ~20 times per event of a long log
        if len(order) == self.size:
            old = order.popleft()
            del ordered[_bisect_left(ordered, old)]
            self._sum -= old
        order.append(x)
        _insort(ordered, x)
        self._sum += x

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()
        self._sum = 0.0
        self._mad = None

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
        if self._mad is not None:
            return self._mad
        m = self.median()
        n = len(self._sorted)
        mid = n // 2
        below, raw = self._kth_deviations(m, mid)
        if n % 2 == 0:
            raw = 0.5 * (below + raw)
        self._mad = 1.4826 * raw
        return self._mad

    def _kth_deviations(self, m: float, k: int) -> tuple[float, float]:
        """The ``k-1``-th and ``k``-th smallest ``|x - m|`` (0-based; ``-inf`` for the first when k is 0),
        in O(log size), without sorting the deviations.

        The deviations of the values below ``m`` (read from ``m`` outwards) and of the others are two
        sorted runs of the sorted window; the ``k + 1`` smallest of their union are the first ``i`` of
        one and ``k + 1 - i`` of the other, ``i`` found by bisection. The largest taken is the ``k``-th,
        the next largest the ``k-1``-th: an even window's MAD (the mean of the two) costs one search. A
        detector asks for the MAD on every step (loss_noise: four windows), and sorting the deviations
        each time made a 200k-step import take half a minute.
        """
        s = self._sorted
        below = bisect.bisect_left(s, m)  # run A: m - s[below - 1 - i]; run B: s[below + j] - m
        n_b = len(s) - below
        lo, hi = max(0, k + 1 - n_b), min(k + 1, below)
        while lo < hi:  # the fewest taken from A such that A's next is not below B's last taken
            i = (lo + hi) // 2
            if m - s[below - 1 - i] < s[below + k - i] - m:
                lo = i + 1
            else:
                hi = i
        j = k + 1 - lo
        a = m - s[below - lo] if lo > 0 else -math.inf  # the largest taken from A, from B
        b = s[below + j - 1] - m if j > 0 else -math.inf
        if a >= b:
            return max(b, m - s[below - lo + 1] if lo > 1 else -math.inf), a
        return max(a, s[below + j - 2] - m if j > 1 else -math.inf), b
