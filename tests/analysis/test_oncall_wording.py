"""Symbols and words an on-call reader can trust (issue 26).

Before: ``trainmon status`` drew "!!!!!!" (non-finite) for the tokens/s of a loop that logs
``samples=`` and no tokens; an open finding read "steps 23-23"; the verdict listed "#2" above
"#1"; a finding open to the end said so twice; a short clean run got "Young/Daly has nothing to
weigh", "failure rate: no failed attempts" and "1 (0 failed), 0 resume(s)"; and ``trainmon grafana
provision --token x`` printed "Ma*** retries e***ceeded": every x of the error was masked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from tests.conftest import LiveCollector
from tests.events import batch, event, step_events
from trainmon.monitor.analysis.report import print_summary, render_html
from trainmon.monitor.grafana import mask_secret

TRAINMON = [sys.executable, "-m", "trainmon"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "TRAINMON_COLLECTOR": "http://127.0.0.1:9"}
    return subprocess.run([*TRAINMON, *args], capture_output=True, text=True, timeout=120, env=env)


def test_status_draws_no_nan_for_tokens_a_loop_does_not_log(live_collector: LiveCollector) -> None:
    steps = step_events(30, run="samples-only")
    for e in steps:
        del e["fields"]["tokens"]
        e["fields"]["samples"] = 32
    start = event("run_start", {"world_size": 1}, run="samples-only", seq=0)
    assert live_collector.post(batch([start, *steps]))[0] == 200
    st = json.loads(_cli("status", "samples-only", "--url", live_collector.url, "--json").stdout)
    assert st["tokens_per_second"] is None and st["recent"]["loss"]  # no tokens, and the loss is there
    view = _cli("status", "samples-only", "--url", live_collector.url)
    assert view.returncode == 0, view.stderr
    assert "!" not in view.stdout and "tokens/s" not in view.stdout  # nothing to draw: no row, not "!!!!"
    assert "loss" in view.stdout


def test_an_open_finding_in_status_reads_since(live_collector: LiveCollector) -> None:
    steps = step_events(40, run="open-nan", loss=lambda i: "NaN" if i >= 30 else 4.1 - 0.01 * i)
    start = event("run_start", {"world_size": 1}, run="open-nan", seq=0)
    assert live_collector.post(batch([start, *steps]))[0] == 200
    view = _cli("status", "open-nan", "--url", live_collector.url).stdout
    line = next(line for line in view.splitlines() if "nan_inf" in line)
    assert "since step 30" in line and "steps 30-" not in line, line


def _finding(kind: str, severity: str, first: int, last: int, status: str = "resolved") -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "rank": 0, "status": status, "first_step": first, "last_step": last,
            "message": f"{kind} message", "hint": f"{kind} hint", "evidence": {}, "level": 1}  # fmt: skip


def _text(summary: dict[str, Any]) -> str:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print_summary(summary, console)
    return console.export_text()


def test_the_problems_box_is_numbered_in_order() -> None:
    """The critical (#2 in the timeline) has more impact than the warning (#1): the box ranks it first
    and numbers the box 1, 2 (the page's list read "2." above "1."), each naming its timeline number."""
    found = [_finding("init_loss", "warning", 0, 0), _finding("nan_inf", "critical", 50, 99, "open")]
    summary = {"run": "r", "steps": 100, "last_step": 99, "failures": 0, "anomalies": found}
    box = _text(summary).split("overview")[0].splitlines()
    heads = [line for line in box if line[:3] in ("1. ", "2. ")]
    assert heads[0].startswith("1. nan_inf #2 ") and heads[1].startswith("2. init_loss #1 "), box
    page = render_html(summary, {})
    items = page[page.index("<ol>") : page.index("</ol>")]
    assert "<li value" not in items and items.index("nan_inf") < items.index("init_loss")
    assert "nan_inf</b> #2 " in items


def test_a_finding_open_at_the_end_says_it_once() -> None:
    summary = {"run": "r", "steps": 300, "last_step": 299, "failures": 0,
               "anomalies": [_finding("straggler", "warning", 23, 23, "open")]}  # fmt: skip
    box = _text(summary).split("overview")[0]
    assert box.count("still open at the end") == 1 and "step 23, still open at the end (step 299)" in box, box


def test_a_short_clean_run_gets_no_noise_lines(tmp_path: Path) -> None:
    start = event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 20}, seq=0, run="short", t=1000.0)
    steps = step_events(20, run="short")
    for i, e in enumerate(steps):
        e["time"] = 1001.0 + 0.05 * i
    end = event("run_end", {"status": "finished", "step": 19}, seq=21, run="short", t=1002.0)
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [start, *steps, end]))
    text = _cli("postmortem", str(path)).stdout
    assert "HEALTHY" in text
    for noise in ("Young/Daly", "nothing to weigh", "failure rate", "0 resume", "(0 failed)"):
        assert noise not in text, noise
    attempts = next(line for line in text.splitlines() if line.strip().startswith("attempts"))
    assert attempts.split() == ["attempts", "1"]


def test_grafana_masks_the_token_not_the_letters() -> None:
    proc = subprocess.run(
        [*TRAINMON, "grafana", "provision", "--url", "http://127.0.0.1:9", "--token", "x"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "GRAFANA_TOKEN": ""},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Max retries exceeded" in proc.stderr and "***" not in proc.stderr, proc.stderr
    assert mask_secret("GET /api?token=x failed: Max retries exceeded", "x") == (
        "GET /api?token=*** failed: Max retries exceeded"
    )
    secret = "glsa_0123456789abcdef_0f7f05"
    assert mask_secret(f"url: /{secret}/api token%3D{secret}x", secret) == "url: /***/api token%3D***x"
