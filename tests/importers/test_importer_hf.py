"""HF trainer_state.json: several eval sets, an RL run's 'loss', a preference run's metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.importers import read_events
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event


def _state(tmp_path: Path, history: list[dict], **top: object) -> Path:
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"global_step": history[-1]["step"], "max_steps": 1000, **top, "log_history": history}))
    return path


def _events(path: Path) -> list[Event]:
    return list(read_events(path))


def _two_sets(losses: list[tuple[float, float]], accs: list[tuple[float, float]], every: int = 100) -> list[dict]:
    """Trainer(eval_dataset={"squad": ..., "wiki": ...}): one entry per set at each eval, the first at step 0."""
    out: list[dict] = []
    for i, ((ls, lw), (acs, acw)) in enumerate(zip(losses, accs, strict=True)):
        s = i * every
        if s:
            out.append({"step": s, "epoch": s / 1000, "loss": 2.0 - s / 2000, "learning_rate": 1e-4, "grad_norm": 1.0})
        out.append(
            {"step": s, "epoch": s / 1000, "eval_squad_loss": ls, "eval_squad_accuracy": acs, "eval_squad_runtime": 2.0}
        )
        out.append(
            {"step": s, "epoch": s / 1000, "eval_wiki_loss": lw, "eval_wiki_accuracy": acw, "eval_wiki_runtime": 3.0}
        )
    return out


def test_several_eval_sets_are_one_eval_per_step_with_each_set_named(tmp_path: Path) -> None:
    path = _state(tmp_path, _two_sets([(1.0, 2.0), (0.9, 1.9)], [(0.5, 0.4), (0.6, 0.45)]))
    events = _events(path)
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [(e["step"], e["loss"]) for e in evals] == [(0, 1.0), (100, 0.9)]  # the eval at step 0 too
    assert evals[1]["metrics"] == {"accuracy": 0.6, "wiki/loss": 1.9, "wiki/accuracy": 0.45}
    assert evals[1]["duration"] == 5.0
    config = next(e for e in events if e.kind == "run_start").fields["config"]
    assert config["eval_sets"] == {"squad": {"primary": True}, "wiki": {"primary": False}}


def test_a_run_whose_eval_sets_all_double_and_drop_is_flagged(tmp_path: Path) -> None:
    # issue 22: named eval sets were not read at all (no eval_loss key), so this run got 'no anomalies'
    base = [(1.0, 1.2)] * 4
    worse = [(1.1, 1.3), (1.6, 1.9), (2.0, 2.4), (2.1, 2.5), (2.2, 2.5), (2.2, 2.6)]
    accs = [(0.8, 0.7)] * 4 + [(0.78, 0.68), (0.7, 0.6), (0.6, 0.5), (0.55, 0.45), (0.5, 0.45), (0.5, 0.44)]
    path = _state(tmp_path, _two_sets(base + worse, accs))
    storage = Storage("sqlite://")
    (run,) = import_file(path, storage)
    found = [a for a in summarize(storage, run)["anomalies"] if a["kind"] == "eval_regression"]
    assert found and found[0]["severity"] in ("warning", "critical") and found[0]["first_step"] in (600, 700)


def _grpo_rows(n: int, nan_at: int | None = None) -> list[dict]:
    rows = []
    for i in range(1, n + 1):
        loss = float("nan") if i == nan_at else (0.0003 if i % 3 else 0.0004)
        rows.append(
            {
                "step": 5 * i,
                "loss": loss,
                "kl": loss / 0.001,
                "reward": 0.9,
                "reward_std": 0.1,
                "rewards/correctness_reward_func/mean": 0.7,
                "frac_reward_zero_std": 0.3,
                "grad_norm": 0.6,
                "learning_rate": 5e-6,
            }
        )
    return rows


def test_an_rl_runs_loss_is_not_a_loss_curve(tmp_path: Path) -> None:
    # 88: TRL GRPO's 'loss' is beta*KL (3e-4 to 4 digits): its 0.0003 -> 0.0004 steps are not spikes
    events = _events(_state(tmp_path, _grpo_rows(40, nan_at=30)))
    steps = [e.fields for e in events if e.kind == "step"]
    assert [s["step"] for s in steps if "loss" in s] == [150] and math.isnan(
        next(s["loss"] for s in steps if "loss" in s)
    )
    config = next(e for e in events if e.kind == "run_start").fields["config"]
    assert config["loss_series"]["terms"] == [] and "reward" in config["loss_series"]["how"]
    assert any("RL run" in n for n in config["notes"])


def test_a_preference_runs_loss_is_kept_with_its_preference_metrics(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "loss": 0.6931, "rewards/accuracies": 0.0, "rewards/margins": 0.0, "rewards/chosen": 0.0,
         "logps/rejected": -433.1, "logps/chosen": -21.7, "grad_norm": 1628.4, "learning_rate": 2.5e-5},
        {"step": 10, "loss": 0.0, "rewards/accuracies": 1.0, "rewards/margins": 141.7, "rewards/chosen": 0.1,
         "logps/rejected": -1784.1, "logps/chosen": -23.8, "grad_norm": 8.1e-8, "learning_rate": 0.0},
    ]  # fmt: skip
    events = _events(_state(tmp_path, rows))
    assert [e.fields["loss"] for e in events if e.kind == "step"] == [0.6931, 0.0]
    config = next(e for e in events if e.kind == "run_start").fields["config"]
    assert config["preference"]["rewards/margins"] == [[1, 0.0], [10, 141.7]]
    assert "loss_series" not in config


def test_evaluations_without_an_eval_loss_are_said_not_judged(tmp_path: Path) -> None:
    # 91: a Seq2SeqTrainer's generation metrics only (rouge-l 71.8 -> 33.1 -> 68.9 on ~50 examples)
    rows: list[dict] = []
    for i, rl in enumerate((71.8, 33.1, 68.9), start=1):
        rows.append({"step": 500 * i, "loss": 0.3, "grad_norm": 1.0, "learning_rate": 5e-5})
        rows.append({"step": 500 * i, "eval_rouge-l": rl, "eval_bleu-4": 0.4, "eval_runtime": 20.0})
    events = _events(_state(tmp_path, rows))
    assert not [e for e in events if e.kind == "eval"]
    notes = next(e for e in events if e.kind == "run_start").fields["config"]["notes"]
    assert any("3 evaluations log no eval loss, only rouge-l, bleu-4: they are not judged" in n for n in notes)
