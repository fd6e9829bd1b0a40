"""What `TrainMonitor.watch` learns from the optimizer: which steps updated, the LRs each update used, and the
optimizer phase, with no Python hook on the optimizer outside the sampled steps."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmon.hooks import TrainMonitor


def _steps(path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [e["fields"] for e in events if e["kind"] == "step"]


def _monitor(path: Path, **kwargs: Any) -> TrainMonitor:
    return TrainMonitor("opt", collector=f"file://{path}", health_interval=0, heartbeat_interval=0, **kwargs)


def _lr_set_before_update(mon: TrainMonitor, opt: torch.optim.Optimizer, skip: int) -> None:
    """The order of llm.c's and modded-nanogpt's loops: the LR is set after backward, right before the update;
    step ``skip`` leaves its update out."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt.add_param_group({"params": list(model.parameters())})
    mon.watch(model, opt)
    mon.start()
    for step in range(4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 0.1 * (step + 1)
        if step != skip:
            opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()


def test_the_lr_set_right_before_the_update_is_the_one_recorded(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # a first group that never gets a gradient
    _lr_set_before_update(_monitor(path), opt, skip=2)
    steps = _steps(path)
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    # an update's own LRs; the skipped step's are those of its forward, set by the step before it
    assert [s["lr"] for s in steps] == [[0.1, 0.1], [0.2, 0.2], [0.2, 0.2], pytest.approx([0.4, 0.4])]


class _StepWithoutProfilerEntry(torch.optim.SGD):
    """An optimizer whose step wrapper, unlike torch's today, does not call ``_optimizer_step_code``."""

    def step(self, closure: Any = None) -> Any:
        out = torch.optim.SGD.step.__wrapped__(self, closure)  # type: ignore[attr-defined]
        for hook in self._optimizer_step_post_hooks.values():
            hook(self, (), {})
        return out

    step.hooked = True  # type: ignore[attr-defined]  # Optimizer.__init__ leaves a hooked step unwrapped


def test_an_optimizer_whose_step_skips_the_profiler_entry_is_recorded_by_a_post_hook(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    opt = _StepWithoutProfilerEntry([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    _lr_set_before_update(_monitor(path), opt, skip=1)
    steps = _steps(path)
    assert [s["skipped"] for s in steps] == [False, True, False, False]
    assert [s["lr"][0] for s in steps] == [0.1, 0.1, pytest.approx(0.3), 0.4]


def test_only_sampled_steps_run_an_optimizer_hook_and_close_gives_torch_its_entry_back(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = _monitor(path, detail_every=3)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon.watch(model, opt)
    mon.start()
    hooked = []
    for step in range(7):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        hooked.append(len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks))
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    assert hooked == [1, 0, 0, 1, 0, 0, 1]
    assert not opt._optimizer_step_pre_hooks and "_optimizer_step_code" not in vars(opt)
    assert [s["step"] for s in _steps(path) if "update_ratio" in s] == [0, 3, 6]


def test_without_a_clip_through_trainmon_the_optimizer_phase_starts_at_the_end_of_backward(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = _monitor(path)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start()
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        time.sleep(0.05)  # the loop's own work before the update (torch's clip_grad_norm_, say): the optimizer's
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    for s in _steps(path):
        assert s["phases"]["optimizer"] >= 0.05 and s["phases"]["other"] < 0.05, s["phases"]
