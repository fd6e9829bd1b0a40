"""In-trainer instrumentation for trainmon: this package runs only in the training process.

What both sides share (the wire format, ``trainmon.wire``, and the LR schedules, ``trainmon.schedules``)
lives beside it, standard-library only, so the collector imports it without torch; ``TrainMonitor``
(which needs torch) is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TrainMonitor"]

if TYPE_CHECKING:
    from trainmon.hooks.train_monitor import TrainMonitor


def __getattr__(name: str) -> Any:
    if name == "TrainMonitor":
        from trainmon.hooks.train_monitor import TrainMonitor

        return TrainMonitor
    raise AttributeError(f"module 'trainmon.hooks' has no attribute {name!r}")
