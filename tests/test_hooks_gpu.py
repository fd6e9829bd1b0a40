"""On a GPU, the instrumented hot path must not synchronise the host with the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainmon.hooks import TrainMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def test_instrumented_steps_never_sync(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mon = TrainMonitor("gpu", collector=f"file://{tmp_path / 'e.jsonl'}", detail_every=5)
    mon.watch(model, opt, sched)  # no GradScaler: its step() syncs by design (found_inf.item())
    mon.start(planned_steps=20)
    x = torch.randn(32, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).pow(2).mean()
            loss.backward()
            mon.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            mon.step_end(step, loss=loss, tokens=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mon.close()
    steps = [line for line in (tmp_path / "e.jsonl").read_text().splitlines() if '"kind":"step"' in line]
    assert len(steps) == 20
