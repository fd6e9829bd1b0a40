"""torchtitan stdout, from lines written out of its own logging code (there is no torchtitan log among the
real logs): ``components/metrics.py`` (``MetricsProcessor.log`` and ``log_validation``), ``train.py``
(``Trainer is initialized with ...``, ``Training starts at step N.``, ``Training completed``),
``components/checkpoint.py`` (``Loading the checkpoint at step N.``), ``tools/logging.py`` (the
``[titan] <asctime> - root - INFO -`` prefix) and ``tools/utils.py`` (the ``Color`` codes), behind
torchrun's ``[rank0]:`` as ``run_train.sh`` tees it.
"""

from __future__ import annotations

import calendar
import time
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.importers import detect_format, read_events
from trainmon.monitor.importers.torchtitan import looks_like_torchtitan, parse_torchtitan
from trainmon.wire import Event

RED, GREEN, YELLOW, BLUE, MAGENTA, CYAN, RESET = (f"\033[{c}m" for c in (31, 32, 33, 34, 35, 36, 39))
ORANGE, TURQUOISE = "\033[38;2;180;60;0m", "\033[38;2;54;234;195m"
T0 = float(calendar.timegm(time.strptime("2025-06-10 09:00:00", "%Y-%m-%d %H:%M:%S")))
STEP_S = 1.5


def _stamp(t: float) -> str:
    whole = int(t)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(whole)) + f",{round((t - whole) * 1000):03d}"


def _line(t: float, msg: str, rank: int | None = 0) -> str:
    return (f"[rank{rank}]:" if rank is not None else "") + f"[titan] {_stamp(t)} - root - INFO - {msg}\n"


def _metrics(step: int, loss: float, color: bool = True) -> str:
    c = dict(red=RED, green=GREEN, orange=ORANGE, turquoise=TURQUOISE, blue=BLUE, cyan=CYAN, magenta=MAGENTA)
    if not color:
        c = dict.fromkeys(c, "")
    end = RESET if color else ""
    return (
        f"{c['red']}step: {step:2}  {c['green']}loss: {loss:7.4f}  {c['orange']}grad_norm: {0.5 + 0.01 * step:7.4f}  "
        f"{c['turquoise']}memory: {45.67:5.2f}GiB(57.71%)  {c['blue']}tps: {round(5461.3):,}  "
        f"{c['cyan']}tflops: {316.25:,.2f}  {c['magenta']}mfu: {31.98:.2f}%{end}"
    )


def _launch(t: float, start: int = 1, loaded: int | None = None, rank: int | None = 0) -> tuple[str, float]:
    text = _line(t, "Starting job: Llama 3 8B training", rank)
    text += _line(t + 5, f"{BLUE}Model llama3 8B {RED}size: 8,030,261,248 total parameters{RESET}", rank)
    text += _line(
        t + 10,
        "Trainer is initialized with local batch size 1, global batch size 8, gradient accumulation steps 1, "
        "sequence length 8192, total steps 100 (warmup 20).",
        rank,
    )
    if loaded is not None:
        text += _line(t + 11, f"Loading the checkpoint at step {loaded}.", rank)
        text += _line(t + 14, "Finished loading the checkpoint in 3.21 seconds.", rank)
    text += _line(t + 15, f"Training starts at step {start}.", rank)
    return text, t + 15


def _train(t: float, first: int, last: int, *, color: bool = True, val_every: int = 50, rank: int | None = 0) -> str:
    """Step lines for step 1 and every 10th step from ``first`` to ``last`` (inclusive), each step STEP_S seconds;
    a validation after every ``val_every``-th step and a checkpoint save after step 50 (30 s each)."""
    text = ""
    prev = first - 1
    for step in range(first, last + 1):
        t += STEP_S
        if step == 1 or step % 10 == 0:
            text += _line(t, _metrics(step, 10.0 - 0.05 * step, color), rank)
        if step % val_every == 0:
            t += 30
            text += _line(
                t,
                f"{YELLOW}validate step: {step:2}  {GREEN}loss: {9.0 - 0.04 * step:7.4f}  "
                f"{TURQUOISE}memory: 45.67GiB(57.71%)  {BLUE}tps: 9,876{RESET}",
                rank,
            )
        if step == 50:
            text += _line(t, "Saving the checkpoint (or staging if async is enabled).", rank)
            t += 30
            text += _line(t, "Finished saving the checkpoint (or staging if async is enabled)in 30.00 seconds.", rank)
        prev = step
    assert prev == last
    return text


def _complete(t: float, rank: int | None = 0) -> str:
    return _line(t, "Sleeping 2 seconds for other ranks to complete", rank) + _line(t + 2, "Training completed", rank)


def _write(tmp_path: Path, text: str, name: str = "titan.log") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _steps(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "step"]


def _starts(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "run_start"]


@pytest.mark.parametrize("color", [True, False])
def test_values_as_torchtitan_prints_them(tmp_path: Path, color: bool) -> None:
    head, t = _launch(T0)
    path = _write(tmp_path, head + _train(t, 1, 100, color=color) + _complete(T0 + 10_000))
    assert detect_format(path) == "textlog"
    events = list(read_events(path))
    (start,) = _starts(events)
    cfg = start["config"]
    assert start["framework"] == "torchtitan" and start["planned_steps"] == 100 and start["resumed"] is False
    assert cfg["format"] == "torchtitan_stdout" and cfg["step_base"] == 1 and cfg["synthetic_time"] is False
    assert "lr" in cfg["missing_signals"] and "grad_norm" not in cfg["missing_signals"]
    assert cfg["n_params"] == 8_030_261_248 and cfg["tokens_per_step"] == 8 * 8192 and cfg["log_interval_steps"] == 10
    assert "loss_mean_over_steps" not in cfg  # the logged step's own loss
    steps = _steps(events)
    assert [s["step"] for s in steps] == [1, *range(10, 101, 10)]
    assert steps[1]["loss"] == pytest.approx(9.5) and steps[1]["grad_norm"] == pytest.approx(0.6)
    assert steps[1]["tokens"] == 65536
    assert "step_time" not in steps[0]  # no line before step 1
    assert steps[1]["step_time"] == pytest.approx(STEP_S, abs=1e-3)  # (t10 - t1) / 9
    # a validation and a checkpoint save fall between steps 50 and 60: that interval is not the steps' time
    assert "step_time" not in steps[6] and steps[7]["step_time"] == pytest.approx(STEP_S, abs=1e-3)
    assert next(e.time for e in events if e.kind == "step") == pytest.approx(T0 + 15 + STEP_S, abs=1e-3)
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [(ev["step"], ev["loss"]) for ev in evals] == [(50, pytest.approx(7.0)), (100, pytest.approx(5.0))]
    assert events[-1].fields == {"status": "finished", "step": 100}


def test_a_resume_from_a_checkpoint_is_an_attempt(tmp_path: Path) -> None:
    """The first launch dies after step 60 (checkpoint at 50); the second loads it and prints 'Training
    starts at step 51.': one run, two attempts, the replayed steps 51-60 read as the second attempt's."""
    head, t = _launch(T0)
    first = head + _train(t, 1, 60)
    head2, t2 = _launch(T0 + 5_000, start=51, loaded=50)
    path = _write(tmp_path, first + head2 + _train(t2, 51, 100) + _complete(T0 + 9_000))
    events = list(read_events(path))
    assert len({e.run for e in events}) == 1
    starts = _starts(events)
    assert [s["resumed"] for s in starts] == [False, True]
    assert starts[1]["config"]["resumed_after_step"] == 50
    assert "Training starts at step 51" in starts[1]["config"]["attempt_inferred_from"]
    assert events[-1].fields["status"] == "finished"


def test_a_log_that_starts_at_a_resume_says_so(tmp_path: Path) -> None:
    head, t = _launch(T0, start=51, loaded=50)
    events = list(read_events(_write(tmp_path, head + _train(t, 51, 100) + _complete(T0 + 9_000))))
    (start,) = _starts(events)
    assert start["resumed"] is True and start["config"]["resumed_after_step"] == 50


def test_a_relaunch_from_step_one_is_a_separate_run(tmp_path: Path) -> None:
    head, t = _launch(T0)
    head2, t2 = _launch(T0 + 5_000)
    text = head + _train(t, 1, 30) + head2 + _train(t2, 1, 100) + _complete(T0 + 9_000)
    events = list(read_events(_write(tmp_path, text)))
    runs = list(dict.fromkeys(e.run for e in events))
    assert runs == ["titan-launch1", "titan-launch2"]
    assert all(s["resumed"] is False for s in _starts(events))
    ends = {e.run: e.fields["status"] for e in events if e.kind == "run_end"}
    assert ends == {"titan-launch1": "interrupted", "titan-launch2": "finished"}


def test_pipeline_placeholder_losses_and_several_ranks(tmp_path: Path) -> None:
    """LOG_RANK=0,4 with two pipeline stages: rank 0 prints loss -1.0 (no last stage), rank 4 the loss."""
    head, t = _launch(T0, rank=0)
    rank0 = head + _train(t, 1, 40, rank=0).replace("loss: ", "loss: -1.0000 x") + _complete(T0 + 900, rank=0)
    rank4 = _train(t, 1, 40, rank=4)
    lines = sorted((rank0 + rank4).splitlines(keepends=True), key=lambda ln: ln.split("[titan] ")[1][:23])
    items, meta = parse_torchtitan(_write(tmp_path, "".join(lines)))
    steps = [it for it in items if type(it).__name__ == "TrainPoint"]
    assert [s.step for s in steps] == [1, 10, 20, 30, 40] and steps[1].loss == pytest.approx(9.5)
    assert any("rank 4" in n for n in meta.notes)


def test_a_2024_build_logs_the_interval_mean(tmp_path: Path) -> None:
    """``wps`` and no ``grad_norm``: the loss is the mean of the losses since the previous line."""
    head, t = _launch(T0)
    old = _train(t, 1, 40).replace("tps:", "wps:")
    old = "".join(
        ln.split(f"{ORANGE}grad_norm")[0] + ln[ln.find(TURQUOISE) :] if ORANGE in ln else ln
        for ln in old.splitlines(keepends=True)
    )
    _, meta = parse_torchtitan(_write(tmp_path, head + old))
    assert meta.loss_mean_over == 10.0 and meta.status == "interrupted"
    assert any("mean over the steps since the previous line" in n for n in meta.notes)


def test_a_crash_after_the_last_step_is_a_failure(tmp_path: Path) -> None:
    head, t = _launch(T0)
    text = head + _train(t, 1, 40) + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    _, meta = parse_torchtitan(_write(tmp_path, text))
    assert meta.status == "failed" and "OutOfMemoryError" in meta.config["failure"]["error"]


def test_only_torchtitan_lines_are_recognised() -> None:
    assert looks_like_torchtitan(_line(T0, _metrics(10, 9.5)))
    assert looks_like_torchtitan(_metrics(10, 9.5, color=False))
    assert not looks_like_torchtitan("step 00042/21400 (0.20%) | loss: 5.47 | lrm: 1.00 | dt: 1142.98ms\n")
    assert not looks_like_torchtitan(_line(T0, "validate step: 10  loss:  8.1234  memory: 45.67GiB(57.71%)"))


def test_every_step_is_read_once_when_torchrun_tees_several_ranks(tmp_path: Path) -> None:
    """``torchrun --tee 3`` without ``--role`` prefixes ``[default0]:``, ``[default1]:``: the same step twice."""
    head, t = _launch(T0)
    one = head + _train(t, 1, 40)
    both = "".join(ln.replace("[rank0]:", f"[default{r}]:") for ln in one.splitlines(keepends=True) for r in (0, 1))
    items, meta = parse_torchtitan(_write(tmp_path, both))
    assert [it.step for it in items if type(it).__name__ == "TrainPoint"] == [1, 10, 20, 30, 40]
    assert any("ranks [0, 1]" in n for n in meta.notes)


def test_a_2024_build_states_its_sizes_on_the_start_line(tmp_path: Path) -> None:
    start = _line(
        T0,
        "Training starts at step 1, with local batch size 8, global batch size 64, sequence length 2048, "
        "total steps 40 (warmup 10)",
    )
    items, meta = parse_torchtitan(_write(tmp_path, start + _train(T0, 1, 40)))
    assert meta.planned_steps == 40 and meta.config["tokens_per_step"] == 64 * 2048 and meta.status == "finished"
    assert all(it.tokens == 64 * 2048 for it in items if type(it).__name__ == "TrainPoint")
