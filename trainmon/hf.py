"""Hugging Face ``Trainer`` callback: ``Trainer(..., callbacks=[TrainmonCallback(run=..., collector=URL)])``."""

from trainmon.hooks.hf import TrainmonCallback

__all__ = ["TrainmonCallback"]
