"""Lightning callback: ``lightning.Trainer(..., callbacks=[TrainmonCallback(run=..., collector=URL)])``."""

from trainmon.hooks.lightning import TrainmonCallback

__all__ = ["TrainmonCallback"]
