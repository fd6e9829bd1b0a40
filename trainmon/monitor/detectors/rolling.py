"""Fixed-size windows with robust statistics, shared by the detectors.

Detectors run on every event of every rank, so the per-event cost matters (the collector
targets 100k samples/s on two cores; a 1M-row post-mortem calls ``add`` ~19 times a row). Two
windows, one set of statistics (``sorted_median``, ``sorted_quantile``, ``sorted_mad`` of a sorted list):

* :class:`RollingWindow` keeps its values in arrival order and in a sorted list, for statistics read on
  every step: adding is one ``insort`` and one ``bisect`` removal (C memmove of at most ``size``
  pointers), median and quantiles are O(1), the MAD is O(log size), computed on demand and kept until
  the next add, and bounded in O(1) (:meth:`RollingWindow.mad_bounds`) for rules that only need to know
  which side of a bar it is on.
* :class:`LazyWindow` keeps arrival order only and sorts when a statistic is asked, for statistics read on
  rare steps (a candidate spike, a finding, a noise the other one did not decide): an ``add`` is one deque
  append. Whether its MAD is positive, for many adds at once, comes from its ties without a sort
  (:meth:`LazyWindow.mad_positive_for`).

Both take many values at once (``extend``), and :func:`window_bounds` gives the median and bounds on the MAD of
every window a run of adds passes through, in one numpy pass: for a detector's ``observe_batch`` that decides a
batch's entries from those statistics, then hands the windows the batch in one go. Where a rule needs only a floor
under each window's MAD, :func:`mad_floors` gives one for many windows at once at a fraction of the sorting (and one
that also holds for any window of fewer values among them), and :func:`sorted_mads` the exact MADs of the few rows
the floors leave undecided.
"""

from __future__ import annotations

import bisect
import collections
import math
import sys
from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = [
    "LazyWindow",
    "RollingWindow",
    "mad_floors",
    "sorted_mad",
    "sorted_mads",
    "sorted_median",
    "sorted_quantile",
    "window_bounds",
]

_NEAR = 4
"""``window_bounds`` tries the bounding blocks this many positions either side of the centre."""

_isfinite, _bisect_left, _insort = math.isfinite, bisect.bisect_left, bisect.insort
_HALF_DOWN = 0.5 - 2.0**-52
"""Half, less the rounding of two subtractions: a span of ``t`` values times this is at most their ``t``-th deviation
(``mad_floors``)."""
_MAX = sys.float_info.max


def sorted_median(s: list[float]) -> float:
    """Median of the sorted ``s``: the middle value, or the mean of the two middle ones. Public, as
    :func:`sorted_quantile`, for a detector that reads many windows' statistics at once from sorted rows (the same
    float operations, so the same values a window gives)."""
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def sorted_quantile(s: list[float], q: float) -> float:
    """Nearest-rank quantile of the sorted ``s``, ``q`` in [0, 1]."""
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def sorted_mad(s: list[float]) -> float:
    """Median absolute deviation of the sorted ``s``, scaled by 1.4826 to estimate sigma for normal data."""
    n = len(s)
    below, raw = _kth_deviations(s, sorted_median(s), n // 2)
    return 1.4826 * (raw if n % 2 else 0.5 * (below + raw))


def _kth_deviations(s: list[float], m: float, k: int) -> tuple[float, float]:
    """The ``k-1``-th and ``k``-th smallest ``|x - m|`` of the sorted ``s`` (0-based; ``-inf`` for the first when
    k is 0), in O(log len(s)), without sorting the deviations.

    The deviations of the values below ``m`` (read from ``m`` outwards) and of the others are two
    sorted runs of the sorted window; the ``k + 1`` smallest of their union are the first ``i`` of
    one and ``k + 1 - i`` of the other, ``i`` found by bisection. The largest taken is the ``k``-th,
    the next largest the ``k-1``-th: an even window's MAD (the mean of the two) costs one search. A
    detector asks for the MAD on every step (loss_noise: four windows), and sorting the deviations
    each time made a 200k-step import take half a minute.
    """
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


def window_bounds(values: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every window of ``size`` (odd, or at least 4) consecutive finite ``values``, window ``j`` being
    ``values[j:j + size]``: its values sorted (row ``j``), its median, the float ``sorted_median`` gives, and
    bounds ``lo <= mad <= hi`` on the float ``sorted_mad`` gives (the exact MAD: ``sorted_mad`` of the row), which
    meet, the MAD itself, on most windows (D_w1m's log changes: 94%), in one numpy pass. Equal as numbers:
    numpy's sort leaves a ``0.0`` and a ``-0.0`` in no particular order, so a zero may differ in sign (what a rule
    compares, not what it reports).

    Why exact: each middle deviation (the ``t``-th smallest) is at most the larger end deviation of any block of
    ``t`` consecutive sorted values and at least the smaller one of a block that straddles the median
    (:meth:`RollingWindow.mad_bounds`), here over the blocks within ``_NEAR`` of the centre, the least of the upper
    bounds and the most of the lower ones. Along the blocks the first end's deviation falls and the last end's rises
    (their floats too: ``m - x`` and ``x - m`` are monotone in ``x``), so where the first block's first end is the
    larger and the last block's last end is (the blocks straddle where they cross), every block outside has a larger
    end deviation than the nearest inside: the least upper bound is the deviation, and the bounds meet. The median
    and the deviations are the same float operations on the same sorted values, the scaling and the mean of two
    ``sorted_mad``'s (monotone, rounding included). The ranks they read are copied out as rows first: read in place,
    strided, they cost several times the sort (and taken as rows of the transposed view, one copy, not a copy of the
    columns copied again: 10,000 windows of 50, 0.5 -> 0.15 ms)."""
    s = np.sort(sliding_window_view(values, size), axis=1)
    k = size >> 1
    c = k >> 1
    if size & 1:  # blocks s[j .. j + k], 0 <= j <= k
        j0, j1 = max(0, c - _NEAR), min(k, c + _NEAR) + 1
        r = s.T[np.r_[j0:j1, j0 + k : j1 + k, k]]
        m, n = r[-1], j1 - j0
        a, b = m - r[:n], r[n : 2 * n] - m
        hi = 1.4826 * np.maximum(a, b).min(axis=0)
        met = (a[0] >= b[0]) & (a[-1] <= b[-1])
        return s, m, np.where(met, hi, 1.4826 * np.minimum(a, b).max(axis=0)), hi
    if size < 4:
        raise ValueError(f"an even window of {size} values has no bounding block")
    j0, j1 = max(1, c - _NEAR), min(k - 1, c + _NEAR) + 1  # blocks s[j .. j + k - 1] and s[j .. j + k], 1 <= j < k
    r = s.T[np.r_[j0:j1, j0 + k - 1 : j1 + k, k - 1, k]]  # s[j]; s[j + k - 1] and s[j + k]; s[k - 1], s[k]
    n = j1 - j0
    m = 0.5 * (r[-2] + r[-1])
    a, b, d = m - r[:n], r[n : n + n] - m, r[n + 1 : n + n + 1] - m  # b <= d
    # the k-th smallest deviation (1-based) over blocks of k (a, b), the (k + 1)-th over blocks of k + 1 (a, d);
    # the lower bounds are mad_bounds' three cases, their sums as it makes them: a + a, b + d where a <= b; b + a,
    # a + d where b < a <= d; b + d, a + a where d < a
    hi = 1.4826 * (0.5 * (np.maximum(a, b).min(axis=0) + np.maximum(a, d).min(axis=0)))
    lo = 1.4826 * (0.5 * (np.minimum(a, b) + np.minimum(a, d)).max(axis=0))
    met = (a[0] >= d[0]) & (a[-1] <= b[-1])  # for both: b <= d
    return s, m, np.where(met, hi, lo), hi


def mad_floors(values: np.ndarray, size: int, block: int) -> np.ndarray:
    """A floor under the ``sorted_mad`` of every window of ``size`` consecutive finite ``values``,
    window ``j`` being ``values[j:j + size]``, one per window: each the floor of the ``block`` consecutive windows
    it shares a block with, from the union of their values, sorted once (``block + size - 1`` values where a window
    costs ``size``). It holds for any ``size`` values among those of the union (a window some values have left).

    Why it holds: the ``t``-th smallest deviation ``|x - m|`` (1-based) is at least half the span of the ``t`` values
    it is taken over (``|xh - m| + |m - xl| >= xh - xl`` for the least and greatest of them, whatever the median),
    and those ``t`` values, among the union's, span at least the least span of ``t`` consecutive sorted values of
    the union. In floats: each deviation is one rounded subtraction (``>= (1 - u)`` times the true one, or
    infinite), and so is the span (``<= (1 + u)`` times, clamped to the largest float where it overflows), so the
    span times ``_HALF_DOWN <= (1 - u) / (2 (1 + u))`` is at most the deviation, and its rounding too (rounding is
    monotone and the deviation a float); ``sorted_mad``'s arithmetic on the deviations (the mean of two, times
    1.4826) is monotone in them, rounding included, so the same arithmetic on the floors stays under it. An even
    window's two middle deviations share the lesser one's floor: a span of ``k + 1`` values against one of ``k`` moves
    the floor by about one part in ``size``, and it is computed once, not twice."""
    n, k = len(values), size >> 1
    span = min(n, size + block - 1)
    windows = n - size + 1
    starts = np.minimum(np.arange(0, windows, block), n - span)  # the last block's union taken from the end
    u = np.sort(sliding_window_view(values, span)[starts], axis=1)  # rows, not an index per value: a third the copy

    def floor(t: int) -> np.ndarray:  # under the t-th smallest deviation
        with np.errstate(over="ignore"):  # an infinite span clamped
            return np.minimum((u[:, t - 1 :] - u[:, : span - t + 1]).min(axis=1), _MAX) * _HALF_DOWN

    # odd: the (k + 1)-th; even: the mean of the k-th and (k + 1)-th, at least the k-th's floor, 0.5 * (f + f) = f
    return np.repeat(1.4826 * floor(k + (size & 1)), block)[:windows]


def sorted_mads(rows: np.ndarray) -> np.ndarray:
    """``sorted_mad`` of each of the sorted finite ``rows`` (a 2-d array), equal as numbers: the same median, the
    same deviations (``|x - m|`` is the float ``m - x`` or ``x - m``, a rounded subtraction being symmetric) and the
    same one or two of them selected (``np.partition`` is exact), with the same arithmetic."""
    n = rows.shape[1]
    mid = n >> 1
    with np.errstate(over="ignore"):  # infinite as sorted_mad's, where values near the float's limit overflow
        m = rows[:, mid] if n & 1 else 0.5 * (rows[:, mid - 1] + rows[:, mid])
        dev = np.abs(rows - m[:, None])
        if n & 1:
            return 1.4826 * np.partition(dev, mid, axis=1)[:, mid]
        two = np.partition(dev, (mid - 1, mid), axis=1)
        return 1.4826 * (0.5 * (two[:, mid - 1] + two[:, mid]))


def _check(size: int) -> None:
    if size < 1:
        raise ValueError(f"window size must be at least 1, got {size}")


class RollingWindow:
    """The last ``size`` finite values, kept sorted; non-finite values are never admitted."""

    __slots__ = ("_bounds", "_order", "_shift", "_sorted", "size")

    def __init__(self, size: int) -> None:
        _check(size)
        self.size = size
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        # the MAD's bounds, cached until the window changes (detectors ask again before it does); equal once the
        # MAD itself was computed, or when they meet: either way they are the MAD
        self._bounds: tuple[float, float] | None = None
        self._shift = 0  # where the MAD's bounding block starts, from the centre (see mad_bounds)

    def __len__(self) -> int:
        return len(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) == self.size

    def add(self, x: float) -> None:
        if not _isfinite(x):
            return
        self._bounds = None  # asked again, the bounds move on (mad_bounds): as after any add
        order, ordered = self._order, self._sorted  # locals: called ~20 times per event of a long log
        if len(order) == self.size:
            old = order.popleft()
            order.append(x)
            if old == x and x != 0.0:  # the same value out and in (a constant LR, a regular clock): the same
                return  # sorted list (equal nonzero floats are the same float; -0.0 and 0.0 are not)
            del ordered[_bisect_left(ordered, old)]
        else:
            order.append(x)
        _insort(ordered, x)

    def extend(self, xs: Iterable[float]) -> None:
        """``add`` of each of ``xs`` in turn. A window's worth or more replaces the values outright: the sorted list
        repeated adds leave is the stable sort of the values in arrival order (equal floats are the same float but
        for ``0.0`` and ``-0.0``, which ``insort`` keeps in arrival order and the removal of the oldest takes
        first)."""
        new = list(filter(_isfinite, xs))
        if len(new) < self.size:
            for x in new:
                self.add(x)
            return
        self._bounds = None
        self._order.clear()
        self._order.extend(new[-self.size :])
        self._sorted[:] = sorted(self._order)

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()
        self._bounds = None

    def values(self) -> list[float]:
        """Values oldest first."""
        return list(self._order)

    def last(self) -> float:
        return self._order[-1]

    def mean(self) -> float:
        return math.fsum(self._order) / len(self._order)

    def std(self) -> float:
        """Population standard deviation, two-pass: sum-of-squares shortcuts lose all precision when
        the values are large and close together (1e6 +- 0.01), which is exactly a converged metric."""
        m = self.mean()
        return math.sqrt(math.fsum((x - m) ** 2 for x in self._order) / len(self._order))

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile, ``q`` in [0, 1]."""
        return sorted_quantile(self._sorted, q)

    def median(self) -> float:
        return sorted_median(self._sorted)

    def mad(self) -> float:
        """Median absolute deviation, scaled by 1.4826 to estimate sigma for normal data."""
        b = self._bounds
        if b is not None and b[0] == b[1]:
            return b[0]
        mad = sorted_mad(self._sorted)
        self._bounds = (mad, mad)
        return mad

    def mad_bounds(self) -> tuple[float, float]:
        """``(lo, hi)`` with ``lo <= mad() <= hi`` in O(1): for a rule that compares the MAD (or a ratio of
        MADs) with a bar and is decided by the bounds on most steps, the exact MAD only when they straddle it.

        Why exact: the deviations ``|x - m|`` along the sorted window fall, then rise (their float values too:
        ``m - x`` and ``x - m`` are monotone in ``x``), so those within any ``d`` of ``m`` are a contiguous
        run. The ``t``-th smallest deviation is therefore at most the larger deviation at the two ends of any
        block of ``t`` consecutive values (the whole block is within it), and, for a block whose first value
        is at most ``m`` and whose last is at least ``m``, at least the smaller of the two: a run of ``t``
        deviations no larger than the ``t``-th reaches past one of the block's ends, and the deviations beyond
        an end are no smaller than the end's. One such block bounds each of the (one or two) middle deviations,
        the tighter the nearer its two end deviations are: each call moves it one value towards where they
        meet, which moves little from one add to the next. The MAD's own arithmetic (mean of two, times 1.4826)
        is monotone in the deviations, rounding included, so the bounds hold for the float ``mad()`` returns.
        """
        bounds = self._bounds
        if bounds is not None:
            return bounds
        s = self._sorted
        n = len(s)
        k = n >> 1
        c = k >> 1  # the block's start when centred; _shift is where it starts from there
        j = c + self._shift
        if n & 1:  # the (k+1)-th smallest deviation from m = s[k]: blocks s[j .. j + k], 0 <= j <= k
            if j < 0:
                j = 0
            elif j > k:
                j = k
            m = s[k]
            a, b = m - s[j], s[j + k] - m
            if a <= b:
                self._shift = j - c - 1 if a < b else j - c
                bounds = self._bounds = (1.4826 * a, 1.4826 * b)
            else:
                self._shift = j - c + 1
                bounds = self._bounds = (1.4826 * b, 1.4826 * a)
            return bounds
        if n < 4:  # no block of k values straddles the median: the MAD itself
            mad = self.mad()
            return mad, mad
        # the k-th and (k+1)-th smallest deviations from m: blocks s[j .. j + k - 1] and s[j .. j + k], 1 <= j < k;
        # a, b, d: the deviations at s[j], s[j + k - 1], s[j + k] (b <= d), none NaN (m is finite or infinite)
        if j < 1:
            j = 1
        elif j >= k:
            j = k - 1
        m = 0.5 * (s[k - 1] + s[k])
        a, b = m - s[j], s[j + k - 1] - m
        if a <= b:
            self._shift = j - c - 1 if a < b else j - c
            lo, hi = a + a, b + (s[j + k] - m)
        else:
            d = s[j + k] - m
            if a <= d:
                self._shift = j - c
                lo, hi = b + a, a + d
            else:
                self._shift = j - c + 1
                lo, hi = b + d, a + a
        bounds = self._bounds = (1.4826 * (0.5 * lo), 1.4826 * (0.5 * hi))
        return bounds


class LazyWindow:
    """The last ``size`` finite values in arrival order, sorted only when a statistic is asked (and kept so until the
    next add): for windows read on rare steps, where keeping them sorted on every add cost more than sorting them
    when read."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int) -> None:
        _check(size)
        self._order: collections.deque[float] = collections.deque(maxlen=size)
        self._sorted: list[float] | None = None

    def __len__(self) -> int:
        return len(self._order)

    def add(self, x: float) -> None:
        if _isfinite(x):
            self._order.append(x)
            self._sorted = None

    def extend(self, xs: Iterable[float]) -> None:
        """``add`` of each of ``xs`` in turn."""
        self._order.extend(filter(_isfinite, xs))
        self._sorted = None

    def values(self) -> list[float]:
        """Values oldest first."""
        return list(self._order)

    def median(self) -> float:
        return sorted_median(self._view())

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile, ``q`` in [0, 1]."""
        return sorted_quantile(self._view(), q)

    def mad(self) -> float:
        """Median absolute deviation, scaled by 1.4826 to estimate sigma for normal data."""
        return sorted_mad(self._view())

    def mad_bounds(self) -> tuple[float, float]:
        """``(lo, hi)`` with ``lo <= mad() <= hi``, as :meth:`RollingWindow.mad_bounds`: here the MAD itself, which
        costs little beside the sort a read needs anyway."""
        mad = self.mad()
        return mad, mad

    def mad_positive_for(self) -> int:
        """How many more adds ``mad()`` is proven positive through, from the values' ties alone (no sort): for a rule
        that must know a baseline's MAD positive on every add (a ratio's divisor exists), one count for many adds.
        Negative: nothing is proven (a window more than about half one value: compute the MAD).

        Why exact: the MAD is positive while fewer than ``len // 2`` values equal the median (the ``len // 2``-th
        smallest deviation is then positive: ``x - m`` is zero only where ``x == m``, gradual underflow, and the mean
        of two deviations of at least the least subnormal, times 1.4826, rounds to a positive float); no value is
        repeated more than ``len - distinct + 1`` times (``0.0`` and ``-0.0`` one value, as for the median), each
        add repeats one at most once more, and a window not yet full only grows its ``len // 2``."""
        order = self._order
        n = len(order)
        return (n >> 1) - 2 - n + len(set(order))

    def _view(self) -> list[float]:
        s = self._sorted
        if s is None:
            s = self._sorted = sorted(self._order)
        return s
