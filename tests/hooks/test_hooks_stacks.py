"""The hooks capture the training thread's stack when it stops stepping, and on SIGUSR1 (real
processes writing JSONL; nothing on the training thread)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.trainer_helpers import ROOT, trainer_env
from trainmon.hooks.stacks import nccl_trace

LOOP = """
import sys, time, torch
from trainmon import TrainMonitor

def wait_for_peer(seconds):
    time.sleep(seconds)

mon = TrainMonitor("st", collector="file://" + sys.argv[1], stack_after=float(sys.argv[3]), health_interval=0,
                   heartbeat_interval=0.2, flush_interval=0.1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon.watch(model, opt)
mon.start(planned_steps=12)
for step in range(12):
    if step == 8:
        wait_for_peer(float(sys.argv[2]))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mon.step_end(step, loss=loss)
mon.close()
"""


def _start(tmp_path: Path, sleep: float, stack_after: float, **env: str) -> tuple[subprocess.Popen, Path]:
    script, out = tmp_path / "loop.py", tmp_path / "events.jsonl"
    script.write_text(LOOP)
    cmd = [sys.executable, str(script), str(out), str(sleep), str(stack_after)]
    return subprocess.Popen(cmd, cwd=ROOT, env={**trainer_env(), **env}, stderr=subprocess.PIPE, text=True), out


def _events(out: Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_a_rank_that_stops_stepping_sends_where_it_waits(tmp_path) -> None:
    proc, out = _start(tmp_path, sleep=3.0, stack_after=1.0)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    events = _events(out)
    kinds = [(e["kind"], e["fields"].get("step")) for e in events if e["kind"] in ("step", "stack")]
    stacks = [e["fields"] for e in events if e["kind"] == "stack"]
    assert stacks, kinds
    # sent while the rank was stuck after step 7, before step 8 ended; again when the silence doubled
    assert kinds.index(("stack", 7)) < kinds.index(("step", 8))
    assert [s["reason"] for s in stacks] == ["no_step"] * len(stacks) and len(stacks) >= 2
    assert stacks[1]["seconds_since_step"] >= 2 * stacks[0]["seconds_since_step"] * 0.9
    inner = stacks[0]["stack"]["frames"][-1]
    assert (inner["function"], inner["code"]) == ("wait_for_peer", "time.sleep(seconds)")
    assert stacks[0]["stack"]["frames"][-2]["code"] == "wait_for_peer(float(sys.argv[2]))"
    assert stacks[0]["thread"] == "MainThread" and "nccl" not in stacks[0]


def test_sigusr1_asks_for_the_stack_now_when_opted_in(tmp_path) -> None:
    # the automatic capture never comes
    proc, out = _start(tmp_path, sleep=60.0, stack_after=1000.0, TRAINMON_STACK_SIGNAL="1")
    try:
        deadline = time.monotonic() + 60
        while not any(e["kind"] == "step" and e["fields"]["step"] == 7 for e in _events(out)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)  # the monitor took the signal: the default would kill the process
        while not (stacks := [e["fields"] for e in _events(out) if e["kind"] == "stack"]):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.1)
        assert stacks[0]["reason"] == "signal" and stacks[0]["step"] == 7
        assert stacks[0]["stack"]["frames"][-1]["function"] == "wait_for_peer"
    finally:
        proc.kill()
        proc.wait()


def test_no_flight_recorder_without_nccl(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")  # asked for, but this is a CPU build
    assert nccl_trace() is None


def test_sigusr1_keeps_its_default_action_unless_opted_in(tmp_path) -> None:
    """Schedulers send SIGUSR1 expecting its default action (SLURM's --signal): the monitor leaves it."""
    proc, out = _start(tmp_path, sleep=60.0, stack_after=1000.0)
    try:
        deadline = time.monotonic() + 60
        while not any(e["kind"] == "step" and e["fields"]["step"] == 7 for e in _events(out)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=30) == -signal.SIGUSR1
    finally:
        proc.kill()
        proc.wait()
