"""DeepSpeed and DeepSpeed-Chat stdout (``monitor/importers/deepspeed.py``).

Small inline logs in the shapes of DeepSpeed-Chat's three steps and of a script with its own step
counter check each semantic the importer states: the step base, the skipped-step counter and the LR
lagging it, the loss scale as the scaler's messages state it (copies printed by every rank dropped,
ZeRO's silent doublings not carried forward), two engines kept apart, perplexity evaluations as
``ln ppl``, the missing training loss said, not invented. The real logs 106-109 are read by
``tests/importers/test_real_logs.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.importers import detect_format, read_events
from trainmon.monitor.importers.deepspeed import parse_deepspeed
from trainmon.wire import Event

T0 = "2023-04-18 01:46:"  # stamps below are T0 + seconds


def _stamp(sec: float) -> str:
    return f"[{T0}{sec:06.3f}]".replace(".", ",")


def _dist(sec: float, step: int, skipped: int, lr: float) -> str:
    return (
        f"{_stamp(sec)} [INFO] [logging.py:96:log_dist] [Rank 0] step={step}, skipped={skipped}, "
        f"lr=[{lr!r}, {lr!r}], mom=[(0.9, 0.95), (0.9, 0.95)]"
    )


def _zero_overflow(sec: float, attempted: int, to: int | None) -> str:
    tail = f"reducing to {to}" if to is not None else "but hysteresis is 2. Reducing hysteresis to 1"
    return (
        f"{_stamp(sec)} [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
        f"Attempted loss scale: {attempted}, {tail}"
    )


def _events(tmp_path: Path, text: str, name: str = "ds.log") -> list[Event]:
    path = tmp_path / name
    path.write_text(text)
    assert detect_format(path) == "textlog"
    return list(read_events(path))


def _start(events: list[Event]) -> dict[str, Any]:
    return next(e.fields for e in events if e.kind == "run_start")


def _steps(events: list[Event]) -> list[dict[str, Any]]:
    return [e.fields for e in events if e.kind == "step"]


def _sft_log() -> str:
    """DeepSpeed-Chat step 1: ZeRO's scaler, log_dist every 10 steps, a perplexity eval per epoch."""
    lines = [
        "cmd = deepspeed main.py --model_name_or_path facebook/opt-1.3b --gradient_accumulation_steps 1 "
        "--num_train_epochs 2 --deepspeed",
        "***** Running training *****",
        "***** Evaluating perplexity, Epoch 0/2 *****",
        "ppl: 4998.29638671875",
        "Beginning of Epoch 1/2, Total Micro Batches 30",
        # start-up search: 6 of the first 10 steps skipped
        _zero_overflow(1.0, 65536, None),
        *(_zero_overflow(1.5 + k, 65536 >> k, 32768 >> k) for k in range(5)),
        _dist(8.0, 10, 6, 9.65e-6),
        _dist(15.0, 20, 6, 9.6e-6),  # no overflow in 11-20: the scale (2048) is stale by now
        _dist(22.0, 30, 6, 9.5e-6),
        "***** Evaluating perplexity, Epoch 1/2 *****",
        "ppl: 2.0179834365844727",
        "Beginning of Epoch 2/2, Total Micro Batches 30",
        _zero_overflow(25.0, 65536, None),  # the scale had regrown silently to 65536
        _zero_overflow(26.0, 65536, 32768),
        _dist(30.0, 40, 8, 9.4e-6),
        *(_zero_overflow(31.0 + k, 32768 >> k, 16384 >> k) for k in range(10)),  # ten steps all skipped
        _dist(41.0, 50, 18, 9.4e-6),
        _dist(48.0, 60, 18, 9.3e-6),
        "***** Evaluating perplexity, Epoch 2/2 *****",
        "ppl: 1.9718239307403564",
        "saving the final model ...",
        f"{_stamp(55.0)} [INFO] [launch.py:460:main] Process 73593 exits successfully.",
    ]
    return "\n".join(lines) + "\n"


def test_sft_stdout_steps_lr_skips_and_no_loss(tmp_path: Path) -> None:
    events = _events(tmp_path, _sft_log())
    start = _start(events)
    cfg = start["config"]
    steps = _steps(events)
    assert [s["step"] for s in steps] == [10, 20, 30, 40, 50, 60]
    # log_dist's step=N is logged after N updates, skipped ones included: step base 1, planned = epochs x batches
    assert cfg["step_base"] == 1 and start["planned_steps"] == 60
    assert cfg["format"] == "deepspeed_chat_stdout"
    # no training loss printed: said (missing, no loss curve), never invented
    assert all("loss" not in s for s in steps)
    assert "loss" in cfg["missing_signals"] and cfg["loss_series"]["terms"] == []
    assert any("no training loss" in n for n in cfg["notes"])
    # the LR of each param group as printed; it lags the counter by the skipped steps (stated)
    assert steps[0]["lr"] == [9.65e-6, 9.65e-6]
    assert "skipped" in cfg["lr_relation"]
    # skipped: every step of the interval (50: 10 of 10), none (20, 30, 60), some (10: 6 of 10; 40: 2 of 10)
    assert [s.get("skipped") for s in steps] == [None, False, False, None, True, False]
    assert cfg["engines"][0]["skipped_steps"] == 18
    # loss scale: only on the point right after a message stated it (ZeRO doubles silently in between)
    assert [s.get("loss_scale") for s in steps] == [2048.0, None, None, 32768.0, 32.0, None]
    # real clock from the stamps; the eval before training takes the first stamp, not time 0
    times = [e.time for e in events]
    assert times == sorted(times) and min(times) > 1.6e9
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [e["step"] for e in evals] == [0, 30, 60]
    assert evals[1]["loss"] == pytest.approx(math.log(2.0179834365844727))
    assert evals[1]["metrics"]["perplexity"] == pytest.approx(2.0179834365844727)
    assert next(e for e in events if e.kind == "run_end").fields["status"] == "finished"
    assert cfg["precision"] == "fp16"


def _fused(sec: float, rank_copies: int, verb: str, a: float, b: float) -> list[str]:
    line = f"{_stamp(sec)} [INFO] [fused_optimizer.py:363:_update_scale] {verb} dynamic loss scale from {a} to {b}"
    return [line] * rank_copies


def test_fp16_optimizer_messages_of_every_rank_are_one_change(tmp_path: Path) -> None:
    """DeepSpeed-Chat step 2 (FP16_Optimizer): each scaler message printed by all 4 ranks; increases printed too."""
    lines = [
        "cmd = deepspeed main.py --model_name_or_path facebook/opt-350m --deepspeed",
        "***** Evaluating reward, Epoch 0/1 *****",
        "chosen_last_scores (higher is better) : 2.8115079402923584, acc (higher is better) : 0.4924241304397583",
        "Beginning of Epoch 1/1, Total Micro Batches 40",
        *_fused(1.0, 4, "Reducing", 65536, 32768.0),
        f"{_stamp(1.0)} [INFO] [logging.py:96:log_dist] [Rank 0] Overflow detected. Skipping step. "
        "Attempted loss scale: 65536, reducing to 32768.0",
        _dist(5.0, 10, 1, 5e-5),
        *_fused(6.0, 4, "Increasing", 32768.0, 65536.0),
        _dist(10.0, 20, 1, 4.9e-5),
        *_fused(11.0, 4, "Reducing", 65536.0, 32768.0),
        *_fused(12.0, 4, "Reducing", 32768.0, 16384.0),
        _dist(15.0, 30, 3, 4.8e-5),
        _dist(20.0, 40, 3, 4.7e-5),
        "Epoch 1/1 with loss 0.5754789632299672",
        "***** Evaluating reward, Epoch 1/1 *****",
        "chosen_last_scores (higher is better) : 2.243525981903076, acc (higher is better) : 0.6994950175285339",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    cfg = _start(events)["config"]
    steps = _steps(events)
    # the scale at every logged step (FP16_Optimizer prints its increases: no stale value)
    assert [s["loss_scale"] for s in steps] == [32768.0, 65536.0, 16384.0, 16384.0]
    scale = cfg["loss_scale"]
    assert scale["changes"] == 4 and scale["lowest"] == 16384.0 and scale["increases_printed"] is True
    assert scale["messages"] - scale["copies_dropped"] == 4  # 17 lines, 4 distinct changes
    assert any("4 copies of each change" in n for n in cfg["notes"])
    assert any("lowest value was 16384 (after step 20)" in n for n in cfg["notes"])
    # the reward evaluations carry no eval loss: recorded, not made into evals; the epoch mean is no step's loss
    assert [e for e in events if e.kind == "eval"] == []
    assert [r["acc"] for r in cfg["reward_evals"]] == pytest.approx([0.4924241304397583, 0.6994950175285339])
    assert cfg["epoch_mean_losses"] == [pytest.approx(0.5754789632299672)]
    assert all("loss" not in s for s in steps)


def _ppo_step(n: int, act: str, cri: str, reward: float, e2e: float) -> list[str]:
    return [
        f"epoch: 0|step: {n}|ppo_ep: 1|act_loss: {act}|cri_loss: {cri}|unsuper_loss: 0.0",
        f"average reward score: {reward}",
        "-" * 85,
        f"|E2E latency={e2e:.2f}s |Gather latency=0.00s (0.00%) |Generate time=2.78s (74.61%) "
        "|Training time=0.74s (19.84%) |Others=0.21 (5.55%)|CurSamplesPerSec=17.17 |AvgSamplesPerSec=10.92",
    ]


def _ppo_log(act_at_3: str = "-0.21") -> str:
    lines = [
        "cmd = deepspeed main.py --actor_model_name_or_path a --critic_model_name_or_path c --deepspeed",
        "Beginning of Epoch 1/1, Total Generation Batches 6",
        # batch 0: both engines overflow (actor first, then critic)
        _zero_overflow(1.0, 65536, None),
        _zero_overflow(1.2, 65536, None),
        *_ppo_step(0, "0.21", "0.12", -0.68, 8.0),
        _zero_overflow(9.0, 65536, 32768),  # batch 1: one overflow
        *_ppo_step(1, "0.29", "0.17", -0.06, 3.7),
        # batch 2 trains engine step 3: both engines print their log_dist line (steps_per_print 3)
        _dist(12.0, 3, 2, 5.79e-7),
        _dist(12.2, 3, 1, 3.5e-7),
        *_ppo_step(2, "-0.05", "-0.01", 0.2, 3.9),
        *_ppo_step(3, act_at_3, "0.02", 0.5, 3.8),
        *_ppo_step(4, "0.03", "-0.03", 1.1, 3.8),
        _dist(24.0, 6, 2, 1.4475e-6),
        _dist(24.2, 6, 1, 8.5e-7),
        *_ppo_step(5, "0.01", "0.01", 1.5, 3.8),
        "saving model ...",
    ]
    return "\n".join(lines) + "\n"


def test_ppo_two_engines_kept_apart_and_rl_terms_not_a_loss_curve(tmp_path: Path) -> None:
    events = _events(tmp_path, _ppo_log())
    start = _start(events)
    cfg = start["config"]
    steps = _steps(events)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5] and cfg["step_base"] == 0
    assert start["planned_steps"] == 6
    # two schedules: each step's lr lists the actor's param groups, then the critic's, on the batch they trained
    assert steps[2]["lr"] == [5.79e-7, 5.79e-7, 3.5e-7, 3.5e-7]
    assert steps[5]["lr"] == [1.4475e-6, 1.4475e-6, 8.5e-7, 8.5e-7]
    assert "lr" not in steps[3]
    # two skip counters
    assert [(e["name"], e["skipped_steps"]) for e in cfg["engines"]] == [("actor", 2), ("critic", 1)]
    # a batch is skipped when an overflow was printed while it trained
    assert [s["skipped"] for s in steps] == [True, True, False, False, False, False]
    # the loss scale is per engine and the lines do not say which: none imported
    assert all("loss_scale" not in s for s in steps)
    # act_loss / cri_loss are RL terms (signed): no loss curve, said; the reward is recorded as the task metric
    assert all("loss" not in s for s in steps)
    assert cfg["loss_series"]["terms"] == [] and set(cfg["loss_series"]["not_judged"]) >= {"actor_loss", "critic_loss"}
    assert cfg["reward"]["n"] == 6
    # E2E latency is the step time and the clock
    assert [s["step_time"] for s in steps[:2]] == [8.0, 3.7]
    times = [e.time for e in events if e.kind == "step"]
    assert times == sorted(times) and times[1] - times[0] == pytest.approx(3.7)


def test_ppo_nan_term_still_reaches_the_loss(tmp_path: Path) -> None:
    steps = _steps(_events(tmp_path, _ppo_log(act_at_3="nan")))
    assert math.isnan(steps[3]["loss"]) and all("loss" not in s for k, s in enumerate(steps) if k != 3)


def test_script_step_counter_with_gradient_accumulation(tmp_path: Path) -> None:
    """A script printing its own batch counter and perplexity ('step':N, 'ppl':X) over a GA=2 engine."""
    lines = [
        "[2022-11-24 00:51:45,963] [INFO] [logging.py:68:log_dist] [Rank 0] step=0, skipped=0, lr=[0.0, 0.0], "
        "mom=[(0.9, 0.999), (0.9, 0.999)]",
        "[2022-11-24 00:51:45,966] [INFO] [config.py:999:print]   fp16_enabled ................. False",
        "[2022-11-24 00:51:45,966] [INFO] [config.py:999:print]   bfloat16_enabled ............. False",
        "[2022-11-24 00:51:45,966] [INFO] [config.py:999:print]   gradient_accumulation_steps .. 2",
        "  Total optimization steps = 20",
        "'step':0, 'ppl': 61.800734668415046, 'seq_len': 256, 'consume layer-tokens': 18432",
        "[2022-11-24 00:52:01,509] [INFO] [logging.py:68:log_dist] [Rank 0] step=2, skipped=0, lr=[1e-06, 1e-06], "
        "mom=[(0.9, 0.999), (0.9, 0.999)]",
        "[2022-11-24 00:52:12,909] [INFO] [logging.py:68:log_dist] [Rank 0] step=4, skipped=0, lr=[2e-06, 2e-06], "
        "mom=[(0.9, 0.999), (0.9, 0.999)]",
        "'step':9, 'ppl': 131.58, 'seq_len': 264, 'consume layer-tokens': 110912",
        "[2022-11-24 00:52:27,098] [INFO] [logging.py:68:log_dist] [Rank 0] step=6, skipped=0, lr=[3e-06, 3e-06], "
        "mom=[(0.9, 0.999), (0.9, 0.999)]",
        "'step':13, 'ppl': 56.8, 'seq_len': 272, 'consume layer-tokens': 205312",
        "'step':19, 'ppl': 23.99, 'seq_len': 280, 'consume layer-tokens': 301632",
        "saving model ...",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    cfg = _start(events)["config"]
    steps = _steps(events)
    assert [s["step"] for s in steps] == [0, 9, 13, 19] and cfg["step_base"] == 0
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["precision"] == "fp32"
    # batch 9 completes engine step 5 (not printed): no LR; batch 13 completes engine step 7: not printed either;
    # batch 0's engine step is 0 (printed before training)
    assert steps[0]["lr"] == [0.0, 0.0] and "lr" not in steps[1]
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [e["step"] for e in evals] == [0, 9, 13, 19]
    assert evals[1]["loss"] == pytest.approx(math.log(131.58))
    assert "loss" in cfg["missing_signals"]
    assert next(e for e in events if e.kind == "run_end").fields["status"] == "finished"  # saved at its planned end


def test_launcher_failure_is_an_interruption(tmp_path: Path) -> None:
    """A process failing before the planned steps: interrupted (the launcher says so), not unknown."""
    head = _sft_log().split(_dist(30.0, 40, 8, 9.4e-6))[0]
    text = (
        head
        + f"{_stamp(40.0)} [ERROR] [launch.py:321:sigkill_handler] ['python', 'main.py'] exits with return code = 1\n"
    )
    events = _events(tmp_path, text)
    assert [s["step"] for s in _steps(events)] == [10, 20, 30]
    assert next(e for e in events if e.kind == "run_end").fields["status"] == "interrupted"


def test_megatron_deepspeed_stdout_stays_megatron(tmp_path: Path) -> None:
    """Megatron-DeepSpeed prints DeepSpeed's log_dist lines beside its iteration lines: its own reader keeps it."""
    lines = [
        _dist(1.0, 1, 0, 1e-4),
        " iteration        1/     100 | consumed samples:           32 | elapsed time per iteration (ms): 900.1 | "
        "learning rate: 1.000E-04 | global batch size:    32 | lm loss: 1.100000E+01 | loss scale: 4096.0 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |",
        _dist(2.0, 2, 0, 1e-4),
        " iteration        2/     100 | consumed samples:           64 | elapsed time per iteration (ms): 900.1 | "
        "learning rate: 1.000E-04 | global batch size:    32 | lm loss: 1.090000E+01 | loss scale: 4096.0 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    assert _start(events)["config"]["format"] == "megatron_stdout"


def _rank_losses(epoch: int, step: int, losses: list[float]) -> list[str]:
    return [
        f"Epoch: {epoch}, Step: {step}, Rank: {r}, loss = tensor({x}, device='cuda:{r}', grad_fn=<DivBackward0>)"
        for r, x in enumerate(losses)
    ]


def test_newer_chat_print_loss_lines_are_the_loss_of_each_update(tmp_path: Path) -> None:
    """Newer DeepSpeed-Chat: ``--print_loss`` lines from every rank, GA=2, the eval loss printed beside the
    perplexity, the launcher's stamped ``cmd =`` line and a multi-node host prefix."""
    lines = [
        f"{_stamp(0.0)} [INFO] [runner.py:607:main] cmd = python -u -m deepspeed.launcher.launch main.py "
        "--gradient_accumulation_steps 2 --num_train_epochs 1 --print_loss --deepspeed",
        "worker-0: ***** Running training *****",
        "worker-0: ***** Evaluating perplexity, Epoch 0/1 *****",
        "worker-0: ppl: 20.0, loss: 2.995732273553991",
        "worker-0: Beginning of Epoch 1/1, Total Micro Batches 8",
    ]
    for step in range(8):
        lines += [f"worker-0: {x}" for x in _rank_losses(0, step, [2.0 + step * 0.1, 2.2 + step * 0.1])]
        if step == 3:  # update 1 ends: FP16_Optimizer halves the scale (every rank says so)
            lines += [f"worker-0: {line}" for line in _fused(3.0, 2, "Reducing", 65536.0, 32768.0)]
            lines.append(_dist(3.5, 2, 1, 1e-5))  # after 2 updates (steps_per_print 2)
        if step == 7:
            lines.append(_dist(7.5, 4, 1, 2e-5))
    lines += [
        "worker-0: ***** Evaluating perplexity, Epoch 1/1 *****",
        "worker-0: ppl: 12.0, loss: 2.4849066497880004",
        "worker-0: saving the final model ...",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    start = _start(events)
    cfg = start["config"]
    steps = _steps(events)
    # one point per optimizer update (2 micro-batches x 2 ranks), step base 0, 4 updates planned
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and cfg["step_base"] == 0 and start["planned_steps"] == 4
    assert steps[0]["loss"] == pytest.approx((2.0 + 2.2 + 2.1 + 2.3) / 4)
    assert cfg["loss_series"]["terms"] == ["loss"] and "loss" not in cfg["missing_signals"]
    # the LR printed after N updates is the one update N uses
    assert steps[2]["lr"] == [1e-5, 1e-5] and "lr" not in steps[1]
    # the scale halved at the end of update 1, stated from there on (FP16_Optimizer prints increases too)
    assert [s.get("loss_scale") for s in steps] == [None, 32768.0, 32768.0, 32768.0]
    # skipped: the counter grew by 1 over updates 0-1, not at all over 2-3
    assert [s.get("skipped") for s in steps] == [None, None, False, False]
    evals = [e.fields for e in events if e.kind == "eval"]
    assert [(e["step"], e["loss"]) for e in evals] == [
        (0, pytest.approx(2.995732273553991)),
        (3, pytest.approx(2.4849066497880004)),
    ]
    assert evals[1]["metrics"]["perplexity"] == 12.0
    assert cfg["format"] == "deepspeed_chat_stdout" and cfg["gradient_accumulation_steps"] == 2
    times = [e.time for e in events]
    assert times == sorted(times) and min(times) > 1.6e9


def test_newer_ppo_lines_and_dpo_eval(tmp_path: Path) -> None:
    """Newer step 3 lines (``Epoch: 0 | Step: 0 | ... | Actor Loss: X``, ``End-to-End => Latency``) and a DPO
    evaluation (``chosen: X, rejected: Y, loss: Z``)."""
    lines = ["Beginning of Epoch 1/1, Total Generation Batches 3"]
    for n in range(3):
        lines += [
            f"Epoch: 0 | Step: {n} | PPO Epoch: 1 | Actor Loss: {-0.1 * n} | Critic Loss: 0.2 | Unsupervised Loss: 0.0",
            f"End-to-End => Latency: 3.{n}0s, TFLOPs: 1.2, Samples/sec: 4.0, Time/seq 0.2s, Batch Size: 16, "
            "Sequence Length: 512",
            f"Average reward score: {n}.5 | EMA reward score: {n}.1",
            "-" * 85,
        ]
    lines += [
        "***** Evaluating rewards, Epoch 1/1 *****",
        "chosen: -31.9375, rejected: -33.96875, loss: 0.6650807857513428",
        "Before cleaning, Epoch at 1 with Perplexity: 23.98",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    cfg = _start(events)["config"]
    steps = _steps(events)
    assert [(s["step"], s["step_time"]) for s in steps] == [(0, 3.0), (1, 3.1), (2, 3.2)]
    assert all("loss" not in s for s in steps) and set(cfg["loss_series"]["not_judged"]) >= {
        "actor_loss",
        "critic_loss",
    }
    assert cfg["reward"]["n"] == 3
    evals = [e.fields for e in events if e.kind == "eval"]
    assert len(evals) == 1 and evals[0]["loss"] == pytest.approx(0.6650807857513428)
    assert evals[0]["metrics"] == {"chosen": -31.9375, "rejected": -33.96875}


def test_reward_model_scores_without_a_loss_are_recorded(tmp_path: Path) -> None:
    lines = [
        "***** Evaluating reward, Epoch 0/1 *****",
        "chosen_last_scores (higher is better) : 2.81, rejected_last_scores (lower is better) : 2.9, "
        "acc (higher is better) : 0.49",
        "Beginning of Epoch 1/1, Total Micro Batches 20",
        _dist(1.0, 10, 0, 5e-5),
        _dist(2.0, 20, 0, 4e-5),
        "***** Evaluating reward, Epoch 1/1 *****",
        "chosen_last_scores (higher is better) : 2.24, rejected_last_scores (lower is better) : 0.9, "
        "acc (higher is better) : 0.7",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    cfg = _start(events)["config"]
    assert [e for e in events if e.kind == "eval"] == []
    assert [(r["step"], r["acc"], r["rejected_last_scores"]) for r in cfg["reward_evals"]] == [
        (0, 0.49, 2.9),
        (20, 0.7, 0.9),
    ]
    assert any("acc 0.49 -> 0.7" in n for n in cfg["notes"])


def test_pipeline_engine_lines_carry_the_loss(tmp_path: Path) -> None:
    """DeepSpeed's pipeline engine prints ``steps: N loss: X iter time (s): T samples/sec: S`` after its
    log_dist line of the same step: the loss, the interval's mean step time, the LR and skips of that N."""
    lines = [
        f"{_stamp(0.0)} [INFO] [runner.py:607:main] cmd = python -u -m deepspeed.launcher.launch train.py --deepspeed"
    ]
    for k, n in enumerate((10, 20, 30)):
        lines.append(_dist(float(k * 5), n, 0 if n < 30 else 10, 1e-4 * n / 30))
        lines.append(f"steps: {n} loss: {3.0 - 0.1 * k:.4f} iter time (s): 0.500 samples/sec: 64.000")
    events = _events(tmp_path, "\n".join(lines) + "\n")
    cfg = _start(events)["config"]
    steps = _steps(events)
    assert [(s["step"], s["loss"], s["step_time"]) for s in steps] == [(10, 3.0, 0.5), (20, 2.9, 0.5), (30, 2.8, 0.5)]
    assert cfg["step_base"] == 1 and cfg["loss_series"]["terms"] == ["loss"]
    assert cfg["format"] == "deepspeed_stdout"  # the launcher's cmd line alone is not DeepSpeed-Chat
    assert steps[1]["lr"] == [pytest.approx(1e-4 * 20 / 30)] * 2
    assert [s.get("skipped") for s in steps] == [None, False, True]


def test_megatron_iteration_lines_past_the_engine_lines_go_to_megatron(tmp_path: Path) -> None:
    """A file whose first recognised lines are DeepSpeed's but that holds Megatron iteration lines further on."""
    head = [_dist(float(k), k, 0, 1e-4) for k in range(1, 3)]
    tail = [
        f" iteration        {n}/     100 | consumed samples:           {32 * n} | elapsed time per iteration (ms): "
        f"900.1 | learning rate: 1.000E-04 | global batch size:    32 | lm loss: {11.0 - n / 10:.6E} | "
        "loss scale: 4096.0 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        for n in (3, 4)
    ]
    path = tmp_path / "mds.log"
    path.write_text("\n".join(head + tail) + "\n")
    items, meta = parse_deepspeed(path)
    assert meta.format == "megatron_stdout" and [it.step for it in items] == [3, 4]


def test_wrapped_lrs_overflowed_perplexity_and_world_size(tmp_path: Path) -> None:
    """Values as newer stacks print them: ``lr=[np.float64(1e-05)]``, ``ppl: inf`` (the script's exp
    overflowed: an infinite eval loss, not a missing one), the launcher's ``dist_world_size``."""
    lines = [
        f"{_stamp(0.0)} [INFO] [launch.py:164:main] dist_world_size=8",
        f"{_stamp(1.0)} [INFO] [logging.py:128:log_dist] [Rank 0] step=10, skipped=0, "
        "lr=[np.float64(1e-05), np.float64(2e-05)], mom=[[0.9, 0.999], [0.9, 0.999]]",
        "***** Evaluating perplexity, Epoch 1/1 *****",
        "ppl: inf, loss: nan",
        f"{_stamp(2.0)} [INFO] [logging.py:128:log_dist] [Rank 0] step=20, skipped=0, "
        "lr=[tensor(3e-05, device='cuda:0'), tensor(3e-05, device='cuda:0')], mom=[[0.9, 0.999], [0.9, 0.999]]",
        "***** Evaluating perplexity, Epoch 1/1 *****",
        "ppl: inf",
    ]
    events = _events(tmp_path, "\n".join(lines) + "\n")
    assert _start(events)["world_size"] == 8
    assert [s["lr"] for s in _steps(events)] == [[1e-05, 2e-05], [3e-05, 3e-05]]
    losses = [e.fields["loss"] for e in events if e.kind == "eval"]
    assert math.isnan(losses[0]) and losses[1] == math.inf
