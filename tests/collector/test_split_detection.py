"""Detection shared out between detections (``Detection(only=...)``, an import's ``SplitDetection``) reports what one
detection of every detector reports, in the same order, once the halves' keyed findings are merged by key.

The traces are the detection benchmark's: one per fault kind (NaNs, spikes, LR drift, stragglers across ranks,
hangs that only a tick sees, bad resumes...) and clean controls, fed in batches that cut through ranks and
attempts, with a tick on the trace's clock after each; the detectors are shared out at random, several ways.
"""

from __future__ import annotations

import heapq
import operator
import random

import pytest

from bench.synthetic import clean_controls, fault_traces
from trainmon.monitor.collector.detection import Detection, Keyed
from trainmon.monitor.collector.detection_process import SplitDetection, parts
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS
from trainmon.wire import Event, validate_event

TRACES = {t.name: t for t in [*fault_traces(1, seed=3), *clean_controls(2, seed=3)]}
KINDS = sorted(c.kind for c in ALL_DETECTORS)


def _items(raw: list[dict]) -> list[tuple[Event, int]]:
    """Events with their attempt: a (run, rank)'s run_starts counted, as the store counts resumes."""
    starts: dict[tuple[str, int], int] = {}
    out = []
    for ev in map(validate_event, raw):
        key = (ev.run, ev.rank)
        if ev.kind == "run_start":
            starts[key] = starts.get(key, -1) + 1
        out.append((ev, max(0, starts.get(key, 0))))
    return out


def _merge(*halves: list[Keyed]) -> list:
    return [found for _, found in heapq.merge(*halves, key=operator.itemgetter(0))]


@pytest.mark.parametrize("name", sorted(TRACES))
def test_detectors_shared_out_report_what_one_detection_reports(name: str) -> None:
    items = _items(TRACES[name].events)
    rng = random.Random(name)
    splits = [frozenset(k for k in KINDS if rng.random() < 0.5) for _ in range(3)]
    config = DetectorsConfig()
    whole = Detection(config)
    halves = [(Detection(config, only=s), Detection(config, only=frozenset(KINDS) - s)) for s in splits]
    total = 0
    i = 0
    while i < len(items):
        n = rng.randint(1, 97)
        batch, i = items[i : i + n], i + n
        expected = whole.observe(batch)
        total += len(expected)
        for a, b in halves:
            assert _merge(a.observe_keyed(batch), b.observe_keyed(batch)) == expected
        now = max(ev.time for ev, _ in batch) + rng.choice([0.0, 30.0, 600.0])
        expected = whole.tick(now)
        total += len(expected)
        for a, b in halves:
            assert _merge(a.tick_keyed(now), b.tick_keyed(now)) == expected
    if not TRACES[name].clean:
        assert total, "a fault trace whose detectors found nothing proves nothing"


def test_a_split_detection_answers_in_call_order_with_what_one_detection_finds() -> None:
    """Through a real child process: the halves joined on whichever thread comes second, answers in call order."""
    items = _items(TRACES["spike-0"].events) + _items(TRACES["nan-0"].events)
    config = DetectorsConfig()
    whole = Detection(config)
    split = SplitDetection(config, frozenset(("nan_inf", "loss_noise", "hang")))
    answers: list[tuple[int, list]] = []
    expected: list[tuple[int, list]] = []
    try:
        for call, at in enumerate(range(0, len(items), 50)):
            batch = items[at : at + 50]
            expected.append((call, whole.observe(batch)))
            split.observe(parts(batch), lambda keyed, call=call: answers.append((call, [f for _, f in keyed])))
    finally:
        split.close(30)
    assert answers == expected
    assert any(found for _, found in expected)
