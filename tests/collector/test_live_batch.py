"""The live state folds a batch into the values that folding its events one by one gives.

``LiveState.apply`` counts every event in order but folds a rank's steps (latest step, scrape extremes,
tokens, precursors) once per batch. The reference is the per-event fold it replaced, kept here as the
definition; random streams of every kind, with late attempts, sequence gaps and resends, skewed clocks,
NaN, infinities and bools where numbers go, are fed both ways and compared after every batch.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from trainmon.clock import aligned
from trainmon.monitor.collector.live import SCRAPE_EXTREMES, LiveState, RankState, RunState
from trainmon.monitor.core.goodput import hang_open
from trainmon.monitor.store.storage import PRECURSOR_FIELDS
from trainmon.schedules import Schedule
from trainmon.wire import Event


def _reference_widen(extremes: dict[str, list[float]], fields: dict[str, Any]) -> None:
    for key in SCRAPE_EXTREMES:
        v = fields.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        span = extremes.get(key)
        if span is None:
            extremes[key] = [v, v]
            continue
        if math.isnan(span[0]) or v < span[0]:
            span[0] = v
        if math.isnan(v) or v > span[1]:
            span[1] = v


def _reference_apply(live: LiveState, event: Event, attempt: int) -> None:
    """The per-event fold as it was (logging left out)."""
    run = live.runs.get(event.run)
    if run is None:
        run = live.runs[event.run] = RunState(event.run)
    rank = run.ranks.get(event.rank)
    if rank is None:
        rank = run.ranks[event.rank] = RankState()
    rank.host = event.host
    t = aligned(event.time, event.clock_offset)
    rank.last_seen = max(rank.last_seen, t)
    last_seq = rank.seqs.get(event.stream, -1)
    if event.seq > last_seq + 1:
        rank.missing_events += event.seq - last_seq - 1
    elif event.seq < last_seq and rank.missing_events > 0:
        rank.missing_events -= 1
    rank.seqs[event.stream] = max(last_seq, event.seq)
    if attempt < rank.attempt:
        return
    rank.attempt = attempt
    f = event.fields
    if event.rank == 0:
        run.goodput.observe(event.kind, f, t, attempt, hang_open(run.anomalies_active))
    if event.kind == "step":
        rank.step = f["step"]
        rank.last = f
        _reference_widen(rank.extremes, f)
        sampled = {k: f[k] for k in PRECURSOR_FIELDS if k in f}
        if sampled:
            rank.precursors = sampled
        rank.last_step_time = t
        tokens = f.get("tokens")
        if tokens is not None:
            rank.tokens_total += tokens
            if f.get("step_time"):
                rank.tokens_per_second = tokens / f["step_time"]
    elif event.kind == "health":
        rank.health = f
    elif event.kind == "run_start":
        rank.start = f
        try:
            rank.schedule = Schedule.from_dict(f["schedule"]) if f.get("schedule") else None
        except (TypeError, ValueError):
            rank.schedule = None
        if event.rank == 0:
            run.status = "running"
        run.world_size = f.get("world_size", run.world_size)
        run.planned_steps = f.get("planned_steps", run.planned_steps)
    elif event.kind == "eval":
        run.eval_loss = f["loss"]
    elif event.kind == "run_end" and event.rank == 0:
        run.status = f["status"]


def _shown(value: Any) -> Any:
    """A value compared exactly: floats by repr (NaN equals NaN, -0.0 is not 0.0, 1 is not 1.0), dicts
    whatever their order."""
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, dict):
        return sorted((repr(k), _shown(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_shown(v) for v in value]
    if isinstance(value, Schedule):
        return repr(value)
    return value


def _state(live: LiveState) -> dict[str, Any]:
    out = {}
    for name, run in live.runs.items():
        fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
        fields.pop("received_at")  # the collector's own clock when the batch came
        fields["ranks"] = {r: {f.name: getattr(s, f.name) for f in dataclasses.fields(s)} for r, s in run.ranks.items()}
        fields["goodput"] = run.goodput.result(now=10_000.0)
        out[name] = _shown(fields)
    return out


_NUMBERS = [1.0, 2.5, 0.5, -0.0, 0.0, 3, True, math.nan, math.inf, -math.inf, 2.5, "x", None]
_SCHEDULES = [
    {"name": "cosine", "peak_lr": 1e-3, "total_steps": 1000},
    {"kind": "no such schedule"},
    None,
]


def _step_fields(rng: random.Random, step: int) -> dict[str, Any]:
    f: dict[str, Any] = {"step": step}
    for key in SCRAPE_EXTREMES:
        if rng.random() < 0.8:
            f[key] = rng.choice(_NUMBERS)
    if rng.random() < 0.5:
        f["tokens"] = rng.choice([0, 512, 4096])
        f["step_time"] = rng.choice([0.0, 0.25, None, 2.0])
    if rng.random() < 0.1:
        f.update({k: {"g": rng.random()} for k in rng.sample(PRECURSOR_FIELDS, 2)})
    if rng.random() < 0.3:
        f["phases"] = {"data": rng.choice([0.01, 0.3]), "checkpoint": rng.choice([0.0, 1.0])}
    return f


def _events(seed: int, n: int) -> list[tuple[Event, int]]:
    """Two runs of three ranks, two streams a rank; attempts that go up and late ones of earlier attempts."""
    rng = random.Random(seed)
    out = []
    seqs: dict[str, int] = {}
    attempts: dict[tuple[str, int], int] = {}
    for i in range(n):
        run, rank = rng.choice(["a", "b"]), rng.randint(0, 2)
        stream = f"{run}{rank}-{rng.randint(0, 1)}"
        seq = seqs.get(stream, -1) + rng.choice([1, 1, 1, 1, 2, 5])
        if rng.random() < 0.05:
            seq = max(0, seq - rng.randint(2, 6))  # a resent batch filling a gap
        seqs[stream] = max(seqs.get(stream, -1), seq)
        attempt = attempts.get((run, rank), 0)
        if rng.random() < 0.02:
            attempt = attempts[(run, rank)] = attempt + 1
        elif rng.random() < 0.03:
            attempt = max(0, attempt - 1)  # a late replay of an earlier attempt
        kind = rng.choices(["step", "health", "eval", "run_start", "run_end", "checkpoint"], [40, 2, 2, 1, 1, 2])[0]
        fields: dict[str, Any]
        if kind == "step":
            fields = _step_fields(rng, i)
        elif kind == "run_start":
            fields = {"world_size": rng.choice([3, 8]), "schedule": rng.choice(_SCHEDULES), "resumed": attempt > 0}
            if rng.random() < 0.5:
                fields["planned_steps"] = 5000
        elif kind == "run_end":
            fields = {"status": rng.choice(["finished", "failed"]), "step": i}
        elif kind == "eval":
            fields = {"step": i, "loss": rng.choice([1.5, math.nan])}
        elif kind == "checkpoint":
            fields = {"step": i, "duration": rng.choice([0.5, None])}
        else:
            fields = {"cpu_percent": rng.random()}
        offset = rng.choice([None, None, 0.001, 120.0])
        ev = Event(kind, run, rank, f"host{rank % 2}", stream, seq, 1000.0 + i + rng.random(), fields, offset)
        out.append((ev, attempt))
    return out


def _batches(rng: random.Random, items: list[tuple[Event, int]]) -> list[list[tuple[Event, int]]]:
    out, i = [], 0
    while i < len(items):
        size = rng.choice([1, 2, 7, 50, 400])
        out.append(items[i : i + size])
        i += size
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_folds_to_what_its_events_fold_to_one_by_one(seed: int) -> None:
    items = _events(seed, 1500)
    batched, reference = LiveState(), LiveState()
    for state in (batched, reference):
        state.anomaly("b", "hang", "opened", "critical")  # run b's rank 0 steps count as hung time
    rng = random.Random(seed)
    for batch in _batches(rng, items):
        batched.apply(batch)
        for event, attempt in batch:
            _reference_apply(reference, event, attempt)
        assert _state(batched) == _state(reference)
        if rng.random() < 0.3:  # a scrape takes the interval's extremes in between
            for state in (batched, reference):
                for run in state.runs.values():
                    for rank in run.ranks.values():
                        rank.extremes.clear()


def test_extremes_of_a_batch_keep_a_nan_as_the_highest_and_the_lowest_number() -> None:
    steps = [
        {"step": 0, "loss": math.nan},
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 1.0},
        {"step": 3, "loss": True},
        {"step": 4, "loss": 2},
    ]
    live = LiveState()
    live.apply([(Event("step", "r", 0, "h", "s", i, 1.0 + i, f), 0) for i, f in enumerate(steps)])
    low, high = live.runs["r"].ranks[0].extremes["loss"]
    assert low == 1.0 and math.isnan(high)
