"""What the framework adapters share: one ``TrainMonitor`` per training call, the stop policy, the
step being summed, and the framework methods patched on their instances for that call.

``trainmon.hooks.hf`` (HF ``TrainerCallback``) and ``trainmon.hooks.lightning`` (Lightning
``Callback``) each derive from :class:`MonitorAdapter` beside their framework's callback class and
keep only what their framework's API needs: which events come when, and where that trainer keeps
the loss, the gradient norm and its checkpoints. So both send the same fields as a plain loop, in
the same way, and a fix to the machinery lands in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainmon.hooks.fingerprint import state_fingerprint
from trainmon.hooks.policy import CollectorFinding
from trainmon.hooks.train_monitor import TrainMonitor
from trainmon.schedules import declared_schedule

__all__ = ["MonitorAdapter"]

_MISSING = object()


class MonitorAdapter:
    """The framework-neutral half of a trainmon callback (see the module docstring).

    Its arguments are the ones every callback takes, documented there: ``run``, ``collector``,
    ``start_fields``, ``fingerprint_model``, ``on_critical``, ``stop_on`` and ``**monitor_kwargs``.
    ``monitor`` is the ``TrainMonitor`` of the training call in progress, else ``None``.
    """

    def __init__(
        self,
        run: str,
        collector: str | None = None,
        *,
        start_fields: dict[str, Any] | None = None,
        fingerprint_model: bool = False,
        on_critical: str | Callable[[CollectorFinding], Any] | None = None,
        stop_on: str = "critical",
        **monitor_kwargs: Any,
    ) -> None:
        self.run = run
        self.collector = collector
        self.start_fields = dict(start_fields or {})
        if self.start_fields.get("schedule") is not None:  # a bad one fails here, not when training starts
            self.start_fields["schedule"] = declared_schedule(self.start_fields["schedule"])
        self.fingerprint_model = fingerprint_model
        self.on_critical = on_critical
        self.stop_on = stop_on
        self.monitor_kwargs = monitor_kwargs
        self.monitor: TrainMonitor | None = None
        self._stopping: CollectorFinding | None = None  # the finding that stops this training call
        self._patched: list[tuple[object, str, object]] = []
        self._optimizer: Any = None  # the torch optimizer (not a framework wrapper): what fingerprints read
        self._scheduler: Any = None
        self._reset_step()

    # -- one training call ----------------------------------------------------------------

    def _open(self) -> TrainMonitor:
        """A new ``TrainMonitor`` for the training call that starts; ``on_critical="stop"`` routes
        findings to :meth:`_on_finding`."""
        self._stopping = None
        policy = self._on_finding if self.on_critical == "stop" else self.on_critical
        mon = TrainMonitor(self.run, self.collector, on_critical=policy, stop_on=self.stop_on, **self.monitor_kwargs)
        self.monitor = mon
        self._reset_step()
        return mon

    def _start(self, mon: TrainMonitor, fields: dict[str, Any]) -> None:
        """``run_start`` with the fields read from the framework, ``start_fields`` overriding them."""
        mon.start(**{**fields, **self.start_fields})

    def _on_finding(self, finding: CollectorFinding) -> None:
        """``on_critical="stop"``: the first finding stops the run (from inside ``step_end``)."""
        if self._stopping is None:
            self._stopping = finding

    def _close(self, status: str, error: str | None = None) -> None:
        """Ends the run (once: ``monitor`` is ``None`` afterwards) and leaves the framework's objects
        as they were."""
        self._unpatch()
        mon, self.monitor = self.monitor, None
        if mon is not None:
            mon.close(status, error)

    # -- patching the framework's instances -----------------------------------------------

    def _patch(self, obj: object, name: str, fn: Callable[..., Any]) -> None:
        """Replaces ``obj.name`` by ``fn`` on this object only, until :meth:`_unpatch`.

        An instance attribute shadows the class method (``object.__setattr__``: never an
        ``nn.Module`` registration). One already there (torch's LR scheduler wraps
        ``optimizer.step`` that way) is put back at the end."""
        self._patched.append((obj, name, vars(obj).get(name, _MISSING)))
        object.__setattr__(obj, name, fn)

    def _unpatch(self) -> None:
        for obj, name, previous in reversed(self._patched):
            if previous is not _MISSING:
                object.__setattr__(obj, name, previous)
            elif name in vars(obj):
                object.__delattr__(obj, name)
        self._patched.clear()

    # -- the step being summed ------------------------------------------------------------

    def _reset_step(self) -> None:
        self._loss: torch.Tensor | None = None
        self._tokens = 0
        self._samples = 0

    def _add_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Adds a micro-batch's loss to the step's, on the device (async, no sync); returns it detached."""
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss
        return loss

    def _step_end(self, mon: TrainMonitor, step: int, loss: torch.Tensor | None) -> None:
        """Records optimizer step ``step`` with the tokens and samples counted since the last one."""
        mon.step_end(step, loss=loss, tokens=self._tokens or None, samples=self._samples or None)
        self._reset_step()

    # -- occasional events ----------------------------------------------------------------

    def _emit_eval(
        self, mon: TrainMonitor, step: int, loss: float | None, metrics: dict[str, float], duration: float | None
    ) -> None:
        mon.emit("eval", {"step": step, "loss": loss, "metrics": metrics or None, "duration": duration})

    def _state_fingerprint(
        self,
        *,
        next_step: int,
        world_size: int,
        accum_steps: int,
        model: torch.nn.Module | None,
        tokens: int | None = None,
        rng: bool = True,
    ) -> dict[str, Any]:
        """The resume fingerprint of the optimizer and scheduler (and ``model`` with
        ``fingerprint_model``). SYNC (checkpoint/resume time only): the optimizer's moment norms
        are read back once."""
        return state_fingerprint(
            next_step=next_step,
            world_size=world_size,
            accum_steps=accum_steps,
            tokens=tokens,
            optimizer=self._optimizer,
            scheduler=self._scheduler,
            model=model if self.fingerprint_model else None,
            rng=rng,
        )
