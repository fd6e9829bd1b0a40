"""The instability precursors: recognised by structure, measured on sampled steps only, valid on the wire."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from trainmon.hooks import TrainMonitor
from trainmon.hooks.precursors import Precursors
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


def test_recognised_by_structure_and_unrecognised_named() -> None:
    p = Precursors(GPT(GPTConfig()))
    assert [a.name for a in p.attention] == ["blocks.0.attn", "blocks.1.attn"]
    net = Net()
    p = Precursors(net)
    assert [a.name for a in p.attention] == ["attn"]
    assert p.unrecognised == ["mha"]  # its packed in-projection is no module: not measured, and said so
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
    assert names == ["attn_logit_max:attn"]
    exact = net.attn.logits(x).abs().max()
    assert exact <= values[0] * (1 + 1e-5)
    assert values[0] < 50 * exact  # a bound that tracks the logits, not an unrelated number
    assert not net.attn.q_proj._forward_hooks and not net.attn.k_proj._forward_hooks  # collect() removed them


def test_fused_qkv_bound_matches_the_gpt_logits() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0))
    p = Precursors(model)
    p.set_vocab(64)
    assert p.head is model.lm_head
    seen = {}

    def grab(_m, _a, out):
        seen["qkv"] = out.detach()

    h = model.blocks[0].attn.qkv.register_forward_hook(grab)
    x = torch.randint(64, (2, 64))
    p.arm()
    logits, _ = model(x)
    names, values = p.collect()
    h.remove()
    got = dict(zip(names, values.tolist(), strict=True))
    q, k, _ = seen["qkv"].split(64, dim=2)
    q, k = (t.view(2, 64, 2, 32).transpose(1, 2) for t in (q, k))
    exact = (q @ k.transpose(-1, -2) / math.sqrt(32)).abs().max().item()
    assert exact <= got["attn_logit_max:blocks.0.attn"] * (1 + 1e-5)
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
    assert all("output_logz" not in e["fields"] for e in steps if e["fields"]["step"] % 3)


def test_a_forward_that_raised_leaves_no_second_set_of_hooks() -> None:
    model = GPT(GPTConfig())
    p = Precursors(model)
    p.arm()  # its forward raises before collect() runs
    p.arm()
    model(torch.randint(64, (1, 8)))
    names, values = p.collect()
    assert names == ["attn_logit_max:blocks.0.attn", "attn_logit_max:blocks.1.attn"] and len(values) == 2
    assert not model.blocks[0].attn.qkv._forward_hooks
