"""Detectors, one module each, behind the small interface in ``base``."""

from monitor.detectors.base import SEVERITIES, Detector, Finding
from monitor.detectors.hang import Hang
from monitor.detectors.memory_leak import MemoryLeak
from monitor.detectors.nan_inf import NanInf
from monitor.detectors.node_health import NodeHealth
from monitor.detectors.straggler import Straggler
from monitor.detectors.throughput_collapse import ThroughputCollapse

__all__ = [
    "ALL_DETECTORS",
    "SEVERITIES",
    "Detector",
    "Finding",
    "Hang",
    "MemoryLeak",
    "NanInf",
    "NodeHealth",
    "Straggler",
    "ThroughputCollapse",
]

ALL_DETECTORS: tuple[type[Detector], ...] = (
    NanInf,
    ThroughputCollapse,
    Straggler,
    Hang,
    NodeHealth,
    MemoryLeak,
)
