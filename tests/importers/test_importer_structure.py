"""Logs read by structure (``importers/structure.py``): which series is the loss, the grad norm and the
LR when no name we know is there, values that are data (``nan`` cells, blanks, zeros), the step base,
several runs in one W&B panel export, and duplicate writers in ms-swift / LLaMA-Factory JSON lines.

Each test writes a small log with a known answer; the real logs 85-95 are judged in ``test_real_logs``.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import read_events
from trainmon.monitor.importers.structure import logging_interval
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event


def _events(path: Path, **kw: Any) -> list[Event]:
    return list(read_events(path, **kw))


def _steps(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "step"]


def _start(events: list[Event]) -> dict[str, Any]:
    return next(e.fields for e in events if e.kind == "run_start")


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _summaries(path: Path) -> list[dict[str, Any]]:
    storage = Storage("sqlite://")
    return [summarize(storage, run) for run in import_file(path, storage)]


def _csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    lines = [",".join(header)] + [",".join("" if v is None else str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- which series is the loss ------------------------------------------------------------------


def test_total_of_loss_terms_is_the_loss_and_nan_cells_are_nan(tmp_path: Path) -> None:
    """A PINN's metrics.csv: component losses and their mean, no train_loss; 'nan' cells from row 30."""
    rows = []
    for s in range(40):
        v = "nan" if s >= 30 else 10.0 / (s + 1)
        rows.append([v, v, s, v, s])
    path = _csv(tmp_path / "metrics.csv", ["Copper_loss", "Air_loss", "epoch", "mean_loss", "step"], rows)
    events = _events(path)
    steps = _steps(events)
    assert len(steps) == 40 and steps[0]["loss"] == 10.0
    assert all(_nan(s["loss"]) for s in steps[30:])
    assert _start(events)["config"]["column_mapping"]["loss"] == "mean_loss"
    (s,) = _summaries(path)
    (nan,) = [a for a in s["anomalies"] if a["kind"] == "nan_inf"]
    assert nan["first_step"] == 30 and nan["severity"] == "critical"


def test_terms_without_a_total_are_summed_and_any_nan_makes_the_step_nan(tmp_path: Path) -> None:
    """A GAN: two players' losses, no total; the generator's is nan from the first row."""
    rows = [[s, s // 4, 1.6e24 if s == 0 else "nan", "nan"] for s in range(12)]
    path = _csv(tmp_path / "metrics.csv", ["step", "epoch", "train_disc_loss", "train_gen_loss"], rows)
    events = _events(path)
    assert all(_nan(s["loss"]) for s in _steps(events)) and len(_steps(events)) == 12
    cfg = _start(events)["config"]
    assert cfg["column_mapping"]["loss"] == "train_disc_loss + train_gen_loss"
    assert cfg["loss_series"]["how"] == "sum of terms"
    (s,) = _summaries(path)
    (nan,) = [a for a in s["anomalies"] if a["kind"] == "nan_inf"]
    assert nan["first_step"] == 0 and "first logged step" in nan["message"]
    # one finite value, then the rest blank: no crash, the single point is the loss
    one = _csv(tmp_path / "one.csv", ["step", "gen_loss", "disc_loss"], [[0, 1.0, 2.0], [1, None, None]])
    assert [s.get("loss") for s in _steps(_events(one))] == [3.0]


def test_signed_objective_is_not_a_loss_curve_but_its_nan_is(tmp_path: Path) -> None:
    """REINFORCE's loss takes both signs: not fed to the loss rules; a NaN in it still is."""
    rows = [[s, -20.0 + (s % 7) * 6.0 if s != 30 else "nan", -110.0 + s * 0.01] for s in range(40)]
    path = _csv(tmp_path / "metrics.csv", ["step", "train/loss", "train/reward"], rows)
    events = _events(path)
    steps = _steps(events)
    assert len(steps) == 40
    assert [s["step"] for s in steps if "loss" in s] == [30] and _nan(steps[30]["loss"])
    cfg = _start(events)["config"]
    assert cfg["loss_series"]["terms"] == [] and "train/loss" in cfg["loss_series"]["not_judged"]
    assert any("not a loss curve" in n for n in cfg["notes"])


def test_rl_terms_and_rewards_are_not_losses_grad_norms_combined(tmp_path: Path) -> None:
    """A MAPPO W&B export: _step not the first column, per-agent objective/critic/entropy losses, rewards,
    per-term grad norms, blank eval cells."""
    header = [
        "collection/a/reward/episode_reward_mean",
        "train/a/loss_objective",
        "train/a/loss_critic",
        "train/a/loss_entropy",
        "train/a/grad_norm_loss_objective",
        "train/a/grad_norm_loss_critic",
        "eval/a/reward/episode_reward_mean",
        "_timestamp",
        "_step",
    ]
    rows = [
        [-7 + s * 0.1, 0.05 * (-1) ** s, 0.01 * (1 + s), -0.05, 0.3, 0.4, -0.5 if s % 10 == 9 else None, 1e9 + s, s]
        for s in range(30)
    ]
    path = _csv(tmp_path / "wandb_export.csv", header, rows)
    events = _events(path)
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(30))
    assert all("loss" not in s for s in steps)  # nothing here is a loss curve
    assert steps[0]["grad_norm"] == pytest.approx(0.5)  # sqrt(0.3^2 + 0.4^2)
    cfg = _start(events)["config"]
    assert set(cfg["loss_series"]["not_judged"]) == {
        "train/a/loss_objective",
        "train/a/loss_critic",
        "train/a/loss_entropy",
    }
    assert not any(e.kind == "eval" for e in events)  # a reward is not an eval loss, a blank is not 0


def test_lr_param_groups_stay_apart(tmp_path: Path) -> None:
    """YOLOv5's x/lr0..x/lr2: one LR per param group, in group order, not one series."""
    rows = [[s, 1.0 / (s + 1), 0.1 - s * 0.01, s * 0.001, s * 0.001] for s in range(5)]
    path = _csv(tmp_path / "results.csv", ["step", "train/box_loss", "x/lr0", "x/lr1", "x/lr2"], rows)
    steps = _steps(_events(path))
    assert steps[2]["lr"] == pytest.approx([0.08, 0.002, 0.002])


# --- step base -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "every", "n", "steps"),
    [(1, 1, 200, 200), (0, 1, 200, 200), (10, 10, 20, 200), (0, 10, 20, 191), (49, 50, 10, 500)],
)
def test_steps_count_what_the_log_covers(tmp_path: Path, first: int, every: int, n: int, steps: int) -> None:
    """Steps 1..N logged are N steps (not N+1); a log with a step 0 counts from 0."""
    rows = [[first + i * every, 3.0 - i * 0.001] for i in range(n)]
    path = _csv(tmp_path / "log.csv", ["iteration", "loss"], rows)
    (s,) = _summaries(path)
    assert s["steps"] == steps


# --- several runs in one W&B panel export --------------------------------------------------------

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "importers"


def test_wandb_panel_export_of_several_runs_analyses_each() -> None:
    """Three runs side by side: each is imported as its own run; the diverging one is flagged, not hidden
    behind the first run."""
    summaries = _summaries(FIX / "wandb_panel_three_runs.csv")
    assert [s["run"].rsplit("-", 1)[-1] for s in summaries] == ["a", "b", "c"]
    assert all(s["steps_logged"] == 60 for s in summaries)
    flagged = {s["run"].rsplit("-", 1)[-1] for s in summaries if s["anomalies"]}
    assert "c" in flagged and "a" not in flagged
    # the user can pick one run by naming its column
    events = _events(FIX / "wandb_panel_three_runs.csv", mapping="loss=sweep-b - train/loss")
    assert len([e for e in events if e.kind == "run_start"]) == 1


# --- duplicate writers --------------------------------------------------------------------------


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _swift2(step: int, loss: float, speed: float) -> dict[str, Any]:
    return {
        "loss": loss,
        "acc": 0.5,
        "grad_norm": 2.0,
        "learning_rate": 1e-5,
        "train_speed(iter/s)": speed,
        "epoch": round(step / 100, 2),
        "global_step": step,
    }


def test_ms_swift_2x_rows_with_two_writers_are_read_once(tmp_path: Path) -> None:
    """ms-swift 2.x: integer global_step; every line written twice by two processes (only the speed differs),
    one copy lost; an eval twice with its own runtime. One attempt, one note, each step once."""
    rows: list[dict[str, Any]] = []
    steps = [1, *range(5, 101, 5)]
    for s in steps:
        loss = 3.0 / s
        rows.append(_swift2(s, loss, 0.3))
        if s != 50:
            rows.append(_swift2(s, loss, 0.5))
        if s == 50:
            for rt in (29.7, 29.9):
                rows.append({"eval_loss": 0.4, "eval_acc": 0.9, "eval_runtime": rt, "epoch": 0.5, "global_step": 50})
    rows.append({"train_runtime": 100.0, "train_loss": 0.2, "epoch": 1.0, "global_step": 100})
    path = _write(tmp_path / "logging.jsonl", rows)
    events = _events(path)
    assert [s["step"] for s in _steps(events)] == steps
    assert len([e for e in events if e.kind == "eval"]) == 1
    assert len([e for e in events if e.kind == "run_start"]) == 1
    cfg = _start(events)["config"]
    assert cfg["duplicate_lines"] == {"train": len(steps) - 1, "eval": 1}
    assert cfg["loss_mean_over_steps"] == 5  # HF logs the mean over the logging interval
    (s,) = _summaries(path)
    assert s["attempts"] == 1 and s["status"] == "finished" and s["steps"] == 100


def test_llamafactory_two_writers_are_not_attempts_a_real_restart_is(tmp_path: Path) -> None:
    """LLaMA-Factory: two writers a second or two apart (elapsed differs) are not 672 failed attempts; the
    step going back with different values is one restart."""
    rows = []
    for s in range(10, 201, 10):
        for lag in (0, 2):
            rows.append(
                {
                    "current_steps": s,
                    "total_steps": 300,
                    "loss": 2.0 - s / 1000,
                    "lr": 1e-4,
                    "epoch": s / 100,
                    "elapsed_time": f"0:{(s * 3 + lag) // 60:02d}:{(s * 3 + lag) % 60:02d}",
                }
            )
    # a restart from the checkpoint at 100: the step goes back, the values differ
    for s in range(110, 301, 10):
        rows.append(
            {
                "current_steps": s,
                "total_steps": 300,
                "loss": 1.5 - s / 1000,
                "lr": 1e-4,
                "epoch": s / 100,
                "elapsed_time": f"0:{(s - 100) * 3 // 60:02d}:{(s - 100) * 3 % 60:02d}",
            }
        )
    path = _write(tmp_path / "trainer_log.jsonl", rows)
    (s,) = _summaries(path)
    assert s["attempts"] == 2
    assert math.isclose(s["final_loss"], 1.2)


# --- TensorBoard files of other trainers ---------------------------------------------------------


def _tb_events(tmp_path: Path, name: str, write: Any) -> list[Event]:
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard not installed (SummaryWriter needs it)")
    w = tb.SummaryWriter(str(tmp_path / name))
    write(w)
    w.close()
    return _events(tmp_path / name)


def test_tensorboard_detection_losses_lr_groups_and_images(tmp_path: Path) -> None:
    """YOLOv5: per-epoch box/obj/cls losses (no total), x/lr0..x/lr2, an image summary and a graph beside them."""
    np = pytest.importorskip("numpy")

    def write(w: Any) -> None:
        for e in range(20):
            for tag, v in (("train/box_loss", 0.1), ("train/obj_loss", 0.04), ("train/cls_loss", 0.02)):
                w.add_scalar(tag, v / (1 + e / 10), e)
            w.add_scalar("metrics/mAP_0.5", 0.1 + e * 0.04, e)
            for g, lr in enumerate((0.07 - e * 0.003, 0.003 + e * 0.001, 0.003 + e * 0.001)):
                w.add_scalar(f"x/lr{g}", lr, e)
        w.add_image("results", np.zeros((3, 8, 8), dtype=np.uint8), 19)
        w.add_text("hyp", "lr0: 0.01", 0)
        torch = pytest.importorskip("torch")
        w.add_graph(torch.nn.Linear(2, 2), torch.zeros(1, 2))  # a graph_def event (and its run metadata)

    events = _tb_events(tmp_path, "yolo", write)
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(20))
    assert steps[0]["loss"] == pytest.approx(0.16, rel=1e-6)
    assert steps[5]["lr"] == pytest.approx([0.055, 0.008, 0.008], rel=1e-5)
    cfg = _start(events)["config"]
    assert cfg["tag_mapping"]["loss"] == "train/box_loss + train/cls_loss + train/obj_loss"
    assert cfg["step_base"] == 0


def test_tensorboard_megatron_tags(tmp_path: Path) -> None:
    """Megatron-LM's own vocabulary: 'lm loss', 'grad-norm', 'learning-rate', 'iteration-time', 'loss-scale',
    and the same loss against samples (not a second loss); iterations counted from 1."""

    def write(w: Any) -> None:
        for it in range(1, 31):
            w.add_scalar("lm loss", 10.0 - it * 0.1, it)
            w.add_scalar("lm loss vs samples", 10.0 - it * 0.1, it * 512)
            w.add_scalar("grad-norm", 1.5, it)
            w.add_scalar("learning-rate", 1e-4 * min(1, it / 10), it)
            w.add_scalar("iteration-time", 0.8, it)
            w.add_scalar("loss-scale", 65536.0, it)
        w.add_scalar("lm loss validation", 9.0, 30)

    events = _tb_events(tmp_path, "megatron", write)
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(1, 31))
    assert steps[0] == {
        "step": 1,
        "loss": pytest.approx(9.9),
        "grad_norm": 1.5,
        "lr": [pytest.approx(1e-5)],
        "step_time": pytest.approx(0.8),
        "loss_scale": 65536.0,
    }
    assert [e.fields["loss"] for e in events if e.kind == "eval"] == [9.0]
    assert _start(events)["config"]["step_base"] == 1  # iteration 1 is the first: 30 iterations, not 31


def test_tensorboard_rl_losses_are_not_a_loss_curve(tmp_path: Path) -> None:
    """Stable-Baselines3 PPO: a signed train/loss, value/policy/entropy terms and an episode reward."""

    def write(w: Any) -> None:
        for s in range(0, 40960, 2048):
            w.add_scalar("rollout/ep_rew_mean", -200 + s / 100, s)
            w.add_scalar("train/loss", 0.5 if s % 4096 else -0.2, s)
            w.add_scalar("train/value_loss", 20 + s / 1000, s)
            w.add_scalar("train/policy_gradient_loss", -0.01, s)
            w.add_scalar("train/entropy_loss", -1.2, s)

    events = _tb_events(tmp_path, "ppo", write)
    steps = _steps(events)
    assert len(steps) == 20 and not any("loss" in s for s in steps)
    assert any("not a loss curve" in n for n in _start(events)["config"]["notes"])


# --- several evaluation sets ---------------------------------------------------------------------


def _evals(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "eval"]


def test_csv_eval_sets_each_with_its_own_loss_and_accuracy_and_an_eval_at_step_0(tmp_path: Path) -> None:
    """Two eval sets named by the set (eval/wiki/*, eval/books/*), evaluated at step 0 before training and
    every 50 steps; blank cells elsewhere. Before: neither set was recognised, no eval at all."""
    header = ["_step", "train/loss", "eval/wiki/loss", "eval/wiki/accuracy", "eval/books/loss", "eval/books/accuracy"]
    rows = []
    for s in range(0, 201, 10):
        ev = s % 50 == 0
        wiki = [3.1 - s / 200, 0.3 + s / 1000] if ev else [None, None]
        books = [4.0 + s / 100, 0.5 - s / 1000] if ev else [None, None]
        rows.append([s, 3.0 - s / 100, *wiki, *books])
    events = _events(_csv(tmp_path / "wandb_export.csv", header, rows))
    evals = _evals(events)
    assert [e["step"] for e in evals] == [0, 50, 100, 150, 200]
    assert evals[2]["loss"] == pytest.approx(2.6)  # wiki's, the first set
    assert evals[2]["metrics"] == {
        "accuracy": pytest.approx(0.4),
        "books/loss": pytest.approx(5.0),
        "books/accuracy": pytest.approx(0.4),
    }
    cfg = _start(events)["config"]
    assert set(cfg["eval_sets"]) == {"wiki", "books"} and cfg["eval_sets"]["wiki"]["primary"]


def test_tensorboard_lightning_eval_dataloaders_are_sets(tmp_path: Path) -> None:
    def write(w: Any) -> None:
        for s in range(0, 100, 10):
            w.add_scalar("train_loss_step", 2.0 - s / 100, s)
        for s in (0, 49, 99):
            for k in (0, 1):
                w.add_scalar(f"val_loss/dataloader_idx_{k}", 2.0 + k - s / 100, s)
                w.add_scalar(f"val_acc/dataloader_idx_{k}", 0.5 + s / 1000, s)

    evals = _evals(_tb_events(tmp_path, "lightning", write))
    assert [e["step"] for e in evals] == [0, 49, 99]
    assert evals[1]["loss"] == pytest.approx(1.51, rel=1e-5)
    assert evals[1]["metrics"]["dataloader_idx_1/loss"] == pytest.approx(2.51, rel=1e-5)
    assert set(evals[1]["metrics"]) == {"acc", "dataloader_idx_1/loss", "dataloader_idx_1/acc"}


def test_ms_swift_eval_lines_of_named_sets_are_one_eval_per_step(tmp_path: Path) -> None:
    """HF's Trainer with a dict of eval datasets logs one line per set (eval_squad_loss, eval_wiki_loss ...),
    at step 0 before training too; ms-swift copies them. Before: no eval_loss key, so no eval was read."""
    rows: list[dict[str, Any]] = []
    for s in range(0, 101, 10):
        if s:
            rows.append({"loss": 2.0 - s / 100, "global_step/max_steps": f"{s}/100", "elapsed_time": f"{s}s"})
        if s % 50 == 0:
            for name, base in (("squad", 1.5), ("wiki", 2.5)):
                rows.append(
                    {
                        f"eval_{name}_loss": base + s / 100,
                        f"eval_{name}_accuracy": 0.6 - s / 1000,
                        f"eval_{name}_runtime": 3.0,
                        "global_step/max_steps": f"{s}/100",
                    }
                )
    events = _events(_write(tmp_path / "logging.jsonl", rows))
    evals = _evals(events)
    assert [e["step"] for e in evals] == [0, 50, 100]
    assert evals[1]["loss"] == pytest.approx(2.0)
    assert evals[1]["metrics"] == {
        "accuracy": pytest.approx(0.55),
        "wiki/loss": pytest.approx(3.0),
        "wiki/accuracy": pytest.approx(0.55),
    }


def test_llamafactory_two_writers_keep_a_resume_shown_by_the_clock(tmp_path: Path) -> None:
    """Two writers a few seconds apart, and a relaunch from the checkpoint at step 100 that goes on at 110:
    the step does not go back, the elapsed time (both writers') starts again. One resume, not 20 attempts
    and not none."""

    def line(s: int, elapsed: int) -> dict[str, Any]:
        return {
            "current_steps": s,
            "total_steps": 200,
            "loss": 2.0 - s / 1000,
            "lr": 1e-4,
            "epoch": s / 100,
            "elapsed_time": f"0:{elapsed // 60:02d}:{elapsed % 60:02d}",
        }

    rows = []
    for s in range(10, 201, 10):
        t = s * 3 if s <= 100 else (s - 100) * 3
        rows += [line(s, t), line(s, t + 3)]
    (s,) = _summaries(_write(tmp_path / "trainer_log.jsonl", rows))
    assert s["attempts"] == 2


def test_auxiliary_terms_beside_the_main_loss_are_not_summed_in(tmp_path: Path) -> None:
    """An MoE run's lm loss beside its load-balancing and z losses: the lm loss is the loss; a spike of the
    balancing loss is not the model's loss spiking, but its NaN still is a NaN."""
    rows = [[s, 3.0 - s / 100, 0.01 if s != 7 else 5.0, 1e-4 if s != 9 else "nan"] for s in range(1, 11)]
    path = _csv(tmp_path / "moe.csv", ["iteration", "lm loss", "load_balancing_loss", "z_loss"], rows)
    events = _events(path)
    losses = [s["loss"] for s in _steps(events)]
    assert losses[6] == pytest.approx(2.93) and _nan(losses[8])
    cfg = _start(events)["config"]
    assert cfg["column_mapping"]["loss"] == "lm loss"
    assert set(cfg["loss_series"]["not_judged"]) == {"load_balancing_loss", "z_loss"}


def test_tensorboard_cleanrl_tags(tmp_path: Path) -> None:
    """CleanRL's PPO: losses/* beside charts/episodic_return, the LR under charts/."""

    def write(w: Any) -> None:
        for s in range(0, 20480, 512):
            w.add_scalar("charts/episodic_return", 20 + s / 100, s)
            w.add_scalar("charts/learning_rate", 2.5e-4 * (1 - s / 20480), s)
            w.add_scalar("losses/value_loss", 10 + s / 1000, s)
            w.add_scalar("losses/policy_loss", -0.01, s)
            w.add_scalar("losses/entropy", 0.69, s)

    events = _tb_events(tmp_path, "cleanrl", write)
    steps = _steps(events)
    assert len(steps) == 40 and not any("loss" in s for s in steps)
    assert steps[1]["lr"] == [pytest.approx(2.5e-4 * (1 - 512 / 20480))]
    assert set(_start(events)["config"]["loss_series"]["not_judged"]) == {"losses/value_loss", "losses/policy_loss"}


def test_one_row_per_epoch_tables(tmp_path: Path) -> None:
    """Ultralytics' results.csv (padded headers, epochs from 1, three detection losses, lr/pg0..2) and
    Keras' CSVLogger (epochs from 0): the epoch is the step when the table has no other."""
    header = ["                  epoch", "      train/box_loss", "      train/cls_loss", "      train/dfl_loss"]
    header += ["   metrics/mAP50(B)", "        val/box_loss", "        val/cls_loss", "        val/dfl_loss"]
    header += ["               lr/pg0", "               lr/pg1", "               lr/pg2"]
    rows = [
        [e, 1.5 / e, 2.0 / e, 1.2 / e, 0.1 * e, 1.4 / e, 1.9 / e, 1.1 / e, 0.07 - e * 0.001, 0.001 * e, 0.001 * e]
        for e in range(1, 11)
    ]
    path = _csv(tmp_path / "results.csv", header, rows)
    events = _events(path)
    steps = _steps(events)
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert steps[0]["loss"] == pytest.approx(4.7) and steps[0]["lr"] == pytest.approx([0.069, 0.001, 0.001])
    assert [e.fields["step"] for e in events if e.kind == "eval"] == list(range(1, 11))
    (s,) = _summaries(path)
    assert s["steps"] == 10  # epochs 1..10 are 10 epochs
    keras = _csv(
        tmp_path / "training.log.csv",
        ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"],
        [[e, 0.5 + e / 100, 1.0 - e / 100, 0.5, 1.1 - e / 200] for e in range(20)],
    )
    events = _events(keras)
    assert len(_steps(events)) == 20
    assert next(e.fields["metrics"] for e in events if e.kind == "eval") == {"accuracy": 0.5}
    (s,) = _summaries(keras)
    assert s["steps"] == 20


def _sorted_interval(steps: list[Any]) -> Any:
    """The logging interval as every importer computed it before ``logging_interval``: Python's sorted gaps."""
    gaps = sorted(b - a for a, b in itertools.pairwise(steps) if b > a)
    return gaps[len(gaps) // 2] if gaps else None


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(0, 40), st.integers(0, 2**53), st.integers(-(2**70), 2**70), st.floats(0, 1e6)),
        max_size=40,
    )
)
@example([0, 2**62, 2**62 + 1])
@example([-5, 10, 20])
@example([1.5, 3.0, 4.5])
def test_logging_interval_is_the_upper_middle_rise(steps: list[Any]) -> None:
    """The array path (ints that fit) and the Python one give the sorted gaps' upper middle, type and all."""
    got, want = logging_interval(steps), _sorted_interval(steps)
    assert got == want and type(got) is type(want)
