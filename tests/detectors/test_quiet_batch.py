"""The detectors whose ``observe_batch`` skips quiet events (:mod:`trainmon.monitor.detectors.quiet`) leave every bit of
their state as ``observe`` one event at a time leaves it, after every batch of every cut.

``test_observe_batch`` compares what they report; state a stream never reports on (a loss window read only at an
eval or an episode that does not come, the last step a finding would name, the first step's time) shows here. The
streams are what the skipping is about: long runs of plain steps, their losses often non-finite or integers (the
windows keep the last finite ones), broken by a step carrying one field a detector reads, another rank, a clock
offset, a start, an eval of several sets, a checkpoint, a health sample or an end, each with any value the wire
format lets through.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Any

import pytest

from tests.detectors.test_observe_batch import _admitted, _plausible
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector
from trainmon.monitor.detectors.quiet import observe_quiet
from trainmon.wire import EVENT_KINDS, Event

QUIET_SKIPPERS = (
    "throughput_collapse",
    "straggler",
    "node_health",
    "memory_leak",
    "init_loss",
    "loss_scale_collapse",
    "replica_divergence",
    "eval_regression",
    "instability_precursor",
)
_LOUD_FIELDS = (
    "step_time",
    "phases",
    "tokens",
    "mem_allocated_bytes",
    "loss_scale",
    "skipped",
    "weights_checksum",
    "attn_logit_max",
    "linear_out_rms",
    "attn_entropy",
    "adam_eps_frac",
)
_OTHER_KINDS = ("run_start", "run_end", "eval", "checkpoint", "health")


def _loss(rng: random.Random, level: float) -> object:
    return rng.choice([level, level, level, math.nan, math.inf, 3, "NaN", None])


def _stream(seed: int, live: bool, n: int = 3000) -> list[tuple[Event, int]]:
    """Plain steps in long runs, broken now and then by anything; with the attempt of each event. ``live``: every
    event carries the collector's clock offset (within the threshold, and in stretches beyond it, long enough or
    not to be reported); otherwise now and then one does."""
    rng = random.Random(seed)
    out: list[tuple[Event, int]] = []
    t, step, attempt, skew_left = 1e9, 0, -1, 0
    for i in range(n):
        if skew_left == 0 and rng.random() < 0.005:
            skew_left = rng.randint(1, 300)
        skew_left = max(0, skew_left - 1)
        t += rng.choice([0.1, 0.1, 0.1, 2.0, 900.0])
        level = 3.0 * math.exp(-i / 1500)
        rank = 1 if rng.random() < 0.003 else 0
        r = rng.random()
        kind = "run_start" if i == 0 or r < 0.002 else rng.choice(_OTHER_KINDS) if r < 0.01 else "step"
        if kind == "step":
            step += rng.choice([1, 1, 1, 1, 0, 50])
            fields: dict[str, Any] = {"step": step, "lr": [1e-3], "grad_norm": 1.0}
            loss = _loss(rng, level)
            if loss is not None:
                fields["loss"] = loss
            if rng.random() < 0.01:
                name = rng.choice(_LOUD_FIELDS)
                fields[name] = _plausible(rng, EVENT_KINDS["step"][name].type, level)
        else:
            specs = EVENT_KINDS[kind].items()
            fields = {name: _plausible(rng, spec.type, level) for name, spec in specs if rng.random() < 0.5}
            if "step" in EVENT_KINDS[kind]:
                fields["step"] = step
            if kind == "eval":
                fields["loss"] = level
                fields["metrics"] = {"accuracy": level, "other/loss": level * 2, "other/accuracy": level}
            if kind == "run_start":
                attempt += 1
                step = rng.choice([0, step // 2, step])
        raw = {"kind": kind, "run": "q", "rank": rank, "host": f"h{rank}", "stream": "s", "seq": i, "time": t}
        ev = _admitted({**raw, "fields": fields})
        if ev is not None:
            if live:
                ev = dataclasses.replace(ev, clock_offset=30.0 if skew_left else rng.choice([0.1, -0.2, 5.0]))
            elif rng.random() < 0.004:
                ev = dataclasses.replace(ev, clock_offset=rng.choice([0.1, 30.0]))
            out.append((ev, max(0, attempt)))
    return out


def _state(x: Any) -> Any:
    """Everything an object holds, as plain data (a NaN equal to itself, through repr)."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (str, int, bool, type(None), Event)):
        return x if not isinstance(x, Event) else repr(x)
    if isinstance(x, dict):
        return [(_state(k), _state(v)) for k, v in x.items()]
    if isinstance(x, (list, tuple, collections.deque)):
        return [type(x).__name__, [_state(v) for v in x]]
    if isinstance(x, (set, frozenset)):
        return sorted(map(repr, x))
    slots = [s for cls in type(x).__mro__ for s in getattr(cls, "__slots__", ())]
    held = {s: getattr(x, s) for s in slots if hasattr(x, s)}
    held.update(getattr(x, "__dict__", {}))
    return [type(x).__name__, {k: _state(v) for k, v in sorted(held.items())}]


@pytest.mark.parametrize("kind", QUIET_SKIPPERS)
@pytest.mark.parametrize("live", [False, True], ids=["imported", "live"])
@pytest.mark.parametrize("seed", range(3))
def test_quiet_skipping_leaves_the_state_observe_leaves(kind: str, live: bool, seed: int) -> None:
    cls = next(c for c in ALL_DETECTORS if c.kind == kind)
    assert cls.observe_batch is not Detector.observe_batch, f"{kind} no longer skips quiet events: drop it here"
    config = getattr(DetectorsConfig(), kind)
    rng = random.Random(f"{kind}/{seed}/{live}")
    group = [(ev, a) for ev, a in _stream(seed, live) if cls.consumes is None or ev.kind in cls.consumes]
    one, cut = cls(config), cls(config)
    i = 0
    while i < len(group):
        batch = group[i : i + rng.choice([1, 2, 7, rng.randint(1, 300), rng.randint(300, 1500)])]
        i += len(batch)
        events, attempts = [e for e, _ in batch], [a for _, a in batch]
        expected = [repr(one.observe(e, a)) for e, a in batch]
        got: list[Any] = []
        cut.observe_batch(events, attempts, got)
        assert list(map(repr, got)) == expected, f"{kind}: outputs differ before event {i}"
        assert _state(cut) == _state(one), f"{kind}: state differs after the batch ending at event {i}"


class _Recorder:
    """A detector's state in the three shapes quiet events may touch: set once, overwritten, a window of losses."""

    def __init__(self, window: int) -> None:
        self.first: int | None = None
        self.last: int | None = None
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.loud: list[int] = []

    def observe(self, event: Event, attempt: int) -> list[Any]:
        f = event.fields
        if self.first is None:
            self.first = f["step"]
        self.last = f["step"]
        loss = f.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            self.losses.append(loss)
        if f.get("loud"):
            self.loud.append(f["step"])
            return [f["step"]]
        return []


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_observe_quiet_keeps_first_last_and_the_last_finite_losses(window: int) -> None:
    rng = random.Random(window)
    for _ in range(300):
        n = rng.randint(0, 60)
        fields = [
            {"step": s, "loss": rng.choice([float(s), math.nan, math.inf, s, True, None]), "loud": rng.random() < 0.1}
            for s in range(n)
        ]
        events = [Event("step", "r", 0, "h", "s", s, float(s), f) for s, f in enumerate(fields)]
        one, batched = _Recorder(window), _Recorder(window)
        expected = [one.observe(e, 0) for e in events]
        got: list[Any] = []
        loud = [i for i, f in enumerate(fields) if f["loud"]] + [n]

        def quiet_until(_: list[Event], i: int, loud: list[int] = loud) -> int:
            return next(j for j in loud if j >= i)

        observe_quiet(batched.observe, events, [0] * n, got, quiet_until, window)
        assert got == expected
        assert (batched.first, batched.last, batched.loud) == (one.first, one.last, one.loud)
        assert list(map(repr, batched.losses)) == list(map(repr, one.losses))
