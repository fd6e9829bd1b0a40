"""In-trainer instrumentation for trainmon.

``trainmon.hooks.wire`` and ``trainmon.hooks.schedules`` are standard-library only, so the collector can import
them without torch; ``TrainMonitor`` (which needs torch) is loaded on first use.
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
