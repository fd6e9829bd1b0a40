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
- ``backward``: from the end of each forward to the arrival of its last parameter gradient (a
  post-accumulate-grad hook on the parameter whose gradient comes last, learnt from the first
  backward), per micro-batch.
- ``comm``: DDP all-reduce time not hidden behind backward (a DDP comm hook wrapping the
  default all-reduce).
- ``optimizer``: from the end of the last micro-batch's backward (or from a clip through
  ``clip_grad_norm_``) to ``step_end``: clipping, the update, the scheduler step and ``zero_grad``.
  Which steps updated, and the LRs each update used, are recorded by a callable of C iterators that
  ``optimizer.step`` calls after the update: no Python hook on the optimizer, except on the sampled
  steps, whose pre-hook copies the parameters for the update/param ratio.
- ``data``: time before each forward not spent in another phase, unless the loop times it
  itself with ``phase("data")``. ``checkpoint`` and ``eval`` are timed with ``phase(...)``.
- ``other``: the rest of the step.

Host-device traffic: none on the hot path. On GPU, forward/backward/optimizer are timed with
CUDA events, and loss, norms, loss scale and per-parameter grad norms are gathered into one device
buffer at ``step_end``, whose non-blocking copy to pinned memory the sender thread queues on a copy
stream of its own (``trainmon.hooks.readback``); the step's record is sent once it has landed, usually
one step later. Events leave through the transport's bounded deque.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import math
import operator
import os
import signal
import socket
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from trainmon.hooks.checksum import normalise_layout, weights_checksum
from trainmon.hooks.device_events import EventPool
from trainmon.hooks.health import HealthSampler, gpu_uuid_of
from trainmon.hooks.launch import launch_id
from trainmon.hooks.policy import CollectorFinding, StopPolicy, TrainingStopped
from trainmon.hooks.precursors import (
    Precursors,
    Sampled,
    UpdateSample,
    adam_eps_fractions,
    snapshot_for_update_ratio,
    update_ratios,
)
from trainmon.hooks.readback import Readback, gather, read
from trainmon.hooks.stacks import StackWatch
from trainmon.hooks.transport import Transport
from trainmon.schedules import Schedule, declared_schedule
from trainmon.wire import PHASES

__all__ = ["TrainMonitor"]

DEFAULT_COLLECTOR = "http://127.0.0.1:9400"
_SPLIT_CLIP = hasattr(torch.nn.utils, "get_total_norm")  # torch >= 2.6: the norm and the clip are separate calls
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_memory_stats = getattr(torch._C, "_cuda_memoryStats", None)
_reset_peak = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)

# The hot path (the hooks and step_end) runs with the interpreter's caches left cold by the model's own work, where
# every Python frame entered costs about a microsecond: helpers are inlined there, the LR is read with C callables
# (a list comprehension is a frame of its own in Python 3.11) and the clock is a module global (one lookup, not two).
_now = time.perf_counter
_LR = operator.itemgetter("lr")
_NO_CODE = (lambda: None).__code__
_new_step = object.__new__


class _Step:
    """What one optimizer step gathered on the training thread; made an event on the sender thread.

    Attributes the step never set keep these class defaults: fewer stores on the hot path.
    ``marks`` holds ``(phase, start, end)`` pairs: ``perf_counter`` floats, or CUDA events for
    device phases on GPU; the sender thread sums them once the events have completed.
    """

    step = 0
    end = 0.0
    loss: Any = None
    tokens: int | None = None
    samples: int | None = None
    fields: dict[str, Any] | None = None
    micro_batches = 0
    stepped = False  # optimizer.step ran (a GradScaler that skips the step never calls it)
    explicit_data = False
    lr: list[float] | None = None
    scale: torch.Tensor | None = None  # the loss scale this step's loss was multiplied by
    clip: tuple[Any, ...] | None = None  # (total pre-clip norm, max_norm, per-param norms, params)
    update_sample: UpdateSample | None = None
    update_ratio: torch.Tensor | None = None
    scheduler_epoch: int | None = None
    memory: tuple[int, int] | None = None
    ready: Any = None  # on GPU, the event behind the step's gathered values (and the optimizer's end)
    checksum: torch.Tensor | None = None  # of the weights the step starts from (trainmon.hooks.checksum)
    precursors: Sampled | None = None  # sampled steps: names, stacked device values (trainmon.hooks.precursors)

    def __init__(self, start: float, number: int, checksum_every: int, detail_every: int) -> None:
        # TrainMonitor.step_end inlines this: a change here goes there too.
        self.start = start
        self.marks: list[tuple[str, Any, Any]] = []
        # What this step samples, decided once here rather than in each hook (a call costs ~2 us on the hot
        # path), on every rank alike from the step's number: the weights checksum on the first step and every
        # ``checksum_every``, the sampled signals every ``detail_every`` (precursors, update ratios, Adam's
        # second moments, as the per-layer grad norms).
        self.checksum_due = checksum_every > 0 and number % checksum_every == 0
        self.sampled = detail_every > 0 and number % detail_every == 0


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
        detail_every: send per-parameter grad norms and the instability precursors
            (``trainmon.hooks.precursors``: attention logits and entropy, linear-layer output RMS, output
            log Z, update/param ratios, Adam's second moments under eps**2) every this many steps (0: never
            on a schedule).
        detail_trigger: also send per-parameter grad norms when the pre-clip norm exceeds this
            multiple of its median over the last 50 steps.
        checksum_every: send a checksum of the weights the step starts from on the first step and
            every this many steps (0: never), for the collector to check that data-parallel replicas
            agree and tensor-parallel shards differ (``trainmon.hooks.checksum``; sharded FSDP/ZeRO-3
            parameters are left out). A checksum reads every weight twice: on a GPU a fraction of a
            step, on a small CPU model ~5% of one, hence 50 by default (~0.1% of the step time).
        layout: the parallel layout, e.g. ``{"tp": 2, "pp": 1}`` (``dp`` defaults to what is left of
            the world size); ranks in Megatron-LM's order, tensor-parallel fastest. Without it every
            rank is a data-parallel replica of the others.
        health_interval, heartbeat_interval: seconds between health samples and heartbeats
            (0 disables the sampler thread).
        memory_interval: seconds between process-memory samples, sent with the next health event
            (0: none); the memory_leak detector needs their trend to catch a fast leak in a minute.
        close_timeout: seconds ``close()`` may take in all, however broken the collector is; what
            is not delivered by then waits in the spool for the next process.
        on_critical: act on the collector's findings for this run (off by default). ``"stop"``:
            at the next ``step_end``, call ``checkpoint`` (if given), end the run as failed and
            raise ``TrainingStopped`` carrying the finding; a callable instead receives each new
            ``CollectorFinding`` there and training goes on. Needs an HTTP collector; the finding
            arrives with an acknowledgement, about ``flush_interval`` plus a round trip after the
            step that caused it.
        stop_on: the least severity acted on: ``"critical"`` or ``"warning"``.
        checkpoint: saves the training state before a stop; what it returns is reported.
        stack_after: seconds without a step (or 10x the median step interval, if longer) after which
            the sender thread captures the training thread's Python stack and sends it (where a hung
            rank waits). Defaults to ``$TRAINMON_STACK_AFTER`` or 30.
        forward: send through the node's forwarder, one request per node and flush instead of one per
            rank (``trainmon.hooks.forwarder``): ``True``, ``False``, or ``None`` for ``$TRAINMON_FORWARD``
            (``1``/``0``), else on where several ranks share the node (``$LOCAL_WORLD_SIZE`` > 1) on Linux.
    """

    def __init__(
        self,
        run: str,
        collector: str | None = None,
        *,
        rank: int | None = None,
        host: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        queue_size: int = 65536,
        flush_interval: float = 0.5,
        detail_every: int = 100,
        detail_trigger: float = 3.0,
        checksum_every: int = 50,
        layout: dict[str, int] | None = None,
        health_interval: float = 10.0,
        heartbeat_interval: float = 5.0,
        memory_interval: float = 1.0,
        close_timeout: float = 2.0,
        on_critical: str | Callable[[CollectorFinding], Any] | None = None,
        stop_on: str = "critical",
        checkpoint: Callable[[], Any] | None = None,
        stack_after: float | None = None,
        forward: bool | None = None,
    ) -> None:
        self.run = run
        self.close_timeout = close_timeout
        self._sigterm = False  # a SIGTERM arrived: the run ends as interrupted
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.host = host or socket.gethostname()
        self.stream = uuid.uuid4().hex
        target = collector or os.environ.get("TRAINMON_COLLECTOR", DEFAULT_COLLECTOR)
        self._readback = Readback(capacity=queue_size)
        self._norm_history: collections.deque[float] = collections.deque(maxlen=50)  # sender thread only
        if spool_dir is None:
            spool_dir = os.path.join(os.path.expanduser("~/.cache/trainmon/spool"), run, f"rank{self.rank}")
        self.policy = StopPolicy(run, on_critical, stop_on, checkpoint) if on_critical is not None else None
        if self.policy is not None and target.startswith("file://"):
            raise ValueError("on_critical needs an http:// collector: a file:// target has no one to report findings")
        self.transport = Transport(
            target,
            spool_dir=spool_dir,
            token=token or os.environ.get("TRAINMON_TOKEN"),
            queue_size=queue_size,
            flush_interval=flush_interval,
            poll=self._completed,
            policy=self.policy,
            forward=forward,
        )
        self.detail_every = detail_every
        self.detail_trigger = detail_trigger
        self.checksum_every = checksum_every
        self.layout = layout
        self.overhead_s = 0.0  # time spent inside trainmon on the training thread
        self._cuda = False
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: Any = None
        self._scheduler: Any = None
        self._scheduler_epoch: int | None = None  # sender thread: last_epoch at the previous step
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self._grad_hooks: dict[int, Any] | None = None  # until the first backward shows which gradient comes last
        self._grad_param: torch.Tensor | None = None
        self._grad_ends: collections.deque[float] = collections.deque(maxlen=1)  # when the watched gradient came
        self._forward_end = 0.0  # host time of the last forward's end: an earlier gradient was another backward's
        self._precursors: Precursors | None = None
        self._precursors_armed = False  # the sampled step's forward hooks are registered
        self._update_hook: Any = None  # the sampled step's optimizer pre-hook, until the update
        self._updates: collections.deque[list[float]] = collections.deque(maxlen=1)  # the last update's LRs
        self._last_step = -1
        self._closed = False
        self._reset_step(time.perf_counter())
        if stack_after is None:
            stack_after = float(os.environ.get("TRAINMON_STACK_AFTER", "30"))
        self._stacks = StackWatch(after=stack_after)
        self._health: HealthSampler | None = None
        if health_interval > 0 or heartbeat_interval > 0:
            self._health = HealthSampler(
                self.emit,
                lambda: self._last_step,
                health_interval=health_interval if health_interval > 0 else float("inf"),
                heartbeat_interval=heartbeat_interval if heartbeat_interval > 0 else float("inf"),
                memory_interval=memory_interval,
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
        attention: list[torch.nn.Module | str] | None = None,
    ) -> None:
        """Install the torch hooks that capture phases, LR, skipped steps and the loss scale.

        ``model`` may be wrapped in DDP (its all-reduce is then timed through a comm hook).
        ``scheduler`` is watched for how often it steps per optimizer step (1 expected), and
        ``start`` declares the schedule it follows when it is one trainmon can read exactly;
        ``scaler`` (a ``GradScaler``) for the fp16 loss scale. ``attention``: the attention modules
        (or their names) whose logits, entropy and linear outputs the instability precursors measure,
        when recognising them by structure fails (``trainmon.hooks.precursors``).
        """
        self._model = model
        self._optimizer = optimizer
        self._scaler = scaler
        inner = getattr(model, "module", model)
        self._names = {id(p): name for name, p in inner.named_parameters()}
        self._precursors = Precursors(inner, attention)
        first = next(model.parameters(), None)
        self._cuda = first is not None and first.is_cuda
        if self._cuda:
            self._events = EventPool(enable_timing=True)
        self._handles.append(model.register_forward_pre_hook(self._on_forward_start))
        self._handles.append(model.register_forward_hook(self._on_forward_end))
        # The end of backward compute is the moment the last parameter gradient is accumulated. Which
        # parameter that is (usually the input embedding) is learnt from the first backward, with a
        # hook on every trainable parameter; then only that one keeps its hook (every hook call from
        # the autograd engine costs ~10 us per step with cold caches).
        self._grad_hooks = {
            id(p): p.register_post_accumulate_grad_hook(self._on_grad) for p in inner.parameters() if p.requires_grad
        } or None
        self._handles.extend((self._grad_hooks or {}).values())
        if optimizer is not None:
            self._watch_updates(optimizer)
        # The scheduler is read, not patched (a patched method would end up in its state_dict):
        # last_epoch counts its steps, so the delta per optimizer step should be 1.
        self._scheduler_epoch = getattr(scheduler, "last_epoch", None)
        self._scheduler = scheduler if self._scheduler_epoch is not None else None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._install_comm_hook(model)

    def start(
        self,
        *,
        config: dict[str, Any] | None = None,
        schedule: Schedule | dict[str, Any] | None = None,
        planned_steps: int | None = None,
        vocab_size: int | None = None,
        world_size: int | None = None,
        **fields: Any,
    ) -> None:
        """Announce the run: what it is, what it plans, and whether it resumed.

        ``schedule`` is a ``Schedule`` or its wire dict (checked here: a bad field raises
        ``ValueError`` naming it); without one, the schedule of the scheduler given to ``watch``
        is declared when trainmon can read it exactly, else none (the collector infers it).
        Extra keyword arguments are ``run_start`` fields of the wire format (``seq_len``,
        ``global_batch_tokens``, ``accum_steps``, ``resumed``, ``resume_path``, ...).
        """
        declared = declared_schedule(schedule, self._scheduler, planned_steps)
        fields.setdefault("launch_id", launch_id(world_size))  # which job this is, beside its run name
        if self._precursors is not None and vocab_size:
            self._precursors.set_vocab(vocab_size)  # the LM head is the layer that maps to the vocabulary
        if self._precursors is not None:
            fields.setdefault("precursors", self._precursors.coverage())
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
                "schedule": declared.to_dict() if declared is not None else None,
                "scheduler": type(self._scheduler).__name__ if self._scheduler is not None else None,
                "schedule_source": None if declared is None else ("user" if schedule is not None else "scheduler"),
                "planned_steps": planned_steps,
                "vocab_size": vocab_size,
                "world_size": world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")),
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "framework": fields.pop("framework", "plain"),
                "layout": self._normalised_layout(world_size),
                **fields,
            },
        )
        if self._health is not None:
            self._health.start()
        self._reset_step(time.perf_counter())
        self._stacks.attach(time.perf_counter())  # the calling thread is the training thread

    def _normalised_layout(self, world_size: int | None) -> dict[str, int] | None:
        if self.layout is None:
            return None
        return normalise_layout(self.layout, world_size or int(os.environ.get("WORLD_SIZE", "1")))

    # -- hooks ----------------------------------------------------------------------------

    def _reset_step(self, now: float) -> None:
        self._s = _Step(now, self._last_step + 1, self.checksum_every, self.detail_every)
        self._gap_start: float | None = now  # host time since the last phase ended
        self._explicit: str | None = None  # inside phase("eval") or phase("checkpoint")
        self._forward_open: Any = None  # start marks of the phases in progress
        self._backward_open: Any = None
        self._optimizer_open: Any = None  # opened by the clip wrapper
        self._after_backward: Any = None  # the last backward's end: the optimizer's start, unless a forward follows
        self._backward_event: Any = None  # the CUDA event of the watched gradient's arrival, on GPU
        self._comm_end = 0.0

    def _on_forward_start(self, _module: Any, _args: Any) -> None:
        if self._explicit is not None or not torch.is_grad_enabled():
            return  # eval / inference forwards are not part of the training step
        t0 = _now()
        s = self._s
        if self._backward_open is not None:
            self._close_backward(t0)  # the previous micro-batch's
        self._after_backward = None  # what followed that backward was the wait for this batch, not the optimizer
        # Host time between phases before a forward is time spent waiting for the next batch.
        gap = self._gap_start
        if gap is not None and not s.explicit_data:
            s.marks.append(("data", gap, t0))
        self._gap_start = None
        s.micro_batches += 1
        if s.micro_batches == 1:
            if self._optimizer is not None:
                # The LR this step will use, for a step that ends up skipped (a GradScaler that skips the update
                # never calls optimizer.step, and reading it at step_end would give the next LR); an update
                # records the LRs it used itself (_update_recorder).
                s.lr = list(map(float, map(_LR, self._optimizer.param_groups)))
            if self._scaler is not None and self._scaler._scale is not None:
                # The scale this step's loss is multiplied by; scaler.update() changes it in place
                # before step_end. A one-element device copy: no sync.
                s.scale = self._scaler._scale.detach().clone()
            if s.checksum_due and self._model is not None:
                s.checksum = weights_checksum(self._model.parameters())  # device reductions, read back later
            if s.sampled:
                p = self._precursors
                if p is not None and p.measurable:  # a model with something to measure
                    p.arm()  # removed at this forward's end: other steps run no hook of ours
                    self._precursors_armed = True
                if self._optimizer is not None and self._update_hook is None:
                    # The parameters before this step's update, for the update/param ratio: a pre-hook that
                    # removes itself, so other steps run no optimizer hook of ours.
                    self._update_hook = self._optimizer.register_step_pre_hook(self._on_sampled_update)
        # A phase boundary: the host time on CPU, a CUDA event queued on the current stream on GPU.
        self._forward_open = self._events.record() if self._cuda else t0
        self.overhead_s += _now() - t0

    def _on_forward_end(self, _module: Any, _args: Any, _output: Any) -> None:
        start = self._forward_open
        if start is None:
            return
        t0 = _now()
        s = self._s
        if self._precursors_armed:
            p = self._precursors
            assert p is not None
            s.precursors = p.collect()
            self._precursors_armed = False
            self.overhead_s += p.spent  # the hooks ran inside the model's forward, outside this accounting
            p.spent = 0.0
        end = self._events.record() if self._cuda else t0
        s.marks.append(("forward", start, end))
        # Backward is timed from here to the last gradient, so it includes a loss computed outside
        # the model (usually negligible next to the backward pass itself).
        self._forward_open = None
        self._backward_open = end
        self._forward_end = t0
        self._gap_start = None
        self.overhead_s += _now() - t0

    def _on_grad(self, param: torch.Tensor) -> None:
        # Only a timestamp: the phase is closed at the loop's next call into trainmon. On GPU this
        # runs on the autograd device thread, where the current stream is the backward's.
        self._grad_ends.append(_now())
        if self._cuda:
            self._backward_event = self._events.record()
        self._grad_param = param

    def _close_backward(self, now: float) -> None:
        s = self._s
        ends = self._grad_ends
        if ends and ends[-1] >= self._forward_end:
            end = ends.pop()
            mark = self._backward_event if self._cuda else end
        else:  # the watched gradient did not come (unused this micro-batch): close it here
            end = now
            mark = self._events.record() if self._cuda else now
        s.marks.append(("backward", self._backward_open, mark))
        if self._comm_end > end:
            # DDP all-reduce that finished after backward compute: time the step waited on the wire.
            comm_end = min(self._comm_end, now)
            s.marks.append(("comm", end, comm_end))
            end = comm_end
            mark = self._events.record() if self._cuda else comm_end  # queued behind the all-reduce's wait
        self._gap_start = end
        if self._optimizer is not None:
            self._after_backward = mark
        self._backward_open = self._backward_event = None
        self._comm_end = 0.0
        if self._grad_hooks is not None and self._grad_param is not None:
            # After the first backward: only the gradient that came last keeps a hook. On CPU, where all it does
            # is take the time, that hook is made of C functions only (_timestamper); on GPU it stays _on_grad,
            # which also records a CUDA event on the autograd thread's stream.
            kept = self._grad_param
            for key, handle in self._grad_hooks.items():
                if key != id(kept) or not self._cuda:
                    handle.remove()
            if not self._cuda:
                hook = _timestamper(self._grad_ends)
                self._handles.append(kept.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
            self._grad_hooks = self._grad_param = None

    def _on_comm_done(self) -> None:
        self._comm_end = max(self._comm_end, time.perf_counter())  # called on the comm thread

    def _install_comm_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self._on_comm_done()
            return fut.value()

        # The hook is a lambda because it has no annotations: DDP checks a hook's against dist.GradBucket /
        # Future[Tensor], and with postponed evaluation a def's would be strings and fail that check.
        with contextlib.suppress(RuntimeError):  # the job has its own comm hook: leave it alone
            ddp.register_comm_hook(None, lambda state, bucket: allreduce_hook(state, bucket).then(done))

    def _watch_updates(self, optimizer: torch.optim.Optimizer) -> None:
        """Know which steps updated, with the LRs each update used, without a Python call per step.

        torch's wrapper around every ``Optimizer.step`` calls ``optimizer._optimizer_step_code()`` right after the
        update (a no-op entry point for torch's profiler): set on the instance, the recorder runs there with no
        Python frame (a pre-hook cost ~6 us a step with the caches the model's work left cold). A torch whose wrapper
        no longer calls it gets the recorder through a step post-hook. ``close`` gives the profiler its entry back.
        """
        record = _update_recorder(optimizer.param_groups, self._updates)
        if "_optimizer_step_code" in getattr(type(optimizer).step, "__code__", _NO_CODE).co_names:
            setattr(optimizer, "_optimizer_step_code", record)  # noqa: B010 (mypy: a method is not assignable)
        else:
            self._handles.append(optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: record()))

    def _on_sampled_update(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """A sampled step's optimizer pre-hook: copies of parameters about to be updated (update/param ratio)."""
        t0 = _now()
        assert self._update_hook is not None
        self._update_hook.remove()
        self._update_hook = None
        if self._s.sampled:  # not a later step's, after a sampled step that skipped its update
            self._s.update_sample = snapshot_for_update_ratio(optimizer)
        self.overhead_s += _now() - t0

    def _close_open_phases(self, now: float) -> None:
        """Backward and optimizer end at the loop's next call into trainmon."""
        if self._backward_open is not None:
            self._close_backward(now)
        start = self._optimizer_open
        if start is None and self._updates:  # no clip through trainmon, but the update ran since the last backward
            start = self._after_backward
        if start is not None:
            self._s.marks.append(("optimizer", start, self._events.record() if self._cuda else now))
            self._gap_start = None
        self._optimizer_open = self._after_backward = None

    # -- the loop's calls -----------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block of the step as one of the wire format's phases (``data``, ``eval``...).

        Forwards inside ``phase("eval")`` or ``phase("checkpoint")`` are not counted as
        training forwards.
        """
        if name not in PHASES:
            raise ValueError(f"phase: unknown phase {name!r}, expected one of {PHASES}")
        t0 = time.perf_counter()
        self._close_open_phases(t0)  # e.g. an eval or checkpoint between optimizer.step and step_end
        s = self._s
        if name == "data":
            s.explicit_data = True
        elif self._gap_start is not None and not s.explicit_data:
            s.marks.append(("data", self._gap_start, t0))
        self._gap_start = None
        outer = self._explicit
        if name in ("eval", "checkpoint"):
            self._explicit = name
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._s.marks.append((name, t0, t1))
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
        t0 = _now()
        if self._backward_open is not None:
            self._close_backward(t0)
        if self._optimizer_open is None:  # the optimizer phase starts with the clip, or at the last backward's end
            start = self._after_backward
            self._optimizer_open = start if start is not None else self._events.record() if self._cuda else t0
            self._after_backward = None
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        with_grad = [p for p in params if p.grad is not None]
        grads = [g for p in with_grad if (g := p.grad) is not None]  # all of with_grad's: the check narrows the type
        per_param = None
        total: torch.Tensor
        if grads and _SPLIT_CLIP and _one_group(grads):
            # What get_total_norm does for one device and dtype, keeping the per-parameter norms (stacked
            # there anyway: the read-back copies them with the step's other values, no second stack).
            per_param = torch.stack(torch._foreach_norm(grads, norm_type))
            total = torch.linalg.vector_norm(per_param, norm_type)
            if error_if_nonfinite and not torch.isfinite(total):  # SYNC: only when asked for, as in torch
                raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
            torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach)
        else:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        t1 = _now()  # clipping itself is the loop's work, not trainmon overhead
        self._s.clip = (total.data, max_norm, per_param, with_grad)
        self._gap_start = None  # inside the optimizer phase, closed by step_end
        self.overhead_s += _now() - t1
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
        stacked = torch.stack([n.data for n in per_param]) if per_param else None
        self._s.clip = (total.data, max_norm, stacked, params)

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
        ``loss_scale``, ...); values given here win over what the hooks measured. Everything that
        can wait is done on the sender thread: here the step's values are only captured.
        """
        t0 = _now()
        s = self._s
        if self._backward_open is not None:
            self._close_backward(t0)
        # _close_open_phases, inlined: the optimizer phase runs from the clip, or else from the last backward's end
        opened = self._optimizer_open
        if opened is None:
            opened = self._after_backward
        if opened is not None:
            self._optimizer_open = self._after_backward = None
            if not self._cuda:
                s.marks.append(("optimizer", opened, t0))
                opened = None  # marked; on GPU it is, below, by the event behind the step's gathered values
        updates = self._updates
        if updates:  # optimizer.step ran: the LRs it used replace those read at the step's first forward
            s.lr = updates.pop()
            s.stepped = True
        s.step, s.end, s.tokens, s.samples, s.fields = step, t0, tokens, samples, fields
        # .data, not .detach(): the same graph-free alias without a dispatcher call that releases the GIL
        # (a training thread that lets the GIL go waits for the sender thread to give it back).
        s.loss = loss.data if isinstance(loss, torch.Tensor) else loss
        if s.lr is None and self._optimizer is not None:
            s.lr = list(map(float, map(_LR, self._optimizer.param_groups)))
        if self._scheduler is not None:
            s.scheduler_epoch = self._scheduler.last_epoch
        if s.scale is None and self._scaler is not None and self._scaler._scale is not None:
            s.scale = self._scaler._scale.detach().clone()  # first step: scale() made it lazily
        if opened is not None and (s.update_sample is not None or (s.stepped and s.sampled)):
            # trainmon's own device work follows the update on a sampled step: the optimizer's end comes before it
            s.marks.append(("optimizer", opened, self._events.record()))
            opened = None
        if s.update_sample is not None:
            s.update_ratio, groups = update_ratios(s.update_sample)
            s.update_sample = None
            s.precursors = _joined(s.precursors, groups)
        if s.stepped and s.sampled:  # after the update: the second moments it used
            s.precursors = _joined(s.precursors, adam_eps_fractions(self._optimizer))
        if self._cuda:
            s.memory = _cuda_memory()
            values = gather(_device_tensors(s))  # in stream order, a step's values are its own
            if values is not None or opened is not None:
                # One event behind the gathered values (a stack and a cat: microseconds of device work): the
                # optimizer's end, where not marked above, and what the sender's copy of them waits for.
                s.ready = ready = self._events.record()
                if opened is not None:
                    s.marks.append(("optimizer", opened, ready))
            events = [end for _, _, end in s.marks if not isinstance(end, float)]
            self._readback.submit(s, values, s.ready, events)
        else:  # self._readback.submit(s), inlined (see Readback.pending)
            readback = self._readback
            if len(readback.pending) < readback.capacity:
                readback.pending.append((s, None, ()))
            else:
                readback.dropped += 1
        self._last_step = step
        # The next step, which starts after ours: _Step.__init__, inlined (no frame on the hot path).
        s = self._s = _new_step(_Step)
        s.marks = []
        every, number = self.checksum_every, step + 1
        s.checksum_due = every > 0 and number % every == 0
        every = self.detail_every
        s.sampled = every > 0 and number % every == 0
        s.start = now = _now()
        self.overhead_s += now - t0
        self._gap_start = now
        if self.policy is not None and self.policy.pending:  # filled by the sender thread from acknowledgements
            self._act(step)

    def _act(self, step: int) -> None:
        """The policy's turn at a step boundary; a stop ends the run as failed before it propagates."""
        assert self.policy is not None
        try:
            self.policy.at_boundary(step)
        except TrainingStopped as exc:
            self.close("failed", str(exc))
            raise

    def _completed(self) -> Iterator[dict[str, Any]]:
        """Sender thread: events whose values have arrived, in the order they were emitted."""
        for item, values in self._readback.ready():
            yield self._to_event(item, values)
        stack = self._stacks.poll(time.perf_counter())  # a rank that stopped stepping: where it waits
        if stack is not None:
            yield self._event("stack", stack, time.time())

    def _to_event(self, item: dict[str, Any] | _Step, values: dict[str, Any]) -> dict[str, Any]:
        return item if isinstance(item, dict) else self._finish(item, values)

    def _finish(self, s: _Step, values: dict[str, Any]) -> dict[str, Any]:
        """Complete a step record off the training thread and make it an event."""

        def value(key: str, v: Any) -> Any:  # what the device copy brought back, else a host read
            return values[key] if key in values else read(v)

        self._stacks.step_done(s.step, s.end)
        record: dict[str, Any] = {"step": s.step, "step_time": s.end - s.start}
        if s.tokens is not None:
            record["tokens"] = s.tokens
        if s.samples is not None:
            record["samples"] = s.samples
        if s.micro_batches:
            record["micro_batches"] = s.micro_batches
        if self._optimizer is not None:
            record["lr"] = s.lr
            record["skipped"] = not s.stepped
        if s.scheduler_epoch is not None and self._scheduler_epoch is not None:
            record["scheduler_steps"] = s.scheduler_epoch - self._scheduler_epoch
            self._scheduler_epoch = s.scheduler_epoch
        if s.marks:
            phases: dict[str, float] = {}
            for name, start, end in s.marks:
                dt = end - start if isinstance(start, float) else start.elapsed_time(end) / 1000.0
                phases[name] = phases.get(name, 0.0) + dt
            phases["other"] = max(0.0, record["step_time"] - sum(phases.values()))
            record["phases"] = phases
            if self._cuda:  # their times are read: the events may be recorded again
                events = {id(e): e for _, start, end in s.marks for e in (start, end) if not isinstance(e, float)}
                events.pop(id(s.ready), None)  # given back below, once
                self._events.release(events.values())
        if s.ready is not None:  # the copy it guarded has completed
            self._events.release((s.ready,))
        if s.memory is not None:
            record["mem_allocated_bytes"], record["mem_peak_bytes"] = s.memory
        if s.loss is not None:
            record["loss"] = float(value("loss", s.loss))
        if s.scale is not None and self._scaler.is_enabled():
            record["loss_scale"] = value("loss_scale", s.scale)
        if s.update_ratio is not None:
            record["update_ratio"] = value("update_ratio", s.update_ratio)
        if s.checksum is not None:
            record["weights_checksum"] = value("weights_checksum", s.checksum)
        if s.precursors is not None:
            self._precursor_fields(record, s.precursors[0], value("precursors", s.precursors[1]))
        if s.clip is not None:
            total, max_norm, per_param, params = s.clip
            norm = record["grad_norm"] = value("grad_norm", total)
            # torch's float32 arithmetic: coef = clamp(max_norm / (norm + 1e-6), max=1)
            coef = min(1.0, _f32(_f32(max_norm) / _f32(norm + _f32(1e-6))))
            record["clip_coef"] = coef
            record["grad_norm_clipped"] = _f32(norm * coef)
            if per_param is not None:
                self._layer_norms(record, norm, values.get("_per_param", per_param), params)
        record.update(s.fields or {})  # what the loop passed explicitly wins over what hooks measured
        # The wall-clock time of the step's end, from its perf_counter one: a time.time() call fewer on the
        # training thread. The sender finishes a step soon after (a step later on GPU); over that delay the
        # clocks drift apart by NTP's slew at most (0.05 %, well under a millisecond a second).
        return self._event("step", record, time.time() - (time.perf_counter() - s.end))

    @staticmethod
    def _precursor_fields(record: dict[str, Any], names: list[str], values: list[float]) -> None:
        """The sampled precursors as step fields: a ``kind:key`` name is one entry of the map ``kind``
        (``attn_logit_max`` per attention module, ``adam_eps_frac`` per group...), a plain name a float."""
        for name, v in zip(names, values, strict=True):
            kind, _, key = name.partition(":")
            if key:
                record.setdefault(kind, {})[key] = v
            else:
                record[kind] = v

    def _layer_norms(self, record: dict[str, Any], norm: float, per_param: Any, params: Any) -> None:
        """Per-parameter grad norms on schedule or when the pre-clip norm jumps above its median."""
        history = self._norm_history
        spiking = (
            len(history) >= 10
            and norm > self.detail_trigger * min(history)  # cheap screen before the median
            and norm > self.detail_trigger * statistics.median(history)
        )
        scheduled = self.detail_every and record["step"] % self.detail_every == 0
        if spiking or scheduled:
            values = per_param.tolist() if isinstance(per_param, torch.Tensor) else per_param  # CPU, or read back
            names = [self._names.get(id(p), f"param{i}") for i, p in enumerate(params or ())]
            record["layer_grad_norms"] = dict(zip(names, values, strict=True))
        if math.isfinite(norm):
            history.append(norm)

    # -- occasional events ----------------------------------------------------------------

    def eval(self, step: int, loss: float, **metrics: float) -> None:
        """Record an evaluation on held-out data after ``step``. Metrics that are not numbers are left
        out: the collector would refuse the whole batch they travel in."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.emit("eval", {"step": step, "loss": float(loss), "metrics": numbers or None})

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
        self._readback.submit(self._event(kind, fields, time.time()))

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

    def close(self, status: str = "finished", error: str | None = None, timeout: float | None = None) -> None:
        """Flush pending records, send ``run_end`` and stop the threads (idempotent).

        Takes at most ``timeout`` seconds (default ``close_timeout``) whatever the collector does;
        what was not acknowledged by then is spooled for the next process to send."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        if self._sigterm and status == "finished":
            status, error = "interrupted", error or "SIGTERM"
        atexit.unregister(self.close)
        for handle in self._handles:
            handle.remove()
        if self._update_hook is not None:
            self._update_hook.remove()
        if self._optimizer is not None:
            vars(self._optimizer).pop("_optimizer_step_code", None)  # torch's profiler entry point again
        if self._health is not None:
            self._health.stop()
        self._stacks.detach()
        # The sender finishes what it took from the readback first (order); half the budget at most.
        self.transport.flush(max(0.0, deadline - time.monotonic()) / 2)
        for item, values in self._readback.drain():
            self.transport.put(self._to_event(item, values))
        self.emit(
            "run_end",
            {
                "status": status,
                "step": self._last_step if self._last_step >= 0 else None,
                "error": error,
                # Every event is stored or counted here: refused by the collector (a malformed one loses its
                # batch), dropped on a full queue or spool, or on the device side's full read-back.
                "dropped_events": self.transport.dropped
                + self.transport.dropped_spool
                + self.transport.rejected
                + self._readback.dropped,
            },
        )
        self.transport.close(max(0.0, deadline - time.monotonic()))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # torchrun and schedulers stop jobs with SIGTERM. A handler of the trainer's own (one that saves a
        # checkpoint within the grace period) runs at once: the monitor only nudges its sender and
        # closes later (explicitly or at exit), so the steps until the trainer stops are recorded too.
        # With the default action the process dies now, so the monitor closes first, within close_timeout.
        self._sigterm = True
        previous = self._previous_sigterm
        if callable(previous):
            self.transport.wake()
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            self.transport.wake()
        else:
            self.close(status="interrupted", error="SIGTERM")
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


def _timestamper(out: collections.deque[float]) -> Callable[[torch.Tensor], None]:
    """A gradient hook made of C functions only: each call appends ``time.perf_counter()`` to ``out``.

    The hook is ``next(clock, param)``: the parameter the autograd engine passes is ``next``'s default, never
    returned, as the clock never ends. Where the backward has left the caches cold, a Python hook costs ~7 us.
    """
    clock = map(out.append, iter(time.perf_counter, None))
    return functools.partial(next, clock)


def _update_recorder(groups: list[dict[str, Any]], out: collections.deque[list[float]]) -> Callable[[], Any]:
    """A callable built of C iterators only: each call appends the param groups' current LRs (floats) to ``out``.

    Called right after an update, the LRs it records are the ones the update used, whenever the loop sets them
    (a scheduler stepped after the update, a loop setting ``group["lr"]`` just before ``optimizer.step``). Each
    call maps ``float`` over a fresh ``map(_LR, groups)``, so groups added later are read too.
    """
    fresh = map(map, itertools.repeat(_LR), itertools.repeat(groups))  # map(_LR, groups), anew at each call
    lrs = map(list, map(map, itertools.repeat(float), fresh))
    return map(out.append, lrs).__next__


def _joined(a: Sampled | None, b: Sampled | None) -> Sampled | None:
    """Two sets of sampled values as one: a single stacked tensor crosses in the step's read-back."""
    if a is None or b is None:
        return a or b
    return a[0] + b[0], torch.cat([a[1], b[1]])


def _device_tensors(s: _Step) -> dict[str, torch.Tensor]:
    """The step's CUDA tensors, copied to the host in one non-blocking transfer by the readback."""
    out = {}
    if isinstance(s.loss, torch.Tensor) and s.loss.is_cuda:
        out["loss"] = s.loss
    if s.scale is not None and s.scale.is_cuda:
        out["loss_scale"] = s.scale
    if s.update_ratio is not None and s.update_ratio.is_cuda:
        out["update_ratio"] = s.update_ratio
    if s.checksum is not None and s.checksum.is_cuda:
        out["weights_checksum"] = s.checksum
    if s.precursors is not None and s.precursors[1].is_cuda:
        out["precursors"] = s.precursors[1]
    if s.clip is not None and s.clip[0].is_cuda:
        out["grad_norm"] = s.clip[0]
        if s.clip[2] is not None:
            out["_per_param"] = s.clip[2]
    return out


def _one_group(grads: list[torch.Tensor]) -> bool:
    """All on one device with one dtype: torch's clip would make one group of them, in this order.

    ``get_device()`` and ``dtype`` return cached values; ``.device`` would build an object per tensor.
    """
    dtype, device = grads[0].dtype, grads[0].get_device()
    return all(g.dtype is dtype and g.get_device() == device for g in grads)


def _cuda_memory() -> tuple[int, int]:
    """The caching allocator's bytes in use now and at their peak since the last call (host counters, no sync).

    One read of the nested statistics: ``torch.cuda.memory_allocated()`` and ``max_memory_allocated()``
    each build, flatten and sort every allocator statistic, about 0.5 ms a step together on an H200.
    """
    if _memory_stats is None or _reset_peak is None:  # a torch without these internals: the public path
        stats = torch.cuda.memory_stats_as_nested_dict()
        torch.cuda.reset_peak_memory_stats()
    else:  # what those two do, less their device lookup through Python (a quarter of the read's cost)
        device = torch.cuda.current_device() if _get_device is None else _get_device()
        stats = _memory_stats(device)
        _reset_peak(device)
    allocated = stats.get("allocated_bytes", {}).get("all", {})
    return int(allocated.get("current", 0)), int(allocated.get("peak", 0))


def _f32(x: float) -> float:
    """Round to float32, so host arithmetic reproduces torch's on float32 tensors."""
    try:
        rounded: float = struct.unpack("f", struct.pack("f", x))[0]
        return rounded
    except OverflowError:  # beyond float32's range: torch would give inf too
        return math.copysign(math.inf, x)
