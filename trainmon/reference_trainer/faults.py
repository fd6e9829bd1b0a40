"""Fault injection: a catalog of deterministic faults and their ground truth.

``--inject KIND@STEP[:key=value,...]`` (repeatable) schedules a fault. Every fault is a pure
function of the step, rank and parameters, so two runs with the same flags fail identically.
Each fault writes its ground truth to ``OUT/labels.json``: a JSON list of
``{kind, rank, first_step, last_step, expected_detection, spec, params}``, where ``rank`` is
the rank that shows the fault (``null`` when every rank of a multi-rank run does) and
``expected_detection`` is the trainmon detector that should fire. Labels are merged across
invocations, so a resumed run keeps the labels of the attempt before it.

``resume_*`` faults act when the run is resumed (``--resume``), at the step it resumes from
(the checkpointed step + 1); their ``STEP`` is a guard: the fault acts only if the run resumes
at a step >= STEP (use ``@0`` to always act). Their label covers the resume boundary
(first_step = last_step = the first resumed step). ``lr_wrong_total``, ``lr_too_high``, ``bad_init``
and ``tp_same_seed`` act from the start of the run; their ``STEP`` is ignored (write ``@0``).

Perturbations are sized to be visible on the tiny default model (a one-step LR x30 is not, see
failure-modes.md §4).
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainmon.reference_trainer.data import one_document_batches
from trainmon.schedules import Schedule

__all__ = ["CATALOG", "Fault", "FaultError", "FaultPlan", "catalog_help", "parse_fault", "write_labels"]


class FaultError(ValueError):
    """A bad ``--inject`` spec; the message quotes the spec and names the problem."""


@dataclass(frozen=True)
class FaultKind:
    name: str
    detection: str  # trainmon detector kind expected to fire
    params: dict[str, Any]  # name -> default; None means "until the end" / "all ranks"
    doc: str
    default_rank: str = "all"  # "all" ranks, or the "last" rank (straggler, hang)


_K = FaultKind
CATALOG: dict[str, FaultKind] = {
    k.name: k
    for k in [
        _K(
            "loss_spike", "loss_spike", {"scale": 10.0, "steps": 1}, "batch replaced by random tokens, its loss x scale"
        ),
        _K("lr_burst", "loss_spike", {"factor": 100.0, "steps": 2}, "LR multiplied by factor for `steps` steps"),
        _K("weight_scale", "loss_spike", {"factor": 20.0}, "every weight matrix multiplied by factor once"),
        _K(
            "lr_too_high",
            "instability_precursor",
            {"factor": 100.0, "warmup": 200},
            "the declared schedule's peak LR x factor, reached by a linear warmup of `warmup` steps (STEP ignored; "
            "no qk-layernorm: attention logits grow early, the loss diverges 50-120 steps later)",
        ),
        _K("nan", "nan_inf", {}, "one output-head weight set to NaN (loss NaN from then on)"),
        _K("divergence", "divergence", {"ramp": 20}, "no clipping; random targets ramp 0->100% over `ramp` steps"),
        _K("lr_per_microbatch", "lr_schedule_drift", {}, "scheduler stepped every micro-batch (needs --accum > 1)"),
        _K("lr_wrong_total", "lr_schedule_drift", {"factor": 4}, "scheduler sized for steps/factor (STEP ignored)"),
        _K("lr_frozen", "lr_schedule_drift", {}, "scheduler no longer stepped from STEP on"),
        _K("resume_no_scheduler", "bad_resume", {}, "on resume: a fresh scheduler (warmup restarts)"),
        _K("resume_no_optimizer", "bad_resume", {}, "on resume: a fresh AdamW (moments and step counts lost)"),
        _K("resume_data_replay", "bad_resume", {}, "on resume: data position reset to 0 (batches replayed)"),
        _K("resume_no_rng", "bad_resume", {}, "on resume: RNG states not restored (re-seeded)"),
        _K("resume_step_reset", "bad_resume", {}, "on resume: step counter reset to 0"),
        _K("resume_no_scaler", "bad_resume", {}, "on resume: a fresh loss scaler (needs --precision fp16)"),
        _K("resume_batch_change", "bad_resume", {"batch_size": None}, "on resume: batch size changed (default x2)"),
        _K("data_stall", "throughput_collapse", {"seconds": 1.0, "steps": 3}, "sleep in the data phase"),
        _K("checkpoint_stall", "throughput_collapse", {"seconds": 2.0}, "extra checkpoint at STEP via a slow writer"),
        _K("memory_leak", "memory_leak", {"mb": 8.0, "steps": None}, "keep `mb` MiB alive every step"),
        _K("gc_pause", "throughput_collapse", {"objects": 300000, "every": 5, "steps": None}, "cyclic garbage + gc"),
        _K("straggler", "straggler", {"ms": 50.0, "steps": None}, "one rank sleeps `ms` in forward", "last"),
        _K("hang", "hang", {"seconds": 10.0}, "one rank stops stepping for `seconds` (heartbeats go on)", "last"),
        _K("labels_unshifted", "init_loss", {"steps": None}, "targets = inputs (no shift): loss under the floor"),
        _K("bad_init", "init_loss", {"scale": 20.0}, "output head initialised x scale (STEP ignored)"),
        _K(
            "unshuffled",
            "loss_noise",
            {"docs": 1},
            "sequences no longer shuffled: every batch is read in order from `docs` document(s) (rows repeat them)",
        ),
        _K(
            "replica_desync",
            "replica_divergence",
            {"scale": 0.01},
            "one rank's weight matrices get noise (x scale of their std) before STEP: its replica parts",
            "last",
        ),
        _K(
            "tp_same_seed",
            "replica_divergence",
            {},
            "every tensor-parallel rank initialised from the same seed (needs --layout tp=N; STEP ignored)",
        ),
    ]
}


def catalog_help() -> str:
    """The fault catalog as text, for ``--help``."""
    lines = [
        "fault catalog (--inject KIND@STEP[:key=value,...]; every fault also takes rank=N):",
    ]
    for k in CATALOG.values():
        params = ",".join(f"{p}={'' if v is None else v}" for p, v in k.params.items())
        lines.append(f"  {k.name:<20} -> {k.detection:<20} {k.doc}" + (f" [{params}]" if params else ""))
    lines.append(
        "resume_* faults act when resuming at a step >= STEP. Ground truth goes to OUT/labels.json. "
        "Example: --inject straggler@10:rank=1,ms=30 --inject loss_spike@20:scale=50"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class Fault:
    """One injected fault: kind, start step, parameters, target rank (None: every rank)."""

    kind: str
    step: int
    params: dict[str, Any]
    spec: str
    rank: int | None = None

    @property
    def detection(self) -> str:
        return CATALOG[self.kind].detection

    @property
    def resume(self) -> bool:
        return self.kind.startswith("resume_")

    def on_rank(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def last_step(self, total_steps: int) -> int:
        """Last step of the fault's window (the run's last step when it lasts to the end)."""
        n = self.params.get("steps")
        if self.kind in ("weight_scale", "hang", "replica_desync"):
            return self.step
        if self.kind == "checkpoint_stall":
            return min(self.step + 1, total_steps - 1)  # the save's time lands in the next step's record
        if n is None or "steps" not in CATALOG[self.kind].params:
            return total_steps - 1
        return min(self.step + int(n) - 1, total_steps - 1)

    def active(self, step: int, rank: int, total_steps: int) -> bool:
        return self.on_rank(rank) and self.step <= step <= self.last_step(total_steps)


def _parse_value(raw: str, default: Any) -> Any:
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, int) and not isinstance(default, bool):
        return int(raw)
    return int(raw)  # None defaults are counts (steps, batch_size)


def parse_fault(text: str, world_size: int = 1) -> Fault:
    """Parse ``KIND@STEP[:key=value,...]``; raise ``FaultError`` naming what is wrong."""

    def fail(problem: str) -> FaultError:
        return FaultError(f"--inject {text!r}: {problem}")

    head, _, rest = text.partition(":")
    kind, at, step_text = head.partition("@")
    kind = kind.strip()
    if kind not in CATALOG:
        raise fail(f"unknown fault kind {kind!r}, expected one of: {', '.join(CATALOG)}")
    if not at or not step_text.strip():
        raise fail("missing @STEP (write KIND@STEP, e.g. nan@10)")
    try:
        step = int(step_text)
    except ValueError:
        raise fail(f"STEP must be an integer, got {step_text!r}") from None
    if step < 0:
        raise fail(f"STEP must be 0 or more, got {step}")
    spec = CATALOG[kind]
    params = dict(spec.params)
    rank: int | None = world_size - 1 if spec.default_rank == "last" else None
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise fail(f"parameter {item!r} is not key=value")
        if key == "rank":
            try:
                rank = int(value)
            except ValueError:
                raise fail(f"rank must be an integer, got {value!r}") from None
            if not 0 <= rank < world_size:
                raise fail(f"rank={rank} but the run has {world_size} rank(s)")
            continue
        if key not in spec.params:
            known = ", ".join([*spec.params, "rank"])
            raise fail(f"unknown parameter {key!r} for {kind}, expected one of: {known}")
        try:
            params[key] = _parse_value(value, spec.params[key])
        except ValueError:
            raise fail(f"{key} must be a number, got {value!r}") from None
        if not params[key] > 0:
            raise fail(f"{key} must be positive, got {value!r}")
    return Fault(kind, step, params, text, rank)


def _first_drift(declared: Schedule, actual: Callable[[int], float], start: int, total: int) -> int:
    """First step >= start whose actual LR differs from the declared one by more than 1%."""
    for s in range(start, total):
        want = declared.lr(s)
        if abs(actual(s) - want) > 0.01 * want:
            return s
    return start


@dataclass
class FaultPlan:
    """The faults of one invocation, answering the training loop's questions step by step."""

    faults: list[Fault]
    rank: int
    world_size: int
    total_steps: int
    _leak: list[torch.Tensor] = field(default_factory=list)
    _gc_keep: list[Any] = field(default_factory=list)

    @classmethod
    def parse(cls, specs: list[str], *, rank: int, world_size: int, total_steps: int) -> FaultPlan:
        return cls([parse_fault(s, world_size) for s in specs], rank, world_size, total_steps)

    def get(self, kind: str, step: int | None = None) -> Fault | None:
        """The fault of this kind active on this rank at ``step`` (or scheduled at all)."""
        for f in self.faults:
            if f.kind != kind:
                continue
            if step is None or f.active(step, self.rank, self.total_steps):
                return f
        return None

    # -- checks made once, before training ---------------------------------------------------

    def check(self, *, accum: int, fp16: bool, resuming: bool, tp: int = 1) -> None:
        """Reject combinations that would inject nothing, with a clear message."""
        for f in self.faults:
            if f.kind == "lr_per_microbatch" and accum < 2:
                raise FaultError(f"--inject {f.spec!r}: needs --accum > 1 (one micro-batch per step changes nothing)")
            if f.kind == "resume_no_scaler" and not fp16:
                raise FaultError(f"--inject {f.spec!r}: needs --precision fp16 (there is no loss scaler otherwise)")
            if f.kind == "bad_init" and resuming:
                raise FaultError(f"--inject {f.spec!r}: bad_init only applies to a fresh run, not with --resume")
            if f.resume and not resuming:
                raise FaultError(f"--inject {f.spec!r}: a resume_* fault needs --resume")
            if f.kind == "replica_desync" and self.world_size // tp < 2:
                raise FaultError(f"--inject {f.spec!r}: needs data-parallel replicas (torchrun with 2+ ranks per tp)")
            if f.kind == "tp_same_seed" and tp < 2:
                raise FaultError(f"--inject {f.spec!r}: needs a tensor-parallel layout (--layout tp=2)")

    def resume_faults(self, start_step: int) -> dict[str, Fault]:
        """The resume faults that act when resuming at ``start_step`` (their guard STEP passed)."""
        return {f.kind: f for f in self.faults if f.resume and start_step >= f.step}

    def scheduler_schedule(self, declared: Schedule) -> Schedule:
        """The schedule the (possibly buggy) scheduler is built from; the declared one stays."""
        f = self.get("lr_wrong_total")
        if f is None:
            return declared
        total = max(1, declared.total_steps // int(f.params["factor"]))
        return Schedule(
            declared.name,
            declared.peak_lr,
            total,
            min(declared.warmup_steps, total),
            declared.min_ratio,
            declared.decay_fraction,
        )

    def init_seed(self, seed: int, tp_rank: int) -> int:
        """The model-init seed of a tensor-parallel rank: offset by its tp rank, unless ``tp_same_seed``."""
        return seed if self.get("tp_same_seed") else seed + tp_rank

    def configured_schedule(self, peak_lr: float, warmup_steps: int) -> tuple[float, int]:
        """The peak LR and warmup the run is configured with: ``lr_too_high`` raises the peak (declared: no drift)."""
        f = self.get("lr_too_high")
        if f is None:
            return peak_lr, warmup_steps
        return peak_lr * float(f.params["factor"]), int(f.params["warmup"])

    def init_head_scale(self) -> float:
        f = self.get("bad_init")
        return float(f.params["scale"]) if f else 1.0

    # -- per step ------------------------------------------------------------------------------

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """Faults that strike between steps: hang, weight scaling, NaN, GC pressure, leaks."""
        if f := self.get("hang", step):
            # The rank stops stepping but stays alive: TrainMonitor's heartbeat thread keeps
            # beating, no step arrives. Bounded so that tests (and DDP peers) carry on.
            time.sleep(float(f.params["seconds"]))
        if f := self.get("replica_desync", step):  # this rank only; a one-step window: strikes once
            g = torch.Generator().manual_seed(3_000_017 * step + self.rank)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
                        p.add_(noise * (float(f.params["scale"]) * p.std()))
        if f := self.get("weight_scale", step):  # a one-step window: strikes once
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.mul_(float(f.params["factor"]))
        if (f := self.get("nan", step)) and step == f.step:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("nan")
        if (f := self.get("gc_pause", step)) and (step - f.step) % int(f.params["every"]) == 0:
            # Reference cycles only the cyclic collector can free; keep 10% so the heap (and the
            # pause) grows, as with real long-lived garbage.
            junk = []
            for i in range(int(f.params["objects"])):
                node: list[Any] = [i]
                node.append(node)
                junk.append(node)
            self._gc_keep.extend(junk[::10])
            del junk
            gc.collect()
        if f := self.get("memory_leak", step):
            n = int(float(f.params["mb"]) * (1 << 20)) // 4
            self._leak.append(torch.ones(n))  # touched pages: resident memory really grows

    def data_delay(self, step: int) -> float:
        f = self.get("data_stall", step)
        return float(f.params["seconds"]) if f else 0.0

    def forward_delay(self, step: int) -> float:
        f = self.get("straggler", step)
        return float(f.params["ms"]) / 1000 if f else 0.0

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor, vocab_size: int, micro: int) -> tuple:
        """Apply batch faults; returns ``(x, y, loss_multiplier)``."""
        mult = 1.0
        if f := self.get("loss_spike", step):
            g = torch.Generator().manual_seed(1_000_003 * step + 1009 * self.rank + micro)
            seq = torch.randint(vocab_size, (x.shape[0], x.shape[1] + 1), generator=g)
            x, y = seq[:, :-1], seq[:, 1:]
            mult = float(f.params["scale"])
        if f := self.get("divergence", step):
            # A slow, unrecovering rise: the share of random targets grows every step.
            share = min(1.0, (step - f.step + 1) / int(f.params["ramp"]))
            g = torch.Generator().manual_seed(2_000_003 * step + 1009 * self.rank + micro)
            noise = torch.rand(y.shape, generator=g) < share
            y = torch.where(noise, torch.randint(vocab_size, y.shape, generator=g), y)
        if f := self.get("unshuffled", step):
            x, y = one_document_batches(x, y, int(f.params["docs"]))
        if self.get("labels_unshifted", step):
            y = x.clone()  # the bug: targets are the inputs themselves, not the next tokens
        return x, y, mult

    def lr_multiplier(self, step: int) -> float:
        mult = 1.0
        if f := self.get("lr_burst", step):
            mult *= float(f.params["factor"])
        return mult

    def no_clip(self, step: int) -> bool:
        return self.get("divergence", step) is not None

    def scheduler_frozen(self, step: int) -> bool:
        return any(f.kind == "lr_frozen" and step >= f.step for f in self.faults)

    def scheduler_per_microbatch(self, step: int) -> bool:
        return any(f.kind == "lr_per_microbatch" and step >= f.step for f in self.faults)

    def force_checkpoint(self, step: int) -> bool:
        return any(f.kind == "checkpoint_stall" and f.step == step for f in self.faults)

    def checkpoint_delay(self, step: int) -> float:
        f = self.get("checkpoint_stall", step)
        return float(f.params["seconds"]) if f and f.step == step and f.on_rank(self.rank) else 0.0

    # -- ground truth ---------------------------------------------------------------------------

    def label(self, f: Fault, first: int, last: int) -> dict[str, Any]:
        rank = f.rank if f.rank is not None else (0 if self.world_size == 1 else None)
        return {
            "kind": f.kind,
            "rank": rank,
            "first_step": first,
            "last_step": last,
            "expected_detection": f.detection,
            "spec": f.spec,
            "params": f.params,
        }

    def planned_labels(self, declared: Schedule, start_step: int, accum: int) -> list[dict[str, Any]]:
        """Labels of the non-resume faults that will strike in this invocation's steps."""
        out = []
        total = self.total_steps
        actual = self.scheduler_schedule(declared)
        for f in self.faults:
            if f.resume:
                continue
            first, last = f.step, f.last_step(total)
            if f.kind == "lr_wrong_total":
                first, last = _first_drift(declared, actual.lr, 0, total), total - 1
            elif f.kind == "lr_frozen":
                first = _first_drift(declared, lambda s, f=f: declared.lr(min(s, f.step)), f.step, total)
            elif f.kind == "lr_per_microbatch":
                first = _first_drift(
                    declared, lambda s, f=f: declared.lr(f.step + (s - f.step) * accum + accum - 1), f.step, total
                )
            elif f.kind in ("bad_init", "tp_same_seed"):
                first = last = 0
            elif f.kind == "lr_too_high":
                first = 0
            if first >= total or last < start_step:
                continue  # outside this invocation's steps (e.g. it struck before the resume)
            out.append(self.label(f, first, last))
        return out


def write_labels(path: str | os.PathLike, labels: list[dict[str, Any]]) -> None:
    """Merge ``labels`` into the JSON list at ``path`` (atomically); duplicates are kept once."""
    path = Path(path)
    existing: list[dict[str, Any]] = []
    if path.exists():
        existing = json.loads(path.read_text() or "[]")
    key = lambda lab: (lab["kind"], lab["rank"], lab["first_step"], lab.get("spec"))  # noqa: E731
    seen = {key(lab) for lab in existing}
    merged = existing + [lab for lab in labels if key(lab) not in seen]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")
