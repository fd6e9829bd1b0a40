"""nanochat stdout: a pipeline's stages are separate runs, a relaunch is an attempt only with a resume
line, failed launches are named without being read as a crash, and the terminal's residue is read through.

Small inline logs written in nanochat's own line formats (``scripts/base_train.py``, ``mid_train.py``,
``chat_sft.py``) check each class; the real logs (101-104, 110) are checked against their manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import read_events
from trainmon.monitor.importers.nanochat import parse_nanochat
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

LOGS = Path(__file__).resolve().parents[3] / "shared" / "real-logs"
_MANIFEST_FILE = LOGS / "manifest.json"
MANIFEST = {m["file"]: m for m in json.loads(_MANIFEST_FILE.read_text())} if _MANIFEST_FILE.is_file() else {}
needs_logs = pytest.mark.skipif(not MANIFEST, reason=f"{LOGS} (the real logs and their manifest) is not available")

_LOG = "2025-10-16 {t} - nanochat.{who} - \x1b[32m\x1b[1mINFO\x1b[0m - {what}\n"


def _world(t: str) -> str:
    """The line a launch opens with (nanochat's ``common`` logger)."""
    return _LOG.format(t=t, who="common", what="Distributed world size: 8")


def _loading(t: str, stage: str, step: int) -> str:
    """A stage loading the checkpoint the stage before it saved (mid from base, SFT from mid)."""
    what = f"Loading model from /root/.cache/nanochat/{stage}_checkpoints/d20 with step {step}"
    return _LOG.format(t=t, who="checkpoint_manager", what=what)


def _saved(t: str, stage: str, step: int) -> str:
    """A stage saving its checkpoint at ``step``."""
    what = f"Saved model file to: /root/.cache/nanochat/{stage}_checkpoints/d20/model_{step:06d}.pt"
    return _LOG.format(t=t, who="checkpoint_manager", what=what)


def _ended(minutes: str, bpb: str) -> list[str]:
    """The summary a base or mid stage prints when it finishes."""
    return ["Peak memory usage: 75422.02MiB\n", f"Total training time: {minutes}\n", f"Minimum validation bpb: {bpb}\n"]


def _base(n: int = 4, planned: int = 4, end: bool = True, prefix: str = "", mfu: str = "mfu") -> str:
    rows = [
        _world("17:12:02,081"),
        "Total batch size 524,288 => gradient accumulation steps: 1\n",
        "Step 00000 | Validation bpb: 3.3013\n",
    ]
    for s in range(n):
        rows.append(
            f"{prefix if s == 2 else ''}step {s:05d}/{planned:05d} ({100 * s / planned:.2f}%) | loss: {11.0 - s:.6f} | "
            f"lrm: 1.00 | dt: 500.00ms | tok/sec: 1,048,576 | {mfu}: 48.00 | total time: 0.00m\r\n"
        )
    if end:
        rows.append(f"Step {n:05d} | Validation bpb: 1.2000\n")
        rows.append(f"Step {n:05d} | CORE metric: 0.2000\n")
        rows.append(_saved("17:12:10,000", "base", n))
        rows += _ended("0.03m", "1.2000")
    return "".join(rows)


def _mid(n: int = 3) -> str:
    rows = [
        _world("17:20:00,000"),
        _loading("17:20:00,500", "base", 4),
        "Total batch size 524,288 => gradient accumulation steps: 1\n",
        "Step 00000 | Validation bpb: 0.6886\n",
    ]
    for s in range(1, n + 1):
        rows.append(
            f"step {s:05d} ({100 * s / (n + 1):.2f}%) | loss: {1.3 - 0.01 * s:.6f} | lrm: 1.00 | dt: 400.00ms | "
            f"tok/sec: 1,310,720 | mfu: 50.00 | total time: 0.00m\n"
        )
    rows.append(f"Step {n:05d} | Validation bpb: 0.3954\n")
    rows.append(_saved("17:21:00,000", "mid", n))
    rows += _ended("0.02m", "0.3954")
    return "".join(rows)


def _sft(planned: int = 4) -> str:
    rows = [
        _world("17:30:00,000"),
        _loading("17:30:00,500", "mid", 3),
        "Step 00000 | Validation loss: 1.009291\n",
    ]
    for s in range(planned - 1):
        rows.append(
            f"Step {s:05d}/{planned:05d} | Training loss: {0.8 + 0.1 * s:.6f}| lrm: {1 - s / planned:.6f}| "
            f"num_tokens: {10_000 + s:,}\n"
        )
    rows.append(f"Step {planned - 1:05d} | Validation loss: 1.011768\n")
    rows.append(f"Step {planned - 1:05d} | mmlu_acc: 0.310547, arc_easy_acc: 0.393555\n")
    rows.append(_saved("17:31:00,000", "chatsft", planned - 1))
    return "".join(rows)


def _failed(script: str, error: str) -> str:
    return (
        f"[rank0]: Traceback (most recent call last):\n[rank0]: {error}\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        f"============================================================\n{script} FAILED\n"
        "------------------------------------------------------------\n"
    )


def _write(tmp_path: Path, text: str, name: str = "speedrun.log") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _runs(events: list[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for e in events:
        out.setdefault(e.run, []).append(e)
    return out


def _start(events: list[Event]) -> dict[str, Any]:
    return next(e.fields for e in events if e.kind == "run_start")


def _steps(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "step"]


def test_a_pipeline_is_one_run_per_stage_each_with_its_own_step_base(tmp_path: Path) -> None:
    """base (0-based ``step N/M``), mid (``step N (p%)``, steps done) and chat SFT (``Step N/M | Training
    loss``): three runs named for the checkpoint folder each saves to, none a resume of the one before."""
    runs = _runs(list(read_events(_write(tmp_path, _base() + _mid() + _sft()))))
    assert list(runs) == ["speedrun-base", "speedrun-mid", "speedrun-chatsft"]
    starts = {name: _start(evs) for name, evs in runs.items()}
    assert all(s["resumed"] is False for s in starts.values())
    assert [s["config"]["step_base"] for s in starts.values()] == [0, 1, 0]
    assert [[x["step"] for x in _steps(evs)] for evs in runs.values()] == [[0, 1, 2, 3], [1, 2, 3], [0, 1, 2]]
    assert [evs[-1].fields["status"] for evs in runs.values()] == ["finished", "finished", "finished"]
    assert starts["speedrun-base"]["planned_steps"] == 4 and "planned_steps" not in starts["speedrun-mid"]
    mid = starts["speedrun-mid"]["config"]
    assert mid["initialised_from"] == {"checkpoint": "/root/.cache/nanochat/base_checkpoints/d20", "step": 4}
    assert any("not a resume" in n for n in mid["notes"])
    # the step-0 evaluation printed before each launch's first step is that launch's
    assert [e.fields["loss"] for e in runs["speedrun-mid"] if e.kind == "eval"] == [0.6886, 0.3954]
    sft_evals = [e.fields for e in runs["speedrun-chatsft"] if e.kind == "eval"]
    assert sft_evals[-1]["metrics"] == {"val_loss": 1.011768, "mmlu_acc": 0.310547, "arc_easy_acc": 0.393555}
    # a step event counts one rank's tokens: the job's batch (524,288) and SFT's num_tokens over 8 ranks
    assert _steps(runs["speedrun-base"])[0]["tokens"] == 524_288 // 8
    assert _steps(runs["speedrun-chatsft"])[1]["tokens"] == round(10_001 / 8)


def test_the_smoothed_loss_says_how_many_steps_it_averages(tmp_path: Path) -> None:
    """The EMA (beta 0.9) of base and mid has 1/19 of one step's variance; chat SFT's loss is one step's."""
    runs = _runs(list(read_events(_write(tmp_path, _base() + _mid() + _sft()))))
    cfgs = [_start(evs)["config"] for evs in runs.values()]
    assert [c.get("loss_mean_over_steps") for c in cfgs] == [19.0, 19.0, None]


def test_step_lines_behind_echoed_keystrokes_are_read(tmp_path: Path) -> None:
    """``^[[B^[[B...step 04354/21400``: cursor keys a ``screen`` session echoed in caret notation (101),
    behind a real escape sequence that is not a colour (``ESC[?25l``, hide the cursor)."""
    events = list(read_events(_write(tmp_path, _base(prefix="\x1b[?25l^[[B^[[B^[[A^[[A"))))
    assert [s["step"] for s in _steps(events)] == [0, 1, 2, 3]


def test_a_launch_that_failed_before_its_first_step_is_not_a_crash_of_the_next(tmp_path: Path) -> None:
    """103: the first torchrun dies on every rank before logging a step; the relaunch trains from step 0
    and the log stops at 50% without end lines: one run, interrupted, the failed launch in its notes."""
    text = _failed("scripts.base_train", "torch.AcceleratorError: CUDA error: invalid device ordinal")
    text += _base(n=2, planned=4, end=False)
    events = list(read_events(_write(tmp_path, text)))
    assert len(_runs(events)) == 1
    start = _start(events)
    assert start["resumed"] is False and events[-1].fields["status"] == "interrupted"
    assert start["config"]["failed_launches_before"] == [
        {"script": "scripts.base_train", "error": "torch.AcceleratorError: CUDA error: invalid device ordinal"}
    ]
    assert [e.kind for e in events].count("run_start") == 1


def test_later_launches_that_failed_are_named_and_the_finished_run_stays_finished(tmp_path: Path) -> None:
    """102: base finished, then mid_train and chat_sft died at start-up (disk full): the base run is finished
    and its notes name the failed launches; they have no run of their own."""
    text = _base() + _world("18:00:00,000")
    text += _failed("scripts.mid_train", "OSError: Not enough disk space.")
    text += _failed("scripts.chat_sft", "FileNotFoundError: no mid_checkpoints")
    events = list(read_events(_write(tmp_path, text)))
    assert len(_runs(events)) == 1 and events[-1].fields["status"] == "finished"
    cfg = _start(events)["config"]
    assert [x["script"] for x in cfg["failed_launches_after"]] == ["scripts.mid_train", "scripts.chat_sft"]
    assert any("did not finish" in n for n in cfg["notes"])


def test_a_crash_after_logged_steps_is_that_launch_failing(tmp_path: Path) -> None:
    text = _base(n=2, planned=4, end=False) + _failed("scripts.base_train", "RuntimeError: CUDA out of memory")
    events = list(read_events(_write(tmp_path, text)))
    assert events[-1].fields["status"] == "failed"
    assert _start(events)["config"]["failure"]["error"] == "RuntimeError: CUDA out of memory"


def test_a_relaunch_is_an_attempt_only_with_a_resume_line(tmp_path: Path) -> None:
    """nanochat prints ``Resuming optimization from step N`` when it restarts from a checkpoint: an attempt.
    A relaunch whose counter starts over without it is a separate run, not a resume."""
    first = _base(n=3, planned=6, end=False)
    resumed = _world("18:00:00,000")
    resumed += "Resuming optimization from step 2\n"
    resumed += "".join(
        f"step {s:05d}/00006 ({100 * s / 6:.2f}%) | loss: {9.0 - s:.6f} | lrm: 1.00 | dt: 500.00ms "
        f"| tok/sec: 1,048,576 | mfu: 48.00 | total time: 0.00m\n"
        for s in range(2, 6)
    )
    events = list(read_events(_write(tmp_path, first + resumed)))
    assert len(_runs(events)) == 1
    starts = [e.fields for e in events if e.kind == "run_start"]
    assert [s["resumed"] for s in starts] == [False, True]
    assert events[-1].fields["status"] == "finished"

    again = _world("18:00:00,000") + _base(n=4, planned=6)
    runs = _runs(list(read_events(_write(tmp_path, first + again, "relaunch.log"))))
    assert list(runs) == ["relaunch-stage1", "relaunch-base"]
    assert all(_start(evs)["resumed"] is False for evs in runs.values())
    assert runs["relaunch-stage1"][-1].fields["status"] == "interrupted"


def test_mfu_under_either_key_and_a_forks_grad_norm(tmp_path: Path) -> None:
    text = _base(mfu="bf16_mfu").replace("| lrm:", "| grad norm: 0.1132 | lrm:")
    _, meta = parse_nanochat(_write(tmp_path, text))
    assert meta.config["mfu_key"] == "bf16_mfu" and meta.config["mfu_percent_median"] == 48.0
    events = list(read_events(tmp_path / "speedrun.log"))
    assert all(s["grad_norm"] == 0.1132 for s in _steps(events))


# -- the real logs ---------------------------------------------------------------------------------


def _summaries(name: str) -> list[dict[str, Any]]:
    storage = Storage("sqlite://")
    try:
        return [summarize(storage, run) for run in import_file(LOGS / name, storage)]
    finally:
        storage.close()


@needs_logs
def test_real_101_reads_every_base_step_and_three_stages() -> None:
    m = MANIFEST["101_nanochat-speedrun-keystrokes-midtrain-slowdown.log"]
    items, _ = parse_nanochat(LOGS / "101_nanochat-speedrun-keystrokes-midtrain-slowdown.log")
    steps = {it.step for it in items if type(it).__name__ == "TrainPoint" and it.step >= 4354 and it.step <= 4382}
    assert set(m["file_meta"]["escape_prefixed_step_lines"]) <= steps and len(steps) == 29
    s = _summaries("101_nanochat-speedrun-keystrokes-midtrain-slowdown.log")
    stages = m["file_meta"]["stages"]
    assert [x["steps_logged"] for x in s] == [stages["base"]["steps"], stages["mid"]["steps"], stages["sft"]["steps"]]
    assert [x["attempts"] for x in s] == [1, 1, 1] and [x["status"] for x in s] == ["finished"] * 3


@needs_logs
def test_real_102_names_the_failed_later_stages() -> None:
    _, meta = parse_nanochat(LOGS / "102_nanochat-base-jitter-then-disk-full.log")
    failed = {x["script"].split(".")[-1] for x in meta.config["failed_launches_after"]}
    assert failed == set(MANIFEST["102_nanochat-base-jitter-then-disk-full.log"]["file_meta"]["failed_stages"])
    assert meta.status == "finished" and "Not enough disk space" in meta.config["failed_launches_after"][0]["error"]


@needs_logs
def test_real_103_is_one_interrupted_run_after_a_failed_launch() -> None:
    m = MANIFEST["103_nanochat-failed-launch-then-cut-off.log"]
    (s,) = _summaries("103_nanochat-failed-launch-then-cut-off.log")
    assert (s["status"], s["attempts"], s["steps_logged"]) == ("interrupted", 1, m["entries"])
    _, meta = parse_nanochat(LOGS / "103_nanochat-failed-launch-then-cut-off.log")
    assert meta.config["failed_launches_before"][0]["script"] == "scripts.base_train"
    assert meta.world_size == m["file_meta"]["world_size"]


@needs_logs
def test_real_104_reads_bf16_mfu_and_splits_base_from_sft() -> None:
    m = MANIFEST["104_nanochat-4x3090-73h-bf16mfu-key.log"]["file_meta"]
    s = _summaries("104_nanochat-4x3090-73h-bf16mfu-key.log")
    assert [x["steps_logged"] for x in s] == [m["base_steps"], m["mid_steps"]]
    items, _ = parse_nanochat(LOGS / "104_nanochat-4x3090-73h-bf16mfu-key.log")
    marks = [it for it in items if type(it).__name__ == "RunMark"]
    assert [mk.config["mfu_key"] for mk in marks] == [m["mfu_key_base"], m["mfu_key_mid"]]


def test_a_log_that_starts_at_a_resume_says_so(tmp_path: Path) -> None:
    text = _world("18:00:00,000")
    text += "Resuming optimization from step 2\n"
    text += "".join(
        f"step {s:05d}/00004 ({100 * s / 4:.2f}%) | loss: {9.0 - s:.6f} | lrm: 1.00 | dt: 500.00ms "
        f"| tok/sec: 1,048,576 | mfu: 48.00 | total time: 0.00m\n"
        for s in range(2, 4)
    )
    events = list(read_events(_write(tmp_path, text)))
    (start,) = [e.fields for e in events if e.kind == "run_start"]
    assert start["resumed"] is True and start["config"]["resumed_after_step"] == 1
    assert start["config"]["step_base"] == 0 and events[-1].fields["status"] == "finished"
