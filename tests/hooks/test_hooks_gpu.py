"""On a GPU, the instrumented hot path must not synchronise the host with the device.

torch's sync-debug mode ("error") raises at any synchronizing CUDA call (``.item()``, a blocking copy, a stream
sync), on every thread: a sync in the training thread fails the step, one in trainmon's sender thread loses its
events. GradScaler is the one documented exception: ``scaler.step`` reads its found-inf flag on the host, by
design, so only that call runs outside the mode. The steps' values cross by the pinned-memory read-back
(``trainmon.hooks.readback``), so each test also checks that every step's loss arrives as the step computed it,
and that its phases were timed with CUDA events. ``bench/gpu_check.sh`` runs every test that skips with "needs a
CUDA GPU"; no test here needs the daemon side (the device machine has none of it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmon.hooks import TrainMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

STEPS = 20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()


def _steps(path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((e["fields"] for e in events if e["kind"] == "step"), key=lambda f: f["step"])


def _train(step: Callable[[torch.Tensor], torch.Tensor], mon: TrainMonitor) -> list[float]:
    """``STEPS`` calls of ``step(x)`` (it returns the loss) under sync-debug "error"; the losses, read after."""
    x = torch.randn(32, 64, device="cuda")
    losses = []
    mon.start(planned_steps=STEPS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(STEPS):
            loss = step(x)
            losses.append(loss.detach().clone())
            mon.step_end(i, loss=loss, tokens=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mon.close()
    return [float(t) for t in losses]  # host reads, after the fact


def _check_steps(records: list[dict[str, Any]], losses: list[float]) -> None:
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["loss"] for r in records] == losses  # the read-back brought each step's own value, bit for bit
    for r in records:
        phases = r["phases"]
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, phases
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert "mem_allocated_bytes" in r and "mem_peak_bytes" in r
    # CUDA-event phase times are device time; over the run they cannot exceed the wall time much.
    assert sum(r["phases"]["forward"] for r in records) <= 1.5 * sum(r["step_time"] for r in records)


def test_instrumented_steps_never_sync(tmp_path: Path) -> None:
    """bf16 autocast, AdamW, a scheduler, clipping through the monitor, per-parameter norms every 5 steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mon = TrainMonitor("gpu", collector=f"file://{tmp_path / 'e.jsonl'}", detail_every=5, checksum_every=5)
    mon.watch(model, opt, sched)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).pow(2).mean()
        loss.backward()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = _train(step, mon)
    records = _steps(tmp_path / "e.jsonl")
    _check_steps(records, losses)
    assert {0, 5, 10, 15} <= {r["step"] for r in records if "layer_grad_norms" in r}  # + any on a norm jump
    assert [r["step"] for r in records if "weights_checksum" in r] == [0, 5, 10, 15]
    assert all(r["skipped"] is False for r in records)


def test_grad_scaler_fp16_syncs_only_in_its_step(tmp_path: Path) -> None:
    """fp16 autocast with a GradScaler: its ``step`` is the one sync (documented by torch); the loss scale each
    step used arrives through the read-back."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=5)
    mon = TrainMonitor("gpu16", collector=f"file://{tmp_path / 'e.jsonl'}", detail_every=5)
    mon.watch(model, opt, None, scaler)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        mon.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.set_sync_debug_mode("default")
        scaler.step(opt)  # SYNC by design: GradScaler reads found_inf on the host to skip the step
        torch.cuda.set_sync_debug_mode("error")
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = _train(step, mon)
    records = _steps(tmp_path / "e.jsonl")
    _check_steps(records, losses)
    scales = [r["loss_scale"] for r in records]
    assert scales[0] == 2.0**10 and scales[-1] == 2.0**13  # grew every 5 clean steps: the scale each step used
    assert all(r["skipped"] is False for r in records)


def test_precursor_capture_never_syncs(tmp_path: Path) -> None:
    """Issue 28's capture (attention-logit bound and entropy, output log Z, linear-output RMS, per-group
    update ratio and Adam second moments under eps^2) runs on sampled steps inside the model's forward and
    after the optimizer step; its reductions must stay on the device and cross with the step's read-back.
    (Checked on CPU for its values and steps; the sync-debug part needs a GPU.)"""
    from trainmon.reference_trainer.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainMonitor("gpu-pre", collector=f"file://{tmp_path / 'e.jsonl'}", detail_every=5, checksum_every=0)
    mon.watch(model, opt)
    mon.start(planned_steps=STEPS, vocab_size=64)
    x = torch.randint(64, (8, 64), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(STEPS):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            mon.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step_end(i, loss=loss, tokens=x.numel())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mon.close()
    sampled = [r for r in _steps(tmp_path / "e.jsonl") if "attn_logit_max" in r]
    assert [r["step"] for r in sampled] == [0, 5, 10, 15]
    assert all(set(r["attn_logit_max"]) == {"blocks.0.attn", "blocks.1.attn"} and r["output_logz"] > 0 for r in sampled)
    assert all({"attn_entropy", "linear_out_rms", "group_update_ratio", "adam_eps_frac"} <= set(r) for r in sampled)
