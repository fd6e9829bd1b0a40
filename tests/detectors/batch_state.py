"""A detector fed in batches ends every batch in the state, and with the outputs, of one fed event by event: for the
``observe_batch`` overrides that move a run of quiet steps' histories in one go (``tests/detectors/test_*_batch.py``).
Stricter than ``test_observe_batch.py``, which compares outputs only: a history off by one entry may find the same on
one stream and not on the next."""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.wire import Event


def _slots(cls: type) -> list[str]:
    """The attributes kept in ``cls``'s slots, its bases' included (a class lists only its own)."""
    names: list[str] = []
    for c in reversed(cls.__mro__):
        own = c.__dict__.get("__slots__", ())
        names += [own] if isinstance(own, str) else [n for n in own if n not in ("__dict__", "__weakref__")]
    return names


def state(det: Detector) -> str:
    """Everything the detector keeps, as text (repr: a NaN equals itself, -0.0 differs from 0.0): an object with
    fields or slots (a window, a rank's record) as the values in them, a slot never set as ``<unset>``."""

    def plain(v: Any) -> Any:
        if isinstance(v, collections.deque):
            return ("deque", v.maxlen, [plain(x) for x in v])
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return (type(v).__name__, {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)})
        slots = _slots(type(v))
        if slots:
            return (type(v).__name__, {k: plain(getattr(v, k, "<unset>")) for k in slots})
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return repr({k: plain(v) for k, v in vars(det).items()})


def check_batches(
    cls: type[Detector], config: Any, events: list[Event], rng: random.Random, ticks: bool = False
) -> int:
    """Feed ``events`` (those ``cls`` consumes) to one instance event by event and to another in batches cut at
    random, comparing outputs and state after every batch; with ``ticks``, then ticking both at a time at or after
    the batch's last event and comparing again (for a detector whose ``tick`` reads what a batch left, hang's).
    Returns how many findings there were, ticks' included."""
    events = [e for e in events if cls.consumes is None or e.kind in cls.consumes]
    one, cut = cls(config), cls(config)
    found = i = 0
    while i < len(events):
        batch = events[i : i + rng.choice([1, 2, 5, rng.randint(1, 100), rng.randint(100, 3000)])]
        attempts = [0] * len(batch)
        expected: list[list[Finding]] = list(map(one.observe, batch, attempts))
        got: list[list[Finding]] = []
        cut.observe_batch(batch, attempts, got)
        assert repr(got) == repr(expected), f"{cls.kind}: outputs differ in the batch from event {i}"
        assert state(cut) == state(one), f"{cls.kind}: state differs after the batch from event {i}"
        found += sum(map(len, expected))
        if ticks:
            now = batch[-1].time + rng.choice([0.0, 1.0, 30.0, 900.0])
            ticked = one.tick(now)
            assert repr(cut.tick(now)) == repr(ticked), f"{cls.kind}: ticks differ after the batch from event {i}"
            assert state(cut) == state(one), f"{cls.kind}: state differs after the tick after the batch from event {i}"
            found += len(ticked)
        i += len(batch)
    return found
