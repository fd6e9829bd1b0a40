"""Grouping the ranks' stacks by signature and naming the odd ones out (trainmon.monitor.core.stacks)."""

from __future__ import annotations

from trainmon.monitor.core.stacks import group_stacks, rank_ranges


def frames(*where: tuple[str, int, str, str]) -> list[dict]:
    return [{"file": f, "line": n, "function": fn, "code": code} for f, n, fn, code in where]


MAIN = ("/job/__main__.py", 9, "<module>", "main()")
ALL_REDUCE = frames(
    MAIN,
    ("/job/train.py", 212, "train", "dist.all_reduce(t)"),
    ("/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 2811, "all_reduce", "work.wait()"),
)
BACKWARD = frames(
    MAIN,
    ("/job/train.py", 363, "train", "scaler.scale(loss / cfg.accum).backward()"),
    ("/v/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward", "torch.autograd.backward("),
    ("/v/lib/python3.11/site-packages/torch/autograd/graph.py", 979, "_engine_run_backward", "return run_backward("),
)
SLEEP = frames(
    MAIN,
    ("/job/train.py", 344, "train", "faults.before_step(step, model)"),
    ("/job/faults.py", 269, "before_step", 'time.sleep(float(f.params["seconds"]))'),
)
LOADER = frames(
    MAIN,
    ("/job/train.py", 330, "train", "x, y = next(batches)"),
    (
        "/v/lib/python3.11/site-packages/torch/utils/data/dataloader.py",
        1285,
        "_get_data",
        "success, data = self._try_get_data()",
    ),
    ("/usr/lib/python3.11/queue.py", 180, "get", "self.not_empty.wait(remaining)"),
)


def test_rank_ranges() -> None:
    assert rank_ranges([7]) == "rank 7"
    assert rank_ranges([3, 0, 1, 2, 5, 7, 8]) == "ranks 0-3, 5, 7-8"


def test_the_minority_is_named_and_described_where_it_waits() -> None:
    stacks = {r: ALL_REDUCE for r in range(7)} | {7: SLEEP}
    out = group_stacks(stacks)
    assert out["summary"] == (
        "ranks 0-6 wait in all_reduce (train.py:212), rank 7 is in before_step (faults.py:269, time.sleep); "
        "the odd one out: rank 7"
    )
    assert out["odd_ranks"] == [7]
    assert [g["ranks"] for g in out["groups"]] == [list(range(7)), [7]]
    assert out["groups"][1]["frames"][0].startswith("/job/faults.py:269 in before_step: time.sleep(")


def test_two_ranks_that_differ_name_the_one_not_waiting_for_the_other() -> None:
    out = group_stacks({0: BACKWARD, 1: SLEEP})
    assert out["summary"].startswith("rank 0 waits in backward (train.py:363), rank 1 is in before_step")
    assert out["odd_ranks"] == [1]
    # both elsewhere than in communication: equal groups, nobody is singled out
    out = group_stacks({0: LOADER, 1: SLEEP})
    assert out["odd_ranks"] == [] and "rank 0 is in train (train.py:330, next)" in out["summary"]


def test_identical_stacks_are_one_group() -> None:
    out = group_stacks({r: ALL_REDUCE for r in range(4)})
    assert out == {
        "summary": "ranks 0-3 wait in all_reduce (train.py:212)",
        "odd_ranks": [],
        "groups": [out["groups"][0]],
    }
    assert out["groups"][0]["ranks"] == [0, 1, 2, 3] and out["groups"][0]["waiting"]
