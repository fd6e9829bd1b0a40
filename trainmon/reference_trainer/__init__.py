"""The reference trainer: a small GPT trained the way large runs are, instrumented with trainmon.

It is the testbed the detectors are judged on (``--inject`` faults with ground-truth labels)
and a template to copy. Entry point: ``python -m trainmon.reference_trainer --help``.
"""

from trainmon.reference_trainer.config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "train"]


def train(cfg: TrainConfig) -> str:
    """Run training (imports torch lazily, so ``--help`` and config checks stay fast)."""
    from trainmon.reference_trainer.train import train as _train

    return _train(cfg)
