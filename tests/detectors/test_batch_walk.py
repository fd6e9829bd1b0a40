"""The walk the observe_batch overrides share (trainmon.monitor.detectors.batch): the columns name every event that is
not a step, and observe_runs hands ``take`` the runs it decides and ``observe`` every other event, once each, in
order, whatever ``take`` decides."""

from __future__ import annotations

import random

import pytest

from tests.detectors.helpers import ev
from trainmon.monitor.detectors.base import NOTHING, Finding
from trainmon.monitor.detectors.batch import columns, observe_runs
from trainmon.wire import Event


def test_columns_name_the_other_kinds_and_read_absent_fields_as_none() -> None:
    rng = random.Random(3)
    kinds = [rng.choice(["step"] * 8 + ["eval", "run_start", "run_end"]) for _ in range(500)]
    events = [ev(k, {"step": i, "loss": 1.0} if i % 3 else {"step": i}) for i, k in enumerate(kinds)]
    fields, others, (losses, norms) = columns(events, "loss", "grad_norm")
    assert fields == [e.fields for e in events]
    assert others == [i for i, k in enumerate(kinds) if k != "step"]
    assert losses == [1.0 if i % 3 else None for i in range(500)]
    assert norms == [None] * 500
    assert columns([ev("step", {"step": 0})]).others == []


@pytest.mark.parametrize("seed", range(50))
def test_observe_runs_observes_each_event_take_does_not_decide_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    events = [ev("step", {"step": i}) for i in range(rng.randint(1, 3000))]
    quiet = [rng.random() < rng.choice([0.0, 0.5, 0.99, 1.0]) for _ in events]
    seen: list[int] = []
    taken: list[int] = []

    def observe(e: Event, attempt: int) -> list[Finding]:
        seen.append(e.fields["step"])
        return [Finding("k", "info", e.fields["step"], "", "")]

    def take(i: int) -> int:  # a run of quiet events from i, of any length up to its end
        j, most = i, rng.choice([1, 64, 5000])
        while j < len(events) and quiet[j] and j - i < most:
            j += 1
        taken.extend(range(i, j))
        return j

    out: list[list[Finding]] = []
    observe_runs(observe, events, [0] * len(events), out, take)
    assert sorted(seen + taken) == list(range(len(events)))  # each event once, by one of them
    assert seen == sorted(seen) and all(quiet[i] for i in taken)
    assert [o is NOTHING for o in out] == [i in set(taken) for i in range(len(events))]
    assert [o[0].step for o in out if o] == seen
