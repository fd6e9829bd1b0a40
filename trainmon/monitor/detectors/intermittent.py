"""Intermittent slow steps: episodes where slow steps come far more often than the run's own rate.

Part of ``throughput_collapse`` (one anomaly kind, one open anomaly per rank), kept apart because it
answers a different question. A collapse is a *level*: the typical step is slower. Here the typical
step is not: isolated steps of 1.5-3.5x among normal ones (nanochat log 102: steps 169-721 and
16357-16605, ~93 s lost, the median unchanged), or a mid-stage stretch where a third of the steps
are 1.2-1.8x (log 101's mid stage, -11 % tokens/s). The principles:

* **Units of the log's own noise.** A step is slow when it exceeds the baseline median by
  ``_SLOW_FACTOR`` *and* by ``_SIGMAS`` robust sigmas *and* the baseline's q90 by
  ``spread_margin``: a run whose step time varies by design never has "slow" steps at its ordinary
  spread. The baseline is the steps ``_WINDOW`` before the recent ones (never the episode itself).
* **Against the run's own rate.** An episode is a window of ``_WINDOW`` steps holding at least
  ``_MIN_SLOW`` slow steps, ``_RATE_FACTOR`` times as many as the baseline's share of slow steps
  predicts, half of them clearly slow (the collapse rules' one-step bar, ``slow_step`` x the
  median), interleaved with normal ones (no block of ``window`` slow steps in a row: a sustained
  block is a collapse, judged by the window and level rules), that together cost
  ``_MIN_LOSS_SHARE`` of the window's time. A slow interval that
  recurs by design (after every evaluation, strictly every 100 iterations: log 100) is in the
  baseline at the same rate, so it is never an episode.
* **The typical step unchanged.** The window's median stays under ``_SLOW_FACTOR`` x the baseline:
  a slower median is a level shift, for the collapse rules.
* **A steady pace.** Only a run whose baseline q90 is within ``_STEADY`` of its median has slow
  steps "among normal ones"; on a run whose step time varies by design (unpacked batches) they
  are its spread, and a shift there is the level rule's. An episode opens on a normal step, never
  inside what may be the start of a sustained block.
* **Onset, extent, persistence.** The episode starts at the first slow step of the window that
  opened it (looking back), follows its slow steps, and ends at its last slow step once a whole
  window holds fewer than half ``_MIN_SLOW``; the time lost is counted over its extent.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

__all__ = ["Intermittent", "IntermittentEpisode"]

_WINDOW = 64
_SLOW_FACTOR = 1.25
_SIGMAS = 6.0
_MIN_SLOW = 8
_RATE_FACTOR = 4.0
_MIN_LOSS_SHARE = 0.05
_MIN_BASELINE = 32
_STEADY = 1.2  # a baseline whose q90 is within this of its median keeps a steady pace


@dataclass(slots=True)
class IntermittentEpisode:
    """An open episode: its extent, its slow steps and what they cost against the baseline."""

    onset: int
    base: float  # baseline median seconds per token (or per step)
    bar: float  # a step above this (seconds per token) is slow
    last_slow: int
    steps: int = 0  # steps from the onset to the last slow step
    slow: int = 0
    seconds: float = 0.0  # seconds and tokens of those steps
    tokens: float = 0.0
    worst: float = 0.0  # the largest step over the baseline, as a ratio
    pending: tuple[int, float, float] = (0, 0.0, 0.0)  # steps, seconds, tokens since the last slow step

    @property
    def lost(self) -> float:
        return max(0.0, self.seconds - self.base * self.tokens)


class Intermittent:
    """Follows one rank's steps (seconds per token, seconds, tokens) and says when an episode opens,
    grows and ends. ``admit`` is False while another finding of the detector holds the anomaly: those
    steps stay out of the baseline too."""

    def __init__(self, spread_margin: float, spread_quantile: float, slow_step: float, block: int) -> None:
        self._margin, self._q = spread_margin, spread_quantile
        self._clear_bar, self._block = slow_step, block
        self._recent: collections.deque[tuple[int, float, float, float]] = collections.deque()
        self._base: collections.deque[float] = collections.deque(maxlen=4 * _WINDOW)
        self.episode: IntermittentEpisode | None = None

    def clear(self) -> None:
        self._recent.clear()
        self._base.clear()
        self.episode = None

    def _bar(self) -> tuple[float, float, float, float] | None:
        """(baseline median, slow bar, baseline share of slow steps, its q90), or None before a baseline."""
        if len(self._base) < _MIN_BASELINE:
            return None
        values = sorted(self._base)
        median = statistics.median(values)
        if median <= 0:
            return None
        mad = statistics.median(abs(v - median) for v in values)
        q = values[min(len(values) - 1, int(self._q * len(values)))]
        bar = max(_SLOW_FACTOR * median, median + _SIGMAS * 1.4826 * mad, self._margin * q)
        share = sum(1 for v in values if v > bar) / len(values)
        return median, bar, share, q

    def observe(
        self, step: int, spt: float, seconds: float, tokens: float, admit: bool, since: float = -math.inf
    ) -> str | None:
        """Add a step; returns ``"opened"``, ``"grew"`` (a new slow step), ``"ended"`` or None. An episode
        never starts before ``since`` (the steps of a collapse the detector already reported)."""
        self._recent.append((step, spt, seconds, tokens))
        if len(self._recent) > _WINDOW:
            old = self._recent.popleft()
            if admit and self.episode is None:
                self._base.append(old[1])
        ep = self.episode
        if ep is not None:
            slow = spt > ep.bar
            p_steps, p_seconds, p_tokens = ep.pending
            p_steps, p_seconds, p_tokens = p_steps + 1, p_seconds + seconds, p_tokens + tokens
            if slow:
                ep.steps += p_steps
                ep.seconds += p_seconds
                ep.tokens += p_tokens
                ep.slow += 1
                ep.last_slow = step
                ep.worst = max(ep.worst, spt / ep.base)
                ep.pending = (0, 0.0, 0.0)
                return "grew"
            ep.pending = (p_steps, p_seconds, p_tokens)
            window_slow = sum(1 for r in self._recent if r[1] > ep.bar)
            if window_slow < _MIN_SLOW / 2 and step - ep.last_slow >= _WINDOW // 2:
                return "ended"
            return None
        if not admit or len(self._recent) < _WINDOW:
            return None
        known = self._bar()
        if known is None:
            return None
        median, bar, share, q = known
        if q > _STEADY * median or spt > bar:
            # a run whose steps vary by design has no "slow step among normal ones" beyond its spread; and
            # an episode opens on a normal step, never inside what may be the start of a sustained block
            return None
        if statistics.median(r[1] for r in self._recent) >= _SLOW_FACTOR * median:
            return None  # the typical step is slower: a level shift, the collapse rules' to judge
        slow = [r for r in self._recent if r[1] > bar and r[0] >= since]
        if len(slow) < max(_MIN_SLOW, _RATE_FACTOR * share * _WINDOW):
            return None
        if sum(1 for r in slow if r[1] > self._clear_bar * median) < _MIN_SLOW / 2:
            return None  # a stretch barely over the bar (a contended host at 1.3x) is not slow steps worth naming
        run = longest = 0
        for r in self._recent:
            run = run + 1 if r[1] > bar else 0
            longest = max(longest, run)
        if longest >= self._block:
            return None  # a sustained block of slow steps is a collapse: the window and level rules judge it
        window_seconds = sum(r[2] for r in self._recent)
        window_tokens = sum(r[3] for r in self._recent)
        if window_seconds - median * window_tokens < _MIN_LOSS_SHARE * window_seconds:
            return None
        onset = slow[0][0]
        ep = IntermittentEpisode(onset=onset, base=median, bar=bar, last_slow=slow[-1][0])
        for r in self._recent:
            if onset <= r[0] <= ep.last_slow:
                ep.steps += 1
                ep.seconds += r[2]
                ep.tokens += r[3]
        ep.slow = len(slow)
        ep.worst = max(r[1] for r in slow) / median
        tail = [r for r in self._recent if r[0] > ep.last_slow]
        ep.pending = (len(tail), sum(r[2] for r in tail), sum(r[3] for r in tail))
        self.episode = ep
        return "opened"

    def median_ratio(self) -> float:
        """The median step of the recent window over the episode's baseline (1.0 without an episode)."""
        ep = self.episode
        if ep is None or not self._recent:
            return 1.0
        return statistics.median(r[1] for r in self._recent) / ep.base

    def end(self) -> None:
        """The episode is over: its steps never enter the baseline (they were not admitted)."""
        self.episode = None
