"""Megatron-LM / Megatron-DeepSpeed stdout: values that are data, not errors, and how a run ended.

Each test writes a small log in the shape of a real one (96-100 in ``/work/shared/real-logs``) and
checks what the importer makes of it and what the post-mortem then says: placeholders printed for a
feature that is off never reach the detectors, skipped intervals are skipped (not NaN), a run that
never applied an update says so, and Ctrl-C is an interruption, not a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import read_events
from trainmon.monitor.store.storage import Storage


def _args(**extra: Any) -> str:
    args = {
        "fp16": True,
        "bf16": False,
        "log_interval": 1,
        "lr": 0.00015,
        "loss_scale": None,
        "initial_loss_scale": 4294967296,
        "seq_length": 1024,
        "train_iters": 1000,
        **extra,
    }
    body = "".join(f"  {k} {'.' * (40 - len(k))} {v}\n" for k, v in args.items())
    return f"------------------------ arguments ------------------------\n{body}" + (
        "-------------------- end of arguments ---------------------\n"
    )


def _line(it: int, **parts: Any) -> str:
    fields = {
        "consumed samples": it * 1024,
        "elapsed time per iteration (ms)": "125536.8",
        "learning rate": f"{1.875e-5 * min(it, 8):.3E}",
        "global batch size": 1024,
        **parts,
    }
    text = "".join(f" {k}: {v} |" for k, v in fields.items() if v is not None)
    return f" iteration {it:8d}/    1000 |{text}\n"


def _losses(n: int) -> list[float]:
    return [12.44 - 0.1 * k for k in range(n)]


def _analyse(path: Path) -> dict[str, Any]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    return summarize(storage, run)


def _steps(path: Path) -> list[dict[str, Any]]:
    return [e.fields for e in read_events(path) if e.kind == "step"]


def _config(path: Path) -> dict[str, Any]:
    return next(e for e in read_events(path) if e.kind == "run_start").fields["config"]


def test_deepspeed_engine_placeholders_are_not_data(tmp_path: Path) -> None:
    """98: under the DeepSpeed engine every line prints ``lm-loss``, ``loss scale: -1.0`` and
    ``grad norm: 0.000``: the loss is read from the hyphenated key, the two placeholders are dropped
    (a -1 scale was a critical loss_scale_collapse 'scale -1 < 1' at iteration 1)."""
    path = tmp_path / "ds-on.out"
    text = _args(loss_scale=12.0, deepspeed=True)
    for it, loss in enumerate(_losses(20), 1):
        text += _line(
            it,
            **{"lm-loss": f"{loss:.6E}", "loss scale": "-1.0", "grad norm": "0.000", "num zeros": "0.0"},
            **{"number of skipped iterations": "  0", "number of nan iterations": "  0"},
        )
    path.write_text(text)
    steps = _steps(path)
    assert [s["loss"] for s in steps] == pytest.approx(_losses(20))
    assert not any("loss_scale" in s or "grad_norm" in s for s in steps)
    cfg = _config(path)
    assert cfg["loss_scale_placeholder"] == -1.0 and cfg["grad_norm_placeholder"] == 0.0
    assert "grad_norm" in cfg["missing_signals"]
    assert [a for a in _analyse(path)["anomalies"] if a["kind"] == "loss_scale_collapse"] == []


def test_a_zero_grad_norm_among_real_ones_is_data(tmp_path: Path) -> None:
    path = tmp_path / "zero-once.out"
    norms = ["1.500", "0.000", "1.200", "1.100"]
    path.write_text(
        _args() + "".join(_line(k + 1, **{"lm loss": f"{9 - k}.0", "grad norm": g}) for k, g in enumerate(norms))
    )
    assert [s["grad_norm"] for s in _steps(path)] == [1.5, 0.0, 1.2, 1.1]


def test_a_static_loss_scale_is_configuration(tmp_path: Path) -> None:
    """97: ``--loss-scale 12`` prints a constant 12.0: configuration, not a dynamic scaler's state."""
    path = tmp_path / "ds-off.out"
    lines = "".join(
        _line(it, **{"lm loss": f"{loss:.6E}", "loss scale": "12.0", "grad norm": "7.900"})
        for it, loss in enumerate(_losses(10), 1)
    )
    path.write_text(_args(loss_scale=12.0) + lines)
    assert not any("loss_scale" in s for s in _steps(path))
    assert _config(path)["static_loss_scale"] == 12.0


def test_hyphenated_tag_names(tmp_path: Path) -> None:
    """The TensorBoard spellings some forks print on stdout: lm-loss, grad-norm, learning-rate, iteration-time."""
    path = tmp_path / "fork.out"
    lines = [
        f" iteration {it:8d}/ 1000 | lm-loss: {loss} | grad-norm: {gn} | learning-rate: {lr} | iteration-time: 1.5 |\n"
        for it, loss, gn, lr in ((1, 9.5, 2.5, "1.0E-04"), (2, 9.0, 2.0, "2.0E-04"))
    ]
    path.write_text(_args() + "".join(lines))
    first = _steps(path)[0]
    assert (first["loss"], first["grad_norm"], first["lr"], first["step_time"]) == (9.5, 2.5, [1e-4], 1.5)


def test_skipped_intervals_and_the_startup_search_from_2_32(tmp_path: Path) -> None:
    """96: one line per 10 iterations; iteration 10's interval was skipped entirely (no lm loss, no grad
    norm, 'number of nan iterations: 0'): a skipped step without a loss, not NaN. The scale halving
    2^32 -> 8388608 -> 32768 -> 16384 while skips stop is the scaler's start-up search, not a collapse."""
    path = tmp_path / "n8.out"
    rows = [
        (10, None, "8388608.0", None, 10),
        (20, "1.210588E+01", "32768.0", None, 8),
        (30, "2.648119E+01", "16384.0", "67.033", 1),
        *[(it, f"{8.5 - it / 1000:.6E}", "16384.0", "3.500", 0) for it in range(40, 210, 10)],
    ]
    text = _args(log_interval=10)
    for it, loss, scale, gn, skipped in rows:
        text += _line(
            it,
            **{"lm loss": loss, "loss scale": scale, "grad norm": gn},
            **{"number of skipped iterations": skipped, "number of nan iterations": 0},
        )
    path.write_text(text)
    steps = _steps(path)
    assert "loss" not in steps[0] and steps[0]["skipped"] is True
    assert "skipped" not in steps[1] and steps[1]["loss"] == pytest.approx(12.10588)  # 2 of 10 applied
    notes = " ".join(_config(path)["notes"])
    assert "1 logged lines print no loss because every iteration in them was skipped" in notes
    s = _analyse(path)
    assert [a for a in s["anomalies"] if a["kind"] in ("loss_scale_collapse", "nan_inf")] == []


def test_a_run_whose_every_iteration_was_skipped_never_trained(tmp_path: Path) -> None:
    """99: four iterations, each skipped by the fp16 scaler (no loss, no grad norm, LR 0): the run never
    trained. Said in the config and notes, and as one warning, not as a collapsed scale of 5e8."""
    path = tmp_path / "n16.out"
    text = _args()
    for it in range(1, 5):
        text += _line(
            it,
            **{"learning rate": "0.000E+00", "loss scale": f"{2.0 ** (33 - it):.1f}"},
            **{"number of skipped iterations": 1, "number of nan iterations": 0},
        )
    text += "slurmstepd: error: *** JOB 1999618 ON r6i4n5 CANCELLED AT 2021-05-27T21:52:36 DUE TO TIME LIMIT ***\n"
    path.write_text(text)
    steps = _steps(path)
    assert all(s["skipped"] is True and "loss" not in s for s in steps)
    cfg = _config(path)
    assert cfg["never_trained"] is True and any("never trained" in n for n in cfg["notes"])
    s = _analyse(path)
    assert s["status"] == "interrupted" and s["final_loss"] is None
    (finding,) = [a for a in s["anomalies"] if a["kind"] == "loss_scale_collapse"]
    assert finding["severity"] == "warning" and (finding["first_step"], finding["last_step"]) == (1, 4)
    assert "every step skipped" in finding["message"] and "collaps" not in finding["message"]


def test_ctrl_c_is_an_interruption_not_a_crash(tmp_path: Path) -> None:
    """100: the file ends in KeyboardInterrupt tracebacks from every rank and the launcher's SIGTERM."""
    path = tmp_path / "ctrlc.log"
    text = _args() + "".join(_line(it, **{"lm loss": f"{10 - it / 10:.6E}"}) for it in range(1, 6))
    trace = 'Traceback (most recent call last):\n  File "pretrain_gpt.py", line 1, in <module>\nKeyboardInterrupt\n'
    text += trace * 4
    text += "[2022-10-29 00:11:52,534] [INFO] [launch.py:295:sigkill_handler] Main process received SIGTERM, exiting\n"
    path.write_text(text)
    cfg = _config(path)
    assert cfg["ended_by"] == "keyboard_interrupt" and any("stopped by hand" in n for n in cfg["notes"])
    s = _analyse(path)
    assert s["status"] == "interrupted"
    assert [a for a in s["anomalies"] if a["severity"] != "info"] == []


def test_ctrl_c_after_the_last_planned_iteration_leaves_a_finished_run_finished(tmp_path: Path) -> None:
    path = tmp_path / "done.log"
    lines = "".join(
        f" iteration {it:8d}/{3:8d} | lm loss: {10 - it:.6E} | elapsed time per iteration (ms): 10.0 |\n"
        for it in range(1, 4)
    )
    path.write_text(_args(train_iters=3) + lines + "KeyboardInterrupt\n")
    assert "ended_by" not in _config(path)
    assert next(e for e in read_events(path) if e.kind == "run_end").fields["status"] == "finished"


def _crash(tail: str) -> str:
    text = _args() + "".join(_line(it, **{"lm loss": f"{10 - it / 10:.6E}"}) for it in range(1, 6))
    text += '[rank3]: Traceback (most recent call last):\n[rank3]:   File "pretrain_gpt.py", line 9, in <module>\n'
    text += "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    return text + "[rank5]: RuntimeError: NCCL communicator was aborted on rank 5.\n" + tail


def test_a_traceback_after_the_last_iteration_is_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "oom.log"
    path.write_text(_crash("[INFO] [launch.py:319:sigkill_handler] ... exits with return code = 1\n"))
    cfg = _config(path)
    assert cfg["end_error"] == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert next(e for e in read_events(path) if e.kind == "run_end").fields["status"] == "failed"
    # a scheduler's kill explains the tracebacks: interrupted, not a crash
    path.write_text(
        _crash("slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2021-05-27T21:52:36 DUE TO TIME LIMIT ***\n")
    )
    assert next(e for e in read_events(path) if e.kind == "run_end").fields["status"] == "interrupted"
    # a traceback followed by more iterations did not end the run
    path.write_text(_crash("") + _line(6, **{"lm loss": "9.0"}))
    assert next(e for e in read_events(path) if e.kind == "run_end").fields["status"] == "interrupted"
    assert "end_error" not in _config(path)


def test_world_size_from_the_argument_dump_keeps_the_jobs_token_totals(tmp_path: Path) -> None:
    """97-99 ran on 64 GPUs ('world size 1' in the report before): the dump's world_size is the job's,
    and each iteration's global tokens are stored as one rank's share, so totals stay the job's."""
    path = tmp_path / "n16.out"
    lines = "".join(_line(it, **{"lm loss": f"{10 - it / 10:.6E}"}) for it in range(1, 5))
    path.write_text(_args(world_size=64) + lines)
    start = next(e for e in read_events(path) if e.kind == "run_start")
    assert start.fields["world_size"] == 64
    assert {s["tokens"] for s in _steps(path)} == {1024 * 1024 // 64}
    s = _analyse(path)
    assert s["world_size"] == 64 and s["tokens"] == 4 * 1024 * 1024
