"""Detectors, one module each, behind the small interface in ``base``."""

from monitor.detectors.bad_resume import BadResume
from monitor.detectors.base import SEVERITIES, Detector, Finding
from monitor.detectors.divergence import Divergence
from monitor.detectors.eval_regression import EvalRegression
from monitor.detectors.grad_explosion import GradExplosion
from monitor.detectors.hang import Hang
from monitor.detectors.init_loss import InitLoss
from monitor.detectors.loss_scale_collapse import LossScaleCollapse
from monitor.detectors.loss_spike import LossSpike
from monitor.detectors.lr_schedule_drift import LrScheduleDrift
from monitor.detectors.memory_leak import MemoryLeak
from monitor.detectors.nan_inf import NanInf
from monitor.detectors.node_health import NodeHealth
from monitor.detectors.straggler import Straggler
from monitor.detectors.throughput_collapse import ThroughputCollapse

__all__ = [
    "ALL_DETECTORS",
    "SEVERITIES",
    "BadResume",
    "Detector",
    "Divergence",
    "EvalRegression",
    "Finding",
    "GradExplosion",
    "Hang",
    "InitLoss",
    "LossScaleCollapse",
    "LossSpike",
    "LrScheduleDrift",
    "MemoryLeak",
    "NanInf",
    "NodeHealth",
    "Straggler",
    "ThroughputCollapse",
]

ALL_DETECTORS: tuple[type[Detector], ...] = (
    NanInf,
    LrScheduleDrift,
    BadResume,
    ThroughputCollapse,
    Straggler,
    Hang,
    NodeHealth,
    MemoryLeak,
    LossSpike,
    GradExplosion,
    Divergence,
    InitLoss,
    LossScaleCollapse,
    EvalRegression,
)
