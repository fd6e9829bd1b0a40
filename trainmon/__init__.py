"""trainmon: training-run monitoring and debugging for PyTorch.

In a training loop::

    from trainmon import TrainMonitor, Schedule

Framework callbacks are ``trainmon.hf.TrainmonCallback`` and ``trainmon.lightning.TrainmonCallback``;
the collector and the CLI live in ``trainmon.monitor``. Names are loaded on first use, so
importing the daemon side (or ``trainmon.wire``) never pulls torch in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Schedule", "TrainMonitor", "TrainingStopped"]

if TYPE_CHECKING:
    from trainmon.hooks.policy import TrainingStopped
    from trainmon.hooks.train_monitor import TrainMonitor
    from trainmon.schedules import Schedule


def __getattr__(name: str) -> Any:
    if name == "TrainMonitor":
        from trainmon.hooks.train_monitor import TrainMonitor

        return TrainMonitor
    if name == "TrainingStopped":  # raised when on_critical="stop" stops a run
        from trainmon.hooks.policy import TrainingStopped

        return TrainingStopped
    if name == "Schedule":
        from trainmon.schedules import Schedule

        return Schedule
    raise AttributeError(f"module 'trainmon' has no attribute {name!r}")
