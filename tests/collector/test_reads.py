"""The driver skips a batch's step events for a detector when they carry none of the fields it reads
(``Detector.reads``), and that changes nothing it finds: every detector, fed random traces through the driver
(batches of random sizes, each keeping a random subset of the step fields, some of them on only some steps;
several ranks, resumes, evals, health samples, checkpoints, heartbeats), finds what a bare instance fed every
event finds. A detector whose declaration lies fails the same check."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmon.monitor.collector.detection import RUN_WIDE, Detection, Found
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.monitor.detectors.loss_scale_collapse import LossScaleCollapse
from trainmon.wire import Event

CONFIG = DetectorsConfig()

# every step field the generator writes ("step" itself is always kept)
FIELDS = (
    "loss",
    "grad_norm",
    "grad_norm_clipped",
    "clip_coef",
    "lr",
    "loss_scale",
    "skipped",
    "tokens",
    "step_time",
    "phases",
    "mem_allocated_bytes",
    "batch_fingerprint",
    "layer_grad_norms",
    "scheduler_steps",
    "weights_checksum",
    "attn_logit_max",
    "attn_entropy",
    "linear_out_rms",
    "adam_eps_frac",
    "update_ratio",
    "output_logz",
)


def _step_fields(rng: random.Random, rank: int, step: int, faults: dict[str, Any]) -> dict[str, Any]:
    """A step's every field, with the attempt's faults in them (spikes, NaNs, a slow rank, halvings...)."""
    loss = 3.0 * math.exp(-step / 150) + 1.0 + rng.gauss(0, 0.12 if faults["noisy"] and step > 180 else 0.02)
    if faults["diverge"] and step > 30:
        loss += 0.05 * (step - 30)
    roll = rng.random()
    if roll < 0.03:
        loss *= 3
    elif roll < 0.04:
        loss = math.nan
    elif roll < 0.05:
        loss = 0.0
    norm = abs(1.0 + rng.gauss(0, 0.05))
    roll = rng.random()
    if roll < 0.03:
        norm *= 20
    elif roll < 0.04:
        norm = math.inf
    elif roll < 0.05 or (faults["noop"] and roll < 0.6):
        norm = 0.0
    lr = 1e-3 if faults["frozen_lr"] else 1e-3 * min(1.0, (step + 1) / 10) * (0.5 + 0.5 * math.cos(step / 100))
    slow = 4.0 if faults["slow_rank"] == rank and step > 20 else 1.0
    step_time = 0.5 * slow * (1 + abs(rng.gauss(0, 0.05)))
    phases = {"data": 0.05 * slow, "forward": 0.15 * slow, "backward": 0.2 * slow, "comm": 0.05, "optimizer": 0.05}
    if rng.random() < 0.05:
        phases["checkpoint"] = 2.0
    mismatch = faults["desync_rank"] == rank and step > 15
    logit = 10.0 * (1.15 ** max(0, step - 20) if faults["logits"] else 1.0) + rng.gauss(0, 0.1)
    return {
        "step": step,
        "loss": loss,
        "grad_norm": norm,
        "grad_norm_clipped": min(norm, 1.0),
        "clip_coef": min(1.0, 1.0 / norm) if norm > 0 and math.isfinite(norm) else 1.0,
        "lr": [lr, lr / 10],
        "loss_scale": 65536.0 / 2 ** (step // faults["halve_every"]),
        "skipped": rng.random() < faults["skip_rate"],
        "tokens": 4096,
        "step_time": step_time,
        "phases": phases,
        "mem_allocated_bytes": int(1e9 + faults["leak"] * step * 4e6),
        "batch_fingerprint": f"b{step % 40}",
        "layer_grad_norms": {"w1": norm / 2, "w2": norm / 2},
        "scheduler_steps": 2 if rng.random() < 0.02 else 1,
        "weights_checksum": [float(step) + mismatch, 1.0, 2.0 + step, 0.0],
        "attn_logit_max": {"l0": logit, "l1": 9.0 + rng.gauss(0, 0.1)},
        "attn_entropy": {"l0": 2.0 + rng.gauss(0, 0.05)},
        "linear_out_rms": {"l0.qkv": 1.0 + rng.gauss(0, 0.02)},
        "adam_eps_frac": {"0": 0.1 + rng.gauss(0, 0.01)},
        "update_ratio": 1e-3 * (1 + rng.gauss(0, 0.1)),
        "output_logz": 5.0 + rng.gauss(0, 0.1),
    }


def _trace(seed: int, ranks: int, attempts: int) -> list[tuple[Event, int]]:
    """A run of ``ranks`` ranks over ``attempts`` attempts (each one after the first resumes from its last
    checkpoint, so it replays steps), every step with every field."""
    rng = random.Random(seed)
    items: list[tuple[Event, int]] = []
    seq = [0] * ranks
    t = 1000.0
    step = 0

    def add(kind: str, rank: int, fields: dict[str, Any], attempt: int) -> None:
        items.append((Event(kind, "run", rank, hosts[rank], f"s{rank}a{attempt}", seq[rank], t, fields), attempt))
        seq[rank] += 1

    last_ckpt = 0
    hosts = [f"node{rank}" for rank in range(ranks)]
    for attempt in range(attempts):
        if rng.random() < 0.5:  # restarted on other nodes
            hosts = [f"node{rng.randrange(2 * ranks)}" for _ in range(ranks)]
        faults = {
            "noisy": rng.random() < 0.3,
            "noop": rng.random() < 0.2,
            "diverge": rng.random() < 0.3,
            "frozen_lr": rng.random() < 0.2,
            "slow_rank": rng.randrange(ranks) if ranks > 1 and rng.random() < 0.5 else -1,
            "desync_rank": rng.randrange(ranks) if ranks > 1 and rng.random() < 0.5 else -1,
            "logits": rng.random() < 0.3,
            "halve_every": rng.choice([3, 10, 1000]),
            "skip_rate": rng.choice([0.0, 0.05, 0.9]),
            "leak": rng.random() < 0.3,
        }
        for rank in range(ranks):
            start: dict[str, Any] = {"world_size": ranks, "device": "cuda:0", "resumed": attempt > 0}
            if rng.random() < 0.5:
                start["vocab_size"] = 50257
            if rng.random() < 0.5:
                start["schedule"] = {"kind": "cosine", "peak_lr": 1e-3, "warmup_steps": 10, "total_steps": 600}
            add("run_start", rank, start, attempt)
            if attempt:
                add("resume", rank, {"step": last_ckpt, "path": f"ckpt-{last_ckpt}"}, attempt)
        if attempt:
            step = last_ckpt + 1
        for _ in range(rng.randrange(5, 400)):
            t += 0.5 + (30.0 if rng.random() < 0.02 else 0.0)  # now and then a stall
            for rank in range(ranks):
                add("step", rank, _step_fields(rng, rank, step, faults), attempt)
                if step % 8 == rank:
                    gpu = {"index": 0, "temperature_c": rng.choice([60.0, 92.0]), "mem_used_bytes": 2**33}
                    gpu["mem_total_bytes"] = 2**34
                    health = {"rss_bytes": int(2e9 + faults["leak"] * step * 1e7), "gpus": [gpu]}
                    health |= {"host_mem_used_bytes": 2**35, "host_mem_total_bytes": 2**36}
                    add("health", rank, health, attempt)
                if step % 5 == 3:
                    add("heartbeat", rank, {"step": step}, attempt)
                if step % 20 == 19:
                    duration = rng.choice([1.0, 60.0])
                    add("checkpoint", rank, {"step": step, "duration": duration, "path": f"ckpt-{step}"}, attempt)
                    last_ckpt = step
            if step % 10 == 9:
                eval_loss = 2.0 + (0.03 * step if faults["diverge"] else 0.0) + rng.gauss(0, 0.01)
                metrics = {"accuracy": 0.5 + rng.gauss(0, 0.01), "other/loss": eval_loss + 0.1}
                add("eval", 0, {"step": step, "loss": eval_loss, "metrics": metrics}, attempt)
            step += 1
        if rng.random() < 0.7:
            for rank in range(ranks):
                add("run_end", rank, {"status": rng.choice(["finished", "failed"]), "step": step - 1}, attempt)
    return items


def _batches(seed: int, ranks: int, attempts: int) -> list[list[tuple[Event, int]]]:
    """A trace cut into batches of random sizes, each batch's steps keeping a random subset of the fields (none,
    a few, most or all; some of them on some steps only)."""
    items = _trace(seed, ranks, attempts)
    rng = random.Random(~seed)
    batches = []
    i = 0
    while i < len(items):
        size = rng.randint(1, 80)
        share = rng.choice([0.0, 0.1, 0.5, 0.9, 1.0])
        kept = {k for k in FIELDS if rng.random() < share}
        sparse = {k for k in kept if rng.random() < 0.3}
        batch = []
        for event, attempt in items[i : i + size]:
            if event.kind == "step":
                fields = {
                    k: v
                    for k, v in event.fields.items()
                    if k == "step" or (k in kept and (k not in sparse or rng.random() < 0.3))
                }
                event = dataclasses.replace(event, fields=fields)
            batch.append((event, attempt))
        batches.append(batch)
        i += size
    return batches


traces = st.builds(_batches, st.integers(0, 2**32), st.integers(1, 3), st.integers(1, 3))
EXAMPLES = [_batches(seed, 1 + seed % 3, 1 + seed // 3 % 3) for seed in range(60)]


def _driven(cls: type[Detector], batches: list[list[tuple[Event, int]]]) -> list[Found]:
    """Through the driver, batch by batch: step events skipped where the batch carries nothing it reads."""
    detection = Detection(CONFIG, (cls,))
    found: list[Found] = []
    for batch in batches:
        found += detection.observe(batch)
    return found


def _bare(cls: type[Detector], batches: list[list[tuple[Event, int]]]) -> list[Found]:
    """Every event to a bare instance per (run, rank) or per run, as the driver would place its findings."""
    dets: dict[Any, Detector | None] = {}
    found: list[Found] = []
    for event, attempt in [item for batch in batches for item in batch]:
        key = (event.run, event.rank) if cls.scope == "rank" else event.run
        if key not in dets:
            dets[key] = cls(getattr(CONFIG, cls.kind))
        det = dets[key]
        if det is None:
            continue
        try:
            out = det.observe(event, attempt)
        except Exception:
            dets[key] = None  # the driver drops it too
            continue
        default = event.rank if cls.scope == "rank" else RUN_WIDE
        found += [(event.run, default if f.rank is None else f.rank, f) for f in out]
    return found


def _same(cls: type[Detector], batches: list[list[tuple[Event, int]]]) -> bool:
    # repr: a NaN in the evidence is equal to itself there
    return repr(_driven(cls, batches)) == repr(_bare(cls, batches))


_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("cls", ALL_DETECTORS, ids=lambda cls: cls.kind)
@_SETTINGS
@given(traces)
def test_skipping_steps_that_carry_nothing_a_detector_reads_changes_nothing_it_finds(
    cls: type[Detector], batches: list[list[tuple[Event, int]]]
) -> None:
    assert _same(cls, batches)


def _skips(cls: type[Detector], batches: list[list[tuple[Event, int]]]) -> bool:
    """Some batch's steps carry none of the fields ``cls`` reads."""
    assert cls.reads is not None
    return any(
        {k for event, _ in batch if event.kind == "step" for k in event.fields}.isdisjoint(cls.reads)
        for batch in batches
        if any(event.kind == "step" for event, _ in batch)
    )


@pytest.mark.parametrize("cls", [cls for cls in ALL_DETECTORS if cls.reads is not None], ids=lambda cls: cls.kind)
def test_the_traces_skip_steps_of_a_detector_that_still_finds_anomalies(cls: type[Detector]) -> None:
    """The generator makes the check mean something for each declaring detector: traces where it is skipped
    some steps and finds something all the same."""
    assert any(_skips(cls, batches) and _driven(cls, batches) for batches in EXAMPLES)


class _Liar(Detector):
    """Says it reads only losses, yet counts every step (the state an audit must catch)."""

    kind = "nan_inf"  # borrows a configured kind's section
    consumes = frozenset(("step",))
    reads = frozenset(("loss",))

    def __init__(self, config: object) -> None:
        self.steps = 0

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        self.steps += 1
        if "loss" not in event.fields:
            return []
        return [Finding(self.kind, "info", event.fields["step"], f"{self.steps} steps", "")]


def test_the_check_fails_a_detector_whose_declaration_lies() -> None:
    assert not all(_same(_Liar, batches) for batches in EXAMPLES)


class _Counted(LossScaleCollapse):
    """The real detector, counting what reaches it."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.seen: list[tuple[str, int | None]] = []

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        self.seen.append((event.kind, event.fields.get("step")))
        return super().observe(event, attempt)


def _ev(kind: str, fields: dict[str, Any], t: float) -> tuple[Event, int]:
    return Event(kind, "run", 0, "host", "s", int(t), t, fields), 0


def test_a_batch_whose_steps_carry_nothing_a_detector_reads_never_reaches_it() -> None:
    detection = Detection(CONFIG, (_Counted,))
    losses = [_ev("step", {"step": i, "loss": 2.0, "lr": [1e-3]}, 1.0 + i) for i in range(3)]
    detection.observe([_ev("run_start", {}, 0.0), *losses, _ev("run_end", {"status": "finished"}, 9.0)])
    (det,) = detection.rank_dets[("run", 0)].dets
    assert isinstance(det, _Counted)
    assert det.seen == [("run_start", None), ("run_end", None)]  # its other kinds still reach it, in order
    # one step with a scale: the batch's every step reaches it, in order
    scaled = [_ev("step", {"step": 3, "loss": 2.0}, 10.0), _ev("step", {"step": 4, "loss_scale": 1024.0}, 11.0)]
    detection.observe(scaled)
    assert det.seen[2:] == [("step", 3), ("step", 4)]
