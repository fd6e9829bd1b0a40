"""Instability precursors: what the model's insides show before the loss does (issue 28).

Measured only on sampled steps (``TrainMonitor.detail_every``): forward hooks are registered on
the recognised modules when that step's first forward starts and removed when it ends, so the
other steps pay one counter check. Every value is computed on the device, under ``no_grad``,
and read back with the step's other tensors (one non-blocking copy): no host sync.

- ``attn_logit_max`` (per attention module): an upper bound on max |q·k|/√d, the largest
  attention logit (Dehghani et al. 2023; Wortsman et al. 2023), computed as max over heads of
  (largest query row norm) x (largest key row norm) / √d_head. Cauchy-Schwarz makes it a
  bound; it costs O(tokens x width) on the projections' outputs and never materialises the
  T x T attention matrix (fused SDPA kernels keep it hidden). It is the quantity whose growth
  drives the logit growth these papers report (q and k norms rising until softmax saturates).
- ``output_logz`` / ``output_logit_max``: mean log-sum-exp and max |logit| of the LM head's
  output (the log Z that PaLM's z-loss pulls toward 0; Wortsman et al.'s output logit divergence).

Recognised by structure: modules whose class name contains ``Attention`` (or given through
``watch(..., attention=[...])``) with separate ``q_proj``/``k_proj`` (``query``/``key``)
children or a fused ``qkv``/``c_attn``/``Wqkv`` child laid out [q | k | v], and a head count
attribute (``n_head``, ``num_heads``, ``num_attention_heads``, ``n_heads``); the LM head is the last
``nn.Linear`` whose ``out_features`` is the vocabulary size given to ``start``. Anything else
(``nn.MultiheadAttention``'s packed in-projection, GPT-NeoX's per-head interleaved fused QKV)
is not measured: ``Precursors.unrecognised`` names it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Precursors"]

_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_SEPARATE = (("q_proj", "k_proj"), ("query", "key"))
_FUSED = ("qkv", "c_attn", "Wqkv")


class _Attention:
    """One attention module's projections and head layout, and what its sampled forward produced."""

    def __init__(self, name: str, n_head: int, n_kv: int, q: nn.Module, k: nn.Module | None) -> None:
        self.name, self.n_head, self.n_kv, self.q, self.k = name, n_head, n_kv, q, k
        self.q_out: torch.Tensor | None = None

    def bound(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """max over heads of max_i |q_i| · max_j |k_j| / √d (a device scalar)."""
        d = q.shape[-1] // self.n_head
        qn: torch.Tensor = q.detach().float().reshape(-1, self.n_head, d).norm(dim=-1).amax(dim=0)
        kn: torch.Tensor = k.detach().float().reshape(-1, self.n_kv, d).norm(dim=-1).amax(dim=0)
        # Grouped-query attention: consecutive query heads share a key head (an expand, no data-dependent size).
        kn = kn[:, None].expand(self.n_kv, self.n_head // self.n_kv).reshape(-1)
        return (qn * kn).amax() / math.sqrt(d)


def _heads(module: nn.Module) -> tuple[int, int] | None:
    n = next((getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
    if not n:
        config = getattr(module, "config", None)  # HF attention modules keep it on their config
        n = next((getattr(config, a) for a in _HEAD_ATTRS if isinstance(getattr(config, a, None), int)), None)
    if not n:
        return None
    kv = next((getattr(module, a) for a in _KV_HEAD_ATTRS if isinstance(getattr(module, a, None), int)), n)
    return (n, kv) if kv and n % kv == 0 else None


def _attention(name: str, module: nn.Module) -> _Attention | None:
    heads = _heads(module)
    if heads is None:
        return None
    children = dict(module.named_children())
    for q, k in _SEPARATE:
        if q in children and k in children:
            return _Attention(name, *heads, children[q], children[k])
    for fused in _FUSED:
        if fused in children:
            return _Attention(name, *heads, children[fused], None)
    return None


class Precursors:
    """The precursor capture of one model: recognised modules, and the hooks of the sampled step."""

    def __init__(self, model: nn.Module, attention: Iterable[nn.Module | str] | None = None) -> None:
        named = dict(model.named_modules())
        by_id = {id(m): n for n, m in named.items()}
        if attention is None:
            chosen = [
                (n, m)
                for n, m in named.items()
                if "Attention" in type(m).__name__ or isinstance(m, nn.MultiheadAttention)
            ]
        else:
            chosen = [
                (a, named[a]) if isinstance(a, str) else (by_id.get(id(a), type(a).__name__), a) for a in attention
            ]
        self.attention: list[_Attention] = []
        self.unrecognised: list[str] = []
        for n, m in chosen:
            found = _attention(n, m)
            if found is None:
                self.unrecognised.append(n)
            else:
                self.attention.append(found)
        self._model = model
        self.head: nn.Linear | None = None
        self._handles: list[Any] = []
        self._values: list[tuple[str, torch.Tensor]] = []
        self.spent = 0.0  # seconds the training thread spent in these hooks, for TrainMonitor.overhead_s

    def set_vocab(self, vocab_size: int) -> None:
        """The LM head: the last ``nn.Linear`` that maps to the vocabulary (known once ``start`` is called)."""
        heads = [m for m in self._model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab_size]
        self.head = heads[-1] if heads else None

    @property
    def measurable(self) -> bool:
        return bool(self.attention) or self.head is not None

    def arm(self) -> None:
        """Register the sampled step's forward hooks (removed by :meth:`collect`)."""
        self.collect()  # hooks a forward that raised left behind: never two sets at once
        for a in self.attention:
            if a.k is None:
                self._handles.append(a.q.register_forward_hook(self._fused_hook(a)))
            else:
                self._handles.append(a.q.register_forward_hook(self._q_hook(a)))
                self._handles.append(a.k.register_forward_hook(self._k_hook(a)))
        if self.head is not None:
            self._handles.append(self.head.register_forward_hook(self._head_hook))

    def collect(self) -> tuple[list[str], torch.Tensor] | None:
        """Remove the hooks; the names and one stacked device tensor of what they measured."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for a in self.attention:
            a.q_out = None  # a query output whose key hook never came is not held until the next sampled step
        values, self._values = self._values, []
        if not values:
            return None
        return [k for k, _ in values], torch.stack([v for _, v in values])

    def _fused_hook(self, a: _Attention) -> Any:
        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
            t0 = time.perf_counter()
            with torch.no_grad():
                width = out.shape[-1] // (a.n_head + 2 * a.n_kv) * a.n_head  # [q | k | v]
                d = width // a.n_head
                q, k = out[..., :width], out[..., width : width + a.n_kv * d]
                self._values.append((f"attn_logit_max:{a.name}", a.bound(q, k)))
            self.spent += time.perf_counter() - t0

        return hook

    def _q_hook(self, a: _Attention) -> Any:
        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
            a.q_out = out.detach()

        return hook

    def _k_hook(self, a: _Attention) -> Any:
        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
            if a.q_out is not None:
                t0 = time.perf_counter()
                with torch.no_grad():
                    self._values.append((f"attn_logit_max:{a.name}", a.bound(a.q_out, out)))
                a.q_out = None
                self.spent += time.perf_counter() - t0

        return hook

    def _head_hook(self, _m: nn.Module, _args: Any, out: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = out.detach().float()
            self._values.append(("output_logz", torch.logsumexp(logits, dim=-1).mean()))
            self._values.append(("output_logit_max", logits.abs().amax()))
        self.spent += time.perf_counter() - t0
