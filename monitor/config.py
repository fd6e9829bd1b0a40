"""The collector's configuration, in one typed place, with defaults that work on a laptop.

A TOML file may override any field (``trainmon serve --config FILE``); an unknown or mistyped
field is named in the error instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CollectorConfig", "ConfigError", "DetectorsConfig", "NanInfConfig", "load_config"]


class ConfigError(ValueError):
    """A configuration file or flag is wrong; the message names the field."""


@dataclass
class NanInfConfig:
    """``nan_inf``: any non-finite loss or grad norm."""

    resolve_after: int = 20
    """Consecutive finite steps after which the anomaly is marked resolved."""
    precursor_window: int = 20
    """Steps of grad-norm history used to tell a numerical blow-up from a sudden fault."""
    precursor_z: float = 3.0
    """A log grad-norm z-score above this before the NaN means it was building up."""


@dataclass
class LossSpikeConfig:
    """``loss_spike``: robust deviation of the loss from its recent trend; recoverable or not."""


@dataclass
class GradExplosionConfig:
    """``grad_explosion``: pre-clip grad-norm spike or a rising clip rate."""


@dataclass
class DivergenceConfig:
    """``divergence``: loss trending up over many steps."""


@dataclass
class ThroughputCollapseConfig:
    """``throughput_collapse``: sustained tokens/s drop, naming the phase whose time grew."""


@dataclass
class LrScheduleDriftConfig:
    """``lr_schedule_drift``: actual LR per group against the declared (or inferred) schedule."""


@dataclass
class BadResumeConfig:
    """``bad_resume``: composite check of the first steps after a resume."""


@dataclass
class StragglerConfig:
    """``straggler``: one rank's step or compute time against the other ranks."""


@dataclass
class HangConfig:
    """``hang``: no step (or no heartbeat) from a rank within a learnt timeout."""


@dataclass
class NodeHealthConfig:
    """``node_health``: NVML/psutil thresholds and counters."""


@dataclass
class MemoryLeakConfig:
    """``memory_leak``: memory rising across many steps."""


@dataclass
class InitLossConfig:
    """``init_loss``: first loss against ln(vocab)."""


@dataclass
class LossScaleCollapseConfig:
    """``loss_scale_collapse``: fp16 loss scale falling repeatedly."""


@dataclass
class EvalRegressionConfig:
    """``eval_regression``: validation loss rising, or jumping after a resume."""


@dataclass
class DetectorsConfig:
    replay_window: int = 512
    """Stored steps per rank replayed into fresh detectors after a collector restart."""
    nan_inf: NanInfConfig = field(default_factory=NanInfConfig)
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    grad_explosion: GradExplosionConfig = field(default_factory=GradExplosionConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    throughput_collapse: ThroughputCollapseConfig = field(default_factory=ThroughputCollapseConfig)
    lr_schedule_drift: LrScheduleDriftConfig = field(default_factory=LrScheduleDriftConfig)
    bad_resume: BadResumeConfig = field(default_factory=BadResumeConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    node_health: NodeHealthConfig = field(default_factory=NodeHealthConfig)
    memory_leak: MemoryLeakConfig = field(default_factory=MemoryLeakConfig)
    init_loss: InitLossConfig = field(default_factory=InitLossConfig)
    loss_scale_collapse: LossScaleCollapseConfig = field(default_factory=LossScaleCollapseConfig)
    eval_regression: EvalRegressionConfig = field(default_factory=EvalRegressionConfig)


@dataclass
class CollectorConfig:
    db: str = "trainmon.sqlite"
    """SQLite file path or SQLAlchemy URL (``postgresql+psycopg://...``)."""
    host: str = "127.0.0.1"
    port: int = 9400
    max_body_bytes: int = 8 << 20
    """Largest accepted POST body; bigger batches get 413 and the sender splits them."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)


def _apply(obj: Any, raw: dict, prefix: str) -> None:
    known = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown field, expected one of {sorted(known)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a table, got {value!r}")
            _apply(current, value, f"{name}.")
            continue
        expected = type(current)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{name}: expected {expected.__name__}, got {value!r}")
        setattr(obj, key, value)


def load_config(path: str | Path | None = None, **overrides: Any) -> CollectorConfig:
    """Defaults, then the TOML file, then explicit overrides (command-line flags)."""
    config = CollectorConfig()
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        _apply(config, raw, "")
    _apply(config, {k: v for k, v in overrides.items() if v is not None}, "")
    return config
