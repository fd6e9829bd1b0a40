"""The training budget: memory, FLOPs, MFU, pipeline-bubble and checkpoint arithmetic.

Plain functions, SI units in the names (``_bytes``, ``_seconds``, ``_flops``); ``GB`` means
10⁹ bytes, as in the worked examples it is tested on (16 x 1,555,126,400 B = 24.88 GB). ``plan`` puts
them together for ``trainmon budget``; the live MFU uses :func:`mfu_from_throughput` with the
same FLOPs-per-token definition the trainer declares (:mod:`trainmon.flops`).

Sources, cited next to each formula where the output prints it: Kaplan et al. 2020 (parameter
count, 6·N·D), Rajbhandari et al. 2020 (ZeRO model states), Korthikanti et al. 2022 (activation
memory), Huang et al. 2019 and Narayanan et al. 2021 (pipeline bubble), Young 1974 and Daly 2006
(checkpoint interval). The tests reproduce the worked numbers of the project's design documents
(GPT-2 XL, a 7B and an 8B model).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from trainmon.flops import training_flops_per_token

__all__ = [
    "RECIPES",
    "BudgetError",
    "Recipe",
    "activation_bytes_per_layer",
    "activation_bytes_per_sequence",
    "activation_bytes_seed003",
    "allreduce_seconds",
    "checkpoint_overhead",
    "daly_interval_seconds",
    "effective_batch_sequences",
    "max_micro_batch",
    "mfu",
    "mfu_from_throughput",
    "model_state_bytes",
    "model_state_bytes_per_rank",
    "param_count",
    "parse_bytes",
    "parse_number",
    "pipeline_bubble_fraction",
    "pipeline_bubble_ratio",
    "plan",
    "tokens_per_step",
    "train_flops",
    "train_seconds",
    "training_flops_per_token",
    "young_interval_seconds",
]

GB = 1e9


class BudgetError(ValueError):
    """A bad or missing input, named by its CLI flag."""

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag}: {problem}")
        self.flag = flag
        self.problem = problem


# -- parameters and model states --------------------------------------------------------------


def param_count(layers: int, d_model: int, vocab: int, seq_len: int = 0, learned_positions: bool = False) -> int:
    """Parameters of a decoder-only transformer from its shape: ``12·N·d² + d·(2N + V + 1)``.

    Seed 003 ("Total Parameters"): per block 4d² attention + 8d² FFN (d_ff = 4d, no biases)
    + 2d for two RMSNorm scales; a Vxd token embedding tied with the output head; one final
    norm (d). The seed assumes RoPE/ALiBi, i.e. no learned position embeddings: that is how
    it gets GPT-2 XL (N=48, d=1600, V=50257) to P = 1,555,126,400. GPT-2 itself learns
    position embeddings; ``learned_positions=True`` adds their ``seq_len·d``.
    """
    p = 12 * layers * d_model**2 + d_model * (2 * layers + vocab + 1)
    return p + (seq_len * d_model if learned_positions else 0)


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of one precision recipe, split the way ZeRO shards them."""

    name: str
    weight_bytes: float  # the weights the forward uses
    grad_bytes: float  # gradients (all copies)
    optimizer_bytes: float  # optimizer states, fp32 master weights included
    activation_value_bytes: int  # bytes per stored activation value
    doc: str

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32", 4, 4, 8, 4, "fp32 weights 4 + grads 4 + Adam m,v 8 = 16 B"),
        Recipe(
            "bf16-mixed",
            2,
            2 + 4,
            4 + 8,
            2,
            "bf16 weights 2 + bf16 grads 2 + fp32 master 4 + fp32 grads 4 + Adam 8 = 20 B",
        ),
        Recipe(
            "fp16-mixed",
            2,
            2,
            4 + 8,
            2,
            "16-bit weights 2 + grads 2 + fp32 master 4 + Adam 8 = 16 B (ZeRO paper, K = 12)",
        ),
        Recipe(
            "mixed",
            2,
            2,
            4 + 8,
            2,
            "same as fp16-mixed with bf16: 2 + 2 + 4 + 8 = 16 B (an 8B model: 128 GB of model states)",
        ),
        Recipe("bf16", 2, 2, 8, 2, "bf16 weights 2 + bf16 grads 2 + fp32 Adam 8 = 12 B, no master copy"),
    )
}


def _recipe(precision: str | Recipe) -> Recipe:
    if isinstance(precision, Recipe):
        return precision
    try:
        return RECIPES[precision]
    except KeyError:
        raise BudgetError("--precision", f"unknown recipe {precision!r}; one of {', '.join(RECIPES)}") from None


def model_state_bytes(params: float, precision: str | Recipe) -> float:
    """Weights + gradients + optimizer states, unsharded: ``bytes_per_param · Ψ`` (16Ψ fp32, 20Ψ bf16-mixed...)."""
    return params * _recipe(precision).bytes_per_param


def model_state_bytes_per_rank(params: float, precision: str | Recipe, zero_stage: int = 0, ranks: int = 1) -> float:
    """Model states one data-parallel rank holds under ZeRO stage 0-3 (seed 002 ZeRO table, seed 001 §6).

    Stage 1 shards the optimizer states, 2 also the gradients, 3 also the weights:
    ``w + g + o/N``, ``w + (g + o)/N``, ``(w + g + o)/N``. For 7B in bf16 with fp32 Adam on 8
    ranks (seed 001): 14 + 14 + 56/8 = 35 GB, 14 + 70/8 = 22.75 GB, 84/8 = 10.5 GB.
    """
    r = _recipe(precision)
    if zero_stage not in (0, 1, 2, 3):
        raise BudgetError("--zero", f"stage must be 0, 1, 2 or 3, not {zero_stage}")
    if ranks < 1:
        raise BudgetError("--ranks", f"must be at least 1, not {ranks}")
    w, g, o = (params * x for x in (r.weight_bytes, r.grad_bytes, r.optimizer_bytes))
    if zero_stage == 0:
        return w + g + o
    if zero_stage == 1:
        return w + g + o / ranks
    if zero_stage == 2:
        return w + (g + o) / ranks
    return (w + g + o) / ranks


# -- activations ---------------------------------------------------------------------------------


def activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, heads: int, value_bytes: int = 2) -> float:
    """Stored activations of one transformer layer, Korthikanti et al. 2022 (eq. 1), no recomputation.

    With 16-bit activations the paper's per-layer total is ``s·b·h·(34 + 5·a·s/h)`` bytes.
    Seed 002 (§I.B) prints the second term as ``5·n_heads/h``: it drops an ``s``; the
    attention scores are a·s² per sequence, so the paper's ``5·a·s/h`` is right and used here.

    The constants count 16 values of s·b·h (2 B each) + 2 one-byte dropout masks (34), and per
    head 2 sxs values (softmax output, dropout output) + 1 mask (5). ``value_bytes=4`` (fp32
    training) doubles the values but not the masks: ``s·b·h·(66 + 9·a·s/h)``.
    """
    sbh = seq_len * micro_batch * d_model
    return sbh * (16 * value_bytes + 2) + heads * seq_len**2 * micro_batch * (2 * value_bytes + 1)


def activation_bytes_per_sequence(
    layers: int, seq_len: int, d_model: int, heads: int, vocab: int = 0, value_bytes: int = 2
) -> float:
    """Activations of one sequence through the whole model: ``L`` layers plus the output logits.

    The layers per :func:`activation_bytes_per_layer`; the logits ``s·V`` kept in fp32 (4 B) for
    the cross-entropy backward (seed 003 counts them too: "Softmax probabilities: B x L x V").
    """
    return layers * activation_bytes_per_layer(seq_len, 1, d_model, heads, value_bytes) + 4 * seq_len * vocab


def activation_bytes_seed003(
    layers: int, seq_len: int, d_model: int, heads: int, vocab: int, micro_batch: int = 1, value_bytes: int = 4
) -> float:
    """Seed 003's cruder count, for its worked example: ``4·(16NBLd + 2NBHL² + BLd + BLV)`` bytes in fp32.

    For GPT-2 XL it is 15.3e9 B per sequence; the seed writes "≈ 14.3 x B GB", which is that
    number in GiB (2³⁰ B) while its "24.88 GB" is in 10⁹ B. Either way the max batch is 3.
    """
    n, b, s, d, h, v = layers, micro_batch, seq_len, d_model, heads, vocab
    return value_bytes * (16 * n * b * s * d + 2 * n * b * h * s**2 + b * s * d + b * s * v)


def max_micro_batch(
    gpu_memory_bytes: float, model_state_bytes_per_rank: float, activation_bytes_per_sequence: float
) -> int:
    """Largest micro-batch whose activations fit next to the model states (seed 003 step 5).

    ``floor((memory - states) / activations per sequence)``; 0 when the states alone do not fit.
    Framework overhead (CUDA context, workspaces, fragmentation; seed 004 says 20-30 %) is not
    included: pass less memory to leave room for it.
    """
    free = gpu_memory_bytes - model_state_bytes_per_rank
    if free <= 0 or activation_bytes_per_sequence <= 0:
        return 0
    return int(free // activation_bytes_per_sequence)


# -- batch ---------------------------------------------------------------------------------------


def effective_batch_sequences(micro_batch: int, data_parallel: int = 1, grad_accum: int = 1) -> int:
    """Sequences per optimizer step: ``mbs x grad_acc x N_d`` (seed 002 §III.A, seed 001 §4)."""
    return micro_batch * data_parallel * grad_accum


def tokens_per_step(micro_batch: int, seq_len: int, data_parallel: int = 1, grad_accum: int = 1) -> int:
    """Tokens per optimizer step (seed 001 §4: 2 x 4096 x 64 x 8 = 4,194,304)."""
    return effective_batch_sequences(micro_batch, data_parallel, grad_accum) * seq_len


# -- compute -------------------------------------------------------------------------------------


def train_flops(params: float, tokens: float) -> float:
    """Training FLOPs ``6·N·D`` (seed 001 §10, seed 003 "6P per token"), via :mod:`trainmon.flops`."""
    return training_flops_per_token(params) * tokens


def train_seconds(flops: float, peak_flops_per_gpu: float, mfu: float, gpus: int = 1) -> float:
    """Wall time to do ``flops`` at a given MFU (seed 003 step 5: 3.83e18 / (19.5e12 · 0.5) ≈ 109 h)."""
    return flops / (peak_flops_per_gpu * gpus * mfu)


def mfu(flops: float, seconds: float, peak_flops_per_gpu: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation: useful FLOP/s over the hardware peak (seed 001 §10: 7B x 300B in 14 d on
    512 x 312 TFLOP/s → 0.065)."""
    return flops / seconds / (peak_flops_per_gpu * gpus)


def mfu_from_throughput(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """MFU from a measured throughput: ``tokens/s x FLOPs/token / peak`` (the live MFU; per device
    when both throughput and peak are per device)."""
    return tokens_per_second * flops_per_token / peak_flops


# -- parallelism and communication -------------------------------------------------------------


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a pipeline's wall time that is idle: ``(p - 1)/(m + p - 1)`` (seed 001 §8; GPipe/1F1B).

    8 stages, 4 micro-batches: 7/11.
    """
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_bubble_ratio(stages: int, micro_batches: int) -> float:
    """Bubble time over ideal compute time: ``(p - 1)/m`` (seed 002 §IV, r_bubble).

    The same bubble as :func:`pipeline_bubble_fraction`, measured against the useful time
    instead of the total: fraction = ratio / (1 + ratio). 8 stages, 4 micro-batches: 7/4.
    """
    return (stages - 1) / micro_batches


def allreduce_seconds(
    payload_bytes: float, bandwidth_bytes_per_second: float, ranks: int | None = None, latency_seconds: float = 0.0
) -> float:
    """Time of one all-reduce: ``latency + 2(n - 1)/n · bytes / bandwidth`` (ring algorithm).

    A ring all-reduce sends and receives ``2(n - 1)/n`` of the payload per rank
    (reduce-scatter then all-gather). With ``ranks=None`` the factor is left out, which is
    seed 001 §9's ``latency + payload / bandwidth``: right when ``bandwidth`` is NCCL's bus
    bandwidth, which already includes it.
    """
    factor = 1.0 if ranks is None else 2.0 * (ranks - 1) / ranks
    return latency_seconds + factor * payload_bytes / bandwidth_bytes_per_second


# -- checkpoints ---------------------------------------------------------------------------------


def checkpoint_overhead(step_seconds: float, checkpoint_seconds: float, every_steps: int) -> float:
    """Share of wall time spent saving: ``δ / (K·t_step + δ)`` (seed 001 §13).

    Each interval is ``K`` steps of work plus one save of ``δ`` seconds. For δ = 180 s every
    100 / 1,000 steps of 2 s: 180/380 = 47.4 %, 180/2180 = 8.26 % (the seed's numbers; the
    other reading, δ/(K·t_step), would give 90 % / 9 %).
    """
    return checkpoint_seconds / (every_steps * step_seconds + checkpoint_seconds)


def young_interval_seconds(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Young's optimal compute time between checkpoints: ``√(2·δ·MTBF)`` (Young 1974).

    Balances the save cost δ against the work lost to a failure (half an interval on
    average); seed 000 §9.4 "the optimal interval balances lost work and checkpoint overhead".
    """
    return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def daly_interval_seconds(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order refinement of Young's interval (Daly 2006, eq. 37).

    ``√(2δM)·(1 + ⅓·√(δ/2M) + δ/18M) - δ`` for δ < 2M, else M. Close to Young's when δ ≪ M.
    """
    d, m = checkpoint_seconds, mtbf_seconds
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


# -- parsing -------------------------------------------------------------------------------------

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12, "p": 1e15}
_BYTE_UNITS = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_number(text: str | float, flag: str = "value") -> float:
    """``7e9``, ``7B``, ``300B``, ``1.5T``, ``400k``, ``312T``, ``19.5TFLOPS`` → a float (B = billion)."""
    if isinstance(text, int | float):
        return float(text)
    s = text.strip().replace(",", "").replace("_", "")
    s = re.sub(r"(?i)\s*(flop/?s|flops)$", "", s)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGbBtTpP]?)", s)
    if not m:
        raise BudgetError(flag, f"cannot read {text!r} as a number (e.g. 7e9, 7B, 300B, 312T)")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def parse_bytes(text: str | float, flag: str = "size") -> float:
    """``80GB`` (10⁹ B), ``80GiB`` (2³⁰ B), ``512MB``... → bytes. A unit is required: a bare ``80`` is ambiguous."""
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise BudgetError(flag, f"cannot read {text!r} as a size; give a unit, e.g. 80GB or 80GiB")
    return float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]


def parse_bandwidth(text: str | float, flag: str = "bandwidth") -> float:
    """``200GB/s`` or ``200GB`` → bytes per second."""
    if isinstance(text, int | float):
        return float(text)
    return parse_bytes(re.sub(r"(?i)/s$|ps$", "", text.strip()), flag)


# -- the whole budget ----------------------------------------------------------------------------


def _need(v: dict[str, Any], names: list[str], why: str) -> None:
    """Raise naming the first missing flag of ``names`` (keyword names, e.g. ``d_model``)."""
    missing = ["--" + n.replace("_", "-") for n in names if v.get(n) is None]
    if missing:
        raise BudgetError(missing[0], f"needed {why}: give {' '.join(missing)}")


def plan(**v: Any) -> dict[str, Any]:
    """Everything the given inputs determine, as one flat dict (the ``trainmon budget --json`` object).

    Keyword names are the CLI flags with ``-`` → ``_`` and the leading ``--`` stripped
    (``layers``, ``d_model``, ``vocab``, ``heads``, ``seq``, ``precision``, ``gpu_memory``,
    ``micro_batch``, ``zero``, ``ranks``, ``grad_accum``, ``params``, ``tokens``, ``gpus``,
    ``peak_flops``, ``days``, ``mfu``, ``stages``, ``micro_batches``, ``step_seconds``,
    ``checkpoint_seconds``, ``checkpoint_every``, ``mtbf_hours``, ``bandwidth``,
    ``allreduce_bytes``). Sizes may be strings with units (``"80GB"``), counts strings like
    ``"7B"``. Raises :class:`BudgetError` naming the flag when an input is bad or missing.
    """
    v = {k: val for k, val in v.items() if val is not None}
    out: dict[str, Any] = {}
    for flag in ("layers", "d_model", "vocab", "heads", "seq", "micro_batch", "ranks", "grad_accum", "gpus"):
        if flag in v and (not isinstance(v[flag], int) or v[flag] < 1):
            raise BudgetError("--" + flag.replace("_", "-"), f"must be a positive integer, not {v[flag]!r}")
    precision = v.get("precision", "fp32")
    recipe = _recipe(precision)
    zero = int(v.get("zero", 0))
    ranks = int(v.get("ranks", 1))
    if zero and "ranks" not in v:
        raise BudgetError("--ranks", f"ZeRO stage {zero} shards over the data-parallel ranks: give --ranks")

    shape = ("layers", "d_model", "vocab")
    if any(k in v for k in shape):
        _need(v, list(shape), "for the parameter count")
    if "layers" in v:
        params: float | None = param_count(
            v["layers"], v["d_model"], v["vocab"], v.get("seq", 0), bool(v.get("learned_positions"))
        )
        out["params_from_shape"] = params
    else:
        params = None
    if "params" in v:
        params = parse_number(v["params"], "--params")
        if params <= 0:
            raise BudgetError("--params", "must be positive")
    if params is not None:
        out["params"] = int(params)
        out["precision"] = recipe.name
        out["bytes_per_param"] = recipe.bytes_per_param
        out["weights_bytes"] = params * recipe.weight_bytes
        out["grads_bytes"] = params * recipe.grad_bytes
        out["optimizer_bytes"] = params * recipe.optimizer_bytes
        out["model_state_bytes"] = model_state_bytes(params, recipe)
        out["zero_stage"] = zero
        out["ranks"] = ranks
        out["model_state_bytes_per_rank"] = model_state_bytes_per_rank(params, recipe, zero, ranks)

    mem = parse_bytes(v["gpu_memory"], "--gpu-memory") if "gpu_memory" in v else None
    if "layers" in v and "seq" in v:
        _need(v, ["heads"], "for the activation memory")
        act = activation_bytes_per_sequence(
            v["layers"], v["seq"], v["d_model"], v["heads"], v["vocab"], recipe.activation_value_bytes
        )
        out["activation_bytes_per_sequence"] = act
        if "micro_batch" in v:
            out["activation_bytes_per_micro_batch"] = act * v["micro_batch"]
        if mem is not None:
            out["gpu_memory_bytes"] = mem
            out["max_micro_batch"] = max_micro_batch(mem, out["model_state_bytes_per_rank"], act)
            if "micro_batch" in v:
                out["fits"] = v["micro_batch"] <= out["max_micro_batch"]
    elif mem is not None:
        if params is None:
            raise BudgetError("--gpu-memory", "compares the model states with the memory: give --params or the shape")
        out["gpu_memory_bytes"] = mem
        out["gpu_memory_left_bytes"] = mem - out["model_state_bytes_per_rank"]
        out["model_states_fit"] = out["gpu_memory_left_bytes"] > 0

    if "micro_batch" in v and "seq" in v:
        dp = ranks
        accum = v.get("grad_accum", 1)
        out["sequences_per_step"] = effective_batch_sequences(v["micro_batch"], dp, accum)
        out["tokens_per_step"] = tokens_per_step(v["micro_batch"], v["seq"], dp, accum)

    if "tokens" in v:
        if params is None:
            raise BudgetError("--tokens", "training FLOPs need --params (or the shape --layers --d-model --vocab)")
        tokens = parse_number(v["tokens"], "--tokens")
        out["tokens"] = tokens
        out["flops_per_token"] = training_flops_per_token(params)
        out["train_flops"] = train_flops(params, tokens)
        gpus = v.get("gpus", 1)
        out["gpus"] = gpus
        if "days" in v or "mfu" in v:
            _need(v, ["peak_flops"], "for MFU and training time")
        if "peak_flops" in v:
            peak = parse_number(v["peak_flops"], "--peak-flops")
            out["peak_flops_per_gpu"] = peak
            if "days" in v:
                days = float(v["days"])
                if days <= 0:
                    raise BudgetError("--days", "must be positive")
                out["train_seconds"] = days * 86400
                out["mfu"] = mfu(out["train_flops"], days * 86400, peak, gpus)
            elif "mfu" in v:
                target = float(v["mfu"])
                if not 0 < target <= 1:
                    raise BudgetError("--mfu", f"must be in (0, 1], not {target}")
                out["mfu"] = target
                out["train_seconds"] = train_seconds(out["train_flops"], peak, target, gpus)
            if "train_seconds" in out:
                out["train_hours"] = out["train_seconds"] / 3600
    elif any(k in v for k in ("days", "mfu", "peak_flops")):
        raise BudgetError("--tokens", "MFU and training time need the token budget --tokens")

    if "stages" in v or "micro_batches" in v:
        _need(v, ["stages", "micro_batches"], "for the pipeline bubble")
        p, m = int(v["stages"]), int(v["micro_batches"])
        if p < 1 or m < 1:
            raise BudgetError("--stages" if p < 1 else "--micro-batches", "must be at least 1")
        out["bubble_fraction"] = pipeline_bubble_fraction(p, m)
        out["bubble_ratio"] = pipeline_bubble_ratio(p, m)

    if "bandwidth" in v:
        bw = parse_bandwidth(v["bandwidth"], "--bandwidth")
        if "allreduce_bytes" in v:
            payload = parse_bytes(v["allreduce_bytes"], "--allreduce-bytes")
        elif params is not None:
            payload = params * recipe.weight_bytes  # one gradient all-reduce in the compute dtype
        else:
            raise BudgetError("--allreduce-bytes", "the all-reduce time needs a payload (or --params)")
        out["allreduce_bytes"] = payload
        out["allreduce_seconds"] = allreduce_seconds(payload, bw, ranks if ranks > 1 else None)

    if any(k in v for k in ("step_seconds", "checkpoint_seconds", "checkpoint_every", "mtbf_hours")):
        _need(v, ["step_seconds", "checkpoint_seconds"], "for the checkpoint overhead")
        if "checkpoint_every" not in v and "mtbf_hours" not in v:
            raise BudgetError("--checkpoint-every", "give the interval in steps (or --mtbf-hours for the optimal one)")
        step_s, ckpt_s = float(v["step_seconds"]), float(v["checkpoint_seconds"])
        for flag, val in (("--step-seconds", step_s), ("--checkpoint-seconds", ckpt_s)):
            if val <= 0:
                raise BudgetError(flag, f"must be positive, not {val}")
        if "checkpoint_every" in v:
            every = int(v["checkpoint_every"])
            if every < 1:
                raise BudgetError("--checkpoint-every", f"must be at least 1 step, not {every}")
            out["checkpoint_overhead"] = checkpoint_overhead(step_s, ckpt_s, every)
        if "mtbf_hours" in v:
            mtbf = float(v["mtbf_hours"]) * 3600
            if mtbf <= 0:
                raise BudgetError("--mtbf-hours", "must be positive")
            best = young_interval_seconds(ckpt_s, mtbf)
            out["optimal_checkpoint_seconds"] = best
            out["optimal_checkpoint_every"] = max(1, round(best / step_s))
            out["optimal_checkpoint_overhead"] = checkpoint_overhead(step_s, ckpt_s, out["optimal_checkpoint_every"])
    if not out:
        raise BudgetError("--layers", "nothing to compute: give a shape, --params/--tokens, --stages or --step-seconds")
    return out


# -- terminal rendering --------------------------------------------------------------------------

_NOTES = {
    "params": "12·N·d² + d·(2N + V + 1)  (Kaplan et al. 2020, + embeddings)",
    "model_state_bytes": "weights + grads + optimizer, unsharded",
    "model_state_bytes_per_rank": "ZeRO-1/2/3 shard optimizer / + grads / + weights (Rajbhandari et al. 2020)",
    "gpu_memory_left_bytes": "GPU memory - model states per rank: room for activations and overhead",
    "activation_bytes_per_sequence": "L·s·h·(34 + 5·a·s/h) at 2 B/value + fp32 logits (Korthikanti et al.)",
    "max_micro_batch": "⌊(memory - states) / activations per sequence⌋",
    "tokens_per_step": "micro-batch x seq x DP x accumulation",
    "train_flops": "6·N·D  (Kaplan et al. 2020)",
    "mfu": "6·N·D / time / (GPUs x peak)",
    "bubble_fraction": "(p - 1)/(m + p - 1)  (GPipe, Huang et al. 2019)",
    "bubble_ratio": "(p - 1)/m  (Narayanan et al. 2021)",
    "allreduce_seconds": "2(n - 1)/n · bytes / bandwidth (ring)",
    "checkpoint_overhead": "δ / (K·t_step + δ): save time over step time + save time",
    "optimal_checkpoint_every": "√(2·δ·MTBF) / t_step  (Young 1974)",
}


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if key.endswith("_every"):
        return f"{value:,} steps"
    if key.endswith("_bytes") or key.endswith("_bytes_per_rank") or "_bytes_per_" in key:
        return f"{value / GB:,.2f} GB ({value / 2**30:,.2f} GiB)"
    if key in ("mfu", "bubble_fraction", "checkpoint_overhead", "optimal_checkpoint_overhead"):
        return f"{value:.4f} ({100 * value:.2f} %)"
    if key.endswith("_seconds") and value >= 3600:
        return f"{value:,.0f} s ({value / 3600:,.1f} h)"
    if key.endswith("_seconds"):
        return f"{value:,.4g} s"
    if isinstance(value, float) and 1e6 <= abs(value) < 1e15:  # the suffixes the inputs take: 300B, 312T
        for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
            if abs(value) >= scale:
                return f"{value / scale:,.4g}{suffix}"
    if isinstance(value, float) and (abs(value) >= 1e15 or 0 < abs(value) < 1e-3):
        return f"{value:.4g}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render(result: dict[str, Any], console: Any = None) -> None:
    """Print a budget as a rich table: quantity, value, formula and source."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="training budget")
    for col in ("quantity", "value", "formula"):
        table.add_column(col, overflow="fold")
    notes = dict(_NOTES)
    if "params_from_shape" not in result:
        del notes["params"]  # given with --params: no formula behind it
    for key, value in result.items():
        table.add_row(key.replace("_", " "), _show(key, value), notes.get(key, ""))
    console.print(table)
