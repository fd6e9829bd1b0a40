"""Each producer's clock, as the collector sees it: shared by the collector, which estimates the offsets,
and the store, which keeps a stream's liveness times on the collector's clock and gives events back on the
producer's.

A trainer's wall clock can be far off the collector's (a node without NTP, a skewed VM): trusting
it made a healthy run look hung for an hour, stretched its duration and froze its age. The
collector therefore measures liveness on its own clock and puts each producer stream's times on it
by an estimated offset (issue 27, part 4). Durations within one stream stay differences of its own
times, which an offset does not change.

The offset is the least (arrival - event time) of the stream's events: transport latency only adds
to it, so the least is the closest to the true offset (as NTP keeps the sample with the least
delay). The least is taken over the current and the previous window of arrivals, so that a clock
that is stepped (NTP finally syncs) is followed within two windows rather than never.
"""

from __future__ import annotations

__all__ = ["SKEW_TOLERANCE", "ClockOffset", "aligned", "producer_time"]

SKEW_TOLERANCE = 1.0
"""Offsets smaller than this (seconds) are latency, not skew: times stay as the producer wrote them."""


def aligned(t: float, offset: float | None) -> float:
    """``t`` (a producer's time) on the collector's clock, given the producer's estimated ``offset``."""
    if offset is None or -SKEW_TOLERANCE < offset < SKEW_TOLERANCE:
        return t
    return t + offset


def producer_time(t: float, offset: float | None) -> float:
    """The inverse of :func:`aligned`: a time on the collector's clock put back on the producer's, so that
    it sits among the producer's own event times (a stored stream's start and end, replayed or exported)."""
    if offset is None or -SKEW_TOLERANCE < offset < SKEW_TOLERANCE:
        return t
    return t - offset


class ClockOffset:
    """The running estimate of one stream's (collector clock - producer clock), in seconds."""

    __slots__ = ("_current", "_previous", "_since", "window")

    def __init__(self, known: float | None = None, window: float = 60.0) -> None:
        """``known``: an estimate from before (stored), used until a window of new arrivals replaces it."""
        self.window = window
        self._previous = known  # least of the previous window
        self._current: float | None = None  # least of the window in progress
        self._since: float | None = None  # arrival that opened the window in progress

    def add(self, sent: float, received: float) -> None:
        """One event, with its producer ``sent`` time and the collector's ``received`` time."""
        sample = received - sent
        if self._since is None:  # the first event: a stored estimate stays the previous window's
            self._current, self._since = sample, received
        elif received - self._since >= self.window:
            self._previous, self._current, self._since = self._current, sample, received
        elif self._current is None or sample < self._current:
            self._current = sample

    @property
    def offset(self) -> float | None:
        """The estimate (None before any event)."""
        if self._current is None:
            return self._previous
        if self._previous is None:
            return self._current
        return min(self._current, self._previous)
