"""Two CPU processes under torchrun (gloo): one stream per rank, distinct data, identical replicas."""

from __future__ import annotations

import pytest

from tests.trainer_helpers import TINY, of_kind, read_events, read_labels, step_fields, torchrun


@pytest.mark.slow
def test_two_rank_gloo_run(tmp_path):
    """Also injects a straggler and a hang on rank 1: both visible in the per-rank streams."""
    torchrun(
        tmp_path,
        *TINY,
        "--checkpoint-every",
        "4",
        "--eval-every",
        "4",
        "--heartbeat-interval",
        "0.5",
        "--inject",
        "straggler@2:ms=150,steps=2",
        "--inject",
        "hang@5:seconds=2",
        steps=8,
    )
    streams = {0: read_events(tmp_path / "events.jsonl"), 1: read_events(tmp_path / "events.rank1.jsonl")}
    steps = {}
    for rank, events in streams.items():
        assert {e["rank"] for e in events} == {rank}
        assert len({e["stream"] for e in events}) == 1
        start = of_kind(events, "run_start")[0]
        assert start["world_size"] == 2 and start["global_batch_tokens"] == 2 * 8 * 32
        assert of_kind(events, "run_end")[-1]["status"] == "finished"
        steps[rank] = step_fields(events)
        assert sorted(steps[rank]) == list(range(8))

    # distinct data per rank: no batch is seen by both, and the losses differ
    fps = [{f["batch_fingerprint"] for f in steps[r].values()} for r in (0, 1)]
    assert not fps[0] & fps[1]
    assert all(steps[0][s]["loss"] != steps[1][s]["loss"] for s in range(8))
    # ... but the gradients were all-reduced: the same norm, LR, and model on both ranks
    for s in range(8):
        assert steps[0][s]["grad_norm"] == pytest.approx(steps[1][s]["grad_norm"], rel=1e-5)
        assert steps[0][s]["lr"] == steps[1][s]["lr"]
    saves = [{c["step"]: c["fingerprint"] for c in of_kind(streams[r], "checkpoint")} for r in (0, 1)]
    assert sorted(saves[0]) == sorted(saves[1]) == [3, 7]
    for step in (3, 7):
        a, b = saves[0][step], saves[1][step]
        assert a["model"] == b["model"]  # bitwise-identical replicas
        assert a["optimizer"] == b["optimizer"]
        assert a["rng"]["torch"] != b["rng"]["torch"]  # rank-aware seeding: different dropout masks
        assert a["data_position"] == b["data_position"] == step + 1
    evals = [[f["loss"] for f in of_kind(streams[r], "eval")] for r in (0, 1)]
    assert evals[0] == evals[1] and len(evals[0]) == 2  # averaged over ranks
    ckpt = tmp_path / "checkpoints" / "step_0000007"
    assert {p.name for p in ckpt.iterdir()} == {"shared.pt", "rank0.pt", "rank1.pt", "meta.json"}

    # the straggler (rank 1 by default) computes slowly; rank 0 waits for it in the all-reduce,
    # which the DDP comm hook reports as exposed communication time
    for s in (2, 3):
        assert steps[1][s]["phases"]["forward"] >= 0.15
        assert steps[0][s]["phases"]["forward"] < 0.1
        assert steps[0][s]["step_time"] >= 0.12
        assert steps[0][s]["phases"]["comm"] >= 0.1 > steps[1][s]["phases"].get("comm", 0.0)
    # the hang: rank 1 stops stepping but sends heartbeats; rank 0 is stuck in the collective
    beats = [f for f in of_kind(streams[1], "heartbeat") if f.get("step") == 4]
    assert len(beats) >= 2
    assert steps[1][5]["step_time"] >= 2.0 and steps[0][5]["step_time"] >= 1.8

    labels = {lab["kind"]: lab for lab in read_labels(tmp_path)}
    assert labels["straggler"] | {"params": None} == {
        "kind": "straggler",
        "rank": 1,
        "first_step": 2,
        "last_step": 3,
        "expected_detection": "straggler",
        "spec": "straggler@2:ms=150,steps=2",
        "params": None,
    }
    assert (labels["hang"]["rank"], labels["hang"]["first_step"], labels["hang"]["expected_detection"]) == (
        1,
        5,
        "hang",
    )
