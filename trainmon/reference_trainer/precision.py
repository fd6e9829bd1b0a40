"""Mixed precision: the autocast context and the loss scaler for each precision and device.

* GPU: ``auto``/``bf16`` → bf16 autocast, no scaler; ``fp16`` → fp16 autocast + ``torch.amp.GradScaler``.
* CPU: fp32 maths. ``fp16`` uses :class:`EmulatedGradScaler`, a dynamic loss scale that treats a
  scaled gradient beyond the fp16 range as an overflow, so loss-scale behaviour (backoff,
  skipped steps, a reset scale after a bad resume) is real and testable without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["EmulatedGradScaler", "autocast_for", "make_scaler", "resolve_precision"]

FP16_MAX = 65504.0


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` → bf16 on CUDA, fp32 on CPU; ``bf16`` on CPU runs fp32 (CPU bf16 is slow and lossy)."""
    if device.type != "cuda":
        return "fp16" if precision == "fp16" else "fp32"
    return "bf16" if precision == "auto" else precision


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


class EmulatedGradScaler:
    """Dynamic loss scaling with the ``torch.amp.GradScaler`` API, for fp32 gradients on CPU.

    A step overflows when any scaled gradient is non-finite or larger than the fp16 maximum
    (what would have been inf in fp16); the step is skipped and the scale halves. After
    ``growth_interval`` clean steps the scale doubles. Disabled, every method is a pass-through.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._enabled = enabled
        # A (CPU) tensor, like GradScaler's, so TrainMonitor can read it the same way.
        self._scale = torch.tensor(float(init_scale))
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf = False

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self._enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled or self._unscaled:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            amax = torch.stack([g.detach().abs().max() for g in grads]).max()
            self._found_inf = not bool(amax <= FP16_MAX)  # CPU: a host read; NaN compares False
            torch._foreach_mul_(grads, 1.0 / float(self._scale))
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            optimizer.step()
            return
        self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        if not self._enabled:
            return
        if self._found_inf:
            self._scale = self._scale * self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale = self._scale * self._growth_factor
                self._growth_tracker = 0
        self._unscaled = False
        self._found_inf = False

    def get_scale(self) -> float:
        return float(self._scale) if self._enabled else 1.0

    def state_dict(self) -> dict[str, Any]:
        if not self._enabled:
            return {}
        return {"scale": float(self._scale), "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._scale = torch.tensor(float(state["scale"]))
            self._growth_tracker = int(state["growth_tracker"])


def make_scaler(precision: str, device: torch.device, init_scale: float) -> Any:
    """The loss scaler for a resolved precision: real GradScaler on CUDA fp16, else emulated/no-op."""
    if device.type == "cuda":
        return torch.amp.GradScaler("cuda", init_scale=init_scale, enabled=precision == "fp16")
    return EmulatedGradScaler(init_scale=init_scale, enabled=precision == "fp16")
