"""``trainmon demo``: the first thing a new user runs, with its output going to a pipe as under make."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from trainmon.monitor.demo import default_injects


def test_default_faults_fall_inside_the_steps_that_run() -> None:
    for steps in (120, 200, 400, 1000):
        at = [int(re.match(r"\w+@(\d+)", spec).group(1)) for spec in default_injects(steps)]
        assert at == sorted(at) and at[0] > 0 and at[-1] < steps, (steps, at)


def test_demo_short_run_in_a_pipe_shows_progress_faults_report_and_web_address(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainmon", "demo", "--steps", "200", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "step 200/200" in out  # progress lines, the last one at the end, though stdout is a pipe
    assert re.search(r"web view: http://127\.0\.0\.1:\d+/runs/demo-\S+ \(open it now", out)
    detected = {m.group(1): m.group(2) for m in re.finditer(r"│ (\w+)\s+│ 0\s+│ [\d-]+\s+│ \w+\s+│ ([^│]+)│", out)}
    for fault in ("loss_spike", "lr_frozen", "nan"):  # the data stall competes with a busy machine's noise
        assert detected.get(fault, "").startswith("step"), (fault, detected, out[-4000:])
    report = re.search(r"report: (\S+report\.html)", out)
    assert report and Path(report.group(1)).exists()
    assert "trainmon serve --db" in out and "/runs/demo-" in out.splitlines()[-1]
