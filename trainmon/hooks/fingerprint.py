"""Cheap summaries of training state, so a resume can be checked against the checkpoint it loaded.

A trainer emits :func:`state_fingerprint` twice per checkpoint round trip: right after saving
(in the ``checkpoint`` event) and right after loading (in the ``resume`` event). A correct
resume restores every piece of state, so the two dicts are equal; the keys that differ name
the bug directly (``optimizer.adam_step_max`` 151 → 0: optimizer state not restored;
``scheduler.last_epoch``: scheduler not restored; ``rng.torch``: RNG not restored;
``data_position``: data replayed or skipped; ``next_step``: step counter reset). Loss barely
moves after such bugs on small models, so these state-level checks are what catches them.

The module imports only the standard library at import time (torch is imported inside the
functions that need it). How two fingerprints compare is shared with the collector, so it lives
beside the wire format: :func:`trainmon.fingerprint.compare_fingerprints`.

Cost: every function here reads state that lives on the host, except where a docstring says
``SYNC``; those are meant for checkpoint and resume time, never for the per-step hot path.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import random
import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "batch_fingerprint",
    "model_summary",
    "optimizer_summary",
    "rng_hashes",
    "scheduler_summary",
    "state_fingerprint",
    "unused_rngs",
]

_DIGEST = 8  # bytes: 16 hex characters is plenty to tell states apart


def _hash_bytes(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def batch_fingerprint(*tensors: Any) -> str:
    """A short hash of a token batch (several tensors, e.g. the micro-batches of a step).

    Replaying a batch produces the same fingerprint, so duplicates across a resume show up as
    repeated strings. Hash the batch while it is still on the CPU (before ``.to(device)``);
    a CUDA tensor is copied to the host first, which is a ``SYNC``.
    """
    import torch

    h = hashlib.blake2b(digest_size=_DIGEST)
    for t in tensors:
        if t.is_cuda:
            t = t.cpu()  # SYNC: device-to-host copy; pass CPU batches to avoid it
        t = t.contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16; hash the raw bits
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _rng_states(loaded_only: bool) -> dict[str, str]:
    out = {"python": _hash_bytes(pickle.dumps(random.getstate()))}
    np = sys.modules.get("numpy") if loaded_only else None
    if np is None and not loaded_only:
        try:
            import numpy as np
        except ImportError:  # numpy is optional for hooks
            np = None
    if np is not None:
        out["numpy"] = _hash_bytes(pickle.dumps(np.random.get_state()))
    torch = sys.modules.get("torch")
    if torch is None and not loaded_only:
        import torch
    if torch is not None:
        out["torch"] = _hash_bytes(torch.get_rng_state().numpy().tobytes())
        if not loaded_only and torch.cuda.is_available() and torch.cuda.is_initialized():
            states = torch.cuda.get_rng_state_all()  # host copies of the generator states
            out["cuda"] = _hash_bytes(*(s.numpy().tobytes() for s in states))
    return out


# Each generator's state when this module was imported (only those of modules already loaded: importing
# it must not pull torch or numpy in). A generator still in that state when a checkpoint is saved was
# never used by the run, so whether a resume restores it does not matter (a trainer that never touches
# NumPy need not restore it).
_IMPORT_STATES = _rng_states(loaded_only=True)


def rng_hashes() -> dict[str, str]:
    """Short hashes of the Python, NumPy (if importable), torch CPU and CUDA RNG states.

    CUDA is only read when it is already initialised, so this never creates a CUDA context.
    """
    return _rng_states(loaded_only=False)


def unused_rngs(hashes: Mapping[str, str]) -> list[str]:
    """Generators whose state has not moved since trainmon was imported: the run does not use them.

    A generator whose module was not loaded then has no known starting state and counts as used.
    """
    return sorted(name for name, h in hashes.items() if _IMPORT_STATES.get(name) == h)


def optimizer_summary(optimizer: Any) -> dict[str, Any]:
    """Adam-style state in a few numbers: step counts (min/max over params) and moment norms.

    ``adam_step_min``/``adam_step_max`` are 0 when the optimizer has no state (fresh or not
    restored); after a correct resume they equal the checkpoint's. ``exp_avg_norm`` and
    ``exp_avg_sq_norm`` are global L2 norms of the first and second moments. SYNC: the norms are
    read back once (one stacked copy), so call this at checkpoint/resume time only.
    """
    import torch

    steps: list[float] = []
    m1: list[Any] = []
    m2: list[Any] = []
    n_params = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            n_params += 1
            state = optimizer.state.get(p)
            if not state:
                continue
            if "step" in state:
                s = state["step"]
                steps.append(float(s) if not isinstance(s, torch.Tensor) or not s.is_cuda else float(s.cpu()))
            if "exp_avg" in state:
                m1.append(torch.linalg.vector_norm(state["exp_avg"].detach().float()))
            if "exp_avg_sq" in state:
                m2.append(torch.linalg.vector_norm(state["exp_avg_sq"].detach().float()))
    out: dict[str, Any] = {
        "params": n_params,
        "params_with_state": len(steps),
        "adam_step_min": int(min(steps)) if steps else 0,
        "adam_step_max": int(max(steps)) if steps else 0,
    }
    norms = [torch.linalg.vector_norm(torch.stack(v)) if v else None for v in (m1, m2)]
    present = [n for n in norms if n is not None]
    values = torch.stack(present).cpu().tolist() if present else []  # SYNC: one read-back
    it = iter(values)
    out["exp_avg_norm"] = next(it) if norms[0] is not None else 0.0
    out["exp_avg_sq_norm"] = next(it) if norms[1] is not None else 0.0
    return out


def scheduler_summary(scheduler: Any) -> dict[str, Any]:
    """Scheduler position: ``last_epoch`` (steps taken) and the LRs it set for the next step."""
    lrs = scheduler.get_last_lr() if hasattr(scheduler, "get_last_lr") else []
    return {"last_epoch": int(scheduler.last_epoch), "lrs": [float(x) for x in lrs]}


def model_summary(model: Any) -> dict[str, Any]:
    """A hash of every parameter's bytes plus the global parameter norm.

    Equal hashes across data-parallel ranks show the replicas are in sync. SYNC and a full
    device-to-host copy of the parameters: call it where a checkpoint copies them anyway.
    """
    import torch

    h = hashlib.blake2b(digest_size=_DIGEST)
    sq = 0.0
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().cpu().contiguous()  # SYNC: device-to-host copy
        h.update(name.encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
        if t.is_floating_point():
            sq += float(torch.sum(t.double() * t.double()))
    return {"model_hash": h.hexdigest(), "param_norm": math.sqrt(sq)}


def state_fingerprint(
    *,
    next_step: int,
    tokens: int | None = None,
    samples: int | None = None,
    data_position: int | None = None,
    world_size: int | None = None,
    global_batch_tokens: int | None = None,
    accum_steps: int | None = None,
    config_hash: str | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    loss_scale: float | None = None,
    model: Any = None,
    rng: bool = True,
) -> dict[str, Any]:
    """Everything a resume must restore, summarised as one JSON-able dict.

    ``next_step`` is the step the trainer will run next (the checkpointed step + 1 after a
    correct resume). The same call after saving and after loading yields equal dicts for a
    correct resume; feed both to :func:`trainmon.fingerprint.compare_fingerprints` to list what differs.
    """
    fp: dict[str, Any] = {"next_step": int(next_step)}
    for key, value in (
        ("tokens", tokens),
        ("samples", samples),
        ("data_position", data_position),
        ("world_size", world_size),
        ("global_batch_tokens", global_batch_tokens),
        ("accum_steps", accum_steps),
        ("config_hash", config_hash),
        ("loss_scale", loss_scale),
    ):
        if value is not None:
            fp[key] = value
    if optimizer is not None:
        fp["optimizer"] = optimizer_summary(optimizer)
    if scheduler is not None:
        fp["scheduler"] = scheduler_summary(scheduler)
    if model is not None:
        fp["model"] = model_summary(model)
    if rng:
        fp["rng"] = rng_hashes()
        unused = unused_rngs(fp["rng"])
        if unused:
            fp["rng_unused"] = unused  # never moved: the resume check skips them
    return fp
