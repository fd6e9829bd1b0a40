"""The instability precursors: recognised by structure, measured on sampled steps only, valid on the wire."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from trainmon.hooks import TrainMonitor
from trainmon.hooks.precursors import Precursors, adam_eps_fractions, snapshot_for_update_ratio, update_ratios
from trainmon.reference_trainer.model import GPT, GPTConfig
from trainmon.wire import validate_event


class HFStyleAttention(nn.Module):
    """Separate q/k/v projections and grouped-query heads, as LLaMA's attention in transformers."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every attention logit q·k/√d, each query head against its key head."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1)
        return q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.logits(x).softmax(-1)
        b, t, _ = x.shape
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = v.repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1)
        return (w @ v).transpose(1, 2).reshape(b, t, -1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = HFStyleAttention()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x) + self.mha(x, x, x)[0]


def _entropy(logits: torch.Tensor) -> float:
    """Mean over rows of -sum p log p, p = softmax(row), straight from the definition."""
    p = logits.double().softmax(-1)
    return (-(p * p.clamp_min(1e-300).log()).sum(-1)).mean().item()


def _rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def test_recognised_by_structure_and_unrecognised_named() -> None:
    p = Precursors(GPT(GPTConfig()))
    assert [a.name for a in p.attention] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(a.causal for a in p.attention)  # "Causal" in the class name: nanoGPT's CausalSelfAttention
    assert [n for n, _ in p.linears] == [
        f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.proj")
    ]  # QKV, attention output, FC2 (not mlp.fc, the up-projection)
    net = Net()
    p = Precursors(net)
    assert [a.name for a in p.attention] == ["attn"]
    assert not p.attention[0].causal  # no is_causal, no c_attn, no "Causal": every key is seen
    assert p.unrecognised == ["mha"]  # its packed in-projection is no module: not measured, and said so
    assert [n for n, _ in p.linears] == ["attn.q_proj", "attn.k_proj", "attn.v_proj"]  # nothing of mha's out_proj
    p = Precursors(net, attention=["attn"])  # the escape hatch, by name
    assert [a.name for a in p.attention] == ["attn"] and p.unrecognised == []


def test_the_bound_holds_every_attention_logit_under_it() -> None:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.attn.q_proj.weight.mul_(5.0)  # large logits, so the bound is tested where it matters
    p = Precursors(net)
    x = torch.randn(3, 17, 32)
    p.arm()
    net(x)
    names, values = p.collect()
    got = dict(zip(names, values.tolist(), strict=True))
    assert set(got) == {"attn_logit_max:attn", "attn_entropy:attn"} | {
        f"linear_out_rms:attn.{m}_proj" for m in "qkv"
    }  # nothing from mha: unrecognised modules are not measured
    exact = net.attn.logits(x).abs().max().item()
    assert exact <= got["attn_logit_max:attn"] * (1 + 1e-5)
    assert got["attn_logit_max:attn"] < 50 * exact  # a bound that tracks the logits, not an unrelated number
    # Head 0 (grouped-query: it reads key head 0), first sequence, every key (not causal): the model's own logits.
    assert math.isclose(got["attn_entropy:attn"], _entropy(net.attn.logits(x)[0, 0]), rel_tol=1e-4)
    with torch.no_grad():
        for m in "qkv":
            out = getattr(net.attn, f"{m}_proj")(x)
            assert math.isclose(got[f"linear_out_rms:attn.{m}_proj"], _rms(out), rel_tol=1e-5)
    assert not net.attn.q_proj._forward_hooks and not net.attn.k_proj._forward_hooks  # collect() removed them


def test_fused_qkv_bound_matches_the_gpt_logits() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0))
    p = Precursors(model)
    p.set_vocab(64)
    assert p.head is model.lm_head
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str):
        def hook(_m, _a, out):
            seen[name] = out.detach()

        return hook

    handles = [m.register_forward_hook(grab(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    x = torch.randint(64, (2, 64))
    p.arm()
    logits, _ = model(x)
    names, values = p.collect()
    for h in handles:
        h.remove()
    got = dict(zip(names, values.tolist(), strict=True))
    q, k, _ = seen["blocks.0.attn.qkv"].split(64, dim=2)
    q, k = (t.view(2, 64, 2, 32).transpose(1, 2) for t in (q, k))
    scores = q @ k.transpose(-1, -2) / math.sqrt(32)
    exact = scores.abs().max().item()
    assert exact <= got["attn_logit_max:blocks.0.attn"] * (1 + 1e-5)
    # Head 0 of the first sequence, causal as the model's SDPA call: a query sees the keys up to itself.
    causal = scores[0, 0].masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf)
    assert math.isclose(got["attn_entropy:blocks.0.attn"], _entropy(causal), rel_tol=1e-4)
    assert got["attn_entropy:blocks.0.attn"] < _entropy(scores[0, 0])  # the mask matters: fewer keys, less entropy
    rms = {n.removeprefix("linear_out_rms:"): v for n, v in got.items() if n.startswith("linear_out_rms:")}
    assert set(rms) == {f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.proj")}
    for name, v in rms.items():
        assert math.isclose(v, _rms(seen[name]), rel_tol=1e-5)
    assert math.isclose(got["output_logz"], torch.logsumexp(logits, -1).mean().item(), rel_tol=1e-5)
    assert math.isclose(got["output_logit_max"], logits.abs().max().item(), rel_tol=1e-6)


def test_sampled_steps_only_and_valid_on_the_wire(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path / "events.jsonl"
    mon = TrainMonitor(
        "p",
        collector=f"file://{out}",
        spool_dir=tmp_path / "spool",
        detail_every=3,
        health_interval=0,
        heartbeat_interval=0,
        checksum_every=0,
    )
    mon.watch(model, opt)
    mon.start(vocab_size=64, planned_steps=7)
    hooked = []
    for step in range(7):
        x = torch.randint(64, (2, 64))
        _, loss = model(x, x)
        hooked.append(bool(model.lm_head._forward_hooks or model.blocks[0].attn.qkv._forward_hooks))
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    assert hooked == [False] * 7  # removed at the end of the sampled forward, never left behind
    events = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    for e in events:
        validate_event(e)
    sampled = [e["fields"]["step"] for e in steps if "attn_logit_max" in e["fields"]]
    assert sampled == [0, 3, 6]
    f = next(e["fields"] for e in steps if e["fields"]["step"] == 3)
    assert set(f["attn_logit_max"]) == {"blocks.0.attn", "blocks.1.attn"}
    assert all(v > 0 for v in f["attn_logit_max"].values())
    assert f["output_logz"] > 0 and f["output_logit_max"] > 0
    assert set(f["attn_entropy"]) == {"blocks.0.attn", "blocks.1.attn"}
    assert all(0 < v <= math.log(64) for v in f["attn_entropy"].values())  # at most uniform over 64 keys
    assert set(f["linear_out_rms"]) == {
        f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.proj")
    }
    assert set(f["group_update_ratio"]) == set(f["adam_eps_frac"]) == {"0"}  # one parameter group
    # The whole sample is group 0's: its ratio is the overall one.
    assert math.isclose(f["group_update_ratio"]["0"], f["update_ratio"], rel_tol=1e-6)
    last = next(e["fields"] for e in steps if e["fields"]["step"] == 6)  # the last step: the state after it
    assert math.isclose(last["adam_eps_frac"]["0"], _below_eps(opt, 0), rel_tol=1e-6, abs_tol=1e-9)
    new = ("output_logz", "attn_entropy", "linear_out_rms", "group_update_ratio", "adam_eps_frac")
    assert all(k not in e["fields"] for e in steps if e["fields"]["step"] % 3 for k in new)


def test_a_forward_that_raised_leaves_no_second_set_of_hooks() -> None:
    model = GPT(GPTConfig())
    p = Precursors(model)
    p.arm()  # its forward raises before collect() runs
    p.arm()
    model(torch.randint(64, (1, 8)))
    names, values = p.collect()
    # Once each: per block the bound, the entropy and three linear outputs.
    assert len(names) == len(set(names)) == len(values) == 10
    assert not model.blocks[0].attn.qkv._forward_hooks


def _below_eps(opt: torch.optim.Optimizer, group: int) -> float:
    """The fraction of a group's Adam second moments under eps**2, element by element on the host."""
    g = opt.param_groups[group]
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in g["params"]])
    return sum(x < g["eps"] ** 2 for x in v.tolist()) / v.numel()


def _small_gpt() -> GPT:
    """Small enough that both AdamW groups fit the update-ratio sample."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, seq_len=16, n_layer=1, n_embd=16, dropout=0.0))


def _train(model: GPT, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randint(16, (2, 16))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_adam_eps_fraction_per_group_matches_the_state() -> None:
    model = _small_gpt()
    # eps large enough that some second moments fall under eps**2 and some do not: a fraction strictly inside (0, 1).
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2, eps=1e-3)
    _train(model, opt, 3)
    names, values = adam_eps_fractions(opt)
    assert names == ["adam_eps_frac:0", "adam_eps_frac:1"]
    for i, v in enumerate(values.tolist()):
        assert math.isclose(v, _below_eps(opt, i), rel_tol=1e-6)
    assert 0 < values[0] < 1


def test_adam_eps_fraction_absent_without_adam_state() -> None:
    model = _small_gpt()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # momentum_buffer state, no eps
    _train(model, sgd, 2)
    assert adam_eps_fractions(sgd) is None
    adam = torch.optim.Adam(model.parameters())
    assert adam_eps_fractions(adam) is None  # no step yet: no second moments to count


def test_update_ratio_per_group_matches_the_update() -> None:
    model = _small_gpt()
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    _train(model, opt, 2)
    x = torch.randint(16, (2, 16))
    model(x, x)[1].backward()
    sample = snapshot_for_update_ratio(opt)
    before = {id(p): p.detach().clone() for g in opt.param_groups for p in g["params"]}
    opt.step()
    ratio, (names, values) = update_ratios(sample)
    assert names == ["group_update_ratio:0", "group_update_ratio:1"]

    def by_hand(params: list[torch.Tensor]) -> float:
        step = sum((p.detach() - before[id(p)]).double().pow(2).sum() for p in params)
        base = sum(before[id(p)].double().pow(2).sum() for p in params)
        return math.sqrt(step / base)

    for i, v in enumerate(values.tolist()):
        assert math.isclose(v, by_hand(opt.param_groups[i]["params"]), rel_tol=1e-5)
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert math.isclose(ratio.item(), by_hand(everything), rel_tol=1e-5)  # the overall ratio is unchanged


def test_unrecognised_modules_are_not_measured() -> None:
    """An attention the precursors cannot read (nn.MultiheadAttention's packed projection) gets no logit bound, no
    entropy and no linear-output RMS, and a model with nothing recognised arms nothing."""

    class OnlyMHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
            self.mlp = nn.Sequential()
            self.mlp.add_module("proj", nn.Linear(32, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.mha(x, x, x)[0])

    model = OnlyMHA()
    p = Precursors(model)
    assert p.unrecognised == ["mha"] and not p.attention and not p.linears and not p.measurable
    p.arm()
    model(torch.randn(2, 5, 32))
    assert p.collect() is None


def test_run_start_says_what_the_precursors_measure(tmp_path: Path) -> None:
    """So that ``trainmon status`` names what is not watched instead of staying silent about it."""
    for model, expected in (
        (GPT(GPTConfig()), {"attention": ["blocks.0.attn", "blocks.1.attn"], "unrecognised": [], "lm_head": True}),
        (Net(), {"attention": ["attn"], "unrecognised": ["mha"], "lm_head": False}),
    ):
        out = tmp_path / f"{type(model).__name__}.jsonl"
        mon = TrainMonitor("p", collector=f"file://{out}", health_interval=0, heartbeat_interval=0, checksum_every=0)
        mon.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
        mon.start(vocab_size=64)
        mon.close()
        (start,) = [e for e in map(json.loads, out.read_text().splitlines()) if e["kind"] == "run_start"]
        assert start["fields"]["precursors"] == expected
        validate_event(start)
