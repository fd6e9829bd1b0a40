"""What the :meth:`Detector.observe_batch` overrides that decide runs of steps at once share: the batch read as columns
(a look at a few fields of thousands of steps, numpy over a column), and the walk that hands the runs they decide to
them and every other event to ``observe``.

A batch is read once for all the detectors of its group: the engine opens a :class:`Reading` of the list it hands them
(:func:`read`), and :func:`columns` and the quiet scans (:mod:`.quiet`) asked about that very list answer from it.
Asked about any other list, they read it afresh. What they hand out is the caller's own copy, and nothing is kept once
the reading is closed."""

from __future__ import annotations

import operator
import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import numpy as np

from trainmon.monitor.detectors.base import NOTHING, Finding
from trainmon.wire import Event

__all__ = ["Columns", "Reading", "carries", "columns", "observe_runs", "read"]

_CHUNK = 8
"""Events observed one at a time after ``take`` decided none (doubling up to :data:`_MAX_CHUNK` while it decides none
again): a loud event, and the few after it, cost what ``observe`` costs."""
_MAX_CHUNK = 1024
"""... so that a stretch only ``observe`` can follow (an open episode, a run of loud steps) is observed in chunks, in C,
with ``take`` asked once a chunk, and the walk is back to deciding runs within a chunk of that stretch's end."""

_FIELDS, _KIND, _OFFSET = map(operator.attrgetter, ("fields", "kind", "clock_offset"))
_T = TypeVar("_T")
_FIRST = operator.itemgetter(0)
_LIST: frozenset[type] = frozenset((list,))
_NONE: frozenset[str] = frozenset()
_STEP = frozenset(("step",))


class Reading:
    """One batch's columns, each read at most once (in C): its events' fields and kinds and where its runs of steps end
    when it is made, and when first asked the field names it carries, a field's column, and where the steps that carry
    some names are. Detectors share it while it is open (``with read(events)``): the lists it holds are read, never
    handed out (:func:`columns` copies them)."""

    __slots__ = (
        "_arrays",
        "_carrying",
        "_clocked",
        "_columns",
        "_firsts",
        "_kept",
        "_keys",
        "_odd",
        "_stretches",
        "_types",
        "_whole",
        "at",
        "ends",
        "events",
        "fields",
        "kinds",
        "rank",
    )

    def __init__(
        self, events: list[Event], fields: list[dict[str, Any]] | None = None, kinds: list[str] | None = None
    ) -> None:
        """``fields`` and ``kinds``: the events' own, in order, where the caller has read them already (the detection
        pipe carries them as columns), so that they are not read twice."""
        self.events = events
        self.fields: list[dict[str, Any]] = list(map(_FIELDS, events)) if fields is None else fields
        self.kinds: list[str] = list(map(_KIND, events)) if kinds is None else kinds
        self.ends = _ends(self.kinds)
        """Where each run of steps ends: the positions of the events that are not steps (a few a batch: starts, evals,
        ends), ascending, then the batch's length."""
        self._keys: frozenset[str] | None = None
        self._columns: dict[str, list[Any]] = {}
        self._carrying: dict[frozenset[str], list[int]] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._firsts: dict[str, np.ndarray | None] = {}
        self._types: dict[str, list[type]] = {}
        self._odd: dict[tuple[str, frozenset[type]], Sequence[int]] = {}
        self._kept: dict[frozenset[str], Reading | None] = {}
        self._whole: Reading | None = None
        self._stretches = [(0, len(events))]
        self.at: list[int] = []
        """Of a reading made by :meth:`kept`: where its events are in the batch it was kept from."""
        self.rank: int | None = None
        """The rank of every event, where the detection that opened it knows the batch is of one rank (an import's
        always), else None: the detectors that ask whether every step is of one rank (hang) or of rank 0 (straggler)
        read it rather than each event's (a pass a batch each)."""
        self._clocked: list[int] | None = None

    def __enter__(self) -> Reading:
        """Open: :func:`read` of its very list answers with it in this thread until it is closed (opened again while
        open, it stays open until the outer close)."""
        _READINGS.open.append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        opened = _READINGS.open
        opened.remove(self)
        if self._kept and self not in opened:  # the outer close: what it kept closes with it, and lets go of it
            for part in filter(None, self._kept.values()):
                opened.remove(part)
            self._kept.clear()

    @property
    def keys(self) -> frozenset[str]:
        """The names of the fields any event carries: a field no event carries is a column of None without a look."""
        if self._keys is None:
            self._keys = frozenset().union(*self.fields)
        return self._keys

    @property
    def present(self) -> frozenset[str]:
        """The kinds of its events, from where its runs of steps end rather than a look at each (a frozenset of 5,000
        kinds: 36 us, twice a batch)."""
        others = self.ends[:-1]
        present = frozenset(map(self.kinds.__getitem__, others))
        return present | _STEP if len(others) < len(self.kinds) else present

    def kept(self, kinds: frozenset[str]) -> Reading | None:
        """The reading of this open batch's events of ``kinds`` (some of its kinds, not all), in order, as a list of
        their own, None where there are none: made once a batch for every detector of both its groups that reads
        those kinds alone (an HF log's evals in a batch of steps: a dozen detectors), and open until this one closes.
        Made for each detector, their lists, readings and the outputs spread back over the batch cost the driver 6x
        the CPU per event on a log with evals (0.42 s on 300k steps and 300 evals, against 0.1 s on 1M steps).

        Its lists, and its columns, are slices of this one's (:meth:`cut`): a few stretches of steps, each copied in C
        (a tenth of a look per event)."""
        part = self._kept.get(kinds, self)
        if part is self:
            stretches = _stretches(self.kinds, self.ends, kinds)
            part = None
            if stretches:
                part = Reading(_cut(self.events, stretches), _cut(self.fields, stretches), _cut(self.kinds, stretches))
                part._whole, part._stretches, part.rank = self, stretches, self.rank
                part.at = _cut(range(len(self.kinds)), stretches)
                _READINGS.open.append(part)
            self._kept[kinds] = part
        return part

    def cut(self, values: Sequence[_T]) -> list[_T]:
        """``values``, one for each event of the batch this reading was kept from (:meth:`kept`), at its events."""
        return _cut(values, self._stretches)

    def column(self, name: str) -> list[Any]:
        """The field ``name`` of each event, None where it is absent."""
        values = self._columns.get(name)
        if values is None:
            if self._whole is None:
                values = _column(self.fields, name, self)
            elif name in self.keys:  # kept: its batch's column, which its other detectors read too, cut
                values = self.cut(self._whole.column(name))
            else:
                values = [None] * len(self.events)
            self._columns[name] = values
        return values

    @property
    def clocked(self) -> list[int]:
        """Where the events that carry a clock offset are (an imported log's carry none), ascending, then the batch's
        length: found once a batch for the detectors that follow the offsets (hang, node_health), each of which read
        every event's, 0.3 ms per 10,000 events."""
        if self._clocked is None:
            offsets = list(map(_OFFSET, self.events))
            n = len(offsets)
            if offsets.count(None) == n:
                self._clocked = [n]
            else:
                self._clocked = [*compress(range(n), map(operator.is_not, offsets, repeat(None))), n]
        return self._clocked

    def floats(self, name: str) -> np.ndarray:
        """The field ``name``'s column as ``np.array(column, dtype=float)`` (an absent field: NaN), read-only, made once
        a batch for the detectors that read it so (a CSV's loss: four of them, its grad norm three; 0.15 ms per 10,000
        events each). Raises what numpy raises, each time it is asked."""
        values = self._arrays.get(name)
        if values is None:
            values = self._arrays[name] = np.array(self.column(name), dtype=float)
            values.flags.writeable = False
        return values

    def firsts(self, name: str) -> np.ndarray | None:
        """The first item of each value of the field ``name``, as a read-only float array, where every value is a
        non-empty list whose first item is a float (a step's LRs, one a param group: group 0's), else None: read once a
        batch for the detectors that read them (lr_schedule_drift, bad_resume: 0.3 ms per 10,000 events each)."""
        if name not in self._firsts:
            values = None
            if self.only(name, _LIST):
                try:
                    items = list(map(_FIRST, self.column(name)))
                except IndexError:  # an empty list
                    items = []
                if items and list(map(type, items)).count(float) == len(items):
                    values = np.fromiter(items, float, len(items))  # floats: np.array's look at each is not needed
                    values.flags.writeable = False
            self._firsts[name] = values
        return self._firsts[name]

    def only(self, name: str, types: frozenset[type], start: int = 0, stop: int | None = None) -> bool:
        """Whether every value of the field ``name`` from ``start`` to ``stop`` is of one of ``types`` (exactly: a bool
        is no int; an absent field is None). The column's types are read once a batch (in C), and where its values are
        of other types once for each ``types`` asked (a count of each type: nearly every batch has none, or all), for
        every detector that asks it of the column, of whatever part (the steps, the losses and the LRs: each asked by
        two to four detectors, a pass of 0.1-0.18 ms per 10,000 events each time)."""
        odd = self._odd.get((name, types))
        if odd is None:
            kinds = self._types.get(name)
            if kinds is None:
                kinds = self._types[name] = list(map(type, self.column(name)))
            n = len(kinds)
            count = sum(map(kinds.count, types))
            if count == n:
                odd = [n]
            elif not count:
                odd = range(n + 1)  # each value, then the batch's length
            else:
                odd = [*compress(range(n), map(operator.not_, map(types.__contains__, kinds))), n]
            self._odd[(name, types)] = odd
        stop = len(self.events) if stop is None else stop
        return start >= stop or odd[bisect_left(odd, start)] >= stop

    def quiet_end(self, i: int, without: frozenset[str] = _NONE) -> int:
        """The end of the run of steps from ``i`` that carry none of the fields ``without``: the next event that is not
        a step or carries one (``i`` itself when ``events[i]`` does), else the batch's end. A query costs two
        bisections: the steps that carry those fields are found once a batch, and only in a batch that carries them."""
        ends = self.ends
        end = ends[bisect_left(ends, i)]
        if end > i and without and not self.keys.isdisjoint(without):
            names = without & self.keys
            at = self._carrying.get(names)
            if at is None:
                carry = map(operator.not_, map(names.isdisjoint, self.fields))
                at = self._carrying[names] = [*compress(range(len(self.events)), carry), len(self.events)]
            end = min(end, at[bisect_left(at, i)])
        return end


def _ends(kinds: list[str]) -> list[int]:
    """:attr:`Reading.ends` of a batch of ``kinds``: the other kinds found by ``list.index`` (in C) rather than a flag
    per event."""
    ends: list[int] = []
    if kinds.count("step") != len(kinds):
        for kind in set(kinds) - {"step"}:
            at = -1
            for _ in range(kinds.count(kind)):
                at = kinds.index(kind, at + 1)
                ends.append(at)
        ends.sort()
    ends.append(len(kinds))
    return ends


def _column(fields: list[dict[str, Any]], name: str, batch: Reading) -> list[Any]:
    """The field ``name`` of each of ``fields`` (``batch``'s), None where it is absent. A field that every event carries
    (a CSV's columns, nearly every batch) is read with ``itemgetter``, 0.09 ms per 5,000 events, where ``dict.get`` and
    the name passed to each call took 0.2 ms (a million-row CSV: four columns a batch, 0.09 s of the detection child's
    CPU), and without the batch's field names (:attr:`Reading.keys`, 0.34 ms per 10,000 events: a batch whose only
    reader is divergence, in the import's own thread, reads its loss and steps without them); a batch where an event
    lacks it is read again with ``dict.get``, or not at all where no event carries it."""
    try:
        return list(map(operator.itemgetter(name), fields))
    except KeyError:
        return list(map(dict.get, fields, repeat(name))) if name in batch.keys else [None] * len(fields)


def _stretches(kinds: list[str], ends: list[int], keep: frozenset[str]) -> list[tuple[int, int]]:
    """Where a batch of ``kinds`` (its :attr:`Reading.ends`) has events of the kinds ``keep``: ``(start, stop)`` of
    each stretch of them, ascending, none empty, none adjacent: a look at each event that is not a step."""
    steps, n = "step" in keep, len(kinds)
    out: list[tuple[int, int]] = []
    i = 0  # the first step after the last other kind
    for j in ends:
        if steps and j > i:
            _join(out, i, j)
        if j < n and kinds[j] in keep:
            _join(out, j, j + 1)
        i = j + 1
    return out


def _join(stretches: list[tuple[int, int]], start: int, stop: int) -> None:
    if stretches and stretches[-1][1] == start:
        stretches[-1] = (stretches[-1][0], stop)
    else:
        stretches.append((start, stop))


def _cut(values: Sequence[_T], stretches: list[tuple[int, int]]) -> list[_T]:
    out: list[_T] = []
    for start, stop in stretches:
        out += values[start:stop]
    return out


class _Readings(threading.local):
    """The readings open in this thread, innermost last (a thread of its own runs a detection beside the import's)."""

    def __init__(self) -> None:
        self.open: list[Reading] = []


_READINGS = _Readings()


def read(events: list[Event]) -> Reading:
    """The open :class:`Reading` of ``events`` (that very list, not one equal to it), else a new one, which only its
    caller sees unless it opens it (``with read(events) as batch:``)."""
    for shared in _READINGS.open:
        if shared.events is events:
            return shared
    return Reading(events)


class Columns(NamedTuple):
    fields: list[dict[str, Any]]
    """Each event's fields, in order."""
    others: list[int]
    """The positions of the events that are not steps, ascending (a few a batch: starts, evals, ends)."""
    values: list[list[Any]]
    """Each named field's value at each event, None where it is absent."""


def columns(events: list[Event], *names: str) -> Columns:
    """The batch's fields, where its other kinds are, and the columns of ``names``, read once for every detector while
    the batch's reading is open (:func:`read`): each a copy of its own (a list copied costs a twelfth of one read),
    which the caller may change."""
    batch = read(events)
    return Columns(list(batch.fields), batch.ends[:-1], [list(batch.column(name)) for name in names])


def carries(events: list[Event], *names: str) -> bool:
    """Whether an event of the batch carries one of the fields ``names``: the names its reading found (:func:`read`),
    rather than a look at each event for each name."""
    return not read(events).keys.isdisjoint(names)


def observe_runs(
    observe: Callable[[Event, int], list[Finding]],
    events: list[Event],
    attempts: list[int],
    out: list[list[Finding]],
    take: Callable[[int], int],
) -> None:
    """``observe`` of each event in order, its outputs appended to ``out``, but for the runs ``take`` decides.

    ``take(i)`` is the end ``j`` of a run of events from ``i`` that it has proven find nothing, after it left the
    detector in the state ``observe`` of ``events[i:j]`` would have (``i``: no run from there, or none worth its
    cost). Between runs, events go to ``observe`` in chunks that double while ``take`` decides none."""
    n = len(events)
    i, chunk = 0, _CHUNK
    while i < n:
        j = take(i)
        if j > i:
            out.extend(repeat(NOTHING, j - i))
            i, chunk = j, _CHUNK
            continue
        j = min(n, i + chunk)
        out.extend(map(observe, events[i:j], attempts[i:j]))
        i, chunk = j, min(2 * chunk, _MAX_CHUNK)
