"""Weight checksums across ranks: data-parallel replicas must agree, tensor-parallel shards must not.

Data-parallel replicas (DDP, ZeRO-1/2) hold bitwise-identical weights: the all-reduce gives every
rank the same gradient bits and the optimizer does the same arithmetic. A rank whose weights
drift (a skipped all-reduce, a rank-local write, a bit flip, a nondeterministic kernel on one
node) trains a different model without any error. The converse bug is shards that should
differ but are identical: tensor-parallel ranks initialised from the same seed hold correlated
shards and the run is quietly worse.

``weights_checksum`` summarises a model's weights in three numbers, computed on the device with
a few reductions and no host sync (the readback copies them with the step's other values):

- the integer sum of the weights' bit patterns (each tensor viewed as integers of its element
  size, summed in int64): exact and order-independent, so it changes with any single bit and is
  identical on replicas whatever kernels summed it. It travels as two 24-bit halves (bits 0-23
  and 24-47) so that float32 carries them exactly;
- the sum of squares (float32), which says how far apart replicas are when the bits differ
  and serves the collector's relative tolerance;
- how many parameters were left out as sharded (below).

Sharded parameters are not replicas and are left out: ``DTensor`` parameters (FSDP2, tensor
parallelism through ``torch.distributed.tensor``), FSDP1's flat parameters and DeepSpeed ZeRO-3's
partitioned parameters. A fully sharded model therefore sends no checksum. The parallel layout
(``layout``, see ``normalise_layout``) tells the collector which ranks are replicas and which
hold different shards of the same layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["LAYOUT_AXES", "normalise_layout", "weights_checksum"]

LAYOUT_AXES = ("tp", "dp", "pp")
"""Parallel dimensions, fastest-varying first: Megatron-LM's rank order (tensor, data, pipeline)."""

# torch._utils._flatten_dense_tensors, less its Python frame: one call that flattens and concatenates a list
_flatten = torch._C._nn.flatten_dense_tensors
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOW = (1 << 24) - 1
_BATCH_ELEMENTS = 1 << 22  # smaller tensors are summed in batches of up to this many elements (16 MiB of int32)


def _sharded(p: torch.Tensor) -> bool:
    """A parameter this rank holds only a shard of (not a replica)."""
    if type(p).__name__ == "DTensor" or getattr(p, "_is_flat_param", False):
        return True
    return hasattr(p, "ds_tensor")  # DeepSpeed ZeRO-3 partitions the parameter; ZeRO-1/2 do not


def weights_checksum(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """``[bits 0-23, bits 24-47, sum of squares, parameters left out]`` of the replicated parameters, a
    float32 tensor on the first parameter's device (queued work only: reading it is the caller's business);
    None when there is nothing replicated. The count of parameters left out (sharded, or not materialised on
    the meta device) tells the collector whether identical checksums on tensor-parallel ranks mean anything.
    A model spread over several devices is reduced per device, the partial sums copied to the first."""
    params = list(params)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        device = p.device
        if p.element_size() in _BITS and device.type != "meta" and not _sharded(p):
            by_device.setdefault(device, []).append(p)
    if not by_device:
        return None
    first = next(iter(by_device))
    with torch.no_grad():  # the reductions read the parameters themselves: no graph, no detach of each
        bits, squares = [], []
        for tensors in by_device.values():
            b, q = _sums(tensors)
            bits.append(b)
            squares.append(q)
        total = torch.stack([b.to(first, non_blocking=True) for b in bits]).sum()
        square = torch.stack([q.to(first, non_blocking=True) for q in squares]).sum()
        left_out = torch.full_like(square, float(len(params) - sum(map(len, by_device.values()))))
        return torch.stack([(total & _LOW).float(), ((total >> 24) & _LOW).float(), square, left_out])


def _sums(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 sum of the tensors' bit patterns (exact, so the same in any order and grouping) and
    the float32 sum of their squares, as device scalars.

    Reducing each tensor on its own made a checksum of a model of many small parameters hundreds of
    kernel launches (3 ms of host time on an H200 for a 12-layer GPT): tensors under ``_BATCH_ELEMENTS``
    are concatenated per dtype (a cat across dtypes would convert the bits, not keep them) and reduced
    once per batch, for a temporary of at most that many elements. A batch is flattened and concatenated
    in one call (``torch._utils._flatten_dense_tensors``), where a reshape and a detach of each tensor from Python were
    still 300 dispatcher calls for that GPT, which made the checksum step the slowest of the overhead
    bench's steps on an H200 (4.4 ms of host time). Called under ``no_grad``.
    """
    parts: list[torch.Tensor] = []
    batches: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        n = t.numel()
        if n >= _BATCH_ELEMENTS:
            parts.append(t)
            continue
        batch, size = batches.get(t.dtype, ([], 0))
        if size + n > _BATCH_ELEMENTS:
            parts.append(_flatten(batch))
            batch, size = [], 0
        batch.append(t)
        batches[t.dtype] = (batch, size + n)
    parts.extend(_flatten(b) if len(b) > 1 else b[0] for b, _ in batches.values() if b)
    bits = torch.stack([f.view(_BITS[f.element_size()]).sum(dtype=torch.int64) for f in parts]).sum()
    squares = torch.stack([torch.linalg.vector_norm(f, dtype=torch.float32) for f in parts]).square().sum()
    return bits, squares


def normalise_layout(layout: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The layout with every axis present (``dp`` inferred from the world size when left out).

    Ranks are numbered tensor-parallel fastest, then data-parallel, then pipeline stage (Megatron-LM's
    default order): rank = tp_rank + tp * (dp_rank + dp * pp_rank). Raises ``ValueError`` on an
    unknown axis or sizes that do not multiply to the world size.
    """
    unknown = set(layout) - set(LAYOUT_AXES)
    if unknown:
        raise ValueError(f"layout: unknown axis {sorted(unknown)[0]!r}, expected some of {LAYOUT_AXES}")
    sizes = {axis: int(layout.get(axis, 1)) for axis in LAYOUT_AXES}
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"layout: sizes must be at least 1, got {dict(layout)}")
    if "dp" not in layout:
        model_parallel = sizes["tp"] * sizes["pp"]
        if world_size % model_parallel:
            raise ValueError(f"layout: tp x pp = {model_parallel} does not divide the world size {world_size}")
        sizes["dp"] = world_size // model_parallel
    if sizes["tp"] * sizes["dp"] * sizes["pp"] != world_size:
        raise ValueError(f"layout: {sizes} does not multiply to the world size {world_size}")
    return sizes
