"""Every detector, whatever it watches, survives the streams real collectors see."""

from __future__ import annotations

import math
import tracemalloc

import pytest

from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, SEVERITIES, Detector, Finding
from trainmon.wire import Event


def _ev(kind: str, fields: dict, t: float, rank: int = 0) -> Event:
    return Event(kind, "run", rank, "host", f"s{rank}", 0, t, fields)


def _steps(n: int, loss, *, ranks: int = 1, t0: float = 1e9):
    yield _ev("run_start", {"world_size": ranks, "vocab_size": 64, "planned_steps": n}, t0)
    for i in range(n):
        for r in range(ranks):
            v = loss(i)
            yield _ev(
                "step",
                {
                    "step": i,
                    "loss": v,
                    "grad_norm": v,
                    "grad_norm_clipped": min(v, 1.0) if v == v else v,
                    "lr": [1e-3],
                    "tokens": 512,
                    "step_time": 0.1,
                    "phases": {"forward": 0.05, "backward": 0.05},
                },
                t0 + 0.1 * (i + 1),
                rank=r,
            )


def _build(cls: type[Detector]) -> Detector:
    return cls(getattr(DetectorsConfig(), cls.kind))


def _check(findings: list[Finding], cls: type[Detector]) -> None:
    for f in findings:
        assert f.kind == cls.kind and f.severity in SEVERITIES and f.message and f.hint


@pytest.mark.parametrize("cls", ALL_DETECTORS, ids=lambda c: c.kind)
def test_builds_with_defaults_and_handles_empty_streams(cls: type[Detector]) -> None:
    det = _build(cls)
    assert det.tick(1e9) == []
    assert cls.scope in ("rank", "run")


@pytest.mark.parametrize("cls", ALL_DETECTORS, ids=lambda c: c.kind)
@pytest.mark.parametrize(
    "loss",
    [
        lambda i: 2.0,
        lambda i: math.nan,
        lambda i: math.inf if i % 7 == 0 else math.nan,
        lambda i: 0.0,
        lambda i: 1e30 if i % 2 else 1e-30,
    ],
    ids=["constant", "all-nan", "nan-and-inf", "zero", "wild"],
)
def test_survives_degenerate_streams(cls: type[Detector], loss) -> None:
    det = _build(cls)
    for ev in _steps(300, loss, ranks=2):
        _check(det.observe(ev, 0), cls)
    _check(det.tick(1e9 + 1e6), cls)


@pytest.mark.parametrize("cls", ALL_DETECTORS, ids=lambda c: c.kind)
def test_state_stays_bounded_on_very_long_streams(cls: type[Detector]) -> None:
    det = _build(cls)
    stream = _steps(60_000, lambda i: 3.0 + 0.1 * math.sin(i / 50))
    for _, ev in zip(range(10_000), stream, strict=False):
        det.observe(ev, 0)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for ev in stream:
        det.observe(ev, 0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 256 * 1024, f"{cls.kind} grew {grown} bytes over 50k steps"
