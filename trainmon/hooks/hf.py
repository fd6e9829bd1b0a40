"""trainmon for the Hugging Face ``Trainer``: one callback, no changes to the training script.

    from trainmon.hooks.hf import TrainmonCallback
    trainer = Trainer(..., callbacks=[TrainmonCallback(run="gpt2-ft", collector="http://127.0.0.1:9400")])

Why a callback alone is not enough: the ``TrainerCallback`` events say *when* things happen but
not the numbers a monitor needs. The Trainer keeps the step's loss in an accumulator that it
resets and NaN-filters (``logging_nan_inf_filter`` replaces a NaN loss by the running mean:
exactly the event we must not hide), and the pre-clip gradient norm is a local variable of the
training loop, handed to callbacks only as a float on logging steps (after an ``.item()``). So at
``on_train_begin`` the callback finds the ``Trainer`` that is calling it (a walk up the call
stack: ``Trainer`` does not pass itself to callbacks) and wraps three of its bound methods on
that instance only, for the duration of ``train()``:

- ``trainer.training_step``: its return value is the micro-batch's detached loss, already divided
  by the accumulation steps, i.e. exactly what the Trainer sums into its logged loss. The
  callback sums it on the device (no sync) and hands the tensor to ``step_end``. Tokens and
  samples come from the shape of ``inputs[model.main_input_name]`` (host metadata, no sync;
  padding included).
- ``trainer.accelerator.clip_grad_norm_``: the Trainer computes (and, with ``max_grad_norm > 0``,
  applies) the clip here, on the last micro-batch of every optimizer step, before
  ``on_pre_optimizer_step``. For the plain and DDP cases the wrapper does what Accelerate does
  (``unscale_gradients()`` then clip) but clips through ``TrainMonitor.clip_grad_norm_``, which
  clips exactly as torch does and keeps the pre-clip norm, post-clip norm and coefficient as
  tensors. The same tensor is returned to the Trainer, so the ``grad_norm`` it logs is the
  value trainmon sends. FSDP, DeepSpeed and XLA keep Accelerate's own path (their norms are
  sharded or computed by the engine); the returned norm is recorded with
  ``TrainMonitor.record_grad_norm``.
- ``trainer.evaluate`` and ``trainer._save_checkpoint`` run inside ``phase("eval")`` /
  ``phase("checkpoint")``, so their time is labelled instead of landing in ``other``.

``TrainMonitor.watch`` is installed on the unwrapped model and the inner torch optimizer
(Accelerate's ``AcceleratedOptimizer`` does not run torch's step hooks), so phases, LR, skipped
fp16 steps (with Accelerate's ``GradScaler``) and micro-batch counts come from the same hooks as
in a plain loop. Steps are numbered from 0: step ``s`` is the ``s``-th optimizer step
(``state.global_step - 1`` at ``on_step_end``), continuing from the checkpoint on resume.

Host-device crossings (all outside the per-step hot path except where noted as host-only):

- per step: none. Loss and norms stay tensors until ``trainmon.hooks.readback`` has them; the LR and the
  token counts are host values.
- ``on_evaluate``: the metrics are already host floats (the Trainer read them back).
- ``on_save`` and the first step after a resume: ``trainmon.hooks.fingerprint.state_fingerprint`` reads
  the optimizer's moment norms back (one stacked copy, ``SYNC``), at checkpoint time only.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import math
import os
import sys
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainmon.flops import model_peak_flops
from trainmon.hooks.adapter import MonitorAdapter
from trainmon.hooks.policy import TrainingStopped, worth_saving
from trainmon.hooks.train_monitor import TrainMonitor

__all__ = ["TrainmonCallback"]

# Accelerate distributed types whose clip_grad_norm_ is "unscale_gradients(); torch clip".
_SHARDED = {"FSDP", "DEEPSPEED", "XLA", "MEGATRON_LM"}


class TrainmonCallback(MonitorAdapter, TrainerCallback):
    """Sends a ``Trainer`` run's signals to trainmon, with the same fields as a plain loop.

    Args:
        run: run id (shared by all ranks).
        collector: ``http://host:port`` or ``file://PATH``; see ``TrainMonitor``.
        start_fields: extra or overriding ``run_start`` fields (``seq_len``, ``schedule``,
            ``global_batch_tokens``, ``flops_per_token``...). ``schedule`` is a ``Schedule`` or its
            dict, checked here; without it the schedule of the Trainer's scheduler is declared
            when trainmon can read it exactly (``Schedule.from_scheduler``).
        fingerprint_model: include a hash of the parameters in checkpoint fingerprints (a full
            device-to-host copy of the model at every save; off by default).
        on_critical: act on the collector's findings for this run at or above ``stop_on`` (see
            ``TrainMonitor``). ``"stop"``: at that step's end set ``control.should_save`` and
            ``control.should_training_stop`` (the Trainer saves a checkpoint and leaves its loop),
            then ``train()`` raises ``TrainingStopped``. A callable receives each new finding.
        stop_on: ``"critical"`` (default) or ``"warning"``.
        **monitor_kwargs: passed to ``TrainMonitor`` (``spool_dir``, ``detail_every``, ...).

    The ``TrainMonitor`` is created at ``on_train_begin`` (one per ``train()`` call) and is
    available as ``callback.monitor``.
    """

    # Set at on_train_begin, for the train() call in progress.
    _model: torch.nn.Module | None = None
    _resume_pending: str | None = None  # the checkpoint resumed from, fingerprinted at the first step
    _checkpoint_seconds: float | None = None  # the last _save_checkpoint's duration, for on_save

    # -- setup ----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if self.monitor is not None:  # the previous train() raised (no on_train_end): end that run first
            self._close("failed", "train() did not reach on_train_end")
        mon = self._open()
        trainer, resume_path = _calling_trainer(self)
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer → torch optimizer
        self._model, self._optimizer, self._scheduler = model, inner, scheduler
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if model is not None:
            mon.watch(model, inner, scheduler, scaler=scaler)
        if trainer is not None:
            self._install(trainer, mon)
        if resume_path is None and isinstance(args.resume_from_checkpoint, str):
            resume_path = args.resume_from_checkpoint
        resumed = state.global_step > 0
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        fields: dict[str, Any] = {
            "config": args.to_dict(),  # type: ignore[no-untyped-call]  # made JSON-safe by TrainMonitor.start
            "planned_steps": state.max_steps or None,
            "accum_steps": args.gradient_accumulation_steps,
            "world_size": args.world_size,
            "vocab_size": vocab if isinstance(vocab, int) else None,
            # from_pretrained records where the weights came from; a model built from a config has none
            "pretrained": True if getattr(config, "_name_or_path", "") else None,
            "peak_flops": None if model is None else model_peak_flops(model, _compute_precision(args)),
            "framework": "hf",
            "resumed": resumed,
            "resume_path": resume_path if resumed else None,
        }
        self._start(mon, fields)
        # The Trainer restores the RNG state inside the epoch loop, after this event: the resume
        # fingerprint is taken at the first on_step_begin, once everything is restored.
        self._resume_pending = resume_path if resumed else None
        atexit.register(self._close_at_exit)

    def _install(self, trainer: Trainer, mon: TrainMonitor) -> None:
        main_input = getattr(getattr(trainer, "model", None), "main_input_name", "input_ids")
        training_step = trainer.training_step

        def counted_training_step(model: Any, inputs: Any, *args: Any, **kw: Any) -> torch.Tensor:
            x = inputs.get(main_input) if isinstance(inputs, dict) else None
            if isinstance(x, torch.Tensor):
                self._tokens += x.numel()  # shape only: host metadata
                self._samples += x.shape[0] if x.dim() else 1
            loss = training_step(model, inputs, *args, **kw)
            if isinstance(loss, torch.Tensor):
                loss = self._add_loss(loss)
            return loss

        self._patch(trainer, "training_step", counted_training_step)

        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "clip_grad_norm_"):
            original_clip = accelerator.clip_grad_norm_

            def monitored_clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
                params = list(parameters)
                kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
                sharded = kind in _SHARDED or any(type(p.grad).__name__ == "DTensor" for p in params)
                if not sharded:
                    accelerator.unscale_gradients()  # what Accelerate does before clipping (fp16)
                    return mon.clip_grad_norm_(params, max_norm, norm_type)
                total = original_clip(params, max_norm, norm_type)
                if isinstance(total, torch.Tensor):
                    mon.record_grad_norm(total, max_norm)
                return total

            self._patch(accelerator, "clip_grad_norm_", monitored_clip)

        evaluate = trainer.evaluate

        def timed_evaluate(*args: Any, **kw: Any) -> Any:
            with mon.phase("eval"):
                return evaluate(*args, **kw)

        self._patch(trainer, "evaluate", timed_evaluate)

        save = getattr(trainer, "_save_checkpoint", None)
        if save is not None:

            def timed_save(*args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                with mon.phase("checkpoint"):
                    try:
                        return save(*args, **kw)
                    finally:
                        self._checkpoint_seconds = time.perf_counter() - t0

            self._patch(trainer, "_save_checkpoint", timed_save)

    # -- per step -------------------------------------------------------------------------

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is not None and self._resume_pending is not None:
            path, self._resume_pending = self._resume_pending, None
            self.monitor.resume(state.global_step - 1, path=path, fingerprint=self._fingerprint(args, state))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self._step_end(self.monitor, state.global_step - 1, self._loss)
        if self._stopping is not None:  # the Trainer saves, then leaves its loop; on_train_end raises
            control.should_save = worth_saving(self._stopping)
            control.should_training_stop = True

    # -- occasional events ----------------------------------------------------------------

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.monitor is None or not metrics:
            return
        key = "eval_loss" if "eval_loss" in metrics else next((k for k in metrics if k.endswith("_loss")), None)
        if key is None:
            return
        prefix = key[: -len("loss")]
        others = {
            k[len(prefix) :]: float(v)
            for k, v in metrics.items()
            if k != key and k.startswith(prefix) and isinstance(v, (int, float)) and math.isfinite(v)
        }
        duration = others.pop("runtime", None)
        self._emit_eval(self.monitor, max(state.global_step - 1, 0), float(metrics[key]), others, duration)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        path = _checkpoint_path(args, state)
        nbytes = _dir_bytes(path)
        self.monitor.checkpoint(
            state.global_step - 1,
            path=path if os.path.exists(path) else None,
            duration=self._checkpoint_seconds,
            bytes=nbytes,
            fingerprint=self._fingerprint(args, state),
        )
        self._checkpoint_seconds = None

    def _fingerprint(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any]:
        return self._state_fingerprint(
            next_step=state.global_step,
            world_size=args.world_size,
            accum_steps=args.gradient_accumulation_steps,
            tokens=state.num_input_tokens_seen or None,
            model=self._model,
        )

    # -- the end --------------------------------------------------------------------------

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._stopping is None:
            self._close("finished")
            return
        path = _checkpoint_path(args, state)
        stopped = TrainingStopped(self._stopping, state.global_step - 1, path if os.path.isdir(path) else None)
        self._close("failed", str(stopped))
        raise stopped

    def _close(self, status: str, error: str | None = None) -> None:
        atexit.unregister(self._close_at_exit)
        super()._close(status, error)

    def _close_at_exit(self) -> None:
        # train() never reached on_train_end: it raised (the Trainer has no exception callback).
        err = getattr(sys, "last_value", None)
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        self._close(status, repr(err) if err is not None else "process exited during training")


def _calling_trainer(callback: TrainerCallback) -> tuple[Trainer | None, str | None]:
    """The ``Trainer`` whose callback handler is calling ``callback``, and its resume checkpoint.

    ``Trainer`` does not pass itself to callbacks; its training-loop frame is a few levels up.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(32):
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer) and callback in obj.callback_handler.callbacks:
                resume = frame.f_locals.get("resume_from_checkpoint")
                return obj, resume if isinstance(resume, str) else None
            frame = frame.f_back
    finally:
        del frame
    return None, None


def _checkpoint_path(args: TrainingArguments, state: TrainerState) -> str:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` in (``output_dir`` is set
    by then: ``TrainingArguments`` defaults it)."""
    return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")


def _compute_precision(args: TrainingArguments) -> str:
    """The precision of the matmuls (``bf16``, ``fp16``, ``fp32``), the key of
    :data:`trainmon.flops.PEAK_FLOPS`."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _dir_bytes(path: str) -> int | None:
    if not os.path.isdir(path):
        return None
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file removed while we walk
                total += os.path.getsize(os.path.join(root, f))
    return total
