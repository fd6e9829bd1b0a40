"""What `TrainMonitor.watch` captures from a real loop without changes inside the loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmon.hooks import TrainMonitor


def _events(path: Path, kind: str = "step") -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [e for e in lines if e["kind"] == kind]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def _loop(
    mon: TrainMonitor,
    steps: int,
    accum: int = 1,
    *,
    data_sleep: float = 0.0,
    explicit_data: bool = False,
    sched_per_micro: bool = False,
    spike_at: int | None = None,
    eval_every: int = 0,
) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    mon.watch(model, opt, sched)
    mon.start(planned_steps=steps, accum_steps=accum)
    for step in range(steps):
        for _ in range(accum):
            if explicit_data:
                with mon.phase("data"):
                    time.sleep(data_sleep)
                    x = torch.randn(64, 16)
            else:
                time.sleep(data_sleep)
                x = torch.randn(64, 16)
            loss = model(x).pow(2).mean() * (1000.0 if step == spike_at else 1.0)
            (loss / accum).backward()
            if sched_per_micro:
                sched.step()
        mon.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if not sched_per_micro:
            sched.step()
        if eval_every and step % eval_every == 0:
            with mon.phase("eval"), torch.no_grad():
                model(torch.randn(8, 16))
        mon.step_end(step, loss=loss, tokens=64 * accum)
    mon.close()


def test_phase_split_with_gradient_accumulation(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("phases", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    _loop(mon, 6, accum=4, data_sleep=0.01, eval_every=2)
    steps = _events(path)
    assert [s["fields"]["step"] for s in steps] == list(range(6))
    for s in steps:
        f = s["fields"]
        assert f["micro_batches"] == 4 and f["scheduler_steps"] == 1 and f["skipped"] is False
        ph = f["phases"]
        assert {"data", "forward", "backward", "optimizer", "other"} <= set(ph)
        assert ph["data"] >= 4 * 0.01  # four sleeps before four forwards, inferred from the gaps
        assert sum(ph.values()) == pytest.approx(f["step_time"], rel=1e-6, abs=1e-6)
        assert ph["forward"] > 0 and ph["backward"] > 0 and ph["optimizer"] > 0
        assert ("eval" in ph) == (f["step"] % 2 == 0)  # the eval forward is not a micro-batch
        assert f["lr"] == [pytest.approx(1e-3 / (1 + f["step"]))]  # the LR this step's update used


def test_explicit_data_phase_wins_over_inference(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("explicit", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    _loop(mon, 3, accum=2, data_sleep=0.02, explicit_data=True)
    for s in _events(path):
        assert s["fields"]["phases"]["data"] == pytest.approx(0.04, abs=0.015)


def test_scheduler_stepped_per_micro_batch_is_visible(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("l1", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    _loop(mon, 3, accum=4, sched_per_micro=True)
    assert {s["fields"]["scheduler_steps"] for s in _events(path)} == {4}


def test_second_level_signals_on_schedule_and_on_a_grad_norm_spike(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("detail", collector=f"file://{path}", detail_every=10, health_interval=0, heartbeat_interval=0)
    _loop(mon, 25, spike_at=17)
    steps = {s["fields"]["step"]: s["fields"] for s in _events(path)}
    with_layers = sorted(k for k, f in steps.items() if "layer_grad_norms" in f)
    assert with_layers == [0, 10, 17, 20]
    layers = steps[17]["layer_grad_norms"]
    assert set(layers) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
    total = sum(v * v for v in layers.values()) ** 0.5
    assert total == pytest.approx(steps[17]["grad_norm"], rel=1e-5)
    assert sorted(k for k, f in steps.items() if "update_ratio" in f) == [0, 10, 20]
    assert 0 < steps[10]["update_ratio"] < 1


def test_grad_scaler_skip_and_loss_scale(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("fp16", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon.watch(model, opt, scaler=scaler)
    mon.start()
    for step in range(4):
        loss = model(torch.randn(8, 16)).mean()
        scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    steps = [s["fields"] for s in _events(path)]
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert [s["loss_scale"] for s in steps] == [1024.0, 1024.0, 1024.0, 512.0]  # the scale each step used


def test_a_step_event_carries_the_wall_clock_time_of_the_step_end(tmp_path: Path) -> None:
    # step_end takes only a perf_counter reading; the sender, finishing the step later, turns it into wall time.
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("t", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start()
    loss = model(torch.randn(8, 16)).mean()
    loss.backward()
    opt.step()
    before = time.time()
    mon.step_end(0, loss=loss)
    after = time.time()
    time.sleep(0.3)  # long enough for the sender to take the step, however late: its time stays the step's end
    mon.close()
    (step,) = _events(path)
    assert before - 1e-3 <= step["time"] <= after + 1e-3


def test_sigterm_flushes_and_reports_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    script = textwrap.dedent(f"""
        import time, torch
        from trainmon.hooks import TrainMonitor
        mon = TrainMonitor("term", collector="file://{path}", health_interval=0, heartbeat_interval=0,
                           flush_interval=60)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon.watch(model, opt)
        mon.start()
        step = 0
        while True:
            loss = model(torch.randn(2, 4)).sum()
            loss.backward(); opt.step(); opt.zero_grad()
            mon.step_end(step, loss=loss)
            step += 1
            if step == 20:
                print("ready", flush=True)
            time.sleep(0.005)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == -signal.SIGTERM  # the default action still happens
    events = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [e["fields"]["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(len(steps))) and len(steps) >= 20  # flush_interval=60: only close() wrote
    assert events[-1]["kind"] == "run_end" and events[-1]["fields"]["status"] == "interrupted"


def test_events_keep_the_order_they_were_emitted_in(tmp_path: Path) -> None:
    """Step records finish on the sender thread; an eval emitted after step s must still follow it."""
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("order", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start()
    for step in range(12):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
        if step % 3 == 2:
            mon.eval(step, loss=1.0)
    mon.close()
    events = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events)))
    last_step = -1
    for e in events:
        if e["kind"] == "step":
            last_step = e["fields"]["step"]
        elif e["kind"] == "eval":
            assert last_step == e["fields"]["step"]  # the step it evaluated came first
    assert events[-1]["kind"] == "run_end"


class _SlowGrad(torch.autograd.Function):
    """Identity whose backward sleeps: a slow input-side layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return grad


class HeadFirst(torch.nn.Module):
    """Parameters registered in the reverse of forward order: the head's gradient comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 1)
        self.inp = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _SlowGrad.apply(self.inp(x))  # the input layer's weight gradient waits for the sleep
        return self.head(torch.relu(h))


def test_backward_ends_at_the_last_gradient_whatever_the_registration_order(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("order", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    model = HeadFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start()
    for step in range(4):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.25)  # host work after the optimizer: "optimizer" until step_end, never "backward"
        mon.step_end(step, loss=loss)
    mon.close()
    for s in _events(path):
        ph = s["fields"]["phases"]
        # the 0.03 s sleep is backward compute; the 0.25 s after the optimizer is not (bounds wide
        # apart, so a loaded CI machine does not turn scheduling delay into a failure)
        assert 0.03 <= ph["backward"] < 0.2, (s["fields"]["step"], ph)
        assert ph["optimizer"] >= 0.25 and ph.get("data", 0.0) < 0.1


def test_on_cpu_backward_and_the_update_run_no_python_of_trainmon_after_the_first_step(tmp_path: Path) -> None:
    """Where the model's work leaves the caches cold a Python hook costs several us: after the first backward,
    which learns which gradient comes last, the end of backward and the update are recorded by C functions."""
    path = tmp_path / "e.jsonl"
    mon = TrainMonitor("c-hooks", collector=f"file://{path}", health_interval=0, heartbeat_interval=0)
    model = HeadFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.watch(model, opt)
    mon.start()
    hooks_dir = str(Path(TrainMonitor.__module__.replace(".", "/")).parent)
    called: list[list[str]] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and hooks_dir in frame.f_code.co_filename:
            called[-1].append(frame.f_code.co_name)

    for step in range(3):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        called.append([])
        sys.setprofile(profile)
        try:
            loss.backward()
            opt.step()
        finally:
            sys.setprofile(None)
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    assert called[0] and called[1:] == [[], []]  # the first backward's hooks on every parameter, then none
    ph = [s["fields"]["phases"] for s in _events(path)]
    assert all(0.03 <= p["backward"] < 0.2 for p in ph), ph  # still ended by the last gradient (_SlowGrad's sleep)
