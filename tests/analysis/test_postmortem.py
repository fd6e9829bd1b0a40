"""`trainmon postmortem` on a reference-trainer run with injected faults, on a synthetic store big
enough to take the sampled path, and its HTML report in a real headless Chromium."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from tests.real_log_types import REAL_LOGS
from tests.trainer_helpers import ROOT, read_labels, run_trainer
from trainmon.monitor.analysis.postmortem import analyse, import_file, optimal_checkpoint_interval, summarize
from trainmon.monitor.store.storage import Storage

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
# A one-rank run on CPU: no per-rank heatmap (nothing to compare), node health is host memory only.
PLOTS = ("loss", "grad_norm", "lr", "throughput", "precursors", "gpu_health")
TRAINER = ["--threads", "1", "--seq-len", "32", "--batch-size", "8", "--checkpoint-every", "25", "--eval-every", "20"]
# What the hint of each expected detection must point at for the injected fault (labels.json).
HINT_WORDS = {
    "loss_spike": ("batch",),  # a batch of random tokens
    "throughput_collapse": ("dataloader", "data phase"),  # a sleep in the data phase
    "nan_inf": ("checkpoint", "batch"),  # replay from the last checkpoint, suspect the batch
}


def _postmortem(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*TRAINMON, "postmortem", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def faulted_run() -> Any:
    """Two attempts: a loss spike and a data stall, a crash (--stop-at) after step 72, a resume from
    the step-49 checkpoint, then NaN weights from step 95."""
    with tempfile.TemporaryDirectory(prefix="trainmon-pm-") as tmp:
        out = Path(tmp) / "run"
        run_trainer(
            out,
            *TRAINER,
            "--stop-at",
            "72",
            "--inject",
            "loss_spike@40:scale=50",
            "--inject",
            "data_stall@60:seconds=0.5,steps=4",
            steps=120,
            run="faulted",
        )
        run_trainer(out, *TRAINER, "--resume", str(out), "--inject", "nan@95", steps=120, run="faulted")
        summary = json.loads(_postmortem(str(out), "--json").stdout)
        yield out, summary


pytestmark = pytest.mark.slow


def test_every_injected_fault_is_named_at_its_step_with_the_right_hint(faulted_run: Any) -> None:
    out, summary = faulted_run
    labels = read_labels(out)
    assert {lab["kind"] for lab in labels} == {"loss_spike", "data_stall", "nan"}
    for lab in labels:
        kind = lab["expected_detection"]
        hits = [
            a
            for a in summary["anomalies"]
            if a["kind"] == kind and lab["first_step"] <= a["first_step"] <= lab["last_step"] + 3
        ]
        assert hits, f"{lab['spec']}: no {kind} at steps {lab['first_step']}-{lab['last_step']}: {summary['anomalies']}"
        hint = hits[0]["hint"].lower()
        assert any(w in hint for w in HINT_WORDS[kind]), (kind, hint)
        assert hits[0]["message"]


def test_json_contract_and_the_run_summary(faulted_run: Any) -> None:
    _, s = faulted_run
    assert {"run", "steps", "attempts", "final_loss", "anomalies"} <= set(s)
    for a in s["anomalies"]:
        assert {"kind", "severity", "rank", "first_step", "last_step", "message", "hint"} <= set(a)
    assert (s["run"], s["steps"], s["attempts"], s["planned_steps"]) == ("faulted", 120, 2, 120)
    assert s["final_loss"] == "NaN"  # strict JSON: non-finite floats as the wire format's markers
    assert s["tokens"] == s["steps_logged"] * 256 and s["tokens_per_second"] > 0
    assert [a["status"] for a in s["attempts_detail"]] == ["interrupted", "finished"]
    assert s["failures"] == 1
    (resume,) = s["resumes"]
    assert (resume["attempt"], resume["step"]) == (1, 49)
    ck = s["checkpoint"]
    assert ck["count"] >= 4 and 0 < ck["overhead_fraction"] < 1 and ck["interval_steps"] == 25
    # one failure in the run's wall time: MTBF = wall time; Young/Daly from trainmon.monitor.core.budget
    assert ck["mtbf_seconds"] == pytest.approx(s["duration_seconds"])
    expected = optimal_checkpoint_interval(ck["mean_seconds"], ck["mtbf_seconds"])
    assert ck["optimal_interval_seconds"] == pytest.approx(expected["daly_seconds"])
    assert ck["optimal_interval_steps"] >= 1


def test_timeline_puts_the_cause_before_its_localisation(faulted_run: Any) -> None:
    _, s = faulted_run
    tl = s["timeline"]
    spike = next(i for i, e in enumerate(tl) if e["kind"] == "loss_spike")
    assert tl[spike]["level"] == 1
    under = [e for e in tl if e["explains"] == spike]
    kinds = [e["kind"] for e in under]
    # the grad-norm jump at the spike's own step is the spike's incident: no separate grad_explosion
    assert "layer_grad_norm" in kinds and not any(a["kind"] == "grad_explosion" for a in s["anomalies"])
    assert all(tl.index(e) > spike for e in under)
    layer = next(e for e in under if e["kind"] == "layer_grad_norm")
    assert (
        layer["first_step"] == 40 and layer["evidence"]["ratio"] > 3 and layer["evidence"]["layer"] in layer["message"]
    )
    # the contract list follows the same order: each symptom first, then what localises it
    kinds_in_order = [a["kind"] for a in s["anomalies"]]
    assert kinds_in_order.index("loss_spike") < kinds_in_order.index("throughput_collapse")
    steps = [e["first_step"] for e in tl if e["level"] == 1]
    assert steps == sorted(steps)


def test_phase_breakdown_shows_the_data_stall(faulted_run: Any) -> None:
    _, s = faulted_run
    parts = s["phases"]["by_part"]
    assert len(parts) == 10
    for p in parts:
        assert sum(v for v in p["shares"].values() if v) == pytest.approx(1.0)
    stalled = next(p for p in parts if p["first_step"] <= 61 <= p["last_step"] and 0 in p["attempts"])
    assert max(stalled["shares"], key=lambda k: stalled["shares"][k] or 0) == "data"


def test_terminal_report_and_silent_json(faulted_run: Any) -> None:
    out, _ = faulted_run
    human = _postmortem(str(out)).stdout
    for text in ("faulted", "loss_spike", "layer_grad_norm", "throughput_collapse", "nan_inf"):
        assert text in human, text
    assert "dataloader" in human and "optimal interval" in human
    assert _postmortem(str(out), "--json").stderr == ""


def test_out_writes_the_plots_and_one_self_contained_html(faulted_run: Any, tmp_path: Path) -> None:
    run_dir, _ = faulted_run
    proc = _postmortem(str(run_dir), "--json", "--out", str(tmp_path / "report"))
    assert json.loads(proc.stdout)["report"] == str(tmp_path / "report" / "report.html")
    for name in PLOTS:
        png = tmp_path / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 10_000, name  # a drawn plot, not an empty canvas
    assert sorted(p.stem for p in (tmp_path / "report").glob("*.png")) == sorted(PLOTS)
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert "http://" not in page and "https://" not in page  # nothing fetched when opened offline
    assert "loss_spike" in page and "dataloader" in page


def test_report_renders_in_headless_chromium(faulted_run: Any, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    from PIL import Image

    run_dir, _ = faulted_run
    _postmortem(str(run_dir), "--out", str(tmp_path / "report"))
    shot = tmp_path / "shot.png"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        (tmp_path / "report" / "report.html").as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2000)
    # The page is mostly white text and tables; the plots are where the colours are. Count the
    # distinct colours per 200-px band: a band holding a rendered plot has hundreds (anti-aliased
    # lines, shaded bands, legends), a band of text or a broken image has few.
    bands = []
    for top in range(0, 2000, 200):
        band = image.crop((0, top, 1280, top + 200))
        bands.append(len(band.getcolors(maxcolors=1 << 20) or []))
    colourful = [n for n in bands if n >= 300]
    assert len(colourful) >= 2, f"distinct colours per band: {bands}"
    assert len(image.getcolors(maxcolors=1 << 20)) > 1000


def test_a_big_run_takes_the_sampled_path_and_still_finds_everything(tmp_path: Path) -> None:
    """20k steps x 8 ranks (bench/postmortem.py's synthetic run): the per-rank table comes from a
    prime-stride sample; totals and phases stay exact."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import postmortem as bench  # bench/postmortem.py
    finally:
        sys.path.remove(str(ROOT / "bench"))
    db = tmp_path / "big.sqlite"
    info = bench.generate(db, 20_000)
    a = analyse(Storage(str(db)), bench.RUN)
    s = a.summary
    assert s["sample"]["stride"] > 1 and len(a.bins) <= 250
    assert (s["steps"], s["attempts"], s["failures"]) == (20_000, 2, 1)
    # rank 0's steps, the repeated ones of attempt 1 included, all counted
    assert s["steps_logged"] == (info["crash"] + 1) + (20_000 - info["resume_from"] - 1)
    slow = [r["rank"] for r in s["ranks"] if r["slow"]]
    assert slow == [5]
    r5 = next(r for r in s["ranks"] if r["rank"] == 5)
    assert r5["compute_rel"] == pytest.approx(1.25, rel=0.03) and r5["comm_rel"] < 0.5
    # checkpoint steps (every 1,000) are neither over- nor under-represented by the sample
    assert s["phases"]["overall"]["checkpoint"] == pytest.approx(20 * 19 / (s["busy_seconds"]), rel=0.15)
    spike = next(e for e in s["timeline"] if e["kind"] == "loss_spike")
    local = [e for e in s["timeline"] if e["kind"] == "layer_grad_norm"]
    assert local and local[0]["evidence"]["layer"] == "blocks.7.attn.qkv.weight"
    assert local[0]["explains"] == s["timeline"].index(spike)
    node = next(e for e in s["timeline"] if e["kind"] == "node_health")
    assert node["level"] == 2 and s["timeline"][node["explains"]]["kind"] == "straggler"
    (h5,) = [h for h in s["health"] if h["rank"] == 5]
    assert h5["max_temperature_c"] > 80 and h5["events"]
    assert s["mfu"] is not None and 0 < s["mfu"] < 1
    assert s["lr"]["max_rel_gap"] < 1e-9  # the synthetic LR follows its declared schedule exactly


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_same_analysis_on_sqlite_and_postgresql(faulted_run: Any, tmp_path: Path, request, backend: str) -> None:
    """NaN is text on SQLite and a float on PostgreSQL; the finite-only aggregates, the raw sample
    reads and the health thinning must agree on both."""
    out, reference = faulted_run
    url = str(tmp_path / "db.sqlite") if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = Storage(url)
    (run,) = import_file(out, storage)
    s = analyse(storage, run).summary
    for key in ("steps", "attempts", "failures", "steps_logged", "tokens", "world_size"):
        assert s[key] == reference[key], key
    assert math.isnan(s["final_loss"])
    assert [(a["kind"], a["first_step"]) for a in s["anomalies"]] == [
        (a["kind"], a["first_step"]) for a in reference["anomalies"]
    ]
    assert [e["kind"] for e in s["timeline"]] == [e["kind"] for e in reference["timeline"]]
    for phase, share in reference["phases"]["overall"].items():
        assert s["phases"]["overall"][phase] == pytest.approx(share, abs=1e-9), phase
    assert s["checkpoint"]["optimal_interval_seconds"] == pytest.approx(
        reference["checkpoint"]["optimal_interval_seconds"]
    )


# -- the report's presentation: verdict first, 80 columns, one number format, plots that show the data --


@pytest.fixture(scope="module")
def faulted_analysis(faulted_run: Any) -> Any:
    out, _ = faulted_run
    storage = Storage("sqlite://")
    (run,) = import_file(out, storage)
    return analyse(storage, run)


def _terminal(summary: dict[str, Any], width: int = 80) -> str:
    from rich.console import Console

    from trainmon.monitor.analysis.report import print_summary

    console = Console(width=width, record=True, emoji=False, file=open(os.devnull, "w"))  # noqa: SIM115
    print_summary(summary, console)
    return console.export_text()


def test_terminal_report_opens_with_the_verdict_and_fits_80_columns(faulted_run: Any) -> None:
    _, s = faulted_run
    text = _terminal(s)
    lines = text.splitlines()
    verdict_at = next(i for i, line in enumerate(lines) if line.startswith("PROBLEMS:"))
    assert "1 CRITICAL" in lines[verdict_at] and "1 FAILED ATTEMPT" in lines[verdict_at]
    first = lines[verdict_at + 1]  # the most impact first: the NaN that never recovered
    assert "nan_inf" in first and "critical" in first and "steps 95-119" in first and "still open" in first
    overview = next(i for i, line in enumerate(lines) if line.startswith("overview"))
    assert verdict_at < overview < next(i for i, line in enumerate(lines) if line.startswith("anomaly timeline"))
    assert "cost:" in text and "steps trained on non-finite values from step 95" in text
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text  # nothing cut: not a name, not a header
    for kind in ("throughput_collapse", "layer_grad_norm", "loss_spike"):
        assert kind in text, kind  # whole, not folded into a narrow column
    assert "e+0" not in text and "36,608" in text  # one number format: thousands separated
    assert "attempt 2 resumed from" in text and "72, 50-62" in text  # attempts counted from 1
    assert len(lines) < 150  # long text below the tables, not wrapped into a 20-character column


def _summary(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"run": "r", "status": "finished", "steps": 100, "last_step": 99, "world_size": 1}
    base["anomalies"] = []
    return {**base, **extra}


def _anomaly(kind: str, severity: str, status: str, first: int, last: int, **evidence: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "severity": severity,
        "status": status,
        "rank": 0,
        "first_step": first,
        "last_step": last,
        "message": f"{kind} message",
        "hint": f"{kind} hint",
        "evidence": evidence,
        "level": 1,
    }


def test_verdict_ranks_by_severity_then_recovery_then_extent() -> None:
    from trainmon.monitor.analysis.verdict import verdict

    anomalies = [
        _anomaly("memory_leak", "info", "open", 0, 99),
        _anomaly("loss_spike", "warning", "resolved", 10, 10, ratio=300.0),
        _anomaly("divergence", "warning", "open", 20, 24),
        _anomaly("straggler", "warning", "open", 30, 60),
        _anomaly("nan_inf", "critical", "resolved", 70, 71),
    ]
    v = verdict(_summary(anomalies=anomalies))
    assert not v["healthy"] and v["headline"] == "problems: 1 critical, 3 warnings"
    assert [f["kind"] for f in v["findings"]] == ["nan_inf", "straggler", "divergence"]
    assert [f["number"] for f in v["findings"]] == [5, 4, 3]  # the numbers of the timeline (step order)
    assert v["more"] == 1  # the loss spike: recovered, one step; in the details
    assert (
        verdict(_summary(anomalies=anomalies[:1]))["headline"]
        == "healthy: no warnings or critical findings in 100 steps"
    )
    assert not verdict(_summary(anomalies=anomalies[:1], failures=1))["healthy"]


def test_verdict_cost_of_a_short_run_is_never_zero_seconds() -> None:
    """A 0.3 s CPU loop at 86% goodput said '0.0 s did no useful work' beside the 14% it had lost."""
    from trainmon.monitor.analysis.verdict import verdict

    good = {"fraction": 0.86, "wall_seconds": 0.3, "recomputed_steps": 0, "failures": 0, "productive_seconds": 0.26}
    good["badput_seconds"] = {"other": 0.03, "slow_steps": 0.012}
    (line,) = verdict(_summary(goodput=good))["cost"]
    assert "0.042 s did no useful work" in line and "0.0 s" not in line
    good = {**good, "wall_seconds": 2000.0}
    assert "280 s did no useful work" in verdict(_summary(goodput=good))["cost"][0]


def test_terminal_never_breaks_a_command_or_a_name() -> None:
    command = "`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`"
    hint = "Throttled: the SM clock fell under load. Check the node's clocks and throttle reasons " + command
    anomaly = {**_anomaly("node_health", "warning", "open", 5, 50), "hint": hint + " and drain it if it stays hot."}
    long_run = "pretrain-llama-70b-ablation-lr3e-4-warmup2000-" + "x" * 40
    whole = {**_anomaly("throughput_collapse", "critical", "resolved", 122250, 122450), "rank": -1}
    timeline = [{**anomaly, "anomaly": 0}, {**whole, "anomaly": 1}]
    text = _terminal(_summary(run=long_run, anomalies=[anomaly, whole], timeline=timeline))
    lines = text.splitlines()
    assert "steps 122250-122450 (201 steps), all ranks," in text  # the header wraps at a space
    assert sum(command in line for line in lines) == 2  # the verdict and the timeline, whole each time
    assert any(long_run in line for line in lines)
    assert all(len(line) <= 80 for line in lines if command not in line and long_run not in line)


def test_plots_show_the_data_not_markers_or_empty_panels(faulted_analysis: Any) -> None:
    from trainmon.monitor.analysis import plots

    a = faulted_analysis
    assert plots.plot_rank_heatmap(a) is None  # one rank: nothing to compare
    loss = plots.plot_loss(a)
    loss.canvas.draw()
    ax = loss.axes[0]
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the data, never over it
    assert {t.get_text() for t in legend.get_texts()} >= {
        "train loss, attempt 1 (mean, min-max)",
        "train loss, attempt 2 (mean, min-max)",
        "non-finite loss",
    }

    def dashed(axes: Any) -> set[float]:
        return {float(line.get_xdata()[0]) for line in axes.get_lines() if line.get_linestyle() == "--"}

    stall = next(an["first_step"] for an in a.summary["anomalies"] if an["kind"] == "throughput_collapse")
    assert 40 in dashed(ax) and 95 in dashed(ax) and stall not in dashed(ax)  # the stall is not a loss event
    assert stall in dashed(plots.plot_throughput(a).axes[0])
    health = plots.plot_gpu_health(a)
    (panel,) = health.axes  # host memory only: no empty GPU panels
    assert panel.get_ylabel() == "host memory used, %"
    y = panel.get_lines()[0].get_ydata()
    assert 1 < max(y) <= 100  # a percentage, as in the table
    assert panel.get_xticklabels() and panel.get_xlabel().endswith("since the first sample")


def test_many_anomaly_labels_never_overlap(faulted_analysis: Any) -> None:
    """26 findings a few steps apart (an imported log's loss spikes): the top ones named, the rest
    numbered where they fit, no two labels on top of each other, all above the data."""
    from dataclasses import replace

    from trainmon.monitor.analysis import plots

    a = faulted_analysis
    many = [_anomaly("loss_spike", "warning", "resolved", 3 + 4 * i, 3 + 4 * i) for i in range(26)]
    crowded = replace(a, summary={**a.summary, "anomalies": many, "timeline": []})
    fig = plots.plot_loss(crowded)
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text().startswith("#")]
    assert 3 <= len(labels) < 26
    boxes = [t.get_window_extent() for t in labels]
    assert all(not b1.overlaps(b2) for i, b1 in enumerate(boxes) for b2 in boxes[i + 1 :])
    assert all(b.y0 >= ax.get_window_extent().y1 - 1 for b in boxes)
    named = [t.get_text() for t in labels if " " in t.get_text()]
    assert len(named) == 3 and all(t.endswith("loss_spike") for t in named)


def test_imported_log_without_throughput_or_health_has_no_empty_panels(tmp_path: Path) -> None:
    log = REAL_LOGS / "44_lightning-slm-v0.csv"
    if not log.exists():
        pytest.skip("real logs not available")
    _postmortem(str(log), "--out", str(tmp_path / "report"))
    assert sorted(p.stem for p in (tmp_path / "report").glob("*.png")) == ["loss"]
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.count("data:image/png") == 1
    for heading in ("Throughput", "Ranks", "Node health", "Gradient norm"):
        assert f"<h2>{heading}" not in page, heading


def test_runs_table_keeps_names_and_ranks_table_reads_cleanly() -> None:
    """``trainmon runs`` at 80 columns never cuts a run's name (``demo-2…``); a rank without comm
    time reads ``-``, not ``- s (x-)``; tokens/s in the one number format."""
    from rich.console import Console

    from trainmon.monitor.analysis.report import print_runs

    console = Console(width=80, record=True, emoji=False, file=open(os.devnull, "w"))  # noqa: SIM115
    row = {"run": "demo-20261124-184946", "status": "running", "step": 41, "planned_steps": 400, "loss": 2.5,
           "tokens_per_second": 17520.4, "attempts": 2, "open_anomalies": 1, "open_kinds": ["throughput_collapse"],
           "updated_at": 1.7e9}  # fmt: skip
    print_runs([row], console)
    text = console.export_text()
    assert "demo-20261124-184946" in text and "17,520" in text and "…" not in text
    assert "demo-20261124-184946: 1 open: throughput_collapse" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    # the widest common row: a finished 400/400 demo run (cut 'open' to 'op…' and dropped the update time)
    done = {**row, "status": "finished", "step": 399, "loss": math.nan, "tokens_per_second": 39428.0,
            "attempts": 1, "open_anomalies": 2, "open_kinds": ["lr_schedule_drift", "nan_inf"],
            "updated_at": time.time() - 840}  # fmt: skip
    console = Console(width=80, record=True, emoji=False, file=open(os.devnull, "w"))  # noqa: SIM115
    print_runs([done], console)
    text = console.export_text()
    assert "…" not in text and "400/400" in text and "14m" in text and "attempts" not in text
    assert "demo-20261124-184946: 2 open: lr_schedule_drift, nan_inf" in text
    ranks = [
        {
            "rank": r,
            "host": f"node-{r}",
            "samples": 10,
            "step_time": 0.5 + 0.1 * r,
            "compute": None,
            "comm": None,
            "data": 0.01,
            "step_time_rel": 1.0 + 0.2 * r,
            "compute_rel": None,
            "comm_rel": None,
            "anomalies": [],
            "slow": r == 1,
        }
        for r in (0, 1)
    ]
    text = _terminal(_summary(ranks=ranks, world_size=2))
    assert "- s" not in text and "(x-)" not in text and "0.6 s (x1.2)" in text


def _spike_run(path: Path, rises: dict[str, float]) -> dict[str, Any]:
    """A loss spike at step 60 with per-layer grad norms every step; ``rises`` multiplies layers there."""
    from tests.events import event

    names = ["blocks.0.ln_1.bias", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight", "ln_f.weight"]
    lines = [event("run_start", {"planned_steps": 100}, run="layers", seq=0, t=1.7e9)]
    for s in range(100):
        spike = s == 60
        norms = {
            n: (1.0 + 0.05 * ((s * 7 + i) % 5)) * (rises.get(n, 1.0) if spike else 1.0) for i, n in enumerate(names)
        }
        fields = {"step": s, "loss": (3.0 - 0.005 * s) * (40.0 if spike else 1.0) + 0.01 * ((s * 3) % 7),
                  "grad_norm": 1.0 + 0.02 * ((s * 5) % 3) + (100.0 if spike else 0.0), "lr": [1e-3],
                  "tokens": 512, "step_time": 0.05, "layer_grad_norms": norms}  # fmt: skip
        lines.append(event("step", fields, run="layers", seq=s + 1, t=1.7e9 + 0.05 * (s + 1)))
    lines.append(event("run_end", {"status": "finished", "step": 99}, run="layers", seq=101, t=1.7e9 + 6))
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    storage = Storage(f"sqlite:///{path.with_suffix('.sqlite')}")
    (run,) = import_file(path, storage)
    return summarize(storage, run)


def test_layers_that_rose_together_are_one_entry_and_not_called_localised(tmp_path: Path) -> None:
    """The demo's loss spike listed three layers under it, each 'the loss_spike is localised to' another
    one (1,540x, 334x, 315x). A bad batch lifts every layer: one entry, the layers ranked, not localised."""
    s = _spike_run(tmp_path / "all.jsonl", {"ln_f.weight": 1500.0, "blocks.0.ln_1.bias": 330.0,
                                             "blocks.1.mlp.fc.weight": 300.0})  # fmt: skip
    (entry,) = [e for e in s["timeline"] if e["kind"] == "layer_grad_norm"]
    assert entry["evidence"]["layer"] == "ln_f.weight" and not entry["evidence"]["localised"]
    assert entry["message"].index("ln_f.weight") < entry["message"].index("blocks.0.ln_1.bias")
    assert "not localised" in entry["hint"] and "is localised to" not in entry["hint"]
    s = _spike_run(tmp_path / "one.jsonl", {"blocks.0.attn.qkv.weight": 800.0, "ln_f.weight": 4.0})
    (entry,) = [e for e in s["timeline"] if e["kind"] == "layer_grad_norm"]
    assert entry["evidence"]["localised"] and "localised to blocks.0.attn.qkv.weight" in entry["hint"]


def test_health_events_below_the_table_are_printed_as_text() -> None:
    """A node_health message is data (it carries a host name): rich markup in it must print literally."""
    message = "[link=https://evil.example]node-[/]7[/link]: GPU 0 at 91 C"
    health = [{"rank": 0, "host": "node-7", "events": [
        {"severity": "warning", "first_step": 3, "last_step": 9, "message": message}]}]  # fmt: skip
    text = _terminal(_summary(health=health))
    assert message in " ".join(text.split())
