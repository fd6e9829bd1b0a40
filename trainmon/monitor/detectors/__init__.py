"""Detectors, one module each, behind the small interface in ``base``.

The package finds its detectors itself: every module of it that defines a :class:`Detector` subclass
(its own, not one it imports) is a detector module; the others (``base``, ``rolling``,
``intermittent``, ``anchors``, and ``batch`` and ``quiet`` for the ``observe_batch`` overrides) are
helpers. Adding a detector is adding its module: the facts the rest of the daemon needs (its config
section, engine order, priority in an incident, plots, whether per-layer norms localise it) are
declared on its class, and read from here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from trainmon.monitor.detectors.base import NOTHING, PLOTS, SEVERITIES, Detector, Finding

__all__ = [
    "ALL_DETECTORS",
    "NOTHING",
    "PLOTS",
    "SEVERITIES",
    "Detector",
    "Finding",
    "kinds_on_plot",
    "localised_kinds",
    "priority_order",
]


def _discover() -> tuple[type[Detector], ...]:
    """Every detector class defined in a module of this package, in engine order."""
    found: list[type[Detector]] = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [
            cls
            for cls in vars(module).values()
            if inspect.isclass(cls)
            and issubclass(cls, Detector)
            and cls is not Detector
            and cls.__module__ == module.__name__
        ]
    return tuple(sorted(found, key=lambda cls: cls.order))


ALL_DETECTORS: tuple[type[Detector], ...] = _discover()
"""Every detector, in the order the engine runs them (:attr:`Detector.order`)."""


def priority_order() -> tuple[str, ...]:
    """The kinds with a priority, first-level symptom first (:attr:`Detector.priority`)."""
    ranked = [cls for cls in ALL_DETECTORS if cls.priority is not None]
    return tuple(cls.kind for cls in sorted(ranked, key=lambda cls: cls.priority))


def kinds_on_plot(plot: str) -> tuple[str, ...]:
    """The kinds whose findings ``plot`` (one of :data:`PLOTS`) marks."""
    if plot not in PLOTS:
        raise ValueError(f"unknown plot {plot!r}, expected one of {PLOTS}")
    return tuple(cls.kind for cls in ALL_DETECTORS if plot in cls.plots)


def localised_kinds() -> tuple[str, ...]:
    """The kinds the post-mortem localises with per-layer grad norms."""
    return tuple(cls.kind for cls in ALL_DETECTORS if cls.localised)
