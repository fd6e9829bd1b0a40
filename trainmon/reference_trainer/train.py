"""The training loop: setup, resume, the step, evaluation, checkpoints, and the monitor calls.

One optimizer step (``step`` counts from 0 and uses the LR ``schedule.lr(step)``):

1. data: ``accum`` micro-batches, each fingerprinted on the CPU before it moves to the device;
2. forward/backward per micro-batch (DDP all-reduces only on the last one, ``no_sync``);
3. unscale (fp16), clip through ``TrainMonitor.clip_grad_norm_`` (records the norms), step;
4. ``scheduler.step()``, then ``mon.step_end`` with the LRs the step used;
5. evaluation and checkpoint when due.

``TrainMonitor.watch`` times forward, backward, optimizer and DDP communication through torch
hooks; the loop itself only marks ``data``, ``eval`` and ``checkpoint``.

Host-device sync points are marked ``# SYNC``; everything else stays asynchronous on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmon.flops import peak_flops_for, training_flops_per_token
from trainmon.hooks.fingerprint import batch_fingerprint, state_fingerprint
from trainmon.hooks.train_monitor import TrainMonitor
from trainmon.reference_trainer.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from trainmon.reference_trainer.config import ConfigError, TrainConfig, parse_layout
from trainmon.reference_trainer.data import Loader, MarkovSource, TokenFileSource
from trainmon.reference_trainer.faults import FaultPlan, write_labels
from trainmon.reference_trainer.model import GPT, GPTConfig
from trainmon.reference_trainer.precision import autocast_for, make_scaler, resolve_precision
from trainmon.schedules import Schedule

__all__ = ["train"]


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def ddp(self) -> bool:
        return self.world_size > 1


@dataclass
class Counters:
    """Where training is: the next step to run and what has been consumed (all ranks together)."""

    step: int = 0
    tokens: int = 0
    samples: int = 0


def setup_distributed(cfg: TrainConfig) -> DistInfo:
    """Join the process group when launched by torchrun (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    elif cfg.device == "cuda":
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    return DistInfo(rank, world, local_rank, device)


def data_parallel(model: torch.nn.Module, d: DistInfo, tp: int) -> torch.nn.Module:
    """DDP across the ranks that are replicas of one another: every rank, or under a simulated tensor-parallel
    layout those at the same tp rank (one process group per tp rank, created on every rank in the same order)."""
    if not d.ddp or d.world_size == tp:
        return model  # nothing to replicate across
    if tp == 1:
        return DDP(model)
    groups = [dist.new_group(list(range(t, d.world_size, tp))) for t in range(tp)]
    return DDP(model, process_group=groups[d.rank % tp])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def event_target(cfg: TrainConfig, rank: int, world_size: int) -> str:
    """Default ``file://OUT/events.jsonl``; ranks > 0 of a multi-rank run get ``events.rankN.jsonl``.

    One file per rank keeps each rank's stream whole (concurrent appends could interleave).
    """
    target = cfg.collector or f"file://{Path(cfg.out).resolve() / 'events.jsonl'}"
    if target.startswith("file://") and world_size > 1 and rank > 0:
        path = Path(target[len("file://") :])
        suffix = path.suffix or ".jsonl"
        target = f"file://{path.with_name(f'{path.stem}.rank{rank}{suffix}')}"
    return target


def memory_bytes(device: torch.device) -> int | None:
    """Memory in use: the CUDA caching allocator's count on GPU (a host counter, no sync), RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


@torch.no_grad()
def evaluate(model: GPT, loader: Loader, batches: int, d: DistInfo, autocast: Any) -> float:
    """Mean loss over the fixed held-out batches, averaged over ranks. Draws no random numbers."""
    model.eval()
    total = torch.zeros((), device=d.device)
    for i in range(batches):
        x, y = loader.val_batch(i)
        with autocast:
            _, loss = model(x.to(d.device), y.to(d.device))
        total += loss.float()
    mean = total / batches
    if d.ddp:
        dist.all_reduce(mean)
        mean /= d.world_size
    model.train()
    return float(mean)  # SYNC: one read-back per evaluation


def train(cfg: TrainConfig) -> str:
    """Run (or resume) training as configured; returns the run_end status."""
    d = setup_distributed(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resuming = cfg.resume is not None
    faults = FaultPlan.parse(cfg.inject, rank=d.rank, world_size=d.world_size, total_steps=cfg.steps)
    precision = resolve_precision(cfg.precision, d.device)
    tp = parse_layout(cfg.layout).get("tp", 1)
    if d.world_size % tp:
        raise ConfigError(f"layout: tp={tp} does not divide the {d.world_size} ranks")
    faults.check(accum=cfg.accum, fp16=precision == "fp16", resuming=resuming, tp=tp)

    # -- find the checkpoint first: a resume fault may change how the run is built -------------
    ckpt_dir = meta = shared = rank_state = None
    resume_faults: dict = {}
    if resuming:
        ckpt_dir = latest_checkpoint(cfg.resume)
        if ckpt_dir is None:
            raise FileNotFoundError(f"resume: no complete checkpoint under {Path(cfg.resume) / 'checkpoints'}")
        t_load = time.perf_counter()
        meta, shared, rank_state = load_checkpoint(ckpt_dir, d.rank)
        resume_faults = faults.resume_faults(meta["step"] + 1)
        if f := resume_faults.get("resume_batch_change"):
            cfg = dataclasses.replace(cfg, batch_size=int(f.params["batch_size"] or 2 * cfg.batch_size))

    # -- model, optimizer, schedule, data ------------------------------------------------------
    # The same init on every replica (DDP also broadcasts its group's first weights); shards of a
    # simulated tensor-parallel group each draw their own (seed + tp rank).
    torch.manual_seed(faults.init_seed(cfg.seed, d.rank % tp))
    gpt_cfg = GPTConfig(cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.init_std)
    model = GPT(gpt_cfg, head_scale=faults.init_head_scale()).to(d.device)
    seed_everything(cfg.seed + 1000 * (d.rank + 1))  # runtime RNG (dropout) differs per rank

    def make_optimizer() -> torch.optim.AdamW:
        return torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=peak_lr, betas=(cfg.beta1, cfg.beta2))

    peak_lr, warmup = faults.configured_schedule(cfg.lr, cfg.warmup_steps)  # lr_too_high: a peak too high
    warmup = min(warmup, cfg.steps)
    declared = Schedule(cfg.schedule, peak_lr, cfg.steps, warmup, cfg.min_lr_ratio, cfg.decay_fraction)
    built = faults.scheduler_schedule(declared)  # == declared unless lr_wrong_total is injected

    def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: built.factor(s))

    optimizer = make_optimizer()
    scheduler = make_scheduler(optimizer)
    scaler = make_scaler(precision, d.device, cfg.init_scale)
    # A loss-scale overflow skips optimizer.step() but the scheduler steps anyway (the usual
    # choice: the schedule follows steps taken, skipped or not); torch warns about exactly that.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
    autocast = autocast_for(precision, d.device)
    if cfg.data == "markov":
        source = MarkovSource(cfg.vocab_size, cfg.seed, cfg.markov_branching)
    else:
        source = TokenFileSource(cfg.data, cfg.vocab_size, cfg.seed, cfg.val_data)
    loader = Loader(source, cfg.batch_size, cfg.seq_len, d.rank, d.world_size)
    tokens_per_rank_step = cfg.batch_size * cfg.seq_len * cfg.accum
    global_batch_tokens = tokens_per_rank_step * d.world_size
    counters = Counters()

    # -- restore everything the checkpoint holds (minus what a resume_* fault "forgets") -------
    load_seconds = None
    if resuming:
        assert meta is not None and shared is not None and rank_state is not None
        model.load_state_dict(shared["model"])
        if "resume_no_optimizer" not in resume_faults:
            optimizer.load_state_dict(shared["optimizer"])
        if "resume_no_scheduler" not in resume_faults:
            scheduler.load_state_dict(shared["scheduler"])
        if "resume_no_optimizer" in resume_faults:  # the bug keeps the LR, loses the moments
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        if "resume_no_scaler" not in resume_faults:
            scaler.load_state_dict(shared["scaler"])
        if "resume_data_replay" not in resume_faults:
            loader.load_state_dict(rank_state["data"])
        if "resume_no_rng" not in resume_faults:
            restore_rng(rank_state["rng"])  # last: nothing above may draw random numbers after it
        counters = Counters(shared["step"] + 1, shared["tokens"], shared["samples"])
        if "resume_step_reset" in resume_faults:
            counters.step = 0
        load_seconds = time.perf_counter() - t_load

    def fingerprint(next_step: int) -> dict[str, Any]:
        return state_fingerprint(
            next_step=next_step,
            tokens=counters.tokens,
            samples=counters.samples,
            data_position=loader.position,
            world_size=d.world_size,
            global_batch_tokens=global_batch_tokens,
            accum_steps=cfg.accum,
            config_hash=cfg.config_hash(),
            optimizer=optimizer,
            scheduler=scheduler,
            loss_scale=scaler.get_scale() if precision == "fp16" else None,  # SYNC on CUDA fp16
            model=model,
        )

    resume_fp = fingerprint(counters.step) if resuming else None  # before anything consumes state

    # -- ground truth of the injected faults -----------------------------------------------------
    if d.rank == 0 and faults.faults:
        first_new = meta["step"] + 1 if meta else 0
        labels = faults.planned_labels(declared, first_new, cfg.accum)
        labels += [faults.label(f, first_new, first_new) for f in resume_faults.values()]
        write_labels(out / "labels.json", labels)

    # -- the monitor -------------------------------------------------------------------------------
    ddp_model = data_parallel(model, d, tp)

    def stop_checkpoint() -> str:
        return checkpoint(counters.step)  # called inside step_end, before counters.step moves on

    mon = TrainMonitor(
        cfg.run,
        collector=event_target(cfg, d.rank, d.world_size),
        spool_dir=out / "spool" / f"rank{d.rank}",
        heartbeat_interval=cfg.heartbeat_interval,
        health_interval=cfg.health_interval,
        checksum_every=cfg.checksum_every,
        detail_every=cfg.detail_every,
        layout={"tp": tp} if cfg.layout else None,
        # --stop-on: a verdict arrives with the acknowledgement of the batch that raised it, so the
        # sender's tick bounds how many steps run past the fault; this trainer's steps are short.
        flush_interval=0.1 if cfg.stop_on else 0.5,
        on_critical="stop" if cfg.stop_on else None,
        stop_on=cfg.stop_on or "critical",
        # Under DDP the ranks hear the verdict at different steps: a checkpoint's barrier would wait
        # for ranks that train on (until torchrun ends them, once the stopped rank has exited).
        checkpoint=stop_checkpoint if cfg.stop_on and not d.ddp else None,
    )
    # Hooks time forward/backward/optimizer (and DDP's exposed all-reduce as "comm"), count
    # micro-batches and scheduler steps, notice skipped optimizer steps and read the loss scale.
    mon.watch(ddp_model, optimizer, scheduler, scaler if scaler.is_enabled() else None)
    if faults.get("straggler") is not None:
        # Registered after watch(): the sleep runs inside the timed forward of this rank.
        def straggle(_module: torch.nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled() and (delay := faults.forward_delay(counters.step)):
                time.sleep(delay / cfg.accum)

        model.register_forward_pre_hook(straggle)
    mon.start(
        config=cfg.to_dict(),
        loss_floor=source.entropy_floor,  # synthetic data: the best reachable loss is known
        schedule=declared,
        planned_steps=cfg.steps,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        global_batch_tokens=global_batch_tokens,
        accum_steps=cfg.accum,
        world_size=d.world_size,
        device=str(d.device),
        framework="reference_trainer",
        resumed=resuming,
        resume_path=str(ckpt_dir) if ckpt_dir else None,
        config_hash=cfg.config_hash(),
        # MFU inputs (trainmon.flops, shared with the budget arithmetic): lookups (wte, wpe) cost no FLOPs,
        # the head does.
        flops_per_token=training_flops_per_token(
            sum(p.numel() for p in model.parameters()) - model.wte.weight.numel() - model.wpe.weight.numel(),
            cfg.n_layer,
            cfg.n_embd,
            cfg.seq_len,
        ),
        peak_flops=cfg.peak_flops
        or (peak_flops_for(torch.cuda.get_device_name(d.device), precision) if d.device.type == "cuda" else None),
    )
    if resuming:
        assert meta is not None
        mon.resume(meta["step"], path=str(ckpt_dir), duration=load_seconds, fingerprint=resume_fp)

    def checkpoint(step: int) -> str:
        with mon.phase("checkpoint"):
            t0 = time.perf_counter()
            shared_state = None
            if d.rank == 0:  # replicas are identical: one copy of the shared state
                shared_state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    "step": step,
                    "tokens": counters.tokens,
                    "samples": counters.samples,
                    "config": cfg.to_dict(),
                }
            rank_state = {"rng": capture_rng(), "data": loader.state_dict()}
            path, nbytes = save_checkpoint(  # SYNC: state_dict tensors are copied to the host by torch.save
                out,
                step,
                shared=shared_state,
                rank_state=rank_state,
                rank=d.rank,
                world_size=d.world_size,
                barrier=dist.barrier if d.ddp else (lambda: None),
                keep=cfg.keep_checkpoints,
                slow_seconds=faults.checkpoint_delay(step),
            )
            duration = time.perf_counter() - t0
            fp = fingerprint(step + 1)
        mon.checkpoint(step, path=str(path), duration=duration, bytes=nbytes, fingerprint=fp)
        return str(path)

    # -- the loop ----------------------------------------------------------------------------------
    status = "finished"
    try:
        model.train()
        while counters.step < cfg.steps:
            step = counters.step
            faults.before_step(step, model)
            loss_sum = torch.zeros((), device=d.device)
            batches = []
            for micro in range(cfg.accum):
                last_micro = micro == cfg.accum - 1
                with mon.phase("data"):
                    if delay := faults.data_delay(step):
                        time.sleep(delay / cfg.accum)
                    x, y = loader.next()
                    x, y, loss_mult = faults.corrupt_batch(step, x, y, cfg.vocab_size, micro)
                    batches.append(x)
                    x = x.to(d.device, non_blocking=True)
                    y = y.to(d.device, non_blocking=True)
                # DDP all-reduces gradients only on the last micro-batch of the step.
                sync = contextlib.nullcontext() if (last_micro or ddp_model is model) else ddp_model.no_sync()
                with sync:
                    with autocast:
                        _, loss = ddp_model(x, y)
                    loss = loss * loss_mult
                    scaler.scale(loss / cfg.accum).backward()
                loss_sum += loss.detach()
                if not last_micro and faults.scheduler_per_microbatch(step):
                    scheduler.step()  # the lr_per_microbatch bug
            scaler.unscale_(optimizer)  # fp16: true gradients before clipping
            max_norm = float("inf") if (cfg.grad_clip == 0 or faults.no_clip(step)) else cfg.grad_clip
            mon.clip_grad_norm_(model.parameters(), max_norm)  # norms stay tensors: no sync
            scheduled_lrs = [g["lr"] for g in optimizer.param_groups]
            if (mult := faults.lr_multiplier(step)) != 1.0:
                for g in optimizer.param_groups:
                    g["lr"] *= mult
            scaler.step(optimizer)  # SYNC on CUDA fp16: GradScaler reads its found-inf flag
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            for g, lr in zip(optimizer.param_groups, scheduled_lrs, strict=True):
                g["lr"] = lr
            if not faults.scheduler_frozen(step):  # the lr_frozen bug skips this
                scheduler.step()
            counters.tokens += global_batch_tokens
            counters.samples += cfg.batch_size * cfg.accum * d.world_size
            extra = {"mem_allocated_bytes": memory_bytes(d.device)} if d.device.type != "cuda" else {}
            mon.step_end(
                step,
                loss=loss_sum / cfg.accum,  # mean over micro-batches; read back without a sync
                tokens=tokens_per_rank_step,
                samples=cfg.batch_size * cfg.accum,
                micro_batches=cfg.accum,
                batch_fingerprint=batch_fingerprint(*batches),
                **extra,
            )
            counters.step = step + 1

            last = step == cfg.steps - 1
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
                with mon.phase("eval"):
                    val_loss = evaluate(model, loader, cfg.eval_batches, d, autocast)
                mon.eval(step, val_loss)
            periodic = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
            if periodic or last or faults.force_checkpoint(step):
                checkpoint(step)
            if cfg.stop_at is not None and step >= cfg.stop_at:
                status = "interrupted"  # a simulated crash: no final checkpoint
                break
    except KeyboardInterrupt:
        mon.close(status="interrupted", error="KeyboardInterrupt")
        raise
    except BaseException as exc:
        mon.close(status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    mon.close(status=status)
    if d.ddp:
        dist.barrier()
        dist.destroy_process_group()
    return status
