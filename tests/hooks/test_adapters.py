"""The HF Trainer and Lightning adapters emit the same signal set as a plain loop.

One tiny randomly initialised GPT-2 (no downloads), trained three ways for 12 optimizer steps
with 2 micro-batches each, clipping at 1.0, evaluating and saving after steps 5 and 11: a plain
loop instrumented through ``TrainMonitor``, a real ``transformers.Trainer`` with
``trainmon.hooks.hf.TrainmonCallback`` and a real ``lightning.Trainer`` with
``trainmon.hooks.lightning.TrainmonCallback``. The three JSONL streams must carry the same events with
the same fields, and the HF stream's numbers must be the ones HF itself logged.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmon.fingerprint import compare_fingerprints, state_fingerprint
from trainmon.hooks import TrainMonitor
from trainmon.schedules import Schedule
from trainmon.wire import validate_event

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
lightning = pytest.importorskip("lightning")

STEPS, ACCUM, BATCH, SEQ, VOCAB, MAX_NORM = 12, 2, 4, 16, 64, 1.0
LINEAR = Schedule("linear", 1e-3, STEPS)  # HF's default: linear to 0 over max_steps, no warmup
SAVED = [5, 11]  # eval and checkpoint after these steps (every 6 optimizer steps)
START_KEYS = {"config", "n_params", "world_size", "local_rank", "device", "planned_steps", "accum_steps"}
START_KEYS |= {"vocab_size", "framework", "resumed"}
STEP_KEYS = {"step", "loss", "grad_norm", "grad_norm_clipped", "clip_coef", "lr", "step_time", "phases"}
STEP_KEYS |= {"micro_batches", "tokens", "samples", "skipped", "scheduler_steps"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fields(events: list[dict], kind: str) -> list[dict[str, Any]]:
    return [e["fields"] for e in events if e["kind"] == kind]


def _monitor_kwargs(path: Path) -> dict[str, Any]:
    return {"collector": f"file://{path}", "health_interval": 0, "heartbeat_interval": 0, "spool_dir": path.parent}


def _lightning_trainer(root: Path, callbacks: list[Any], **kw: Any) -> Any:
    """A Lightning trainer on CPU that prints and saves nothing of its own (no bar, summary or logger)."""
    return lightning.Trainer(
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        accelerator="cpu",
        default_root_dir=str(root),
        callbacks=callbacks,
        **kw,
    )


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class _LMData(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1) -> None:
        self.x = _tokens(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


# -- the three harnesses ----------------------------------------------------------------------


def _plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain" / "events.jsonl"
    path.parent.mkdir()
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LINEAR.factor)  # what HF's default scheduler does
    data, val = _tokens(STEPS * ACCUM * BATCH), _tokens(8, seed=2)
    mon = TrainMonitor("plain", **_monitor_kwargs(path))
    mon.watch(model, opt, sched)
    mon.start(config={"lr": 1e-3}, planned_steps=STEPS, vocab_size=VOCAB, accum_steps=ACCUM, resumed=False)
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUM):
            x = data[(step * ACCUM + micro) * BATCH :][:BATCH]
            loss = model(input_ids=x, labels=x).loss / ACCUM
            loss.backward()
            total += loss.detach()
        mon.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step in SAVED:
            with mon.phase("eval"), torch.no_grad():
                val_loss = model(input_ids=val, labels=val).loss
            with mon.phase("checkpoint"):
                ckpt = tmp_path / "plain" / f"step{step}.pt"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
            mon.eval(step, float(val_loss))
            mon.checkpoint(step, path=str(ckpt), fingerprint=state_fingerprint(next_step=step + 1, optimizer=opt))
        mon.step_end(step, loss=total, tokens=x.numel() * ACCUM, samples=BATCH * ACCUM)
    mon.close()
    return path


def _hf_args(out: Path, **overrides: Any) -> Any:
    kw: dict[str, Any] = {
        "max_steps": STEPS,
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": 8,
        "gradient_accumulation_steps": ACCUM,
        "max_grad_norm": MAX_NORM,
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "logging_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 6,
        "save_steps": 6,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(output_dir=str(out), **{**kw, **overrides})


def _hf(tmp_path: Path, *, resume: str | None = None, run: str = "hf", **callback_kw: Any) -> tuple[Path, Any]:
    from trainmon.hooks.hf import TrainmonCallback

    path = tmp_path / run / "events.jsonl"
    path.parent.mkdir(exist_ok=True)
    trainer = transformers.Trainer(
        model=_gpt2(),
        args=_hf_args(tmp_path / f"{run}-out"),
        train_dataset=_LMData(STEPS * ACCUM * BATCH),
        eval_dataset=_LMData(8, seed=2),
        callbacks=[TrainmonCallback(run=run, **_monitor_kwargs(path), **callback_kw)],
    )
    trainer.train(resume_from_checkpoint=resume)
    return path, trainer


class _LitGPT(lightning.LightningModule):
    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = _gpt2()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, LINEAR.factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _LitCosine(_LitGPT):
    """transformers' cosine schedule, stepped every optimizer step or every epoch."""

    def __init__(self, interval: str = "step") -> None:
        super().__init__()
        self.interval = interval

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = transformers.get_cosine_schedule_with_warmup(opt, 3, STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def _lightning(
    tmp_path: Path,
    *,
    resume: str | None = None,
    run: str = "lit",
    module: lightning.LightningModule | None = None,
    **callback_kw: Any,
) -> Path:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainmon.hooks.lightning import TrainmonCallback

    path = tmp_path / run / "events.jsonl"
    path.parent.mkdir(exist_ok=True)
    trainer = _lightning_trainer(
        tmp_path / f"{run}-out",
        [
            TrainmonCallback(run=run, **_monitor_kwargs(path), **callback_kw),
            ModelCheckpoint(dirpath=str(tmp_path / f"{run}-out" / "ckpt"), every_n_train_steps=6, save_top_k=-1),
        ],
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=MAX_NORM,
        val_check_interval=6 * ACCUM,  # batches: after every 6 optimizer steps
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    train = torch.utils.data.DataLoader(_tokens(STEPS * ACCUM * BATCH), batch_size=BATCH)
    val = torch.utils.data.DataLoader(_tokens(8, seed=2), batch_size=8)
    trainer.fit(module or _LitGPT(), train, val, ckpt_path=resume)
    return path


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("adapters")
    hf_path, trainer = _hf(tmp)
    return {
        "plain": _events(_plain(tmp)),
        "hf": _events(hf_path),
        "lightning": _events(_lightning(tmp)),
        "hf_log": trainer.state.log_history,
        "tmp": tmp,
    }


@pytest.mark.parametrize("name", ["plain", "hf", "lightning"])
def test_each_stream_carries_the_full_signal_set(streams: dict[str, Any], name: str) -> None:
    events = streams[name]
    for e in events:
        validate_event(e)  # the wire format is the contract
    assert events[0]["kind"] == "run_start" and events[-1]["kind"] == "run_end"
    start = events[0]["fields"]
    assert start.keys() >= START_KEYS
    assert start["framework"] == {"plain": "plain", "hf": "hf", "lightning": "lightning"}[name]
    assert (start["planned_steps"], start["accum_steps"], start["world_size"]) == (STEPS, ACCUM, 1)
    assert start["vocab_size"] == VOCAB and start["resumed"] is False
    assert start["n_params"] == sum(p.numel() for p in _gpt2().parameters())

    steps = _fields(events, "step")
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s.keys() >= STEP_KEYS, STEP_KEYS - s.keys()
        assert s["micro_batches"] == ACCUM and s["scheduler_steps"] == 1 and s["skipped"] is False
        assert s["tokens"] == ACCUM * BATCH * SEQ and s["samples"] == ACCUM * BATCH
        assert {"forward", "backward", "optimizer"} <= s["phases"].keys()
        assert all(s["phases"][p] > 0 for p in ("forward", "backward", "optimizer"))
        # Equal up to the previous step_end's own duration (TrainMonitor starts the next step's data
        # gap before that work, and its step clock after it): microseconds unless the host is busy.
        assert sum(s["phases"].values()) == pytest.approx(s["step_time"], rel=1e-6, abs=1e-6)
        assert math.isfinite(s["loss"]) and 3.0 < s["loss"] < 5.0  # ≈ ln(64) = 4.16 at init
        assert s["grad_norm_clipped"] <= MAX_NORM + 1e-6 and 0 < s["clip_coef"] <= 1.0
        assert s["grad_norm_clipped"] == pytest.approx(min(s["grad_norm"], MAX_NORM), rel=1e-5)
        assert s["grad_norm_clipped"] == pytest.approx(s["grad_norm"] * s["clip_coef"], rel=1e-6)
    assert any(s["clip_coef"] < 1.0 for s in steps), "no step exercised clipping"
    assert "layer_grad_norms" in steps[0] and "update_ratio" in steps[0]  # second level at step 0

    assert [e["step"] for e in _fields(events, "eval")] == SAVED
    assert all(3.0 < e["loss"] < 5.0 for e in _fields(events, "eval"))
    checkpoints = _fields(events, "checkpoint")
    assert [c["step"] for c in checkpoints] == SAVED
    assert all(os.path.exists(c["path"]) and c["fingerprint"]["next_step"] == c["step"] + 1 for c in checkpoints)
    assert events[-1]["fields"]["status"] == "finished" and events[-1]["fields"]["step"] == STEPS - 1


def test_the_three_streams_have_the_same_fields(streams: dict[str, Any]) -> None:
    def shape(events: list[dict]) -> dict[str, Any]:
        return {
            "kinds": sorted(e["kind"] for e in events if e["kind"] != "step"),
            "run_start": set(events[0]["fields"]),
            "steps": [set(s) for s in _fields(events, "step")],
            "eval": [set(e) - {"metrics", "duration"} for e in _fields(events, "eval")],
        }

    plain = shape(streams["plain"])
    assert shape(streams["hf"]) == plain
    assert shape(streams["lightning"]) == plain


def test_hf_numbers_are_the_ones_hf_logged(streams: dict[str, Any]) -> None:
    steps = {s["step"]: s for s in _fields(streams["hf"], "step")}
    logged = [h for h in streams["hf_log"] if "grad_norm" in h]
    assert len(logged) == STEPS  # logging_steps=1
    for h in logged:
        s = steps[h["step"] - 1]  # HF logs after global_step += 1
        assert s["grad_norm"] == h["grad_norm"]  # the very tensor HF clipped with: pre-clip norm
        assert s["loss"] == pytest.approx(h["loss"], rel=1e-6)
        assert s["lr"][0] == pytest.approx(h["learning_rate"], rel=1e-9, abs=1e-15)  # the LR the step used
    evals = [h for h in streams["hf_log"] if "eval_loss" in h]
    assert [e["loss"] for e in _fields(streams["hf"], "eval")] == [h["eval_loss"] for h in evals]


def test_resume_fingerprint_matches_the_checkpoint(streams: dict[str, Any]) -> None:
    tmp = streams["tmp"]
    checkpoint = _fields(streams["hf"], "checkpoint")[0]
    path, _ = _hf(tmp, resume=checkpoint["path"], run="hf-resumed")
    events = _events(path)
    start = events[0]["fields"]
    assert start["resumed"] is True and start["resume_path"] == checkpoint["path"]
    resume = _fields(events, "resume")[0]
    assert resume["step"] == checkpoint["step"] and resume["path"] == checkpoint["path"]
    assert compare_fingerprints(checkpoint["fingerprint"], resume["fingerprint"]) == {}
    assert [s["step"] for s in _fields(events, "step")] == list(range(checkpoint["step"] + 1, STEPS))

    lit_checkpoint = _fields(streams["lightning"], "checkpoint")[0]
    events = _events(_lightning(tmp, resume=lit_checkpoint["path"], run="lit-resumed"))
    resume = _fields(events, "resume")[0]
    assert events[0]["fields"]["resumed"] is True and resume["step"] == lit_checkpoint["step"]
    assert compare_fingerprints(lit_checkpoint["fingerprint"], resume["fingerprint"]) == {}
    assert [s["step"] for s in _fields(events, "step")] == list(range(lit_checkpoint["step"] + 1, STEPS))


class _Boom(Exception):
    pass


def test_a_failing_run_ends_with_status_failed(tmp_path: Path) -> None:
    from trainmon.hooks.hf import TrainmonCallback as HFCallback
    from trainmon.hooks.lightning import TrainmonCallback as LitCallback

    class Explode(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                raise _Boom("step 3")

    hf_path = tmp_path / "hf.jsonl"
    callback = HFCallback(run="hf-fail", **_monitor_kwargs(hf_path))
    trainer = transformers.Trainer(
        model=_gpt2(),
        args=_hf_args(tmp_path / "hf-out", save_strategy="no", eval_strategy="no"),
        train_dataset=_LMData(STEPS * ACCUM * BATCH),
        callbacks=[callback, Explode()],
    )
    with pytest.raises(_Boom):
        trainer.train()
    assert "training_step" in vars(trainer)  # still instrumented: the run is not over until exit
    callback._close_at_exit()  # what the atexit hook does when train() raised
    end = _events(hf_path)[-1]
    assert end["kind"] == "run_end" and end["fields"]["status"] == "failed" and end["fields"]["step"] == 2
    assert "training_step" not in vars(trainer)  # the trainer is left as it was

    class Failing(_LitGPT):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 6:
                raise _Boom("batch 6")
            return super().training_step(batch, batch_idx)

    lit_path = tmp_path / "lit.jsonl"
    module = Failing()
    trainer = _lightning_trainer(
        tmp_path,
        [LitCallback(run="lit-fail", **_monitor_kwargs(lit_path))],
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        enable_checkpointing=False,
    )
    with pytest.raises(_Boom):
        trainer.fit(module, torch.utils.data.DataLoader(_tokens(64), batch_size=BATCH))
    end = _events(lit_path)[-1]
    assert end["kind"] == "run_end" and end["fields"]["status"] == "failed" and "batch 6" in end["fields"]["error"]
    assert [s["step"] for s in _fields(_events(lit_path), "step")] == [0, 1, 2]
    assert "training_step" not in vars(module)  # the module is left as it was


def test_the_trainers_scheduler_declares_the_schedule(streams: dict[str, Any], tmp_path: Path) -> None:
    for name in ("plain", "hf", "lightning"):  # HF's own scheduler, LambdaLR(Schedule.factor) in the others
        assert streams[name][0]["fields"]["schedule"] == LINEAR.to_dict()

    cosine = Schedule("cosine", 1e-3, STEPS, 3).to_dict()
    events = _events(_lightning(tmp_path, run="lit-cosine", module=_LitCosine("step")))
    assert events[0]["fields"]["schedule"] == cosine
    lrs = [s["lr"][0] for s in _fields(events, "step")]
    assert lrs == pytest.approx([Schedule.from_dict(cosine).lr(s) for s in range(STEPS)], rel=1e-9, abs=1e-15)
    # Stepped per epoch, its schedule counts epochs: nothing is declared, and it is not held to one step per step.
    events = _events(_lightning(tmp_path, run="lit-epoch", module=_LitCosine("epoch")))
    assert "schedule" not in events[0]["fields"]
    assert all("scheduler_steps" not in s for s in _fields(events, "step"))


def test_start_fields_take_the_schedule_as_object_or_dict(tmp_path: Path) -> None:
    from trainmon.hooks.hf import TrainmonCallback as HFCallback
    from trainmon.hooks.lightning import TrainmonCallback as LitCallback

    declared = Schedule("wsd", 1e-3, STEPS, 2, min_ratio=0.1)
    path, _ = _hf(tmp_path, run="hf-declared", start_fields={"schedule": declared.to_dict()})
    assert _events(path)[0]["fields"]["schedule"] == declared.to_dict()
    path = _lightning(tmp_path, run="lit-declared", start_fields={"schedule": declared})
    assert _events(path)[0]["fields"]["schedule"] == declared.to_dict()
    for callback in (HFCallback, LitCallback):
        with pytest.raises(ValueError, match=r"schedule\.warmup_steps"):
            callback(run="bad", start_fields={"schedule": {**declared.to_dict(), "warmup_steps": 99}})


class _LitClassifier(lightning.LightningModule):
    """Images and class labels: an ``(x, y)`` batch whose only integer tensor is the labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(SEQ, 10)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_counts_tokens_of_the_input_not_the_labels(tmp_path: Path) -> None:
    """Issue 26: an ``(x, y)`` batch of float features and integer labels has no tokens (its labels
    were counted: "tokens 6,400"); an ``(ids, labels)`` batch has the ids' tokens, not twice as many."""
    from trainmon.hooks.lightning import TrainmonCallback

    def fit(run: str, module: lightning.LightningModule, data: torch.utils.data.Dataset) -> list[dict[str, Any]]:
        path = tmp_path / f"{run}.jsonl"
        trainer = _lightning_trainer(
            tmp_path, [TrainmonCallback(run=run, **_monitor_kwargs(path))], max_steps=3, enable_checkpointing=False
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
        return _fields(_events(path), "step")

    features = torch.randn(3 * BATCH, SEQ)
    labels = torch.randint(0, 10, (3 * BATCH,))
    steps = fit("lit-images", _LitClassifier(), torch.utils.data.TensorDataset(features, labels))
    assert len(steps) == 3
    assert all("tokens" not in s and s["samples"] == BATCH for s in steps), steps

    class IdsAndLabels(_LitGPT):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids, targets = batch
            return self.model(input_ids=ids, labels=targets).loss

    ids = _tokens(3 * BATCH)
    steps = fit("lit-ids", IdsAndLabels(), torch.utils.data.TensorDataset(ids, ids.clone()))
    assert [s["tokens"] for s in steps] == [BATCH * SEQ] * 3 and all(s["samples"] == BATCH for s in steps)


@pytest.mark.parametrize("name", ["hf", "lightning"])
def test_live_mfu_counts_the_models_parameters(streams: dict[str, Any], name: str) -> None:
    """Issue 26: both callbacks send the model's parameter count, so with the device's peak FLOP/s
    (declared by the callback on a known GPU; here as a user would declare it) the collector's live
    MFU (``trainmon_mfu``) is 6·N FLOPs per token at the rank's tokens/s; it asked for
    ``flops_per_token``, which no callback sends."""
    from trainmon.monitor.collector.live import LiveState
    from trainmon.wire import validate_event

    peak = 1e12
    events = [dict(e) for e in streams[name]]
    assert "flops_per_token" not in events[0]["fields"]  # what the callbacks send: n_params
    events[0] = {**events[0], "fields": {**events[0]["fields"], "peak_flops": peak}}
    live = LiveState()
    live.apply([(validate_event(e), 0) for e in events])
    (run,) = live.runs.values()
    rank = run.ranks[0]
    n_params = events[0]["fields"]["n_params"]
    assert rank.tokens_per_second and rank.mfu() == pytest.approx(rank.tokens_per_second * 6 * n_params / peak)
