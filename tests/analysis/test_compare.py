"""``trainmon.monitor.analysis.compare`` and ``trainmon compare``: synthetic stories with known answers, then real runs.

The headline story is seed 004's TP seeding bug: the run with tensor parallelism was
"consistently worse" than its reference, which only a side-by-side with the noise taken
into account makes a finding rather than an impression.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import start_collector
from tests.events import event
from tests.trainer_helpers import ROOT, TINY, run_trainer
from trainmon.monitor.analysis.compare import compare, load_run, noise_sigma, series_from_arrays
from trainmon.monitor.analysis.postmortem import import_file
from trainmon.monitor.cli import main
from trainmon.monitor.store.storage import Storage

STEPS = 2000
NOISE = 0.03


def _curve(steps: np.ndarray) -> np.ndarray:
    return 2.2 + 2.5 * np.exp(-steps / 250)


def _tp_story(seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A reference and a run that falls behind from step 1,200, settling 0.08 nats worse."""
    rng = np.random.default_rng(seed)
    s = np.arange(STEPS, dtype=float)
    a = _curve(s) + rng.normal(0, NOISE, STEPS)
    gap = np.where(s >= 1200, 0.08 * (1 - np.exp(-(s - 1200) / 40)), 0.0)
    b = _curve(s) + gap + rng.normal(0, NOISE, STEPS)
    return s, a, b


def _lr(steps: np.ndarray, peak: float = 3e-4, total: int = STEPS) -> np.ndarray:
    warm = np.minimum(1.0, (steps + 1) / 100)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * np.minimum(steps, total) / total)))


def test_noise_sigma_ignores_trend_and_spikes() -> None:
    rng = np.random.default_rng(1)
    s = np.arange(3000, dtype=float)
    x = _curve(s) + rng.normal(0, 0.05, len(s))
    x[[100, 900, 2000]] += 3.0
    assert noise_sigma(x) == pytest.approx(0.05, rel=0.1)


def test_tp_seeding_story_names_step_and_direction() -> None:
    s, a, b = _tp_story()
    result = compare(series_from_arrays("ref", s, a, _lr(s)), series_from_arrays("tp", s, b, _lr(s)))
    loss = result["loss"]
    assert result["differs"] and loss["verdict"] == "worse"
    assert loss["direction"] == "worse"
    assert 1200 <= loss["from_step"] <= 1260
    assert loss["gap"] == pytest.approx(0.08, abs=0.01)
    assert loss["noise_a"] == pytest.approx(NOISE, rel=0.15)
    assert "B is consistently worse than A by 0.0" in result["summary"][0]
    assert f"from step {loss['from_step']:,}" in result["summary"][0]
    # the same story the other way round: A is better, so B (the reference) reads "better"
    flipped = compare(series_from_arrays("tp", s, b), series_from_arrays("ref", s, a))
    assert flipped["loss"]["direction"] == "better"
    assert abs(flipped["loss"]["from_step"] - loss["from_step"]) <= 5


def test_identical_runs_no_divergence() -> None:
    s, a, _ = _tp_story()
    result = compare(series_from_arrays("a", s, a, _lr(s)), series_from_arrays("b", s, a.copy(), _lr(s)))
    assert result["loss"]["verdict"] == "within noise"
    assert not result["differs"]
    assert result["summary"][0].startswith("within noise")
    assert result["lr"]["differs"] is False


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_same_curve_independent_noise_and_a_spike_stay_within_noise(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = np.arange(STEPS, dtype=float)
    a = _curve(s) + rng.normal(0, NOISE, STEPS)
    b = _curve(s) + rng.normal(0, NOISE, STEPS)
    b[700] += 2.0  # one loss spike is a spike, not a gap
    result = compare(series_from_arrays("a", s, a), series_from_arrays("b", s, b))
    assert result["loss"]["verdict"] == "within noise", result["summary"]


def test_transient_gap_that_closes() -> None:
    rng = np.random.default_rng(3)
    s = np.arange(STEPS, dtype=float)
    a = _curve(s) + rng.normal(0, NOISE, STEPS)
    b = _curve(s) + 0.2 * np.exp(-(((s - 500) / 80) ** 2)) + rng.normal(0, NOISE, STEPS)
    loss = compare(series_from_arrays("a", s, a), series_from_arrays("b", s, b))["loss"]
    assert loss["verdict"] == "transient"
    t = loss["transient"]
    assert t["direction"] == "worse"
    assert t["from_step"] < 500 < t["to_step"]
    assert t["peak_gap"] == pytest.approx(0.2, abs=0.03)


def test_lr_schedule_shape_difference() -> None:
    s, a, _ = _tp_story()
    lr_b = np.where(s < 500, _lr(s), _lr(s, total=STEPS // 4))  # e.g. a scheduler sized for a quarter of the run
    result = compare(series_from_arrays("a", s, a, _lr(s)), series_from_arrays("b", s, a, lr_b))
    lr = result["lr"]
    assert lr["differs"] and lr["constant_ratio"] is False
    assert 500 <= lr["first_step"] <= 520
    assert "schedules differ in shape" in result["summary"][1]
    peak = compare(series_from_arrays("a", s, a, _lr(s)), series_from_arrays("b", s, a, 2 * _lr(s)))["lr"]
    assert peak["first_step"] == 0 and peak["ratio"] == pytest.approx(2) and peak["constant_ratio"]


def test_align_by_tokens_with_a_bigger_batch() -> None:
    """B takes 2,048-token steps, A 1,024: by step B is far ahead, by tokens they match."""
    rng = np.random.default_rng(11)
    sa = np.arange(STEPS, dtype=float)
    sb = np.arange(STEPS // 2, dtype=float)
    a = _curve(sa) + rng.normal(0, NOISE, len(sa))
    b = _curve(2 * sb + 1) + rng.normal(0, NOISE, len(sb))  # B's step k ends where A's step 2k+1 ends
    ra = series_from_arrays("a", sa, a, tokens=np.full(len(sa), 1024), step_time=np.full(len(sa), 0.1))
    rb = series_from_arrays("b", sb, b, tokens=np.full(len(sb), 2048), step_time=np.full(len(sb), 0.2))
    by_tokens = compare(ra, rb, by="tokens")
    assert by_tokens["loss"]["verdict"] == "within noise", by_tokens["summary"]
    assert by_tokens["aligned_points"] == len(sb)
    by_step = compare(ra, rb, by="step")
    assert by_step["loss"]["verdict"] == "better" == by_step["loss"]["direction"]


def test_throughput_names_the_slower_phase() -> None:
    s = np.arange(200, dtype=float)
    loss = _curve(s)
    phases_a = {"data": np.full(200, 0.01), "forward": np.full(200, 0.03), "backward": np.full(200, 0.06)}
    phases_b = dict(phases_a, data=np.full(200, 0.11))  # a dataloader stall: 0.1 s more per step
    ra = series_from_arrays("a", s, loss, tokens=np.full(200, 4096), step_time=np.full(200, 0.1), phases=phases_a)
    rb = series_from_arrays("b", s, loss, tokens=np.full(200, 4096), step_time=np.full(200, 0.2), phases=phases_b)
    result = compare(ra, rb)
    t = result["throughput"]
    assert t["ratio"] == pytest.approx(0.5)
    assert t["phase"] == "data" and t["phase_ratio"] == pytest.approx(11)
    assert "the data phase changed most" in " ".join(result["summary"])


# -- through files, the CLI and a store ------------------------------------------------------------


def _write_run(path: Path, run: str, losses: np.ndarray, lrs: np.ndarray, config: dict[str, Any]) -> Path:
    t0 = 1_700_000_000.0
    events = [
        event("run_start", {"config": config, "world_size": 1, "vocab_size": 64}, run=run, stream=run, seq=0, t=t0)
    ]
    for i, (loss, lr) in enumerate(zip(losses, lrs, strict=True)):
        fields = {"step": i, "loss": float(loss), "lr": [float(lr)], "tokens": 1024, "step_time": 0.1}
        fields["phases"] = {"data": 0.01, "forward": 0.03, "backward": 0.05, "optimizer": 0.01}
        events.append(event("step", fields, run=run, stream=run, seq=len(events), t=t0 + 0.1 * (i + 1)))
        if i % 500 == 499:
            ev = {"step": i, "loss": float(np.median(losses[i - 20 : i + 1]))}
            events.append(event("eval", ev, run=run, stream=run, seq=len(events), t=t0 + 0.1 * (i + 1)))
    events.append(
        event("run_end", {"status": "finished", "step": len(losses) - 1}, run=run, stream=run, seq=len(events))
    )
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _stored_story(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The TP story's two runs as files, and a store holding both."""
    s, a, b = _tp_story()
    fa = _write_run(tmp_path / "ref.jsonl", "smol-ref", a, _lr(s), {"tp": 1, "seed": 42})
    fb = _write_run(tmp_path / "tp.jsonl", "smol-tp", b, _lr(s), {"tp": 2, "seed": 42})
    db = tmp_path / "store.sqlite"
    store = Storage(str(db))
    import_file(fa, store)
    import_file(fb, store)
    store.close()
    return fa, fb, db


def test_cli_files_and_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fa, fb, db = _stored_story(tmp_path)
    assert main(["compare", str(fa), str(fb), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loss"]["verdict"] == "worse" == out["loss"]["direction"]
    assert 1200 <= out["loss"]["from_step"] <= 1260
    assert out["config_differences"] == {"tp": [1, 2]}
    assert out["eval"]["common"] == 4 and out["eval"]["final_gap"] > 0.05
    assert out["throughput"]["ratio"] == pytest.approx(1.0)

    assert main(["compare", "smol-ref", "smol-tp", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"]["from_step"] == out["loss"]["from_step"]
    assert main(["compare", "smol-ref", "smol-tp", "--db", str(db)]) == 0
    assert "B is consistently worse than A" in capsys.readouterr().out.replace("\n", " ")
    assert main(["compare", "smol-ref", "nope", "--db", str(db)]) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_runs_on_a_collector_read_as_in_its_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--url``: run ids on a collector give the comparison their store gives (the same series, read through the
    run's export), a file beside a run id works too, and a run the collector lacks is an error naming it."""
    fa, _, db = _stored_story(tmp_path)
    assert main(["compare", "smol-ref", "smol-tp", "--db", str(db), "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    collector = start_collector(db)
    try:
        assert main(["compare", "smol-ref", "smol-tp", "--url", collector.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == stored
        assert main(["compare", str(fa), "smol-tp", "--url", collector.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["loss"] == stored["loss"]
        assert main(["compare", "smol-ref", "nope", "--url", collector.url]) == 2
        err = capsys.readouterr().err
        assert "nope" in err and collector.url in err
    finally:
        collector.stop()
    assert main(["compare", "smol-ref", "smol-tp", "--url", collector.url]) == 2  # nothing answers there now
    assert "smol-ref" in capsys.readouterr().err


# -- real reference-trainer runs -------------------------------------------------------------------

REAL = [*TINY, "--eval-every", "20", "--heartbeat-interval", "0", "--health-interval", "0"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare-runs")
    runs = {"seed1": ["--seed", "1"], "seed2": ["--seed", "2"], "lr": ["--seed", "1", "--lr", "0.01"]}
    for name, extra in runs.items():
        run_trainer(root / name, *REAL, *extra, steps=80, run=name)
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_real_runs_different_seeds_within_noise(real_runs: dict[str, Path]) -> None:
    result = compare(load_run(str(real_runs["seed1"])), load_run(str(real_runs["seed2"])))
    assert result["loss"]["verdict"] == "within noise", result["summary"]
    assert result["lr"]["differs"] is False
    assert result["config_differences"] == {"seed": [1, 2]}


@pytest.mark.slow
def test_real_runs_different_lr_cli(real_runs: dict[str, Path]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "trainmon.monitor.cli",
        "compare",
        str(real_runs["seed1"]),
        str(real_runs["lr"]),
        "--json",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout)
    assert out["lr"]["first_step"] == 1  # warmup starts from 0: both LRs are 0 at step 0
    assert out["lr"]["ratio"] == pytest.approx(0.01 / 0.003) and out["lr"]["constant_ratio"]
    assert out["loss"]["verdict"] in ("better", "worse", "transient")  # a higher LR learns this toy task faster
    direction = out["loss"].get("direction") or out["loss"]["transient"]["direction"]
    assert direction == "better"
    assert out["config_differences"]["lr"] == [0.003, 0.01]
    assert math.isfinite(out["eval"]["final_gap"]) and out["eval"]["final_gap"] < 0


def test_two_imported_logs_compare_hyperparameters_not_importer_internals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two nanoGPT/llm.c text logs: how each was read (line shapes, missing signals, the clock) is
    not a difference between the runs."""
    logs = Path("/work/shared/real-logs")
    a, b = logs / "39_llmc-gpt2-124m-mainlog.log", logs / "43_build-nanogpt-nowarmup.txt"
    if not (a.exists() and b.exists()):
        pytest.skip("the real logs are not on this machine")
    assert main(["compare", str(a), str(b), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    internals = {"line_shapes", "missing_signals", "imported_from", "format", "synthetic_time", "step_base"}
    assert not {k.split(".")[0] for k in out["config_differences"]} & internals, out["config_differences"]
    assert out["loss"]["verdict"] in ("worse", "better", "transient", "within noise", "too short")
    assert "diverged" not in " ".join(out["summary"])


def test_a_noisier_b_gets_the_shuffling_line_and_equal_noise_does_not() -> None:
    """SmolLM3's loader change: the same curve, three times the step-to-step noise in B."""
    rng = np.random.default_rng(3)
    s = np.arange(STEPS, dtype=float)
    a = _curve(s) + rng.normal(0, NOISE, STEPS)
    noisy = _curve(s) + rng.normal(0, 3 * NOISE, STEPS)
    result = compare(series_from_arrays("ref", s, a, _lr(s)), series_from_arrays("loader", s, noisy, _lr(s)))
    assert result["noise"]["ratio"] == pytest.approx(3.0, rel=0.15)
    (line,) = [x for x in result["summary"] if x.startswith("loss noise")]
    assert "shuffling" in line
    same = _curve(s) + rng.normal(0, NOISE, STEPS)
    result = compare(series_from_arrays("ref", s, a, _lr(s)), series_from_arrays("same", s, same, _lr(s)))
    assert result["noise"]["ratio"] == pytest.approx(1.0, rel=0.15)
    assert not any(x.startswith("loss noise") for x in result["summary"])


def test_noise_of_runs_at_different_loss_levels_is_not_blamed_on_shuffling() -> None:
    """Real logs 01 (whisper-large-v2, trained to a loss ~100x lower) vs 04 (whisper-tiny): B's noise
    in nats was '171.5x A's' with 'check sequence-level shuffling'. Noise scales with the loss."""
    logs = Path("/work/shared/real-logs")
    if not (logs / "01_whisper-large-v2-ja.json").exists():
        pytest.skip("the shared real logs are not on this machine")
    result = compare(load_run(logs / "01_whisper-large-v2-ja.json"), load_run(logs / "04_whisper-tiny-nb-100k.json"))
    assert result["noise"] is not None and result["noise"]["ratio"] > 2 and not result["noise"]["comparable"]
    assert not any(x.startswith("loss noise") for x in result["summary"]), result["summary"]
