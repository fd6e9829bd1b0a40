"""The report says what it could not check, and why (issue 26; DESIGN "Say what was not checked").

Before: a log without grad norms, evals or a clock, or written once every 25 steps, got "HEALTHY"
and nothing else: the reader could not tell a run that was checked from one that could not be.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select

from tests.events import event, step_events
from tests.real_log_types import REAL_LOGS
from trainmon.monitor.analysis.coverage import not_checked
from trainmon.monitor.analysis.postmortem import Analysis, analyse, import_file
from trainmon.monitor.analysis.report import print_summary, render_html
from trainmon.monitor.store.storage import Storage, runs
from trainmon.wire import json_safe

SMALL = 250_000  # bytes: the real logs read here (about 40 of them, a few seconds)
# The HF importer keeps no eval that has generation metrics and no eval_loss (BLEU/ROUGE only): the
# stored run has no evaluation, and the report says none was read.
EVALS_NOT_IMPORTED = {"91_hf-chatglm-zero-loss-zero-gradnorm.json"}


def _analysed(path: Path) -> tuple[Analysis, Any]:
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    with storage.connect() as conn:
        config = conn.execute(select(runs.c.config).where(runs.c.run == run)).scalar()
    return analyse(storage, run), config


def _gaps(path: Path) -> dict[str, dict[str, str]]:
    a, config = _analysed(path)
    return {g["signal"]: g for g in not_checked(a.summary, a.carried, a.evals, config)}


def _manifest() -> list[dict[str, Any]]:
    if not (REAL_LOGS / "manifest.json").exists():
        pytest.skip("no real logs here")
    return [e for e in json.loads((REAL_LOGS / "manifest.json").read_text()) if e["bytes"] <= SMALL]


def test_what_a_real_log_lacks_is_what_its_reading_says() -> None:
    """The manifest's independent reading of each log (has a grad norm? an LR? evals?) against the
    signals the report says it could not check."""
    for entry in _manifest():
        gaps = _gaps(REAL_LOGS / entry["file"])
        assert ("grad norm" in gaps) != entry["has_grad_norm"], entry["file"]
        assert ("learning rate" in gaps) != entry["has_lr"], entry["file"]
        evals = (entry.get("file_meta") or {}).get("n_eval_entries")
        if evals is not None and entry["file"] not in EVALS_NOT_IMPORTED:
            assert ("eval metric" in gaps) != bool(evals), entry["file"]


def test_synthetic_clock_interval_means_and_missing_ranks_are_named() -> None:
    if not REAL_LOGS.exists():
        pytest.skip("no real logs here")
    whisper = _gaps(REAL_LOGS / "01_whisper-large-v2-ja.json")  # HF: every 25 steps, no clock
    assert "one entry per 25 steps" in whisper["per-step values"]["why"]
    assert "synthetic" in whisper["wall clock"]["why"] and "hangs" in whisper["wall clock"]["unchecked"]
    nanochat = _gaps(REAL_LOGS / "55_nanochat-sft-nan.log")  # a smoothed loss
    assert "mean over" in nanochat["per-step loss"]["why"]
    megatron = _gaps(REAL_LOGS / "97_megatron-ds-3d-static-scale-explode-rediverge.out")  # rank 0's stdout
    assert "stragglers" in megatron["ranks"]["unchecked"] and "rank 0 of" in megatron["ranks"]["why"]


def _hook_run(tmp_path: Path, with_eval: bool) -> Path:
    start = event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 40}, seq=0, run="hooked", t=1000.0)
    steps = step_events(40, run="hooked")
    for i, e in enumerate(steps):
        e["time"] = 1001.0 + 0.05 * i
    evs = [event("eval", {"step": 39, "loss": 3.8}, run="hooked", seq=41, t=1003.0)] if with_eval else []
    end = event("run_end", {"status": "finished", "step": 39}, seq=42, run="hooked", t=1003.1)
    path = tmp_path / f"hooked-{with_eval}.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [start, *steps, *evs, end]))
    return path


def test_a_run_from_the_hooks_lists_only_what_it_lacks(tmp_path: Path) -> None:
    without = _gaps(_hook_run(tmp_path, with_eval=False))
    assert without["eval metric"]["why"] == "no evaluation in the run"
    for carried in ("loss", "grad norm", "learning rate", "step time", "wall clock", "per-step values", "ranks"):
        assert carried not in without, carried
    assert "eval metric" not in _gaps(_hook_run(tmp_path, with_eval=True))


def _render(summary: dict[str, Any]) -> tuple[str, str]:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print_summary(summary, console)
    return console.export_text(), render_html(summary, {})


def test_the_verdict_lists_what_was_not_checked() -> None:
    if not REAL_LOGS.exists():
        pytest.skip("no real logs here")
    a, config = _analysed(REAL_LOGS / "01_whisper-large-v2-ja.json")
    summary = json_safe(a.summary | {"not_checked": not_checked(a.summary, a.carried, a.evals, config)})
    text, page = _render(summary)
    box = " ".join(text.split("overview")[0].split())
    assert "HEALTHY" in box and "not checked" in box
    assert "gradient explosions" in box and "no grad norm in the log" in box and "one entry per 25 steps" in box
    verdict = " ".join(page[page.index('id="verdict"') : page.index("</section>")].split())
    assert "Not checked" in verdict and "no grad norm in the log" in verdict
    older = {k: v for k, v in a.summary.items() if k != "not_checked"}  # from an older collector
    bare, _ = _render(json_safe(older))
    assert "not checked" not in bare


def test_the_json_carries_what_was_not_checked(tmp_path: Path) -> None:
    a, _ = _analysed(_hook_run(tmp_path, with_eval=False))
    assert [g["signal"] for g in a.summary["not_checked"]] == ["eval metric", "GPU health"]
