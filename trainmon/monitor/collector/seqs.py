"""Which sequence numbers a stream has stored: a small set of inclusive ranges.

Deduplication is by identity: an event is a duplicate only if its (stream, seq) was stored
before. A producer that resends an unacknowledged batch after newer ones were acknowledged
(a timeout, a spool replay) sends seqs below the stream's highest; they are new events, not
duplicates. A stream that never loses an event is one range, ``[[0, last]]``; each gap adds one,
and a gap that is filled merges its neighbours again.

The set is bounded: past ``MAX_RANGES`` the oldest gap is closed (its seqs are treated as stored,
so if they ever arrive they are counted as duplicates). The producer's own counters and the
stream's ``missing`` count still say they were lost.
"""

from __future__ import annotations

import bisect

__all__ = ["MAX_RANGES", "SeqSet"]

MAX_RANGES = 256


class SeqSet:
    """Sorted, disjoint, inclusive ``[first, last]`` ranges of stored sequence numbers."""

    __slots__ = ("_firsts", "_lasts", "closed")

    def __init__(self, ranges: list[list[int]] | None = None) -> None:
        self._firsts = [r[0] for r in ranges or ()]
        self._lasts = [r[1] for r in ranges or ()]
        self.closed = 0  # gaps closed to stay within MAX_RANGES

    @classmethod
    def up_to(cls, last: int) -> SeqSet:
        """What a stream stored before ranges were kept: everything up to its high-water mark."""
        return cls([[0, last]] if last >= 0 else None)

    @property
    def last(self) -> int:
        return self._lasts[-1] if self._lasts else -1

    def copy(self) -> SeqSet:
        other = SeqSet()
        other._firsts, other._lasts, other.closed = self._firsts.copy(), self._lasts.copy(), self.closed
        return other

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self._firsts, self._lasts, strict=True)]

    def add(self, seq: int) -> bool:
        """Record ``seq``; False if it was stored already (a duplicate)."""
        lasts = self._lasts
        if not lasts or seq > lasts[-1]:  # the common case: the next seq, or one after a gap
            if lasts and seq == lasts[-1] + 1:
                lasts[-1] = seq
            else:
                self._firsts.append(seq)
                lasts.append(seq)
                self._bound()
            return True
        i = bisect.bisect_right(self._firsts, seq) - 1  # the range starting at or before seq
        if i >= 0 and seq <= lasts[i]:
            return False
        joins_left = i >= 0 and lasts[i] == seq - 1
        joins_right = i + 1 < len(self._firsts) and self._firsts[i + 1] == seq + 1
        if joins_left and joins_right:
            lasts[i] = lasts[i + 1]
            del self._firsts[i + 1], lasts[i + 1]
        elif joins_left:
            lasts[i] = seq
        elif joins_right:
            self._firsts[i + 1] = seq
        else:
            self._firsts.insert(i + 1, seq)
            lasts.insert(i + 1, seq)
            self._bound()
        return True

    def add_all(self, seqs: list[int]) -> list[bool]:
        """Record ``seqs`` in order, as :meth:`add` each; False for those stored already (before, or earlier in
        ``seqs``). A stream's usual batch, the next seqs one by one, extends the set by its first and last alone
        (a million-event import made a million calls here)."""
        if seqs and seqs[0] > self.last and seqs == list(range(seqs[0], seqs[0] + len(seqs))):
            self.add(seqs[0])
            self._lasts[-1] = seqs[-1]
            return [True] * len(seqs)
        return list(map(self.add, seqs))

    def _bound(self) -> None:
        while len(self._firsts) > MAX_RANGES:
            self.closed += self._firsts[1] - self._lasts[0] - 1
            self._lasts[0] = self._lasts[1]
            del self._firsts[1], self._lasts[1]
