"""``TrainMonitor``: the object a training loop talks to.

A plain loop needs a handful of calls::

    mon = TrainMonitor("my-run", collector="http://127.0.0.1:9400")
    mon.watch(model, optimizer, scheduler)        # torch hooks: phases, LR, skipped steps
    mon.start(config=cfg, planned_steps=1000, vocab_size=50257)
    for step in range(1000):
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        mon.step_end(step, loss=loss, tokens=x.numel())  # lr: what optimizer.step() used
    mon.close()

What ``watch`` installs, and what each phase means:

- ``forward``: module forward pre/post hooks on the model, counted only with grad enabled
  (an eval forward under ``no_grad`` is not training); one per micro-batch.
- ``backward``: from the end of each forward to the end of its gradient computation (an
  autograd-engine callback queued from parameter gradient hooks), per micro-batch.
- ``comm``: DDP all-reduce time not hidden behind backward (a DDP comm hook wrapping the
  default all-reduce).
- ``optimizer``: clipping, then from ``optimizer.step`` (a step pre-hook) to ``step_end``: the
  update, the scheduler step and ``zero_grad``.
- ``data``: time before each forward not spent in another phase, unless the loop times it
  itself with ``phase("data")``. ``checkpoint`` and ``eval`` are timed with ``phase(...)``.
- ``other``: the rest of the step.

Host-device traffic: none on the hot path. On GPU, forward/backward/optimizer are timed with
CUDA events, and loss, norms, loss scale and per-parameter grad norms stay tensors until their
non-blocking copy to pinned memory has landed (``hooks.readback``); the step's record is sent
when that happens, usually one step later. Events leave through the transport's bounded deque.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import math
import os
import signal
import socket
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hooks.health import HealthSampler, gpu_uuid_of
from hooks.readback import Readback, Timing
from hooks.schedules import Schedule
from hooks.transport import Transport
from hooks.wire import PHASES

__all__ = ["TrainMonitor"]

DEFAULT_COLLECTOR = "http://127.0.0.1:9400"
_UPDATE_SAMPLE_ELEMENTS = 1 << 16  # parameters copied to measure the update/param ratio


class _Clock:
    """Start/end marks of device phases: CUDA events on GPU, ``perf_counter`` on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # queued on the current stream; read later through hooks.readback
        return ev


class TrainMonitor:
    """Collects a training run's signals and ships them to a trainmon collector.

    Args:
        run: run id shared by all ranks (letters, digits, ``.``, ``_``, ``-``).
        collector: ``http://host:port`` of the collector, or ``file://PATH`` for a JSONL file.
            Defaults to ``$TRAINMON_COLLECTOR`` or ``http://127.0.0.1:9400``.
        rank: global rank; defaults to ``$RANK`` (set by torchrun) or 0.
        spool_dir: where events wait while the collector is unreachable.
        token: bearer token, defaults to ``$TRAINMON_TOKEN``.
        queue_size: events buffered in memory before new ones are dropped and counted.
        detail_every: send per-parameter grad norms and the update/param ratio every this many
            steps (0: never on a schedule).
        detail_trigger: also send per-parameter grad norms when the pre-clip norm exceeds this
            multiple of its median over the last 50 steps.
        health_interval, heartbeat_interval: seconds between health samples and heartbeats
            (0 disables the sampler thread).
    """

    def __init__(
        self,
        run: str,
        collector: str | None = None,
        *,
        rank: int | None = None,
        host: str | None = None,
        spool_dir: str | os.PathLike | None = None,
        token: str | None = None,
        queue_size: int = 65536,
        flush_interval: float = 0.5,
        detail_every: int = 100,
        detail_trigger: float = 3.0,
        health_interval: float = 10.0,
        heartbeat_interval: float = 5.0,
    ) -> None:
        self.run = run
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.host = host or socket.gethostname()
        self.stream = uuid.uuid4().hex
        target = collector or os.environ.get("TRAINMON_COLLECTOR", DEFAULT_COLLECTOR)
        self._readback = Readback(capacity=queue_size)
        self._norm_history: collections.deque[float] = collections.deque(maxlen=50)  # sender thread only
        if spool_dir is None:
            spool_dir = os.path.join(os.path.expanduser("~/.cache/trainmon/spool"), run, f"rank{self.rank}")
        self.transport = Transport(
            target,
            spool_dir=spool_dir,
            token=token or os.environ.get("TRAINMON_TOKEN"),
            queue_size=queue_size,
            flush_interval=flush_interval,
            poll=self._completed,
        )
        self.detail_every = detail_every
        self.detail_trigger = detail_trigger
        self.overhead_s = 0.0  # time spent inside trainmon on the training thread
        self._clock = _Clock(cuda=False)
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: Any = None
        self._scheduler: Any = None
        self._scheduler_mark: int | None = None
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self._last_step = -1
        self._closed = False
        self._reset_step(time.perf_counter())
        self._health: HealthSampler | None = None
        if health_interval > 0 or heartbeat_interval > 0:
            self._health = HealthSampler(
                self.emit,
                lambda: self._last_step,
                health_interval=health_interval if health_interval > 0 else float("inf"),
                heartbeat_interval=heartbeat_interval if heartbeat_interval > 0 else float("inf"),
            )
        atexit.register(self.close)
        self._previous_sigterm: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- setup ----------------------------------------------------------------------------

    def watch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
    ) -> None:
        """Install the torch hooks that capture phases, LR, skipped steps and the loss scale.

        ``model`` may be wrapped in DDP (its all-reduce is then timed through a comm hook).
        ``scheduler`` is watched for how often it steps per optimizer step (1 expected);
        ``scaler`` (a ``GradScaler``) for the fp16 loss scale.
        """
        self._model = model
        self._optimizer = optimizer
        self._scaler = scaler
        inner = getattr(model, "module", model)
        self._names = {id(p): name for name, p in inner.named_parameters()}
        first = next(model.parameters(), None)
        self._clock = _Clock(cuda=first is not None and first.is_cuda)
        self._handles.append(model.register_forward_pre_hook(self._on_forward_start))
        self._handles.append(model.register_forward_hook(self._on_forward_end))
        # The end of backward is an autograd-engine callback, queued from a gradient hook registered
        # once here on the last parameter in module order (per-forward tensor hooks cost ~40 us each;
        # every hook call from the engine ~9 us): layers near the output get their gradient first.
        trainable = [p for p in inner.parameters() if p.requires_grad]
        if trainable:
            self._handles.append(trainable[-1].register_post_accumulate_grad_hook(self._on_grad_ready))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_start))
        # The scheduler is read, not patched (a patched method would end up in its state_dict):
        # last_epoch counts its steps, so the delta per optimizer step should be 1.
        self._scheduler = scheduler
        self._scheduler_mark = getattr(scheduler, "last_epoch", None)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._install_comm_hook(model)

    def start(
        self,
        *,
        config: dict | None = None,
        schedule: Schedule | None = None,
        planned_steps: int | None = None,
        vocab_size: int | None = None,
        world_size: int | None = None,
        **fields: Any,
    ) -> None:
        """Announce the run: what it is, what it plans, and whether it resumed.

        Extra keyword arguments are ``run_start`` fields of the wire format (``seq_len``,
        ``global_batch_tokens``, ``accum_steps``, ``resumed``, ``resume_path``, ...).
        """
        if self._model is not None:
            fields.setdefault("n_params", sum(p.numel() for p in self._model.parameters()))
            first = next(self._model.parameters(), None)
            if first is not None:
                fields.setdefault("device", str(first.device))
                if first.is_cuda:
                    fields.setdefault("gpu_uuid", gpu_uuid_of(first.device.index or 0))
        self.emit(
            "run_start",
            {
                "config": json_config(config) if config is not None else None,
                "schedule": schedule.to_dict() if schedule is not None else None,
                "planned_steps": planned_steps,
                "vocab_size": vocab_size,
                "world_size": world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")),
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "framework": fields.pop("framework", "plain"),
                **fields,
            },
        )
        if self._health is not None:
            self._health.start()
        self._reset_step(time.perf_counter())

    # -- hooks ----------------------------------------------------------------------------

    def _reset_step(self, now: float) -> None:
        self._step_start = now
        self._gap_start: float | None = now  # host time since the last phase ended
        self._phases: dict[str, float] = {}
        self._timings: list[Timing] = []
        self._open: dict[str, Any] = {}
        self._explicit: str | None = None
        self._explicit_data = False
        self._micro_batches = 0
        self._optimizer_steps = 0
        self._lr: list[float] | None = None
        self._scale_used: torch.Tensor | None = None
        self._clip: tuple[torch.Tensor, ...] | None = None
        self._update_sample: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._comm_end = 0.0
        self._backward_end = 0.0
        self._in_backward = False

    def _close_gap(self, now: float) -> None:
        # Host time between phases before a forward is time spent waiting for the next batch.
        if self._gap_start is not None and not self._explicit_data:
            self._phases["data"] = self._phases.get("data", 0.0) + now - self._gap_start
        self._gap_start = None

    def _add(self, phase: str, start: Any, end: Any) -> None:
        if self._clock.cuda:
            self._timings.append(Timing(phase, start, end))
        else:
            self._phases[phase] = self._phases.get(phase, 0.0) + end - start

    def _on_forward_start(self, _module: Any, _args: Any) -> None:
        if not torch.is_grad_enabled() or self._explicit is not None:
            return  # eval / inference forwards are not part of the training step
        t0 = time.perf_counter()
        self._close_gap(t0)
        self._micro_batches += 1
        if self._micro_batches == 1 and self._optimizer is not None:
            # The LR this step will use; the optimizer pre-hook refines it (a skipped fp16 step never
            # calls optimizer.step, and reading it at step_end would give the next step's LR).
            self._lr = [float(g["lr"]) for g in self._optimizer.param_groups]
        if self._micro_batches == 1 and self._scaler is not None:
            # The scale this step's loss is multiplied by; scaler.update() changes it before
            # step_end. A one-element device copy: no sync.
            scale = self._scaler._scale
            self._scale_used = scale.detach().clone() if scale is not None else None
        self._open["forward"] = self._clock.mark()
        self.overhead_s += time.perf_counter() - t0

    def _on_forward_end(self, _module: Any, _args: Any, _output: Any) -> None:
        start = self._open.pop("forward", None)
        if start is None:
            return
        t0 = time.perf_counter()
        end = self._clock.mark()
        self._add("forward", start, end)
        # Backward is timed from here to the end of gradient computation, so it includes a loss
        # computed outside the model (usually negligible next to the backward pass itself).
        self._open["backward"] = end
        self._gap_start = None
        self.overhead_s += time.perf_counter() - t0

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            # Runs once autograd has computed every gradient, before DDP's own callback (queued
            # when its last bucket is ready) waits on the all-reduce: the boundary between
            # backward compute and exposed communication.
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        t0 = time.perf_counter()
        self._in_backward = False
        start = self._open.pop("backward", None)
        if start is not None:
            self._add("backward", start, self._clock.mark())
        self._backward_end = self._gap_start = time.perf_counter()
        self.overhead_s += self._backward_end - t0

    def _on_comm_done(self) -> None:
        self._comm_end = max(self._comm_end, time.perf_counter())  # called on the comm thread

    def _install_comm_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # No annotations on purpose: DDP checks them against dist.GradBucket / Future[Tensor],
        # and with postponed evaluation they would be strings and fail that check.
        def timed_allreduce(state, bucket):
            def done(fut):
                self._on_comm_done()
                return fut.value()

            return allreduce_hook(state, bucket).then(done)

        with contextlib.suppress(RuntimeError):  # the job has its own comm hook: leave it alone
            ddp.register_comm_hook(None, timed_allreduce)

    def _account_comm(self) -> None:
        # All-reduce that finished after backward compute was time the step waited on the wire.
        if self._comm_end > self._backward_end > 0:
            exposed = self._comm_end - self._backward_end
            self._phases["comm"] = self._phases.get("comm", 0.0) + exposed
            self._phases["data"] = max(0.0, self._phases.get("data", 0.0) - exposed)
        self._comm_end = 0.0

    def _on_optimizer_start(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        t0 = time.perf_counter()
        # The LR this update uses, whenever the loop steps its scheduler (host floats).
        self._lr = [float(g["lr"]) for g in optimizer.param_groups]
        self._account_comm()
        self._gap_start = None
        if self.detail_every and (self._last_step + 1) % self.detail_every == 0:
            self._snapshot_for_update_ratio(optimizer)
        self._optimizer_steps += 1  # a GradScaler that skips the step never calls optimizer.step
        # Closed in step_end (one hook call fewer per step: each costs ~10 us with cold caches).
        self._open["optimizer"] = self._clock.mark()
        self.overhead_s += time.perf_counter() - t0

    def _close_optimizer(self) -> None:
        if (start := self._open.pop("optimizer", None)) is not None:
            self._add("optimizer", start, self._clock.mark())

    def _snapshot_for_update_ratio(self, optimizer: Any) -> None:
        sample, budget = [], _UPDATE_SAMPLE_ELEMENTS
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() <= budget:
                    sample.append((p, p.detach().clone()))
                    budget -= p.numel()
        self._update_sample = sample or None

    def _update_ratio(self) -> torch.Tensor | None:
        if self._update_sample is None:
            return None
        with torch.no_grad():
            delta = torch.stack([torch.linalg.vector_norm(p.detach() - old) for p, old in self._update_sample])
            base = torch.stack([torch.linalg.vector_norm(old) for _, old in self._update_sample])
            ratio = torch.linalg.vector_norm(delta) / (torch.linalg.vector_norm(base) + 1e-12)
        self._update_sample = None
        return ratio

    # -- the loop's calls -----------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block of the step as one of the wire format's phases (``data``, ``eval``...).

        Forwards inside ``phase("eval")`` or ``phase("checkpoint")`` are not counted as
        training forwards.
        """
        if name not in PHASES:
            raise ValueError(f"phase: unknown phase {name!r}, expected one of {PHASES}")
        self._close_optimizer()  # an eval or checkpoint between optimizer.step and step_end
        t0 = time.perf_counter()
        if name == "data":
            self._explicit_data = True
            self._gap_start = None
        else:
            self._close_gap(t0)
        outer = self._explicit
        if name in ("eval", "checkpoint"):
            self._explicit = name
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._phases[name] = self._phases.get(name, 0.0) + t1 - t0
            self._explicit = outer
            self._gap_start = t1

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that also records the norm before and after.

        Gradients are clipped exactly as torch does (same total norm, same coefficient); the
        per-parameter norms torch computes on the way are kept as a tensor for the second-level
        signal, and the post-clip norm is derived from the coefficient: no extra pass, no sync.
        """
        t0 = time.perf_counter()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        per_param = None
        if grads and len({(g.device, g.dtype) for g in grads}) == 1 and hasattr(torch.nn.utils, "get_total_norm"):
            # What get_total_norm does for one device and dtype, keeping the per-parameter norms.
            per_param = torch._foreach_norm(grads, norm_type)
            total = torch.linalg.vector_norm(torch.stack(per_param), norm_type)
            if error_if_nonfinite and not torch.isfinite(total):  # SYNC: only when asked for, as in torch
                raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        else:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        t1 = time.perf_counter()  # clipping itself is the loop's work, not trainmon overhead
        self.record_grad_norm(total, max_norm, per_param, [p for p in params if p.grad is not None])
        self._gap_start = time.perf_counter()
        self._phases["optimizer"] = self._phases.get("optimizer", 0.0) + self._gap_start - t0
        self.overhead_s += self._gap_start - t1
        return total

    def record_grad_norm(
        self,
        total: torch.Tensor,
        max_norm: float,
        per_param: list[torch.Tensor] | None = None,
        params: list[torch.Tensor] | None = None,
    ) -> None:
        """Record a clip done elsewhere (a framework's, FSDP, DeepSpeed): its total pre-clip norm.

        Nothing is computed here: the coefficient and post-clip norm are derived from the total on
        the sender thread, as torch derives them, and per-parameter norms are read only on the
        steps that send them.
        """
        self._clip = (total.detach(), max_norm, per_param, params)

    def step_end(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        tokens: int | None = None,
        samples: int | None = None,
        **fields: Any,
    ) -> None:
        """Record the end of optimizer step ``step``. Never blocks on the device or network.

        Extra keyword arguments are ``step`` fields of the wire format (``batch_fingerprint``,
        ``loss_scale``, ...); values given here win over what the hooks measured.
        """
        t0 = time.perf_counter()
        self._account_comm()
        self._close_optimizer()
        record: dict[str, Any] = {"step": step, "step_time": t0 - self._step_start}
        if tokens is not None:
            record["tokens"] = tokens
        if samples is not None:
            record["samples"] = samples
        if self._micro_batches:
            record["micro_batches"] = self._micro_batches
        if self._optimizer is not None:
            record["lr"] = self._lr or [float(g["lr"]) for g in self._optimizer.param_groups]
            record["skipped"] = self._optimizer_steps == 0
        if self._scheduler_mark is not None:
            now_epoch = self._scheduler.last_epoch
            record["scheduler_steps"] = now_epoch - self._scheduler_mark
            self._scheduler_mark = now_epoch
        if self._phases:
            record["phases"] = self._phases
        if self._clock.cuda:
            record["mem_allocated_bytes"] = torch.cuda.memory_allocated()  # allocator counters: host only
            record["mem_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        tensors: dict[str, torch.Tensor] = {}
        if isinstance(loss, torch.Tensor):
            tensors["loss"] = loss.detach()
        elif loss is not None:
            record["loss"] = float(loss)
        if self._clip is not None:
            total, record["_max_norm"], per_param, record["_params"] = self._clip
            tensors["grad_norm"] = total
            if per_param is not None and self._clock.cuda:
                tensors["_per_param"] = torch.stack(per_param)  # one async copy with the rest
            elif per_param is not None:
                record["_per_param"] = per_param  # CPU tensors, read only if this step sends them
        if self._scaler is not None and self._scaler.is_enabled():
            # A device tensor read through the readback (get_scale() would sync).
            scale = self._scale_used
            if scale is None and self._scaler._scale is not None:  # first step: scale() made it lazily
                scale = self._scaler._scale.detach().clone()  # update() changes it in place later
            if scale is not None:
                tensors["loss_scale"] = scale
        ratio = self._update_ratio()
        if ratio is not None:
            tensors["update_ratio"] = ratio
        record.update(fields)
        for key in fields:
            tensors.pop(key, None)  # what the loop passed explicitly wins over what hooks measured
        record["_time"] = time.time()
        timings = self._timings
        self._last_step = step
        self._reset_step(t0)
        self._readback.submit(record, tensors, timings)
        self.overhead_s += time.perf_counter() - t0
        self._step_start = self._gap_start = time.perf_counter()  # the next step starts after ours

    def _completed(self) -> list[dict[str, Any]]:
        """Sender thread: events whose values have arrived, in the order they were emitted."""
        return [self._to_event(r) for r in self._readback.ready()]

    def _to_event(self, record: dict[str, Any]) -> dict[str, Any]:
        return record["_event"] if "_event" in record else self._finish(record)

    def _finish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Complete a step record off the training thread and make it an event."""
        t = record.pop("_time")
        phases = record.get("phases")
        if phases:
            phases["other"] = max(0.0, record["step_time"] - sum(v for k, v in phases.items() if k != "other"))
        max_norm = record.pop("_max_norm", None)
        per_param = record.pop("_per_param", None)
        params = record.pop("_params", None)
        norm = record.get("grad_norm")
        if norm is not None and max_norm is not None:
            # torch's float32 arithmetic: coef = clamp(max_norm / (norm + 1e-6), max=1)
            coef = min(1.0, _f32(_f32(max_norm) / _f32(norm + _f32(1e-6))))
            record["clip_coef"] = coef
            record["grad_norm_clipped"] = _f32(norm * coef)
        if per_param is not None and norm is not None:
            history = self._norm_history
            spiking = (
                len(history) >= 10
                and norm > self.detail_trigger * min(history)  # cheap screen before the median
                and norm > self.detail_trigger * statistics.median(history)
            )
            scheduled = self.detail_every and record["step"] % self.detail_every == 0
            if spiking or scheduled:
                values = [float(v) for v in per_param]  # floats (GPU: read back) or CPU tensors
                names = [self._names.get(id(p), f"param{i}") for i, p in enumerate(params or ())]
                record["layer_grad_norms"] = dict(zip(names, values, strict=True))
            if math.isfinite(norm):
                history.append(norm)
        return self._event("step", record, t)

    # -- occasional events ----------------------------------------------------------------

    def eval(self, step: int, loss: float, **metrics: float) -> None:
        """Record an evaluation on held-out data after ``step``."""
        self.emit("eval", {"step": step, "loss": float(loss), "metrics": metrics or None})

    def checkpoint(self, step: int, *, path: str | None = None, duration: float | None = None, **fields: Any) -> None:
        """Record a checkpoint save (``fingerprint`` holds the saved state's summary)."""
        self.emit("checkpoint", {"step": step, "path": path, "duration": duration, **fields})

    def resume(self, step: int, *, path: str | None = None, **fields: Any) -> None:
        """Record a resume from a checkpoint, with the restored state's ``fingerprint``."""
        self.emit("resume", {"step": step, "path": path, **fields})

    def emit(self, kind: str, fields: dict[str, Any]) -> None:
        """Queue one event of the wire format (``None`` fields are left out). Thread-safe.

        Events queue behind the step records still in flight, so an eval after step 9 never
        reaches the collector before step 9 does. The sequence number is assigned by the sender
        thread, in queue order, so events from several threads (training, health) stay ordered.
        """
        self._readback.submit({"_event": self._event(kind, fields, time.time())}, {})

    def _event(self, kind: str, fields: dict[str, Any], t: float) -> dict[str, Any]:
        return {
            "kind": kind,
            "run": self.run,
            "rank": self.rank,
            "host": self.host,
            "stream": self.stream,
            "time": t,
            "fields": {k: v for k, v in fields.items() if v is not None},
        }

    def close(self, status: str = "finished", error: str | None = None, timeout: float = 10.0) -> None:
        """Flush pending records, send ``run_end`` and stop the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for handle in self._handles:
            handle.remove()
        if self._health is not None:
            self._health.stop()
        for ready in self._readback.drain():
            self.transport.put(self._to_event(ready))
        self.emit(
            "run_end",
            {
                "status": status,
                "step": self._last_step if self._last_step >= 0 else None,
                "error": error,
                "dropped_events": self.transport.dropped + self._readback.dropped,
            },
        )
        self.transport.close(timeout)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # torchrun and schedulers stop jobs with SIGTERM: flush what we have, then let the
        # previous handler (or the default action) proceed.
        self.close(status="interrupted", error="SIGTERM")
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def json_config(d: dict[Any, Any]) -> dict[str, Any]:
    """A configuration as the wire format carries it: scalars, lists of scalars and nested tables;
    non-finite floats as strings; anything else (objects, tensors, callables) left out."""

    def ok(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, bool)) or (isinstance(v, float) and math.isfinite(v))

    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[str(k)] = str(v)
        elif ok(v):
            out[str(k)] = v
        elif isinstance(v, dict):
            out[str(k)] = json_config(v)
        elif isinstance(v, (list, tuple)) and all(ok(x) for x in v):
            out[str(k)] = list(v)
    return out


def _f32(x: float) -> float:
    """Round to float32, so host arithmetic reproduces torch's on float32 tensors."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: torch would give inf too
        return math.copysign(math.inf, x)
