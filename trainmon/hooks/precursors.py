"""Instability precursors: what the model's insides show before the loss does (issue 28).

Measured only on sampled steps (``TrainMonitor.detail_every``): forward hooks are registered on
the recognised modules when that step's first forward starts and removed when it ends, so the
other steps pay one counter check. Every value is computed on the device, under ``no_grad``,
and read back with the step's other tensors (one non-blocking copy): no host sync.

From the sampled forward:

- ``attn_logit_max`` (per attention module): an upper bound on max |q·k|/√d, the largest
  attention logit (Dehghani et al. 2023; Wortsman et al. 2023), computed as max over heads of
  (largest query row norm) x (largest key row norm) / √d_head. Cauchy-Schwarz makes it a
  bound; it costs O(tokens x width) on the projections' outputs and never materialises the
  T x T attention matrix (fused SDPA kernels keep it hidden). It is the quantity whose growth
  drives the logit growth these papers report (q and k norms rising until softmax saturates).
- ``attn_entropy`` (per attention module): the mean entropy, in nats, of softmax(q·k/√d) for one
  head (head 0, and the key head it reads under grouped-query attention) over the first
  ``_ENTROPY_QUERIES`` queries of the batch's first sequence: at most 256 x T logits, where the
  collapse toward one-hot attention these papers describe shows as entropy falling toward 0.
  Causal (each query sees the keys up to itself, so only the first 256 keys are read) when the
  module says so (a truthy ``is_causal`` attribute, as transformers' attention classes have) or
  looks GPT-style (a fused ``c_attn`` child, or ``Causal`` in its class name); otherwise every key is
  seen. The logits are taken on the projections' outputs, batch first ([B, T, width]): exact for
  attention computed directly on them (GPT-2/nanoGPT style, the reference model); for models that
  rotate (RoPE) or normalise q and k after the projection it is the entropy of the unrotated
  logits, a proxy. A padding mask is not known here and not applied.
- ``linear_out_rms`` (per ``nn.Linear``, Rybakov et al. 2024): the RMS of the output of each
  recognised block's QKV and attention output projections (the attention module's own
  ``nn.Linear`` children) and of its MLP down-projection (FC2: a ``_FC2``-named ``nn.Linear`` of
  the block's ``_MLP``-named child), named as ``named_modules`` names them.
- ``output_logz`` / ``output_logit_max``: mean log-sum-exp and max |logit| of the LM head's
  output (the log Z that PaLM's z-loss pulls toward 0; Wortsman et al.'s output logit divergence).

From the optimizer, after the sampled step's update (Wortsman et al. 2023):

- ``update_ratio`` and ``group_update_ratio`` (per parameter group index): ||update|| / ||param||
  over a sample of the parameters (the first ones, up to ``_UPDATE_SAMPLE_ELEMENTS`` elements,
  whole tensors only: a large model's matrices are often left out), over the whole sample and
  per group of it.
- ``adam_eps_frac`` (per parameter group index): the fraction of Adam's second-moment elements
  (``state[p]["exp_avg_sq"]``, raw, not bias-corrected) below ``eps**2``, where the update is
  mostly ε and shrinks silently. One comparison and one sum per parameter, stacked per group: a
  ``_foreach`` form would hold a temporary copy of every second moment at once.

Recognised by structure: modules whose class name contains ``Attention`` (or given through
``watch(..., attention=[...])``) with separate ``q_proj``/``k_proj`` (``query``/``key``)
children or a fused ``qkv``/``c_attn``/``Wqkv`` child laid out [q | k | v], and a head count
attribute (``n_head``, ``num_heads``, ``num_attention_heads``, ``n_heads``); the LM head is the last
``nn.Linear`` whose ``out_features`` is the vocabulary size given to ``start``; Adam by its
``exp_avg_sq`` state and its groups' ``eps``. Anything else (``nn.MultiheadAttention``'s packed
in-projection, GPT-NeoX's per-head interleaved fused QKV) is not measured: ``Precursors.unrecognised``
names it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Precursors", "Sampled", "UpdateSample", "adam_eps_fractions", "snapshot_for_update_ratio", "update_ratios"]

_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_SEPARATE = (("q_proj", "k_proj"), ("query", "key"))
_FUSED = ("qkv", "c_attn", "Wqkv")
_MLP = ("mlp", "feed_forward", "ffn")  # a block's MLP child
_FC2 = ("down_proj", "fc2", "c_proj", "proj", "w2", "dense_4h_to_h")  # the MLP's down-projection
_ENTROPY_QUERIES = 256  # queries of the sampled head whose attention entropy is measured
_UPDATE_SAMPLE_ELEMENTS = 1 << 16  # parameters copied to measure the update/param ratio

# Sampled values: ``kind:key`` names (a map per kind on the wire) or plain ``kind`` names, and one stacked tensor.
Sampled = tuple[list[str], torch.Tensor]
# (parameter group index, parameter, its copy before the update), group by group.
UpdateSample = list[tuple[int, torch.Tensor, torch.Tensor]]


class _Attention:
    """One attention module's projections and head layout, and what its sampled forward produced."""

    def __init__(self, name: str, n_head: int, n_kv: int, q: nn.Module, k: nn.Module | None, causal: bool) -> None:
        self.name, self.n_head, self.n_kv, self.q, self.k, self.causal = name, n_head, n_kv, q, k, causal
        self.q_out: torch.Tensor | None = None

    def bound(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """max over heads of max_i |q_i| · max_j |k_j| / √d (a device scalar)."""
        d = q.shape[-1] // self.n_head
        qn: torch.Tensor = q.detach().float().reshape(-1, self.n_head, d).norm(dim=-1).amax(dim=0)
        kn: torch.Tensor = k.detach().float().reshape(-1, self.n_kv, d).norm(dim=-1).amax(dim=0)
        # Grouped-query attention: consecutive query heads share a key head (an expand, no data-dependent size).
        kn = kn[:, None].expand(self.n_kv, self.n_head // self.n_kv).reshape(-1)
        return (qn * kn).amax() / math.sqrt(d)

    def entropy(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """Mean entropy (nats) of head 0's attention over the first sequence's first queries (a device scalar);
        None unless the projections are batch first ([B, T, width])."""
        if q.dim() != 3 or k.dim() != 3:
            return None
        d = q.shape[-1] // self.n_head
        queries = min(q.shape[1], _ENTROPY_QUERIES)
        keys = queries if self.causal else k.shape[1]  # a causal query never sees a later key
        qh, kh = q[0, :queries, :d].detach().float(), k[0, :keys, :d].detach().float()  # head 0; key head 0
        with torch.autocast(qh.device.type, enabled=False):  # the model's autocast would round the logits to 16 bits
            logits = qh @ kh.T / math.sqrt(d)
        if self.causal:
            later = torch.ones(queries, keys, dtype=torch.bool, device=logits.device).triu(1)
            logits = logits.masked_fill(later, -math.inf)
        # -sum p log p per query, with entr(0) = 0: the masked keys add nothing.
        entropy: torch.Tensor = torch.special.entr(logits.softmax(dim=-1)).sum(dim=-1).mean()
        return entropy


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
    causal = bool(getattr(module, "is_causal", False)) or "c_attn" in children or "Causal" in type(module).__name__
    for q, k in _SEPARATE:
        if q in children and k in children:
            return _Attention(name, *heads, children[q], children[k], causal)
    for fused in _FUSED:
        if fused in children:
            return _Attention(name, *heads, children[fused], None, causal)
    return None


def _block_linears(name: str, attention: nn.Module, named: dict[str, nn.Module]) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear``s whose output RMS is measured: the attention's own (QKV, output projection) and the
    down-projection of its block's MLP (the block: the attention's parent)."""
    found = [(f"{name}.{c}", m) for c, m in attention.named_children() if isinstance(m, nn.Linear)]
    if name not in named:  # a module given to watch() that is not the model's: no block to look in
        return found
    parent = name.rpartition(".")[0]
    for c, mlp in named[parent].named_children():
        if c in _MLP:
            prefix = f"{parent}.{c}" if parent else c
            found += [(f"{prefix}.{f}", m) for f, m in mlp.named_children() if f in _FC2 and isinstance(m, nn.Linear)]
    return found


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
        self.linears: list[tuple[str, nn.Linear]] = []
        self.unrecognised: list[str] = []
        for n, m in chosen:
            found = _attention(n, m)
            if found is None:
                self.unrecognised.append(n)
            else:
                self.attention.append(found)
                self.linears += _block_linears(n, m, named)
        self._model = model
        self.head: nn.Linear | None = None
        self._handles: list[Any] = []
        self._values: list[tuple[str, torch.Tensor]] = []
        self.spent = 0.0  # seconds the training thread spent in these hooks, for TrainMonitor.overhead_s

    def set_vocab(self, vocab_size: int) -> None:
        """The LM head: the last ``nn.Linear`` that maps to the vocabulary (known once ``start`` is called)."""
        heads = [m for m in self._model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab_size]
        self.head = heads[-1] if heads else None

    def coverage(self) -> dict[str, Any]:
        """What the precursors measure on this model, for ``run_start``: so that ``trainmon status`` can say
        which attention modules were not recognised (their logit growth is not watched) instead of staying
        silent about them."""
        return {
            "attention": [a.name for a in self.attention],
            "unrecognised": self.unrecognised,
            "lm_head": self.head is not None,
        }

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
        for name, linear in self.linears:
            self._handles.append(linear.register_forward_hook(self._rms_hook(name)))
        if self.head is not None:
            self._handles.append(self.head.register_forward_hook(self._head_hook))

    def collect(self) -> Sampled | None:
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

    def _attention_values(self, a: _Attention, q: torch.Tensor, k: torch.Tensor) -> None:
        self._values.append((f"attn_logit_max:{a.name}", a.bound(q, k)))
        entropy = a.entropy(q, k)
        if entropy is not None:
            self._values.append((f"attn_entropy:{a.name}", entropy))

    def _fused_hook(self, a: _Attention) -> Any:
        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
            t0 = time.perf_counter()
            with torch.no_grad():
                width = out.shape[-1] // (a.n_head + 2 * a.n_kv) * a.n_head  # [q | k | v]
                d = width // a.n_head
                self._attention_values(a, out[..., :width], out[..., width : width + a.n_kv * d])
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
                    self._attention_values(a, a.q_out, out)
                a.q_out = None
                self.spent += time.perf_counter() - t0

        return hook

    def _rms_hook(self, name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
            t0 = time.perf_counter()
            with torch.no_grad():
                norm = torch.linalg.vector_norm(out.detach(), dtype=torch.float32)
                self._values.append((f"linear_out_rms:{name}", norm / math.sqrt(max(out.numel(), 1))))
            self.spent += time.perf_counter() - t0

        return hook

    def _head_hook(self, _m: nn.Module, _args: Any, out: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = out.detach().float()
            self._values.append(("output_logz", torch.logsumexp(logits, dim=-1).mean()))
            self._values.append(("output_logit_max", logits.abs().amax()))
        self.spent += time.perf_counter() - t0


def snapshot_for_update_ratio(optimizer: Any) -> UpdateSample | None:
    """Copies of (up to 64K elements of) the parameters about to be updated, with their group index."""
    sample, budget = [], _UPDATE_SAMPLE_ELEMENTS
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.grad is not None and p.numel() <= budget:
                sample.append((i, p, p.detach().clone()))
                budget -= p.numel()
    return sample or None


def update_ratios(sample: UpdateSample) -> tuple[torch.Tensor, Sampled]:
    """||update|| / ||param|| over the sampled parameters (a device scalar), and per group of them (no sync)."""
    with torch.no_grad():
        olds = [old for _, _, old in sample]
        delta = torch.stack(torch._foreach_norm(torch._foreach_sub([p.detach() for _, p, _ in sample], olds)))
        base = torch.stack(torch._foreach_norm(olds))  # a few launches, not three per sampled parameter
        ratio: torch.Tensor = torch.linalg.vector_norm(delta) / (torch.linalg.vector_norm(base) + 1e-12)
        names, ratios, start = [], [], 0
        for group, run in itertools.groupby(g for g, _, _ in sample):  # taken group by group: one slice each
            end = start + sum(1 for _ in run)
            names.append(f"group_update_ratio:{group}")
            ratios.append(
                torch.linalg.vector_norm(delta[start:end]) / (torch.linalg.vector_norm(base[start:end]) + 1e-12)
            )
            start = end
        return ratio, (names, torch.stack(ratios))


def adam_eps_fractions(optimizer: Any) -> Sampled | None:
    """Per parameter group of an Adam-like optimizer, the fraction of second-moment elements below eps**2
    (device scalars); None when no group has ``exp_avg_sq`` state and a numeric ``eps``."""
    names, fractions = [], []
    with torch.no_grad():
        for i, group in enumerate(optimizer.param_groups):
            eps = group.get("eps")
            moments = [
                v
                for p in group["params"]
                if isinstance(v := optimizer.state.get(p, {}).get("exp_avg_sq"), torch.Tensor) and v.numel()
            ]
            if not moments or isinstance(eps, bool) or not isinstance(eps, (int, float)):
                continue
            below = torch.stack([(v < eps * eps).sum() for v in moments]).sum()
            names.append(f"adam_eps_frac:{i}")
            fractions.append(below / sum(v.numel() for v in moments))
    return (names, torch.stack(fractions)) if fractions else None
