"""Training FLOPs per token and the peak FLOP/s of common GPUs (standard library only).

One definition shared by the trainer side (which fills ``run_start.flops_per_token`` and
``run_start.peak_flops``; it must not import ``monitor``) and by ``trainmon.monitor.core.budget`` (the
``trainmon budget`` arithmetic and the live MFU): MFU is only comparable when both sides count
FLOPs the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["PEAK_FLOPS", "declared_flops_per_token", "model_peak_flops", "peak_flops_for", "training_flops_per_token"]


def training_flops_per_token(n_params: float, n_layers: int = 0, d_model: int = 0, seq_len: int = 0) -> float:
    """Model FLOPs of one training token: ``6·N``, plus ``12·L·d·s`` for attention when the shape is given.

    ``6·N`` is the seeds' rule (seed 003 "Training FLOPs per token ≈ 6 x number of parameters":
    2N forward, 4N backward; seed 001 §10 ``train_flops = 6 * params * tokens``). The attention
    score and weighted-sum matmuls are not parameter matmuls; for a sequence of ``s`` tokens they
    add ``2·2·s·d`` forward FLOPs per token and layer, x3 with the backward: ``12·L·d·s``
    (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's ``estimate_mfu``). With ``n_layers``,
    ``d_model`` or ``seq_len`` left at 0 the result is the seeds' plain ``6·N``.

    ``n_params`` should count the parameters that take part in matmuls: embedding lookups
    cost no FLOPs (an untied output head does).
    """
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def declared_flops_per_token(start: Mapping[str, Any]) -> float | None:
    """The training FLOPs per token a run declared in ``run_start``: ``flops_per_token`` when given,
    else ``6·n_params`` (every adapter counts the watched model's parameters), else ``None``.

    The one rule for the live MFU (``/metrics``, ``trainmon status``) and the post-mortem's."""
    if start.get("flops_per_token"):
        return float(start["flops_per_token"])
    return training_flops_per_token(start["n_params"]) if start.get("n_params") else None


# Dense (no sparsity) peak FLOP/s of one device from the vendors' data sheets, per compute
# precision: "bf16"/"fp16" on tensor cores, "fp32" on the CUDA cores (PyTorch does not use
# TF32 for matmuls by default). A missing precision means the device does not support it.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100-SXM": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100-PCIE": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM: the H100 SXM's compute, more memory; GH200 too
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},  # seed 001 §10: 312e12; seed 003: 19.5 TFLOP/s
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}


def _model_key(device_name: str) -> str | None:
    """Map a CUDA device name (``torch.cuda.get_device_name``) to a :data:`PEAK_FLOPS` key."""
    tokens = {t.upper() for t in re.split(r"[^A-Za-z0-9]+", device_name) if t}
    if "H100" in tokens:
        return "H100-PCIE" if "PCIE" in tokens else "H100-SXM"
    if tokens & {"H200", "GH200"}:
        return "H200"
    for key in ("A100", "V100", "A10", "L4", "T4"):  # whole tokens: "A10" must not match "A100" or "A10G"
        if key in tokens:
            return key
    return None


def peak_flops_for(device_name: str, precision: str) -> float | None:
    """Peak dense FLOP/s of a known GPU at ``precision`` (bf16, fp16, fp32), else ``None``."""
    key = _model_key(device_name)
    if key is None:
        return None
    return PEAK_FLOPS[key].get(precision)


def model_peak_flops(model: Any, precision: str) -> float | None:
    """Peak FLOP/s of the GPU holding ``model``'s first parameter at ``precision``, for the framework
    callbacks' ``run_start`` (they hold the model and know its precision, so MFU needs nothing
    from the user on a known GPU). ``None`` on a CPU, an unknown GPU or a parameterless model.

    ``torch`` is imported here, not at the top: the monitor side imports this module without it."""
    import torch

    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(first.device), precision)
