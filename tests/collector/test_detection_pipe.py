"""The pipe to the detection child: frames, the events' encoding, and what the child holds between messages.

A frame arrives in pieces when the child waits on the pipe: read straight into its own buffer, it must come out
whole however it was cut, with a timeout between the pieces. Events cross as columns (``_events``) with the attempts
apart and must come back equal, with their clock offsets (which equality ignores) and their types.
Between messages the child must hold nothing of the last one, or every garbage collection there scans it.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import threading

import pytest

from trainmon.monitor.collector import detection_process as dp
from trainmon.monitor.collector.detection import Detection
from trainmon.monitor.config import DetectorsConfig
from trainmon.wire import Event


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def test_a_frame_cut_anywhere_comes_out_whole() -> None:
    payloads = [b"", b"x", bytes(range(256)) * 300, b"last"]
    stream = b"".join(map(_frame, payloads))
    for cut in (1, 3, 4, 5, 7, 4096, 60_000):  # each piece fits the pipe (64 KiB): the test writes, then reads
        r, w = os.pipe()
        try:
            frames = dp._Frames(r)
            got: list[bytes] = []
            for i in range(0, len(stream), cut):
                os.write(w, stream[i : i + cut])
                while (frame := frames.read(timeout=0.0)) is not None:  # nothing more in the pipe: None, not a part
                    got.append(bytes(frame))
            assert got == payloads, cut
        finally:
            os.close(r)
            os.close(w)


def test_a_frame_cut_short_by_the_end_of_the_pipe_raises_eof() -> None:
    r, w = os.pipe()
    frames = dp._Frames(r)
    os.write(w, _frame(b"whole") + _frame(b"cut short")[:7])
    os.close(w)
    try:
        assert frames.read() == b"whole"
        with pytest.raises(EOFError):
            frames.read()
    finally:
        os.close(r)


def test_a_blocking_read_waits_for_the_rest_of_a_frame() -> None:
    r, w = os.pipe()
    data = pickle.dumps(["observe", 1, list(range(100_000))])
    stream = _frame(data)
    writer = threading.Thread(target=lambda: [os.write(w, stream[i : i + 1000]) for i in range(0, len(stream), 1000)])
    writer.start()
    try:
        assert pickle.loads(dp._Frames(r).read()) == ["observe", 1, list(range(100_000))]
    finally:
        writer.join()
        os.close(r)
        os.close(w)


def _events() -> list[tuple[Event, int]]:
    events = [
        (Event("run_start", "a", 0, "h0", "s0", 0, 1e9, {"world_size": 2, "config": {"x": [1, "y"]}}), 0),
        (Event("step", "a", 0, "h0", "s0", 1, 1e9 + 1, {"step": 1, "loss": math.nan, "lr": [1e-3]}), 0),
        (Event("step", "a", 1, "h1", "s1", 7, 1e9 + 1.5, {"step": 1, "loss": math.inf}, clock_offset=-0.25), 2),
        (Event("eval", "b", 0, "h0", "s2", 3, 1e9 + 2, {"step": 1, "loss": 2.0}, clock_offset=3.0), 1),
        (Event("step", "a", 0, "h0", "s0", 2, 1e9 + 3, {}), 0),
    ]
    return events


def test_events_cross_the_pipe_unchanged() -> None:
    items = _events()
    back = dp._items(pickle.loads(pickle.dumps(dp._events(items), dp._PROTOCOL)))
    assert [a for _, a in back] == [a for _, a in items]
    for (got, _), (sent, _) in zip(back, items, strict=True):
        assert type(got) is Event
        for name in ("kind", "run", "rank", "host", "stream", "seq", "time", "clock_offset"):
            assert getattr(got, name) == getattr(sent, name) and type(getattr(got, name)) is type(getattr(sent, name))
        assert repr(got.fields) == repr(sent.fields)  # NaN too, and the nested list
    assert dp._items(dp._events([])) == []


def test_the_child_holds_nothing_of_a_message_once_it_is_handled() -> None:
    """What ``_serve`` runs per message, with collections off as there: the message's field dicts are gone when
    it returns, so the collection ``gc.enable`` lets happen next scans nothing of it."""
    marker = "only-in-this-message"
    items = [(Event("step", "r", 0, "h", "s", i, 1e9 + i, {"step": i, marker: [i]}), 0) for i in range(50)]
    frame = bytearray(pickle.dumps(["observe", 0, dp._events(items)], dp._PROTOCOL))
    del items
    detection = Detection(DetectorsConfig(), only=frozenset())
    r, w = os.pipe()
    enabled = gc.isenabled()
    gc.disable()
    try:
        assert dp._handle(detection, frame, w)
        alive = [o for o in gc.get_objects() if isinstance(o, dict) and marker in o]
        assert pickle.loads(dp._Frames(r).read()) == [0, []]  # the call answered, with nothing found
    finally:
        if enabled:
            gc.enable()
        os.close(r)
        os.close(w)
    assert alive == []
    assert not dp._handle(detection, bytearray(pickle.dumps(["stop"])), w)
