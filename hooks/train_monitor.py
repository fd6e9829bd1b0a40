"""``TrainMonitor``: the object a training loop talks to.

A plain loop needs four calls::

    mon = TrainMonitor("my-run", collector="http://127.0.0.1:9400")
    mon.watch(model, optimizer)
    mon.start(config=cfg, planned_steps=1000, vocab_size=50257)
    for step in range(1000):
        with mon.phase("data"):
            x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        mon.step_end(step, loss=loss, tokens=x.numel())
    mon.close()

Everything on the training thread is cheap and non-blocking: values that live on the GPU stay
tensors until their device-to-host copy has landed (see ``hooks.readback``), and events are
handed to the sender thread through a bounded deque (see ``hooks.transport``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hooks.readback import Readback
from hooks.schedules import Schedule
from hooks.transport import Transport
from hooks.wire import PHASES

__all__ = ["TrainMonitor"]

DEFAULT_COLLECTOR = "http://127.0.0.1:9400"


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


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
    ) -> None:
        self.run = run
        self.rank = _env_rank() if rank is None else rank
        self.host = host or socket.gethostname()
        self.stream = uuid.uuid4().hex
        target = collector or os.environ.get("TRAINMON_COLLECTOR", DEFAULT_COLLECTOR)
        if spool_dir is None:
            spool_dir = os.path.join(os.path.expanduser("~/.cache/trainmon/spool"), run, f"rank{self.rank}")
        self.transport = Transport(
            target,
            spool_dir=spool_dir,
            token=token or os.environ.get("TRAINMON_TOKEN"),
            queue_size=queue_size,
            flush_interval=flush_interval,
        )
        self._seq = 0
        self._readback = Readback()
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_clip: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._phases: dict[str, float] = {}
        self._last_step_end = time.perf_counter()
        self._last_step = -1
        self.overhead_s = 0.0  # time spent inside trainmon on the training thread
        self._closed = False
        atexit.register(self.close)

    # -- setup ----------------------------------------------------------------------------

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Attach the model (for its parameter count) and optimizer (for LR per param group)."""
        self._model = model
        self._optimizer = optimizer

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
        if self._model is not None and "n_params" not in fields:
            fields["n_params"] = sum(p.numel() for p in self._model.parameters())
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.emit(
            "run_start",
            {
                "config": config,
                "schedule": schedule.to_dict() if schedule is not None else None,
                "planned_steps": planned_steps,
                "vocab_size": vocab_size,
                "world_size": world_size,
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "framework": fields.pop("framework", "plain"),
                **fields,
            },
        )
        self._last_step_end = time.perf_counter()

    # -- per step -------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block of the step as one of the wire format's phases (``data``, ``eval``...)."""
        if name not in PHASES:
            raise ValueError(f"phase: unknown phase {name!r}, expected one of {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0, **kwargs: Any
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that also records the norm before and after.

        The post-clip norm is derived from the returned total norm with the same coefficient
        torch applies, as a tensor: no extra pass over the gradients and no sync.
        """
        total = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, **kwargs)
        t0 = time.perf_counter()
        coef = torch.clamp(max_norm / (total.detach() + 1e-6), max=1.0)
        self._pending_clip = (total.detach(), total.detach() * coef, coef)
        self.overhead_s += time.perf_counter() - t0
        return total

    def step_end(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        tokens: int | None = None,
        samples: int | None = None,
        **fields: Any,
    ) -> None:
        """Record the end of optimizer step ``step``. Never blocks on the device or network."""
        t0 = time.perf_counter()
        step_time = t0 - self._last_step_end
        self._last_step_end = t0
        self._last_step = step
        record: dict[str, Any] = {"step": step, "step_time": step_time, **fields}
        if tokens is not None:
            record["tokens"] = tokens
        if samples is not None:
            record["samples"] = samples
        if self._phases:
            phases = self._phases
            phases["other"] = max(0.0, step_time - sum(phases.values()))
            record["phases"] = phases
            self._phases = {}
        if self._optimizer is not None:
            record["lr"] = [_host_float(g["lr"]) for g in self._optimizer.param_groups]
        tensors: dict[str, torch.Tensor] = {}
        if isinstance(loss, torch.Tensor):
            tensors["loss"] = loss.detach()
        elif loss is not None:
            record["loss"] = float(loss)
        if self._pending_clip is not None:
            pre, post, coef = self._pending_clip
            tensors.update(grad_norm=pre, grad_norm_clipped=post, clip_coef=coef)
            self._pending_clip = None
        for ready in self._readback.submit(record, tensors):
            self.emit("step", ready)
        self.overhead_s += time.perf_counter() - t0

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
        """Queue one event of the wire format (``None`` fields are left out)."""
        event = {
            "kind": kind,
            "run": self.run,
            "rank": self.rank,
            "host": self.host,
            "stream": self.stream,
            "seq": self._seq,
            "time": time.time(),
            "fields": {k: v for k, v in fields.items() if v is not None},
        }
        self._seq += 1
        self.transport.put(event)

    def close(self, status: str = "finished", error: str | None = None, timeout: float = 10.0) -> None:
        """Flush pending records, send ``run_end`` and stop the sender (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ready in self._readback.drain():
            self.emit("step", ready)
        self.emit(
            "run_end",
            {
                "status": status,
                "step": self._last_step if self._last_step >= 0 else None,
                "error": error,
                "dropped_events": self.transport.dropped,
            },
        )
        self.transport.close(timeout)


def _host_float(value: Any) -> float:
    # A tensor LR (some fused optimizers) on the GPU would sync here; such optimizers keep it
    # on the CPU, so this is a host read.
    return float(value)
