"""Synthetic labelled training traces for the detection benchmark.

Each trace is a list of wire-format event dicts (one run, one or more ranks) and a list of
labels in the reference trainer's ``labels.json`` shape. The clean part of a trace is a
plausible small-model run: loss decaying exponentially to a floor with multiplicative noise,
a grad norm that settles after warmup, a declared LR schedule followed exactly, and a step
time split into phases with jitter. Faults are layered on top with a chosen magnitude, so the
benchmark can sweep from obvious to barely detectable. Clean controls carry the benign events
detectors must not alarm on: warmup, epoch-boundary drops, eval and checkpoint windows, and a
declared WSD decay (a large, deliberate LR change).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from trainmon.schedules import Schedule

__all__ = ["Trace", "clean_controls", "fault_traces"]


@dataclass
class Trace:
    name: str
    events: list[dict[str, Any]]
    labels: list[dict[str, Any]] = field(default_factory=list)
    clean: bool = False


def _label(kind: str, first: int, last: int, expected: str, rank: int = 0) -> dict[str, Any]:
    return {"kind": kind, "rank": rank, "first_step": first, "last_step": last, "expected_detection": expected}


class _Run:
    """One rank's clean trajectory, generated step by step so faults can bend it."""

    def __init__(self, rng: random.Random, steps: int, schedule: Schedule, noise: float, vocab: int = 256) -> None:
        self.rng = rng
        self.steps = steps
        self.schedule = schedule
        self.noise = noise
        self.l0 = math.log(vocab) * rng.uniform(0.98, 1.02)
        self.floor = rng.uniform(1.2, 2.5)
        self.tau = rng.uniform(steps / 8, steps / 3)
        self.g_floor = rng.uniform(0.2, 1.0)
        self.base_time = rng.uniform(0.05, 0.5)
        self.vocab = vocab

    def loss(self, t: int) -> float:
        clean = self.floor + (self.l0 - self.floor) * math.exp(-t / self.tau)
        return clean * math.exp(self.noise * self.rng.gauss(0, 1))

    def grad_norm(self, t: int) -> float:
        warm = max(1, self.schedule.warmup_steps)
        level = self.g_floor * (1 + 4 * math.exp(-t / warm))
        return level * math.exp(0.15 * self.rng.gauss(0, 1))

    def phases(self) -> dict[str, float]:
        b = self.base_time * math.exp(0.05 * self.rng.gauss(0, 1))
        return {"data": 0.05 * b, "forward": 0.3 * b, "backward": 0.5 * b, "optimizer": 0.1 * b, "other": 0.05 * b}


def _trace(
    name: str,
    seed: int,
    steps: int = 600,
    noise: float = 0.02,
    schedule_name: str = "cosine",
    ranks: int = 1,
    edit: Any = None,
    epoch: int = 0,
    eval_every: int = 0,
    ckpt_every: int = 0,
    health_every: int = 0,
    fp16: bool = False,
    edit_eval: Any = None,
    edit_health: Any = None,
) -> list[dict[str, Any]]:
    """Events of a run; ``edit(rank, t, fields)`` may change a step's fields in place, and
    ``edit_eval(t, fields)`` / ``edit_health(rank, t, fields)`` the eval and health events."""
    rng = random.Random(seed)
    schedule = Schedule(
        schedule_name, peak_lr=rng.choice([3e-4, 1e-3, 6e-4]), total_steps=steps, warmup_steps=rng.choice([0, 20, 50])
    )
    runs = [_Run(random.Random(seed * 1000 + r), steps, schedule, noise) for r in range(ranks)]
    t0 = 1.7e9 + (seed % 20_000) * 1e5  # distinct clocks, all before 2**32 (the wire format's bound on time)
    events: list[dict[str, Any]] = []
    seqs = [0] * ranks

    def emit(rank: int, kind: str, time: float, fields: dict[str, Any]) -> None:
        events.append(
            {
                "kind": kind,
                "run": name,
                "rank": rank,
                "host": f"node{rank // 8}",
                "stream": f"s{rank}",
                "seq": seqs[rank],
                "time": time,
                "fields": fields,
            }
        )
        seqs[rank] += 1

    for r in range(ranks):
        emit(
            r,
            "run_start",
            t0,
            {
                "world_size": ranks,
                "vocab_size": runs[r].vocab,
                "planned_steps": steps,
                "schedule": schedule.to_dict(),
                "accum_steps": 1,
                "global_batch_tokens": 4096 * ranks,
                "framework": "synthetic",
            },
        )
    clock = [t0] * ranks
    for t in range(steps):
        for r, run in enumerate(runs):
            phases = run.phases()
            loss = run.loss(t)
            if epoch and t >= epoch:
                loss *= 0.97 ** (t // epoch)  # memorisation drop at each epoch boundary: benign
            if eval_every and t and t % eval_every == 0:
                phases["eval"] = 3 * run.base_time
            if ckpt_every and t and t % ckpt_every == 0:
                phases["checkpoint"] = 5 * run.base_time
            norm = run.grad_norm(t)
            clip = min(1.0, 1.0 / (norm + 1e-6))
            fields = {
                "step": t,
                "loss": loss,
                "grad_norm": norm,
                "grad_norm_clipped": norm * clip,
                "clip_coef": clip,
                "lr": [schedule.lr(t)],
                "tokens": 4096,
                "phases": phases,
            }
            if fp16:  # a healthy dynamic scale: one overflow (a halving, a skipped step) now and then
                overflow = t % 250 == 137
                fields["loss_scale"] = 32768.0 if (t % 250) >= 137 else 65536.0
                fields["skipped"] = overflow
            if edit is not None:
                edit(r, t, fields)
            fields["step_time"] = sum(fields["phases"].values())
            clock[r] += fields["step_time"]
            emit(r, "step", clock[r], fields)
            if eval_every and t and t % eval_every == 0 and r == 0:
                ev = {"step": t, "loss": run.floor + (run.l0 - run.floor) * math.exp(-t / run.tau) + 0.05}
                if edit_eval is not None:
                    edit_eval(t, ev)
                emit(r, "eval", clock[r], ev)
            if health_every and t % health_every == 0:
                gpu = {
                    "index": 0,
                    "uuid": f"GPU-{r}",
                    "temperature_c": 64 + 3 * run.rng.random(),
                    "utilization_ratio": 0.97,
                    "mem_used_bytes": 61 * 10**9,
                    "mem_total_bytes": 80 * 10**9,
                    "power_w": 520.0,
                    "sm_clock_hz": 1.98e9,
                    "throttle_reasons": 0,
                    "ecc_corrected": 0,
                    "ecc_uncorrected": 0,
                }
                health = {
                    "cpu_percent": 105.0,
                    "rss_bytes": 9 * 10**9,
                    "host_mem_used_bytes": 21 * 10**10,
                    "host_mem_total_bytes": 10**12,
                    "gpus": [gpu],
                }
                if edit_health is not None:
                    edit_health(r, t, health)
                emit(r, "health", clock[r], health)
    for r in range(ranks):
        emit(r, "run_end", clock[r], {"status": "finished", "step": steps - 1})
    return events


def clean_controls(n: int, seed: int = 0) -> list[Trace]:
    """Runs with benign events only; every alert on them is a false alarm."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 5
        kw: dict[str, Any] = {"noise": rng.choice([0.005, 0.02, 0.05]), "health_every": 10, "fp16": i % 2 == 0}
        if kind == 1:
            kw["epoch"] = rng.choice([100, 150])
        elif kind == 2:
            kw.update(eval_every=50, ckpt_every=100)
        elif kind == 3:
            kw["schedule_name"] = "wsd"  # a deliberate, declared LR drop
        elif kind == 4:
            kw["schedule_name"] = rng.choice(["linear", "constant", "inverse_sqrt"])
        name = f"clean-{i}"
        out.append(Trace(name, _trace(name, seed * 10_000 + i, **kw), clean=True))
    return out


def fault_traces(n_per_kind: int, seed: int = 1) -> list[Trace]:
    """Traces with one fault each, magnitudes swept from obvious to subtle."""
    rng = random.Random(seed)
    out: list[Trace] = []
    for i in range(n_per_kind):
        noise = rng.choice([0.005, 0.02, 0.05])
        at = rng.randint(200, 450)
        base = seed * 100_000 + i * 100

        # loss spike: the loss jumps by a factor that is several noise widths, then recovers
        mag = rng.choice([1.5, 2.0, 3.0, 5.0])
        recover = rng.choice([1, 3, 10])

        def spike(r: int, t: int, f: dict, at=at, mag=mag, recover=recover) -> None:
            if at <= t < at + recover:
                f["loss"] *= 1 + (mag - 1) * (1 - (t - at) / recover)

        name = f"spike-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 1, noise=noise, edit=spike),
                [_label("loss_spike", at, at + recover - 1, "loss_spike")],
            )
        )

        # grad explosion: the pre-clip norm jumps by 10-1000x for a few steps
        gmag = rng.choice([10.0, 50.0, 1000.0])

        def explode(r: int, t: int, f: dict, at=at, gmag=gmag) -> None:
            if at <= t < at + 3:
                f["grad_norm"] *= gmag
                f["clip_coef"] = min(1.0, 1.0 / (f["grad_norm"] + 1e-6))
                f["grad_norm_clipped"] = f["grad_norm"] * f["clip_coef"]

        name = f"gradexp-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 2, noise=noise, edit=explode),
                [_label("grad_explosion", at, at + 2, "grad_explosion")],
            )
        )

        # NaN: from one step on, loss and norm are NaN
        def nan(r: int, t: int, f: dict, at=at) -> None:
            if t >= at:
                f["loss"] = f["grad_norm"] = f["grad_norm_clipped"] = math.nan

        name = f"nan-{i}"
        out.append(Trace(name, _trace(name, base + 3, noise=noise, edit=nan), [_label("nan", at, 599, "nan_inf")]))

        # slow divergence: the loss climbs a few percent per 10 steps and never comes back
        slope = rng.choice([0.002, 0.005, 0.01])

        def diverge(r: int, t: int, f: dict, at=at, slope=slope) -> None:
            if t >= at:
                f["loss"] *= 1 + slope * (t - at)
                f["grad_norm"] *= 1 + 2 * slope * (t - at)

        name = f"diverge-{i}"
        out.append(
            Trace(
                name, _trace(name, base + 4, noise=noise, edit=diverge), [_label("divergence", at, 599, "divergence")]
            )
        )

        # throughput collapse: the data phase grows 2-10x the step and stays there
        slow = rng.choice([1.0, 3.0, 10.0])

        def stall(r: int, t: int, f: dict, at=at, slow=slow) -> None:
            if at <= t < at + 60:
                total = sum(f["phases"].values())
                f["phases"]["data"] += slow * total

        name = f"stall-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 5, noise=noise, edit=stall),
                [_label("data_stall", at, at + 59, "throughput_collapse")],
            )
        )

        # LR frozen: the scheduler stops being stepped
        def frozen(r: int, t: int, f: dict, at=at, box={}) -> None:  # noqa: B006 - per-trace closure state
            if t == at - 1:
                box["lr"] = f["lr"]
            if t >= at:
                f["lr"] = box["lr"]

        name = f"lrfrozen-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 6, noise=noise, edit=frozen),
                [_label("lr_frozen", at, 599, "lr_schedule_drift")],
            )
        )

        # GPU overheating: temperature climbs past 90 C and the driver throttles (HW thermal)
        def hot(r: int, t: int, f: dict, at=at) -> None:
            if t >= at:
                g = f["gpus"][0]
                g["temperature_c"] = min(96.0, 70 + 0.5 * (t - at))
                g["throttle_reasons"] = 0x40 if g["temperature_c"] >= 90 else 0

        name = f"gpuhot-{i}"
        hot_from = at + 40  # when it reaches 90 C
        out.append(
            Trace(
                name,
                _trace(name, base + 7, noise=noise, health_every=10, edit_health=hot),
                [_label("gpu_overheat", hot_from, 599, "node_health")],
            )
        )

        # fp16 overflow storm: the scale halves on every other step
        def storm(r: int, t: int, f: dict, at=at) -> None:
            if t >= at:
                f["loss_scale"] = max(1.0, 65536.0 / 2 ** ((t - at) // 2 + 1))
                f["skipped"] = (t - at) % 2 == 0

        name = f"scalestorm-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 8, noise=noise, fp16=True, edit=storm),
                [_label("overflow_storm", at, 599, "loss_scale_collapse")],
            )
        )

        # overfitting: eval loss turns up while the train loss keeps falling
        rise = rng.choice([0.1, 0.2, 0.3])  # eval loss gained per evaluation (every 25 steps)
        at = min(at, 350)  # leave at least ten evaluations after the turn

        def overfit(t: int, f: dict, at=at, rise=rise) -> None:
            if t > at:
                f["loss"] += rise * (t - at) / 25

        name = f"overfit-{i}"
        out.append(
            Trace(
                name,
                _trace(name, base + 9, noise=noise, eval_every=25, edit_eval=overfit),
                [_label("overfit", at, 599, "eval_regression")],
            )
        )
    return out
