"""trainmon for Lightning: one ``Callback``, no changes to the ``LightningModule``.

    from trainmon.hooks.lightning import TrainmonCallback
    trainer = lightning.Trainer(..., callbacks=[TrainmonCallback(run="lit-7", collector="http://127.0.0.1:9400")])

Why more than callback hooks: Lightning never calls the module's ``forward`` itself (it calls
``training_step``), runs forward and backward *inside* ``optimizer.step(closure)``, and clips in
``configure_gradient_clipping`` without keeping the norm. A plain ``TrainMonitor.watch`` would see
no forward, an optimizer phase that swallows the last micro-batch, and no gradient norm. So at
``on_train_start`` the callback adapts, on these instances only and until the run ends:

- ``pl_module.training_step`` is routed through a small ``nn.Module`` stand-in whose ``forward``
  is the training step, and *that* is what ``watch`` hooks: one forward per micro-batch, the
  backward from the returned loss. The stand-in also keeps the step's loss (the detached
  ``training_step`` losses, averaged over micro-batches on the device: no sync) and counts
  tokens and samples from the batch's shape (host metadata).
- the torch optimizer's ``step(closure)`` runs the closure (forward, backward, clipping) first
  and then the update, so the ``optimizer`` phase times only the update and the clip, as in a
  plain loop. Only for ``torch.optim`` optimizers that evaluate the closure once (not LBFGS);
  others keep Lightning's order and their optimizer phase includes the last micro-batch.
- the precision plugin's ``clip_grad_by_norm`` (reached from ``configure_gradient_clipping``,
  after AMP unscaling) clips through ``TrainMonitor.clip_grad_norm_``, which clips exactly as
  torch does and keeps pre-clip norm, post-clip norm and coefficient as tensors. Without norm
  clipping, ``on_before_optimizer_step`` (gradients complete, unscaled) measures the norm the
  same way with ``max_norm=inf``. FSDP and DeepSpeed plugins, whose norms are sharded, are left
  alone (no grad norm).
- ``trainer.save_checkpoint`` runs inside ``phase("checkpoint")`` and reports path, duration and
  size; validation runs inside ``phase("eval")``.

Steps are numbered from 0 (``trainer.global_step - 1`` after the update), and a step is recorded
at ``on_train_batch_end`` only for batches that stepped the optimizer, so with
``accumulate_grad_batches=k`` each record covers ``k`` micro-batches.

Host-device crossings: none per step (loss and norms go through ``trainmon.hooks.readback``; LR and
counts are host values). ``on_validation_end`` reads the logged validation loss back (``SYNC``,
once per evaluation); checkpoint and resume fingerprints read the optimizer moment norms back
(``SYNC``, at save/resume time only).

Works with ``lightning`` (preferred) or the older ``pytorch_lightning`` package.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision as _BasePrecision
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError:  # pragma: no cover - the older distribution
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.plugins.precision import Precision as _BasePrecision  # type: ignore[assignment]
    from pytorch_lightning.utilities.model_helpers import is_overridden

from trainmon.flops import model_peak_flops
from trainmon.hooks.adapter import MonitorAdapter
from trainmon.hooks.policy import CollectorFinding, TrainingStopped, worth_saving
from trainmon.hooks.train_monitor import TrainMonitor

__all__ = ["TrainmonCallback"]


class _TrainingStep(torch.nn.Module):
    """Stand-in ``nn.Module`` whose forward is the LightningModule's ``training_step``.

    ``module`` is the LightningModule itself, so ``watch`` sees its parameters and names.
    """

    def __init__(
        self, pl_module: Any, step: Callable[..., Any], on_output: Callable[[Any, tuple[Any, ...]], None]
    ) -> None:
        super().__init__()
        self.module = pl_module
        self._step = step
        self._on_output = on_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._step(*args, **kwargs)
        self._on_output(out, args)
        return out


class TrainmonCallback(MonitorAdapter, pl.Callback):
    """Sends a Lightning run's signals to trainmon, with the same fields as a plain loop.

    Args:
        run: run id (shared by all ranks).
        collector: ``http://host:port`` or ``file://PATH``; see ``TrainMonitor``.
        start_fields: extra or overriding ``run_start`` fields (``vocab_size``, ``seq_len``,
            ``schedule``...). ``schedule`` is a ``Schedule`` or its dict, checked here; without
            it the schedule of the first LR scheduler is declared when it steps once per
            optimizer step and trainmon can read it exactly (``Schedule.from_scheduler``).
        eval_loss_key: the ``callback_metrics`` key holding the validation loss; by default
            ``val_loss``, else the first key with both ``val`` and ``loss`` in it.
        tokens_fn: ``batch -> (tokens, samples)``; by default tokens are the element count of
            the model's input when it holds token ids (an integer tensor: the batch, ``input_ids``
            in a dict, ``x`` of an ``(x, y)`` batch; labels are not counted) and samples its length.
        fingerprint_model: include a parameter hash in checkpoint fingerprints (a full
            device-to-host copy at every save; off by default).
        on_critical: act on the collector's findings for this run at or above ``stop_on`` (see
            ``TrainMonitor``). ``"stop"``: at that step's end save ``trainmon-stop-step{N}.ckpt``
            (next to the ``ModelCheckpoint`` files, else in ``default_root_dir``) and set
            ``trainer.should_stop``; ``fit()`` then raises ``TrainingStopped``. A callable
            receives each new finding.
        stop_on: ``"critical"`` (default) or ``"warning"``.
        **monitor_kwargs: passed to ``TrainMonitor``.
    """

    def __init__(
        self,
        run: str,
        collector: str | None = None,
        *,
        start_fields: dict[str, Any] | None = None,
        eval_loss_key: str | None = None,
        tokens_fn: Callable[[Any], tuple[int | None, int | None]] | None = None,
        fingerprint_model: bool = False,
        on_critical: str | Callable[[CollectorFinding], Any] | None = None,
        stop_on: str = "critical",
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__(
            run,
            collector,
            start_fields=start_fields,
            fingerprint_model=fingerprint_model,
            on_critical=on_critical,
            stop_on=stop_on,
            **monitor_kwargs,
        )
        self.eval_loss_key = eval_loss_key
        self.tokens_fn = tokens_fn or _count_batch
        self._stop: TrainingStopped | None = None  # raised at on_train_end, once Lightning left its loop
        self._clips = False  # the precision plugin's clip_grad_by_norm is the one this callback wraps
        self._eval: contextlib.ExitStack | None = None
        self._eval_start = 0.0

    def _reset_step(self) -> None:
        super()._reset_step()
        self._micro = 0
        self._stepped = False

    # -- setup ----------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop = None
        mon = self._open()
        self._optimizer = trainer.optimizers[0] if trainer.optimizers else None
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        self._scheduler = configs[0].scheduler if configs else None

        stand_in = _TrainingStep(pl_module, pl_module.training_step, self._on_training_step)
        self._patch(pl_module, "training_step", lambda *a, **k: stand_in(*a, **k))
        precision = trainer.precision_plugin
        self._clips = type(precision).clip_grad_by_norm is _BasePrecision.clip_grad_by_norm
        if self._clips:
            self._patch(precision, "clip_grad_by_norm", self._clip_by_norm(precision, mon))
        if _closure_once(self._optimizer):
            self._patch(self._optimizer, "step", _closure_first(self._optimizer.step))
        save = trainer.save_checkpoint
        self._patch(trainer, "save_checkpoint", self._timed_save(trainer, save))

        scaler = getattr(precision, "scaler", None)
        # Only a scheduler stepped once per optimizer step is watched (and its schedule declared):
        # one stepped per epoch or every k steps counts in other units than the step records.
        per_step = bool(configs) and configs[0].interval == "step" and configs[0].frequency == 1
        mon.watch(stand_in, self._optimizer, self._scheduler if per_step else None, scaler=scaler)

        hparams = dict(getattr(pl_module, "hparams", {}) or {})
        resumed = trainer.ckpt_path is not None
        fields: dict[str, Any] = {
            "config": (  # made JSON-safe by TrainMonitor.start
                {
                    **hparams,
                    "max_steps": trainer.max_steps,
                    "max_epochs": trainer.max_epochs,
                    "accumulate_grad_batches": trainer.accumulate_grad_batches,
                    "gradient_clip_val": trainer.gradient_clip_val,
                    "gradient_clip_algorithm": str(trainer.gradient_clip_algorithm or "norm"),
                    "precision": str(trainer.precision),
                    "strategy": type(trainer.strategy).__name__,
                }
            ),
            "planned_steps": _planned_steps(trainer),
            "accum_steps": trainer.accumulate_grad_batches,
            "world_size": trainer.world_size,
            "vocab_size": _vocab_size(pl_module, hparams),
            "peak_flops": model_peak_flops(pl_module, _compute_precision(trainer.precision)),
            "framework": "lightning",
            "resumed": resumed,
            "resume_path": str(trainer.ckpt_path) if resumed else None,
        }
        self._start(mon, fields)
        if resumed:
            # Lightning has restored optimizer, schedulers and loops by now (the global RNG is not
            # part of a Lightning checkpoint, so the fingerprint leaves it out).
            mon.resume(trainer.global_step - 1, path=str(trainer.ckpt_path), fingerprint=self._fingerprint(trainer))

    def _clip_by_norm(self, precision: Any, mon: TrainMonitor) -> Callable[[Any, float], None]:
        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            mon.clip_grad_norm_(precision.main_params(optimizer), clip_val)  # same clip as torch's

        return clip_grad_by_norm

    def _timed_save(self, trainer: pl.Trainer, save: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            mon = self.monitor
            if mon is None:
                return save(filepath, *args, **kwargs)
            t0 = time.perf_counter()
            with mon.phase("checkpoint"):
                out = save(filepath, *args, **kwargs)
            duration = time.perf_counter() - t0
            path = str(filepath)
            mon.checkpoint(
                max(trainer.global_step - 1, 0),
                path=path,
                duration=duration,
                bytes=os.path.getsize(path) if os.path.isfile(path) else None,
                fingerprint=self._fingerprint(trainer),
            )
            return out

        return save_checkpoint

    def _fingerprint(self, trainer: pl.Trainer) -> dict[str, Any]:
        return self._state_fingerprint(
            next_step=trainer.global_step,
            world_size=trainer.world_size,
            accum_steps=trainer.accumulate_grad_batches,
            model=trainer.lightning_module,
            rng=False,
        )

    # -- per step -------------------------------------------------------------------------

    def _on_training_step(self, out: Any, args: tuple[Any, ...]) -> None:
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, torch.Tensor):
            self._add_loss(loss)
        self._micro += 1
        if args:
            tokens, samples = self.tokens_fn(args[0])
            self._tokens += tokens or 0
            self._samples += samples or 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        mon = self.monitor
        if mon is None:
            return
        self._stepped = True
        algorithm = trainer.gradient_clip_algorithm
        by_norm = bool(trainer.gradient_clip_val) and (algorithm is None or str(algorithm).lower().endswith("norm"))
        custom = is_overridden("configure_gradient_clipping", pl_module)
        if self._clips and by_norm and not custom:
            return  # the clip_grad_by_norm wrapper records the norms
        # No norm clipping (or a custom one that may not clip): measure only. max_norm=inf scales
        # by exactly 1.0; a clip through the wrapper later in this step replaces the record.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mon.clip_grad_norm_(params, math.inf)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        mon = self.monitor
        if mon is None or not self._stepped:
            return  # an accumulation micro-batch: the step continues
        loss = self._loss / self._micro if self._loss is not None and self._micro > 1 else self._loss
        self._step_end(mon, trainer.global_step - 1, loss)
        if self._stopping is not None and self._stop is None:
            step = trainer.global_step - 1
            ckpt = getattr(trainer, "checkpoint_callback", None)
            folder = getattr(ckpt, "dirpath", None) or trainer.default_root_dir
            path = None
            if worth_saving(self._stopping):
                path = os.path.join(folder, f"trainmon-stop-step{step}.ckpt")
                trainer.save_checkpoint(path)  # through _timed_save: reported like any other save
            trainer.should_stop = True
            self._stop = TrainingStopped(self._stopping, step, path)

    # -- evaluation -----------------------------------------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking:
            return
        self._eval = contextlib.ExitStack()
        self._eval.enter_context(self.monitor.phase("eval"))
        self._eval_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval is None or self.monitor is None:
            return
        self._eval.close()
        self._eval = None
        duration = time.perf_counter() - self._eval_start
        metrics = trainer.callback_metrics
        key = self.eval_loss_key or (
            "val_loss" if "val_loss" in metrics else next((k for k in metrics if "val" in k and "loss" in k), None)
        )
        if key is None or key not in metrics:
            return
        others = {
            k: v
            for k, v in ((k, _scalar(v)) for k, v in metrics.items() if k != key and "val" in k)
            if v is not None and math.isfinite(v)
        }
        loss = _scalar(metrics[key])  # SYNC: once per evaluation
        self._emit_eval(self.monitor, max(trainer.global_step - 1, 0), loss, others, duration)

    # -- the end --------------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stop is None:
            self._close("finished")
            return
        self._close("failed", str(self._stop))
        raise self._stop

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
        self._close(status, repr(exception))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unpatch()  # whatever happened, leave the module and trainer as they were

    def _close(self, status: str, error: str | None = None) -> None:
        if self._eval is not None:
            self._eval.close()
            self._eval = None
        super()._close(status, error)


def _closure_once(optimizer: Any) -> bool:
    """A torch.optim optimizer whose ``step(closure)`` evaluates the closure once, first."""
    if optimizer is None:
        return False
    cls = type(optimizer)
    return cls.__module__.startswith("torch.optim") and cls.__name__ != "LBFGS"


def _closure_first(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)  # keeps the LR scheduler's _wrapped_by_lr_sched marker
    def closure_first_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None:
            return step(**kwargs)
        with torch.enable_grad():  # what torch's first-order optimizers do with the closure
            loss = closure()
        step(**kwargs)  # the update alone: the forward and backward are done and timed by then
        return loss

    return closure_first_step


def _count_batch(batch: Any) -> tuple[int | None, int | None]:
    """Tokens and samples of the model's input, from shapes only.

    The input is the batch itself, ``input_ids`` in a dict, or the first element of an ``(x, y)``
    list or tuple. Tokens are its element count when it holds token ids (an integer tensor), none
    otherwise: the labels of ``(images, labels)`` are not tokens the model processed (they were
    counted as such: "tokens 6,400" for a batch of 6,400 class labels). Samples are its length."""
    if isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, dict):
        x = batch.get("input_ids")
        if not isinstance(x, torch.Tensor):  # no token ids: count the samples of the first tensor
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
            return None, (first.shape[0] if first is not None and first.dim() else None)
        batch = x
    if not isinstance(batch, torch.Tensor):
        return None, None
    samples = batch.shape[0] if batch.dim() else None
    ids = not batch.is_floating_point() and not batch.is_complex() and batch.dtype != torch.bool
    return (batch.numel() if ids else None), samples


def _planned_steps(trainer: pl.Trainer) -> int | None:
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    with contextlib.suppress(Exception):  # needs a sized dataloader
        steps = trainer.estimated_stepping_batches
        if math.isfinite(steps):
            return int(steps)
    return None


def _compute_precision(precision: Any) -> str:
    """Lightning's precision setting (``"bf16-mixed"``, ``"16-true"``, ``"32"``...) as the precision
    of the matmuls, the key of :data:`trainmon.flops.PEAK_FLOPS`."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    return "fp16" if text.startswith("16") else "fp32"


def _vocab_size(pl_module: Any, hparams: dict[str, Any]) -> int | None:
    for value in (
        hparams.get("vocab_size"),
        getattr(pl_module, "vocab_size", None),
        getattr(getattr(pl_module, "config", None), "vocab_size", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu()) if value.numel() == 1 else None  # SYNC: eval time only
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
