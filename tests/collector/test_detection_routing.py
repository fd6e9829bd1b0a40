"""The driver hands each event only to the detectors that read its kind (``Detector.consumes``), and that
changes nothing they find: every detector's declaration is checked against feeding it every event."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.collector.detection import RUN_WIDE, Detection, Found
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.wire import Event, validate_event

ROOT = Path(__file__).resolve().parent.parent.parent


def _synthetic() -> Any:
    spec = importlib.util.spec_from_file_location("bench_synthetic", ROOT / "bench" / "synthetic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_synthetic"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _ev(kind: str, fields: dict, t: float, rank: int = 0, run: str = "run") -> Event:
    return Event(kind, run, rank, "host", f"s{rank}", 0, t, fields)


def _every_event_to_every_detector(items: list[tuple[Event, int]]) -> list[Found]:
    """The driver before routing: each event to each detector of its (run, rank), then of its run."""
    config = DetectorsConfig()
    ranks: dict[tuple[str, int], list[Detector]] = {}
    runs: dict[str, list[Detector]] = {}
    found: list[Found] = []
    for event, attempt in items:
        for dets, rank in (
            (ranks.setdefault((event.run, event.rank), _make("rank", config)), event.rank),
            (runs.setdefault(event.run, _make("run", config)), RUN_WIDE),
        ):
            for det in dets:
                found += [(event.run, rank if f.rank is None else f.rank, f) for f in det.observe(event, attempt)]
    return found


def _make(scope: str, config: DetectorsConfig) -> list[Detector]:
    return [cls(getattr(config, cls.kind)) for cls in ALL_DETECTORS if cls.scope == scope]


@functools.cache
def _traces() -> list[list[Event]]:
    synthetic = _synthetic()
    traces = synthetic.fault_traces(1) + synthetic.clean_controls(5)
    out = []
    for trace in traces:
        events = [validate_event(e) for e in trace.events]
        # heartbeats and stacks between the steps: kinds most detectors do not read
        mixed = []
        for e in events:
            mixed.append(e)
            if e.kind == "step" and e.fields["step"] % 7 == 3:
                mixed.append(_ev("heartbeat", {"step": e.fields["step"]}, e.time + 0.01, e.rank, e.run))
            if e.kind == "step" and e.fields["step"] % 97 == 5:
                stack = {"frames": [{"file": "train.py", "line": 1, "function": "step"}]}
                fields = {"reason": "slow", "step": e.fields["step"], "stack": stack}
                mixed.append(_ev("stack", fields, e.time + 0.02, e.rank, e.run))
        out.append(mixed)
    return out


@pytest.mark.parametrize("index", range(len(_traces())))
def test_routing_by_kind_finds_what_every_detector_fed_every_event_finds(index: int) -> None:
    events = _traces()[index]
    items = [(e, 0) for e in events]
    routed = Detection(DetectorsConfig()).observe(items)
    assert routed == _every_event_to_every_detector(items)
    assert any(e.kind not in ("step", "run_start") for e in events)


class _Evals(Detector):
    """Reads eval events only, and says so."""

    kind = "eval_regression"  # borrows a configured kind's section
    consumes = frozenset({"eval"})

    def __init__(self, config: object) -> None:
        self.seen: list[str] = []

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        self.seen.append(event.kind)
        return []


class _Everything(_Evals):
    kind = "degenerate"
    consumes = None


class _Fails(_Evals):
    """Raises on rank 1's first step: dropped for that rank only."""

    kind = "divergence"
    consumes = frozenset({"step", "eval"})

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "step" and event.rank == 1:
            raise RuntimeError("broken")
        self.seen.append(event.kind)
        return [Finding(self.kind, "warning", event.fields.get("step"), "seen", "")] if event.kind == "eval" else []


def _mixed(ranks: int = 2) -> list[tuple[Event, int]]:
    items = []
    for r in range(ranks):
        items.append((_ev("run_start", {}, 0.0, r), 0))
    for i in range(3):
        for r in range(ranks):
            items.append((_ev("step", {"step": i}, 1.0 + i, r), 0))
            items.append((_ev("heartbeat", {"step": i}, 1.5 + i, r), 0))
            items.append((_ev("eval", {"step": i, "loss": 1.0}, 1.6 + i, r), 0))
    return items


def test_a_detector_gets_only_the_kinds_it_declares_and_by_default_every_kind() -> None:
    detection = Detection(DetectorsConfig(), (_Evals, _Everything))
    detection.observe(_mixed(1))
    evals, everything = detection.rank_dets[("run", 0)].dets
    assert isinstance(evals, _Evals) and evals.seen == ["eval"] * 3
    assert everything.seen == ["run_start"] + ["step", "heartbeat", "eval"] * 3


def test_a_detector_that_raises_is_dropped_for_its_rank_and_the_others_still_get_their_events() -> None:
    detection = Detection(DetectorsConfig(), (_Evals, _Fails))
    found = detection.observe(_mixed(2))
    rank0, rank1 = detection.rank_dets[("run", 0)].dets, detection.rank_dets[("run", 1)].dets
    assert [type(d) for d in rank0] == [_Evals, _Fails] and [type(d) for d in rank1] == [_Evals]
    assert rank0[1].seen == ["step", "eval"] * 3
    assert rank1[0].seen == ["eval"] * 3  # its eval detector was not dropped with the broken one
    assert [(rank, f.step) for _, rank, f in found] == [(0, 0), (0, 1), (0, 2)]
