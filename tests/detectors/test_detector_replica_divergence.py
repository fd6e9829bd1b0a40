"""replica_divergence: replicas that part and tensor-parallel shards that are alike, on synthetic traces."""

from __future__ import annotations

import dataclasses

import pytest

from tests.trainer_helpers import TINY, read_labels, run_trainer, torchrun
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors.base import Finding
from trainmon.monitor.detectors.replica_divergence import ReplicaDivergence, ReplicaDivergenceConfig
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event

KIND = "replica_divergence"


def checksum(model: int, step: int, offset: float = 0.0, left_out: float = 0.0) -> list[float]:
    """A checksum of "model" ``model`` at ``step``: equal inputs give equal bits; ``offset`` moves the norm."""
    bits = float((model * 7_919 + step * 104_729) % (1 << 24))
    return [bits + (1.0 if offset else 0.0), float(model), 1000.0 - 0.5 * step + offset, left_out]


def trace(
    ranks: int,
    steps: int = 100,
    *,
    every: int = 10,
    layout: dict | None = None,
    model=lambda rank, step: 0,
    offset=lambda rank, step: 0.0,
    left_out: float = 0.0,
    attempt_starts: tuple[int, ...] = (0,),
) -> list[tuple[Event, int]]:
    """(event, attempt) pairs of ``ranks`` ranks; ``model(rank, step)`` says which weights a rank holds."""
    out = []
    t = 1e9
    for attempt, first in enumerate(attempt_starts):
        last = attempt_starts[attempt + 1] if attempt + 1 < len(attempt_starts) else steps
        for r in range(ranks):
            fields = {"world_size": ranks, "layout": layout} if layout else {"world_size": ranks}
            out.append((Event("run_start", "r", r, f"n{r}", f"s{r}.{attempt}", 0, t, fields), attempt))
        for s in range(first, last):
            t += 0.1
            for r in reversed(range(ranks)):  # arrival order is not rank order
                fields = {"step": s, "loss": 2.0}
                if s == first or s % every == 0:
                    fields["weights_checksum"] = checksum(model(r, s), s, offset(r, s), left_out)
                out.append((Event("step", "r", r, f"n{r}", f"s{r}.{attempt}", s + 1, t, fields), attempt))
    return out


def run(events: list[tuple[Event, int]], **config) -> list[Finding]:
    det = ReplicaDivergence(dataclasses.replace(ReplicaDivergenceConfig(), **config))
    return [f for ev, attempt in events for f in det.observe(ev, attempt)]


def test_identical_replicas_stay_silent() -> None:
    assert run(trace(4)) == []
    assert run(trace(2, layout={"tp": 1, "dp": 2, "pp": 1})) == []


def test_the_minority_rank_is_named_with_when_it_parted() -> None:
    findings = run(trace(4, model=lambda r, s: 1 if (r == 2 and s >= 30) else 0))
    first = findings[0]
    assert (first.kind, first.rank, first.step) == (KIND, 2, 30)
    assert not first.resolved and first.severity in ("warning", "critical")
    assert "rank 2's weights differ" in first.message and "ranks 0, 1 and 3 agree" in first.message
    assert "since step 30 (identical at step 20)" in first.message
    assert first.evidence["majority"] == [0, 1, 3] and first.evidence["last_agreed_step"] == 20
    assert all(f.rank == 2 for f in findings)


def test_an_open_finding_follows_a_growing_difference_then_resolves() -> None:
    # rank 3 parts at step 20 by a hair, the gap grows tenfold per check, then a restart re-syncs it
    events = trace(
        4,
        120,
        model=lambda r, s: 1 if (r == 3 and 20 <= s < 80) else 0,
        offset=lambda r, s: 1e-4 * 10 ** ((s - 20) // 10) if (r == 3 and 20 <= s < 80) else 0.0,
        attempt_starts=(0, 80),
    )
    findings = run(events)
    opened = [f for f in findings if not f.resolved]
    assert opened[0].step == 20 and opened[0].severity == "warning"
    assert opened[-1].severity == "critical" and opened[-1].evidence["first_step"] == 20
    assert opened[-1].evidence["rel_norm_diff"] > 100 * opened[0].evidence["rel_norm_diff"]
    (resolved,) = [f for f in findings if f.resolved]
    assert resolved.rank == 3 and resolved.step == 80


def test_two_replicas_have_no_majority_both_are_named() -> None:
    (finding,) = run(trace(2, model=lambda r, s: 1 if (r == 1 and s >= 40) else 0))
    assert finding.rank == -1 and finding.step == 40
    assert "replicas 0 and 1 hold different weights since step 40" in finding.message
    assert "no majority" in finding.message and "likely" not in finding.message


def test_two_replicas_the_one_whose_norm_jumped_is_named_as_likely() -> None:
    # the weights' norm drifts by 5 per check; at step 60 rank 0's jumps by 200 while rank 1 follows the trend
    (finding,) = run(
        trace(
            2,
            model=lambda r, s: 1 if (r == 0 and s >= 60) else 0,
            offset=lambda r, s: 200.0 if (r == 0 and s >= 60) else 0.0,
        )
    )
    assert finding.rank == -1 and finding.evidence["conditions"][0]["likely_rank"] == 0
    assert "rank 0 is the likely odd one" in finding.message


def test_ranks_that_never_agreed_are_not_replicas() -> None:
    # pipeline or tensor parallelism without a declared layout: every rank holds different weights from the start
    assert run(trace(4, model=lambda r, s: r)) == []


def test_relative_tolerance_accepts_rounding_differences() -> None:
    events = trace(
        4, model=lambda r, s: 1 if (r == 1 and s >= 30) else 0, offset=lambda r, s: 1e-9 if r == 1 and s >= 30 else 0.0
    )
    assert run(events, rtol=1e-6) == []
    assert [f.rank for f in run(events)][:1] == [1]  # exact by default: the bits differ


def test_tensor_parallel_shards_initialised_alike_are_flagged_at_the_first_step() -> None:
    layout = {"tp": 2, "dp": 2, "pp": 1}  # ranks 0,1 and 2,3 are TP groups; 0,2 and 1,3 replicas
    assert run(trace(4, layout=layout, model=lambda r, s: r % 2)) == []  # shards differ, replicas agree
    (finding,) = run(trace(4, layout=layout, model=lambda r, s: 0))
    assert finding.rank == -1 and finding.step == 0 and finding.severity == "warning"
    assert "ranks 0 and 1; 2 and 3 are declared shards of tensor-parallel groups (tp=2)" in finding.message
    assert "same seed" in finding.message and "tp_rank" in finding.hint
    # a resumed run (shards now distinct) clears it at its first check
    events = trace(4, layout=layout, model=lambda r, s: 0 if s < 50 else r % 2, attempt_starts=(0, 50))
    assert [(f.step, f.resolved) for f in run(events)] == [(0, False), (50, True)]


def test_shard_check_skipped_when_sharded_parameters_were_left_out() -> None:
    # DTensor shards are not in the checksum: what is left (norms, biases) is legitimately the same on TP ranks
    assert run(trace(2, layout={"tp": 2}, model=lambda r, s: 0, left_out=4.0)) == []


def test_replicas_within_a_layout_are_compared_by_group() -> None:
    layout = {"tp": 2, "dp": 2, "pp": 1}
    (finding,) = run(trace(4, layout=layout, model=lambda r, s: r % 2 + (10 if (r == 3 and s >= 20) else 0)))
    assert finding.rank == -1 and "replicas 1 and 3 hold different weights since step 20" in finding.message


def test_a_missing_rank_leaves_the_step_unjudged_with_bounded_state() -> None:
    events = [
        (ev, a)
        for ev, a in trace(3, 2000, every=1, model=lambda r, s: r == 1)
        if not (ev.kind == "step" and ev.rank == 2)
    ]
    det = ReplicaDivergence(ReplicaDivergenceConfig())
    assert [f for ev, a in events for f in det.observe(ev, a)] == []
    assert len(det._pending) <= ReplicaDivergenceConfig().max_pending


# -- the reference trainer under torchrun (gloo): real DDP replicas, a simulated tensor-parallel layout ------------


def _found(out, run: str) -> list[dict]:
    storage = Storage("sqlite://")
    import_file(out, storage)  # every rank's events*.jsonl
    return [a for a in summarize(storage, run)["anomalies"] if a["kind"] == KIND]


@pytest.mark.slow
def test_torchrun_the_desynced_replica_is_named_by_the_majority(tmp_path) -> None:
    torchrun(
        tmp_path,
        *TINY,
        "--threads",
        "1",
        "--checksum-every",
        "4",
        "--inject",
        "replica_desync@12:rank=1",
        nproc=3,
        steps=20,
        run="rd3",
    )
    (label,) = read_labels(tmp_path)
    assert (label["rank"], label["first_step"], label["expected_detection"]) == (1, 12, KIND)
    (found,) = _found(tmp_path, "rd3")
    assert (found["rank"], found["first_step"]) == (1, 12)
    assert "ranks 0 and 2 agree" in found["message"] and "identical at step 8" in found["message"]


@pytest.mark.slow
def test_torchrun_two_replicas_both_named_and_a_clean_run_is_silent(tmp_path) -> None:
    torchrun(
        tmp_path / "f",
        *TINY,
        "--threads",
        "1",
        "--checksum-every",
        "4",
        "--inject",
        "replica_desync@10",
        steps=20,
        run="rd2",
    )
    (found,) = _found(tmp_path / "f", "rd2")
    assert found["rank"] == -1 and 10 <= found["first_step"] <= 12
    assert "replicas 0 and 1 hold different weights" in found["message"]
    torchrun(
        tmp_path / "c", *TINY, "--threads", "1", "--checksum-every", "2", "--checkpoint-every", "5", steps=20, run="rc2"
    )
    assert _found(tmp_path / "c", "rc2") == []


@pytest.mark.slow
def test_torchrun_tensor_parallel_ranks_seeded_alike_flagged_at_step_0(tmp_path) -> None:
    torchrun(
        tmp_path / "f", *TINY, "--threads", "1", "--layout", "tp=2", "--inject", "tp_same_seed@0", steps=6, run="tps"
    )
    (found,) = _found(tmp_path / "f", "tps")
    assert (found["rank"], found["first_step"]) == (-1, 0)
    assert "ranks 0 and 1 are declared shards of one tensor-parallel group (tp=2)" in found["message"]
    torchrun(tmp_path / "c", *TINY, "--threads", "1", "--layout", "tp=2", steps=6, run="tpc")
    assert _found(tmp_path / "c", "tpc") == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--inject", "replica_desync@2"], "needs data-parallel replicas"),
        (["--inject", "tp_same_seed@0"], "needs a tensor-parallel layout"),
        (["--layout", "tp=2"], "tp=2 does not divide the 1 ranks"),
        (["--layout", "pp=2"], "expected tp=N"),
    ],
)
def test_layout_faults_refuse_a_run_they_cannot_act_on(tmp_path, args, problem) -> None:
    proc = run_trainer(tmp_path, *TINY, *args, steps=2, check=False)
    assert proc.returncode == 2 and problem in proc.stderr
