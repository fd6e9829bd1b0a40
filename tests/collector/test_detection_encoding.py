"""The events' encoding on the pipe to the detection child: hostile batches come back as the very events sent.

Events cross as columns, a column of one value as that value alone (``detection_process._events``). Whatever the
batch (streams, kinds and hosts interleaved, gaps and huge numbers in the seqs, clock offsets on some events and
not others, 0.0 beside -0.0, NaN and infinities, huge and nested fields), the child must rebuild every event with
each attribute equal and of the same type, floats to the bit, field dicts alike in order and content, with the
attempt it was sent with. And an import's batch, one stream throughout, must carry what its events share once.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest

from tests.bitwise import same
from trainmon.monitor.collector import detection_process as dp
from trainmon.wire import Event

Items = list[tuple[Event, int]]

_ATTRIBUTES = ("kind", "run", "rank", "host", "stream", "seq", "time", "fields", "clock_offset")


def _across(items: Items) -> Items:
    return dp._items(pickle.loads(pickle.dumps(dp._events(items), dp._PROTOCOL)))


def _assert_crosses_unchanged(items: Items) -> None:
    back = _across(items)
    assert len(back) == len(items)
    for (got, got_attempt), (sent, attempt) in zip(back, items, strict=True):
        assert type(got) is Event
        assert same(got_attempt, attempt)
        for name in _ATTRIBUTES:
            assert same(getattr(got, name), getattr(sent, name)), (name, getattr(got, name), getattr(sent, name))


def _step(i: int, **kw: Any) -> Event:
    args: dict[str, Any] = {
        "kind": "step",
        "run": "r",
        "rank": 0,
        "host": "h",
        "stream": "s",
        "seq": i,
        "time": 1.7e9 + i,
        "fields": {"step": i, "loss": 2.0},
    }
    args.update(kw)
    return Event(**args)


def _hostile() -> Items:
    nan, inf = math.nan, math.inf
    huge = {"blob": "x" * 200_000, "nested": {"a": [1, [2.5, {"b": None}]], "t": (1, "2")}, "many": list(range(5000))}
    return [
        (_step(0, kind="run_start", fields={"world_size": 4, "config": {"lr": [1e-3, nan]}}), 0),
        (_step(1, fields={"step": 1, "loss": nan, "grad_norm": inf, "lr": [-inf]}), 0),
        (_step(2, rank=1, host="h1", stream="s1", clock_offset=0.0), 1),
        (_step(3, rank=1, host="h1", stream="s1", clock_offset=-0.0, time=-0.0), 1),
        (_step(10, kind="eval", fields={"step": 1, "loss": 1.5, "ok": True, "none": None}), 0),  # a gap in the seqs
        (_step(2**70, run="другой", rank=7, host="ĥ", stream="s7", time=inf, clock_offset=-1e-300), 3),
        (_step(11, fields=huge, time=nan), 0),
        (_step(12, fields={}), 0),
        (_step(-5, rank=2**63, clock_offset=nan, fields={"x": -(2**80), "f": 1e308, "i": 1, "one": 1.0}), 2),
        (_step(13), 0),
    ]


def test_a_hostile_batch_crosses_unchanged() -> None:
    _assert_crosses_unchanged(_hostile())


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_short_batches_cross_unchanged(n: int) -> None:
    _assert_crosses_unchanged(_hostile()[:n])
    _assert_crosses_unchanged([(_step(i), 0) for i in range(n)])


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("stream", ["a", "b", "b", "a"]),  # first and last alike, the middle not
        ("stream", ["a", "a", "a", "b"]),
        ("stream", ["b", "a", "a", "a"]),
        ("kind", ["step", "step", "eval", "step"]),
        ("run", ["r", "r", "r", "q"]),
        ("host", ["h", "g", "h", "h"]),
        ("rank", [0, 0, 1, 0]),
        ("clock_offset", [None, None, 0.5, None]),
        ("clock_offset", [0.5, None, None, None]),
        ("clock_offset", [0.0, -0.0, 0.0, 0.0]),  # equal, but not the same offset
        ("clock_offset", [0.25, 0.25, 0.25, 0.25]),
        ("seq", [5, 5, 5, 5]),
        ("time", [1.0, 1.0, -0.0, 0.0]),
    ],
)
def test_one_odd_value_anywhere_in_a_column_crosses(name: str, values: list[Any]) -> None:
    _assert_crosses_unchanged([(_step(i, **{name: v}), 0) for i, v in enumerate(values)])


def test_attempts_cross_per_event() -> None:
    for attempts in ([0, 0, 1, 0], [2, 2, 2, 2], [0, 1, 2, 3]):
        _assert_crosses_unchanged([(_step(i), a) for i, a in enumerate(attempts)])


def test_a_live_group_of_many_streams_crosses_unchanged() -> None:
    items = [
        (_step(seq, rank=s, host=f"h{s // 8}", stream=f"st{s}", clock_offset=0.001 * s - 0.01), s % 3)
        for seq in range(1, 9)
        for s in range(32)
    ]
    _assert_crosses_unchanged(items)


def test_what_an_import_batch_shares_crosses_once() -> None:
    """One stream, one kind, no clock offset, one attempt: per event only its seq, time and fields go (a seq and a
    time are 12 bytes, an empty dict 2), not the kind, run, rank, host, stream, offset and attempt again."""
    n = 1000
    items = [(_step(i, run="a-long-run-name", stream="imp-" + "f" * 24, fields={}), 0) for i in range(n)]
    data = pickle.dumps(dp._events(items), dp._PROTOCOL)
    assert len(data) / n < 16
    _assert_crosses_unchanged(items)
