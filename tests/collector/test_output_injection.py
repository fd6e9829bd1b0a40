"""Producer strings are data in every output (issue 15, item 5): never terminal control, rich markup
or mathtext.

A real collector on loopback stores a run whose status, error text, host, layer names, config and
eval metric names carry escape sequences, rich markup and a mathtext crasher, all within the wire
format; then the CLI runs as a user runs it (subprocesses) and its output must show them escaped:
exit code 0, no raw control character, no traceback, the report and plots written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import start_collector
from tests.events import batch, event

ROOT = Path(__file__).resolve().parents[2]
PLOTS = ("loss", "grad_norm", "lr", "throughput", "gpu_health")  # one rank: no rank heatmap

# Clears the screen and paints a fake red verdict (and a rich emoji code); "[/]" crashed rich's markup
# parser (MarkupError).
STATUS = "[/]\x1b[2J\x1b[31mall runs healthy :white_check_mark:"
# A rich link, an OSC 8 terminal hyperlink, a C1 CSI, DEL and HTML.
ERROR = (
    "[link=https://evil.example]click[/link] \x1b]8;;https://evil.example\x1b\\here\x1b]8;;\x1b\\ "
    "\x9b2J\x7f <script>alert(1)</script>"
)
HOST = "node$\\frac{$"  # mathtext: an unfinished \frac, ParseFatalException while drawing the legend
LAYER = "blocks.0.attn\x1b[2J[bold]w[/bold]"
CONFIG_KEY = "optim\x1b[2J[link=https://evil.example]x[/link]"
CONFIG = {
    "lr": 0.001,
    CONFIG_KEY: "adam",
    "imported_from": "[/]log\x1b[2J.jsonl",
    "format": "jsonl",
    "missing_signals": [1, {"a": 2}, "grad_norm\x1b[2J"],  # not strings: crashed `postmortem`
    "notes": ["[link=https://evil.example]note[/link]\x1b[2J"],
}
# Any C0 control but newline and tab, DEL, any C1 control: none may reach the terminal raw.
RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """``text`` as the terminal must show it: controls written out as \\xNN."""
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def _step(run: str, stream: str, seq: int, step: int, loss: Any, host: str, layers: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0,
        "lr": [1e-3],
        "tokens": 512,
        "step_time": 0.05,
        "phases": {"data": 0.01, "forward": 0.02, "backward": 0.015, "optimizer": 0.005},
    }
    if layers:  # the layer's grad norm explodes with the NaN loss: the anomaly is localised to it
        fields["layer_grad_norms"] = {LAYER: 1.0 if step < 30 else 1e6, "blocks.1.mlp": 1.0}
    ev = event("step", fields, run=run, stream=stream, seq=seq)
    ev["host"] = host
    return ev


def _hostile_run() -> list[dict[str, Any]]:
    """Attempt 0 fails at step 24 with ERROR; attempt 1 resumes, its loss turns NaN at step 30, its
    GPU reports ECC errors, and it ends with STATUS."""
    out = []
    for stream, steps, end in (
        ("s0", range(25), {"status": "failed", "step": 24, "error": ERROR}),
        ("s1", range(20, 40), {"status": STATUS, "step": 39}),
    ):
        seq = 0
        start = event("run_start", {"config": CONFIG, "planned_steps": 100}, run="hostile", stream=stream, seq=seq)
        start["host"] = HOST
        out.append(start)
        for step in steps:
            seq += 1
            loss = "NaN" if step == 30 else 4.0 - 0.01 * step
            out.append(_step("hostile", stream, seq, step, loss, HOST, layers=True))
        if stream == "s1":
            out.append(event("eval", {"step": 35, "loss": 3.7, "metrics": {"acc\x1b[2J[/]": 0.5}}, run="hostile",
                             stream=stream, seq=seq + 1))  # fmt: skip
            gpus = [{"index": 0, "temperature_c": 60.0, "ecc_uncorrected": 3}]
            for n in (2, 3):  # two samples: the health plot draws a trend, and a trend needs two
                health = event("health", {"gpus": gpus}, run="hostile", stream=stream, seq=seq + n)
                health["host"] = HOST
                health["time"] += n
                out.append(health)
            seq += 3
        out.append(event("run_end", end, run="hostile", stream=stream, seq=seq + 1))
    return out


def _plain_run() -> list[dict[str, Any]]:
    out = [event("run_start", {"config": {"lr": 0.001, "optim": "adam"}}, run="plain", stream="p0", seq=0)]
    out += [_step("plain", "p0", 1 + i, i, 4.0 - 0.01 * i, "node-1", layers=False) for i in range(40)]
    out.append(event("run_end", {"status": "finished", "step": 39}, run="plain", stream="p0", seq=41))
    return out


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("injection") / "trainmon.sqlite"
    collector = start_collector(path)
    try:
        events = _hostile_run() + _plain_run()
        status, body = collector.post(batch(events))
        assert status == 200, body
        assert body["accepted"] == len(events), body
    finally:
        collector.stop()
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run(
        [sys.executable, "-m", "trainmon", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
        env={**base, "COLUMNS": "400", "PYTHONIOENCODING": "utf-8", **(env or {})},
    )


def _clean(proc: subprocess.CompletedProcess) -> str:
    """The command succeeded and wrote no raw control character; returns stdout."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for name, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        raw = RAW_CONTROL.search(text)
        assert raw is None, f"raw {raw.group()!r} in {name}: {text[max(0, raw.start() - 80) : raw.end() + 80]!r}"
    return proc.stdout


def test_runs_shows_the_status_as_text(db: Path) -> None:
    out = _clean(_cli("runs", "--db", str(db)))
    assert _visible(STATUS) in out  # "[/]" kept literally, ESC shown as \x1b
    assert "plain" in out


def test_status_shows_status_and_host_as_text(db: Path) -> None:
    out = _clean(_cli("status", "hostile", "--db", str(db)))
    assert _visible(STATUS) in out
    assert f"{HOST}: GPU 0: 3 uncorrected ECC errors" in out  # node_health's message, from the host name


def test_runs_and_status_from_a_collector_show_the_data_as_text(db: Path) -> None:
    """The same views read over HTTP (``--url``): the collector's JSON is data too."""
    collector = start_collector(db)
    try:
        out = _clean(_cli("runs", "--url", collector.url))
        assert _visible(STATUS) in out
        out = _clean(_cli("status", "hostile", "--url", collector.url))
        assert _visible(STATUS) in out and f"{HOST}: GPU 0: 3 uncorrected ECC errors" in out
    finally:
        collector.stop()


def test_postmortem_shows_every_hostile_string_as_text(db: Path) -> None:
    out = _clean(_cli("postmortem", "hostile", "--db", str(db)))
    assert _visible(STATUS) in out
    assert "[link=https://evil.example]click[/link]" in out  # markup shown, not made a link
    assert _visible("\x1b]8;;https://evil.example\x1b\\here") in out
    assert _visible("\x9b2J\x7f <script>alert(1)</script>") in out
    assert f"grad norm of {_visible(LAYER)} at step 30" in out  # the timeline's localisation row
    assert HOST in out
    assert _visible(f"imported from {CONFIG['imported_from']} (jsonl); the log has no 1, ") in out
    assert _visible('{"a": 2}, grad_norm\x1b[2J') in out
    assert _visible(CONFIG["notes"][0]) in out


def test_postmortem_json_keeps_the_data_and_parses(db: Path) -> None:
    out = _clean(_cli("postmortem", "hostile", "--db", str(db), "--json"))
    summary = json.loads(out)  # JSON escapes controls itself (\u001b): the data round-trips unchanged
    assert summary["status"] == STATUS
    assert [a["error"] for a in summary["attempts_detail"]] == [ERROR, None]
    assert any(LAYER in e["message"] for e in summary["timeline"])
    assert summary["health"][0]["host"] == HOST
    assert summary["notes"][0].endswith('the log has no 1, {"a": 2}, grad_norm\x1b[2J')


def test_postmortem_out_writes_plots_and_an_escaped_report(db: Path, tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    out = _clean(_cli("postmortem", "hostile", "--db", str(db), "--out", str(report_dir)))
    assert f"report: {report_dir / 'report.html'}" in out
    for name in PLOTS:
        png = report_dir / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    html = (report_dir / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert HOST in html and "[link=https://evil.example]click[/link]" in html


def test_compare_shows_config_keys_as_text(db: Path) -> None:
    out = _clean(_cli("compare", "hostile", "plain", "--db", str(db)))
    assert "config differs: " in out and f"{_visible(CONFIG_KEY)} 'adam' -> None" in out


@pytest.mark.parametrize(
    ("args", "styled"),
    [
        (("runs",), "\x1b[31m2"),  # the open-anomaly count in red
        (("status", "hostile"), "\x1b[1mrun hostile"),  # the bold header
        (("postmortem", "hostile"), "\x1b[31mcritical"),  # the severity in red
    ],
)
def test_on_a_terminal_only_trainmon_styles(db: Path, args: tuple[str, ...], styled: str) -> None:
    """Forced terminal output: trainmon's own styling is there, the data's sequences are not."""
    proc = _cli(*args, "--db", str(db), env={"FORCE_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for text in (proc.stdout, proc.stderr):  # stderr: rich's own progress display, nothing of the data's
        assert "\x1b[2J" not in text and "\x1b]8;" not in text and "\x9b" not in text  # no clear, no link
    assert styled in proc.stdout
    assert _visible(STATUS) in re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)
