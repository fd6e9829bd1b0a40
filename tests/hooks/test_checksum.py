"""Weight checksums in the hooks: exact, cheap to compare, sharded parameters left out, sent every N steps."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from tests.trainer_helpers import ROOT, trainer_env
from trainmon import TrainMonitor
from trainmon.hooks.checksum import normalise_layout, weights_checksum


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def test_replicas_agree_exactly_and_a_single_ulp_shows() -> None:
    a = _model()
    b = copy.deepcopy(a)
    ca, cb = weights_checksum(a.parameters()), weights_checksum(b.parameters())
    assert ca.dtype == torch.float32 and ca.tolist() == cb.tolist()
    assert ca[2].item() == pytest.approx(
        sum(float(p.detach().double().square().sum()) for p in a.parameters()), rel=1e-6
    )
    assert ca[3].item() == 0  # nothing left out
    with torch.no_grad():
        w = b[2].weight
        w[0, 3] = torch.nextafter(w[0, 3], torch.tensor(1.0))  # one bit
    assert weights_checksum(b.parameters())[:2].tolist() != ca[:2].tolist()


def test_batched_reductions_give_the_per_tensor_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tensors are reduced in batches per dtype: the bits must be those of each tensor on its own, a batch
    boundary must not move them, and a cat across dtypes (which would convert the bits) must never happen."""
    import trainmon.hooks.checksum as checksum

    torch.manual_seed(1)
    params = [
        torch.randn(n).to(dtype)
        for n, dtype in [
            (5, torch.float32),
            (7, torch.bfloat16),
            (300, torch.float32),
            (9, torch.float16),
            (40, torch.bfloat16),
            (3, torch.float32),
        ]
    ]
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    expected = sum(int(p.view(bits[p.dtype]).sum(dtype=torch.int64)) for p in params)
    squares = sum(float(p.double().square().sum()) for p in params)
    for batch in (1 << 22, 64, 8, 1):  # one batch per dtype, batches cut mid-list, a tensor per batch, none batched
        monkeypatch.setattr(checksum, "_BATCH_ELEMENTS", batch)
        total = weights_checksum(params)
        assert int(total[0]) + (int(total[1]) << 24) == expected % (1 << 48), batch
        assert float(total[2]) == pytest.approx(squares, rel=1e-5)


def test_half_precision_and_zero3_partitioned_parameters() -> None:
    m = _model().to(torch.bfloat16)
    assert weights_checksum(m.parameters()).tolist() == weights_checksum(copy.deepcopy(m).parameters()).tolist()
    params = list(m.parameters())
    params[0].ds_tensor = torch.zeros(0)  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    assert weights_checksum(params)[3].item() == 1
    assert weights_checksum(params[:1]) is None  # nothing replicated: no checksum


def test_dtensor_parameters_are_left_out() -> None:
    """A real DTensor (one-rank gloo group on loopback, in a child process to keep this one clean)."""
    code = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
from trainmon.hooks.checksum import weights_checksum
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
plain = torch.nn.Parameter(torch.ones(4))
sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
c = weights_checksum([plain, sharded])
print(c[2].item(), c[3].item())
dist.destroy_process_group()
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["4.0", "1.0"]  # only the plain parameter's squares; one left out


def test_layout_fills_in_data_parallel_and_refuses_what_does_not_fit() -> None:
    assert normalise_layout({"tp": 2}, 8) == {"tp": 2, "dp": 4, "pp": 1}
    assert normalise_layout({"tp": 2, "pp": 2, "dp": 2}, 8) == {"tp": 2, "dp": 2, "pp": 2}
    for bad in ({"tp": 3}, {"tp": 2, "dp": 3}, {"ep": 2}, {"tp": 0}):
        with pytest.raises(ValueError, match="layout"):
            normalise_layout(bad, 8)


def test_a_plain_loop_sends_the_initial_weights_and_every_nth_step(tmp_path) -> None:
    model = _model()
    initial = weights_checksum(model.parameters()).tolist()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "events.jsonl"
    mon = TrainMonitor(
        "cs", f"file://{path}", health_interval=0, heartbeat_interval=0, checksum_every=4, layout={"tp": 1}
    )
    mon.watch(model, opt)
    mon.start(world_size=1)
    for step in range(10):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step_end(step, loss=loss)
    mon.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    (start,) = [e["fields"] for e in events if e["kind"] == "run_start"]
    assert start["layout"] == {"tp": 1, "dp": 1, "pp": 1}
    sums = {e["fields"]["step"]: e["fields"].get("weights_checksum") for e in events if e["kind"] == "step"}
    assert [s for s, c in sums.items() if c is not None] == [0, 4, 8]
    assert sums[0] == initial  # the weights step 0 started from
    assert sums[4] != sums[0]


def test_parameters_not_materialised_are_left_out() -> None:
    m = _model()
    with torch.device("meta"):
        lazy = torch.nn.Linear(4, 4)
    c = weights_checksum([*m.parameters(), *lazy.parameters()])
    assert c[:3].tolist() == weights_checksum(m.parameters())[:3].tolist() and c[3].item() == 2
