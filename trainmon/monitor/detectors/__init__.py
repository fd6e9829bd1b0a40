"""Detectors, one module each, behind the small interface in ``base``."""

from trainmon.monitor.detectors.bad_resume import BadResume
from trainmon.monitor.detectors.base import SEVERITIES, Detector, Finding
from trainmon.monitor.detectors.degenerate import Degenerate
from trainmon.monitor.detectors.divergence import Divergence
from trainmon.monitor.detectors.eval_regression import EvalRegression
from trainmon.monitor.detectors.grad_explosion import GradExplosion
from trainmon.monitor.detectors.hang import Hang
from trainmon.monitor.detectors.init_loss import InitLoss
from trainmon.monitor.detectors.instability_precursor import InstabilityPrecursor
from trainmon.monitor.detectors.loss_noise import LossNoise
from trainmon.monitor.detectors.loss_scale_collapse import LossScaleCollapse
from trainmon.monitor.detectors.loss_spike import LossSpike
from trainmon.monitor.detectors.lr_schedule_drift import LrScheduleDrift
from trainmon.monitor.detectors.memory_leak import MemoryLeak
from trainmon.monitor.detectors.nan_inf import NanInf
from trainmon.monitor.detectors.node_health import NodeHealth
from trainmon.monitor.detectors.replica_divergence import ReplicaDivergence
from trainmon.monitor.detectors.straggler import Straggler
from trainmon.monitor.detectors.throughput_collapse import ThroughputCollapse

__all__ = [
    "ALL_DETECTORS",
    "SEVERITIES",
    "BadResume",
    "Degenerate",
    "Detector",
    "Divergence",
    "EvalRegression",
    "Finding",
    "GradExplosion",
    "Hang",
    "InitLoss",
    "InstabilityPrecursor",
    "LossNoise",
    "LossScaleCollapse",
    "LossSpike",
    "LrScheduleDrift",
    "MemoryLeak",
    "NanInf",
    "NodeHealth",
    "ReplicaDivergence",
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
    InstabilityPrecursor,
    Divergence,
    InitLoss,
    LossScaleCollapse,
    EvalRegression,
    ReplicaDivergence,
    LossNoise,
    Degenerate,
)
