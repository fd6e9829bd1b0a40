"""The read-back's bookkeeping without a GPU: the CUDA pieces it calls (events, a copy stream, pinned memory) stand
in for the absent device; the tensors are real.

``Readback`` hands items back in submission order once their copy and events have completed, whether a step
gathered device values or not (a CPU step, an event emitted between steps), with each step's own values; the sender
thread queues each copy once, only after the step was submitted, and never lets an item whose copy it has not
queued out. ``tests/hooks/test_hooks_gpu.py`` (``bench/gpu_check.sh``) checks the same on a GPU with real streams.
"""

from __future__ import annotations

import contextlib
import random
import types
from typing import Any

import pytest
import torch

from trainmon.hooks import readback


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Pool:
    made: list[_Event] = []

    def __init__(self, enable_timing: bool) -> None:
        self.released: list[int] = []

    def record(self) -> _Event:
        event = _Event()
        _Pool.made.append(event)
        return event

    def release(self, events: Any) -> None:
        self.released.extend(map(id, events))


class _Stream:
    waited: list[Any] = []

    def __init__(self, device: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        _Stream.waited.append(event)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-ins for the CUDA calls the read-back makes; torch's own ops stay real (on CPU tensors)."""
    cuda = types.SimpleNamespace(Stream=_Stream, stream=lambda stream: contextlib.nullcontext())
    empty = torch.empty
    fake = types.SimpleNamespace(
        cat=torch.cat, stack=torch.stack, cuda=cuda, empty=lambda shape, dtype, pin_memory: empty(shape, dtype=dtype)
    )
    monkeypatch.setattr(readback, "torch", fake)
    monkeypatch.setattr(readback, "EventPool", _Pool)
    _Pool.made, _Stream.waited = [], []


@pytest.mark.parametrize("seed", range(5))
def test_items_come_back_in_order_with_their_own_values(fake_cuda: None, seed: int) -> None:
    rng = random.Random(seed)
    r = readback.Readback(capacity=1000)
    expected: list[tuple[Any, dict[str, Any]]] = []
    got: list[tuple[Any, dict[str, Any]]] = []
    readies = []
    for i in range(300):
        x = rng.random()
        if x < 0.3:  # a CPU step: step_end appends it itself
            r.pending.append((("cpu", i), None, ()))
            expected.append((("cpu", i), {}))
        elif x < 0.4:  # an event emitted between steps
            r.submit(("event", i))
            expected.append((("event", i), {}))
        else:
            # as _device_tensors orders them: vectors between scalars (the buffer holds the scalars first)
            device = {"loss": torch.tensor(float(i))}
            if i % 3:
                device["update_ratio"] = torch.arange(3.0) + i
            device["grad_norm"] = torch.tensor(2.0 * i, dtype=torch.float64)
            if i % 7 == 0:
                device["precursors"] = torch.full((2, 2), float(i))
            if i % 11 == 0:
                device = {"_per_param": torch.arange(3.0) + i}
            ready = _Event()
            readies.append(ready)
            r.submit(("gpu", i), readback.gather(device), ready, [ready])
            values = {k: v.item() if v.dim() == 0 else v.reshape(-1).tolist() for k, v in device.items()}
            expected.append((("gpu", i), values))
        for event in [*_Pool.made, *readies]:
            if rng.random() < 0.5:
                event.done = True
        if rng.random() < 0.3:
            got += r.ready()
    got += r.drain()
    assert [item for item, _ in got] == [item for item, _ in expected]
    assert [values for _, values in got] == [values for _, values in expected]
    assert sorted(map(id, _Stream.waited)) == sorted(map(id, readies))  # each copy queued once, behind its event


def test_nothing_is_let_out_before_its_copy_is_queued(fake_cuda: None) -> None:
    """A step submitted after the sender looked is neither copied nor let out until the sender looks again."""
    r = readback.Readback()
    ready = _Event()
    ready.done = True
    r.submit(("gpu", 0), readback.gather({"loss": torch.tensor(1.5)}), ready, [ready])
    r.pending.append((("cpu", 1), None, ()))
    r._queue_copies()  # the sender's look: both counted, the first copy queued
    ready2 = _Event()
    ready2.done = True
    r.submit(("gpu", 2), readback.gather({"loss": torch.tensor(2.5)}), ready2, [ready2])
    assert r.pending[2][1].copied is None  # not queued until the sender looks again
    for event in _Pool.made:  # the first copy completes
        event.done = True
    got = r.ready()  # this look queues the third copy, whose event has not completed
    assert got == [(("gpu", 0), {"loss": 1.5}), (("cpu", 1), {})]
    assert r.ready() == []
    for event in _Pool.made:
        event.done = True
    assert r.ready() == [(("gpu", 2), {"loss": 2.5})]
