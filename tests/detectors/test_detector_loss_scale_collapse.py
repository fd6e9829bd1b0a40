"""loss_scale_collapse: repeated halvings, skip storms, a scale under 1; calibration is ignored."""

from __future__ import annotations

from pathlib import Path

from tests.detectors.helpers import ev, feed, run_reference, start
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors.loss_scale_collapse import LossScaleCollapse
from trainmon.wire import Event


def _steps(scales, skips=None, first=0) -> list[Event]:
    evs = [start()]
    for i, s in enumerate(scales):
        f = {"step": first + i, "loss": 2.0, "loss_scale": s}
        if skips is not None:
            f["skipped"] = skips[i]
        evs.append(ev("step", f, float(i)))
    return evs


def _det() -> LossScaleCollapse:
    return LossScaleCollapse(DetectorsConfig().loss_scale_collapse)


def _halving_run(at: list[int], n: int = 300, s0: float = 65536.0) -> tuple[list[float], list[bool]]:
    scales, skips, s = [], [], s0
    for t in range(n):
        skip = t in at
        if skip:
            s /= 2
        scales.append(s)
        skips.append(skip)
    return scales, skips


def test_repeated_halvings_warn() -> None:
    scales, skips = _halving_run([150, 160, 175])
    found = feed(_det(), _steps(scales, skips))
    assert (found[0].step, found[0].severity) == (175, "warning") and "overflow" in found[0].hint
    assert found[-1].resolved and found[-1].step == 275


def test_consecutive_skips_and_tiny_scale_are_critical() -> None:
    scales, skips = _halving_run(list(range(100, 120)), n=200, s0=1024.0)
    found = feed(_det(), _steps(scales, skips))
    assert found[0].step == 102 and found[0].severity == "warning"
    assert found[1].step == 104 and found[1].severity == "critical"


def test_without_skipped_field_uses_scale_decreases() -> None:
    scales, _ = _halving_run([50, 55, 60])
    found = feed(_det(), _steps(scales))
    assert found[0].step == 60


def test_startup_calibration_is_not_a_collapse() -> None:
    scales, skips = _halving_run([*range(20), 40], s0=2.0**40)
    assert feed(_det(), _steps(scales, skips)) == []


def test_a_non_positive_scale_is_a_placeholder_not_a_collapse() -> None:
    """Megatron-DeepSpeed under the DeepSpeed engine prints 'loss scale: -1.0' on every line: no scaler of
    its own (was critical 'scale -1 < 1' at the first step)."""
    assert feed(_det(), [*_steps([-1.0] * 50, [False] * 50), ev("run_end", {"status": "finished"}, 50.0)]) == []


def test_a_run_ending_before_any_applied_step_never_trained() -> None:
    """Every step skipped while the scale searched down from 2^32 (5e8 is not collapsed): one warning at
    the end, from the first skipped step to the last, saying every step was skipped."""
    scales = [2.0**32 / 2**k for k in range(4)]
    found = feed(_det(), [*_steps(scales, [True] * 4, first=1), ev("run_end", {"status": "interrupted"}, 5.0)])
    assert [(f.step, f.severity) for f in found] == [(1, "warning"), (4, "warning")]
    assert "every step skipped" in found[0].message and "collaps" not in found[0].message


def test_a_search_below_the_minimum_scale_is_not_calibration() -> None:
    """The start-up search halves once per skipped step; one that goes under min_scale before any step
    was applied is an underflow, flagged where it happens."""
    scales = [2.0**4 / 2**k for k in range(8)]
    found = feed(_det(), _steps(scales, [True] * 8))
    assert found and (found[0].step, found[0].severity) == (5, "critical")


def test_occasional_overflow_is_silent() -> None:
    scales, skips = _halving_run([100, 400, 700], n=1000)
    assert feed(_det(), _steps(scales, skips)) == []


def test_reference_trainer(tmp_path: Path) -> None:
    anomalies, _ = run_reference(tmp_path, "ws16", "--precision", "fp16", "--inject", "weight_scale@40", steps=60)
    hits = [a for a in anomalies if a["kind"] == "loss_scale_collapse"]
    assert hits and 40 <= hits[0]["first_step"] <= 50, anomalies  # within a few overflow-skip windows
    anomalies, _ = run_reference(tmp_path, "clean16", "--precision", "fp16", "--init-scale", "1e9", steps=60)
    assert [a for a in anomalies if a["kind"] == "loss_scale_collapse"] == []


def _logged(points: list[tuple[int, float, bool]]) -> list[Event]:
    """Steps logged every few steps: (step, scale, the whole interval skipped)."""
    evs = [start()]
    for i, (step, scale, skip) in enumerate(points):
        evs.append(ev("step", {"step": step, "loss": 2.0, "loss_scale": scale, "skipped": skip}, float(i)))
    return evs


def test_a_regrow_and_halve_sawtooth_logged_every_ten_steps_is_routine() -> None:
    """DeepSpeed-Chat (real log 106): the scale regrows to 65536 and the next overflow halves it back, again and
    again; logged every 10 steps, three halvings fell within 100 *logged lines* (1,000 steps) and warned."""
    points, scale = [], 65536.0
    for step in range(10, 8000, 10):
        cycle = step % 300
        halve = cycle == 0
        scale = 32768.0 if halve else (65536.0 if cycle == 150 else scale)
        points.append((step, scale, halve))
    assert feed(_det(), _logged(points)) == []


def test_a_fall_to_a_low_scale_warns_then_resolves_while_the_sawtooth_goes_on() -> None:
    """DeepSpeed-Chat reward model (real log 107): 512 -> 8 over steps 480-560, then doubling back and a
    1024-4096 oscillation: one warning at the third power of two down, resolved once it stopped falling."""
    points, scale = [], 512.0
    falls = {480: 64.0, 490: 32.0, 550: 16.0, 560: 8.0}
    for step in range(10, 2000, 10):
        if step in (460, 470):
            scale /= 2
        scale = falls.get(step, scale)
        if step > 560 and step % 100 == 0 and scale < 4096:
            scale *= 2
        if step > 1500 and step % 50 == 0:
            scale = 1024.0 if scale == 4096.0 else 4096.0
        points.append((step, scale, step in falls or step in (460, 470)))
    found = feed(_det(), _logged(points))
    assert [(f.step, f.severity, f.resolved) for f in found][:1] == [(480, "warning", False)]
    assert found[-1].resolved and 560 < found[-1].step <= 700, [(f.step, f.resolved) for f in found]
