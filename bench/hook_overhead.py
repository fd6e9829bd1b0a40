"""What trainmon's instrumentation costs a training step, next to no monitoring and to wandb/TensorBoard/MLflow.

Why: issue 4 promises hooks that users add and forget. Targets: the training thread spends at most 0.5 % of a
step inside trainmon, at least 10x less than ``wandb.log`` offline for the same metrics, and with the collector
down the step never waits (at most 1 ms added) and no event is lost. Step times on this 2-core machine drift
by tens of percent, so, as in ``shared/research/logging-overhead.md``, two figures are reported:

- in-step accounting: time the training thread spends inside the monitor's code, measured inside every step.
  For trainmon that is ``TrainMonitor.overhead_s`` plus what it does not count (the backward hooks, the clip
  wrapper's extra work vs plain ``clip_grad_norm_``, the scheduler wrapper, torch's hook dispatch). For the
  peers it is the logging call, and separately the collection of the metrics (two ``.item()`` reads, a dict,
  a /proc read) that their users must write and that trainmon does inside ``step_end``;
- A/B: all variants run in the same process, alternated in rounds in a shuffled order, each block between
  two baseline blocks; overhead = block median / mean of the adjacent baseline block medians - 1, median over
  rounds. It includes indirect costs (GIL contention from background threads, the collector process) and is
  limited by machine noise, which the A/A row (baseline vs baseline) shows.

Each variant trains its own copy of the same model (same seed, same batches), so hooks installed by one
variant never touch another. Background work a block leaves behind (trainmon's sender, TensorBoard's writer)
is finished, untimed, before the next block starts, so it is not charged to a neighbour.

Run ``python bench/hook_overhead.py [--quick]``; the last line holds the headline figures as key=value pairs.

On a GPU (``--device cuda``, with ``--layers``/``--d-model``/``--batch``... for a step of tens of ms) every step
ends with ``torch.cuda.synchronize()``, so a step's time is the device's work, not only the launches; a host sync
inside trainmon would hide in that wait, which is why ``--sync-debug`` runs each step (not that final wait) under
torch's sync-debug mode ("warn") and counts the synchronizing calls it reports, per variant and call site.
``--no-serve`` (a machine without the daemon's dependencies) sends the collector-up variant's events to a
``file://`` JSONL collector instead of a ``trainmon serve`` subprocess.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import datetime
import functools
import importlib.util
import json
import logging
import math
import os
import platform
import pstats
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainmon.hooks.train_monitor import TrainMonitor, _timestamper, _update_recorder
from trainmon.reference_trainer.model import GPT, GPTConfig

VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS = 256, 64, 8, 128, 4, 2
CLIP = 1.0
N_BATCHES = 32  # pre-generated batches, cycled: data loading is not what is measured
PAGE = os.sysconf("SC_PAGE_SIZE")
DEVICE = torch.device("cpu")  # --device
SYNC_DEBUG = False  # --sync-debug

perf = time.perf_counter
_SCHEDSTAT = (
    os.open("/proc/thread-self/schedstat", os.O_RDONLY) if os.path.exists("/proc/thread-self/schedstat") else None
)


def sched_ns() -> tuple[int, int]:
    """(ns on CPU, ns runnable but waiting for a CPU) of the calling thread; (0, 0) without schedstat.

    The fd is bound to the thread that opened it, the main thread, which runs the training loop.
    """
    if _SCHEDSTAT is None:
        return 0, 0
    cpu, wait, _ = os.pread(_SCHEDSTAT, 128, 0).split()
    return int(cpu), int(wait)


# -- the loop ---------------------------------------------------------------------------------


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N_BATCHES):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous().to(DEVICE), t[:, 1:].contiguous().to(DEVICE)))
    return out


@dataclass
class StepTimes:
    """What one measured step cost; every field in seconds."""

    step: float  # the whole step: forward, backward, clip, optimizer, monitor, scheduler
    clip: float  # the clip call (plain clip_grad_norm_, or TrainMonitor.clip_grad_norm_)
    sched: float  # scheduler.step() (trainmon wraps it to count calls)
    counted: float = 0.0  # trainmon: overhead_s delta over the step
    clip_counted: float = 0.0  # trainmon: the part of counted spent in the clip wrapper
    uncounted_hooks: float = 0.0  # trainmon: backward hooks, which overhead_s does not count
    collect: float = 0.0  # peers: reading and assembling the 12 metrics
    call: float = 0.0  # peers: the logging call
    runq: float = 0.0  # the step's time runnable but not running (the OS gave the core to another process)
    cpu: float = 0.0  # the step's time on a CPU

    @property
    def blocked(self) -> float:
        """Time the training thread slept in this step: waiting for the GIL, a lock or I/O (not preemption)."""
        return max(0.0, self.step - self.cpu - self.runq) if self.cpu else math.nan


class Loop:
    """The anchors' loop: 2-layer GPT, d_model 128, 4 heads, vocab 256, seq 64, batch 8, AdamW, clip 1.0."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=D_MODEL, dropout=0.0)
        self.model = GPT(cfg).to(DEVICE)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.param_groups(0.1), lr=3e-4, betas=(0.9, 0.95))
        warmup, total = 100, 100_000
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, total) / total))),
        )
        self.batches = batches
        self.i = 0


class SyncWatch:
    """torch's sync-debug mode ("warn") around a step: counts the host syncs it reports, by call site.

    The mode is process-wide, so a sync on a background thread (trainmon's sender) during the step counts too."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._caught: Any = None

    def start(self) -> None:
        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter("always")
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        self._cm.__exit__(None, None, None)
        for w in self._caught:
            if "synchronizing CUDA operation" in str(w.message):
                self.sites[f"{Path(w.filename).name}:{w.lineno}"] += 1


def trainmon_syncs(v: Variant, base: Variant) -> int:
    """Host syncs in ``v``'s steps beyond the baseline's: torch's own (an op that syncs in every variant's step, at
    the same call site) are not trainmon's, so each site counts only what exceeds the baseline's rate per step."""
    assert v.syncs is not None and base.syncs is not None
    rate = {site: n / max(1, base.steps_run) for site, n in base.syncs.sites.items()}
    return sum(max(0, n - round(rate.get(site, 0.0) * v.steps_run)) for site, n in v.syncs.sites.items())


class Variant:
    """No monitoring: the baseline (and, under a second name, the A/A noise-floor row)."""

    kind = "baseline"

    def __init__(self, name: str, label: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.name, self.label = name, label
        self.loop = Loop(batches)
        self.syncs = SyncWatch() if SYNC_DEBUG else None
        self.steps_run = 0
        self.setup_s = 0.0
        self.close_s = 0.0

    def clip(self, params: Any) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, CLIP)

    def end(self, step: int, loss: torch.Tensor, norm: torch.Tensor, step_t0: float, st: StepTimes) -> None:
        """Called after optimizer.step(), before scheduler.step() (the reference trainer's order)."""

    def settle(self) -> None:
        """Finish background work left by a block (untimed)."""

    def close(self) -> None:
        pass

    def run_step(self) -> StepTimes:
        lp = self.loop
        x, y = lp.batches[lp.i % len(lp.batches)]
        lp.i += 1
        step = self.steps_run
        cpu0, wait0 = sched_ns()
        t0 = perf()
        st = StepTimes(0.0, 0.0, 0.0)
        if self.syncs is not None:
            self.syncs.start()
        self.before(st)
        _, loss = lp.model(x, y)
        loss.backward()
        c0 = perf()
        norm = self.clip(lp.model.parameters())
        st.clip = perf() - c0
        lp.opt.step()
        self.end(step, loss, norm, t0, st)
        s0 = perf()
        lp.sched.step()
        st.sched = perf() - s0
        lp.opt.zero_grad(set_to_none=True)
        self.after(st)
        if self.syncs is not None:
            self.syncs.stop()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()  # the step's time includes the device's work
        st.step = perf() - t0
        cpu1, wait1 = sched_ns()
        st.cpu, st.runq = (cpu1 - cpu0) / 1e9, (wait1 - wait0) / 1e9
        self.steps_run += 1
        return st

    def before(self, st: StepTimes) -> None:
        pass

    def after(self, st: StepTimes) -> None:
        pass


class Trainmon(Variant):
    """Full instrumentation: watch(model, opt, sched), the clip wrapper, step_end, health thread on."""

    kind = "trainmon"

    def __init__(
        self, name: str, label: str, batches: Any, collector: str, spool: Path, run: str, per_hook: bool = False
    ) -> None:
        super().__init__(name, label, batches)
        t0 = perf()
        self.mon = TrainMonitor(run, collector, spool_dir=spool)
        self.spool = spool
        # overhead_s does not count the gradient hook that marks the end of backward; time it
        # from outside (watch() registers the instance attribute, so wrapping here catches every call).
        # On CPU only the first backward runs it: the hook kept after that is C functions (in hook_dispatch_s).
        self.hook_s = 0.0
        for attr in ("_on_grad",):
            setattr(self.mon, attr, self._timed(getattr(self.mon, attr)))
        # --profile: the overhead_s each counted entry adds, call by call (hook_costs_in_loop).
        self.per_hook: dict[str, list[float]] = collections.defaultdict(list)
        if per_hook:
            for attr in IN_LOOP_HOOKS:
                setattr(self.mon, attr, self._counted(attr, getattr(self.mon, attr)))
        lp = self.loop
        self.mon.watch(lp.model, lp.opt, lp.sched)
        self.mon.start(config={"bench": "hook_overhead"}, planned_steps=None, vocab_size=VOCAB, seq_len=SEQ)
        self.setup_s = perf() - t0

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            before = self.mon.overhead_s
            try:
                return fn(*args, **kwargs)
            finally:
                self.per_hook[name].append(self.mon.overhead_s - before)

        return counted

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = perf()
            try:
                return fn(*args)
            finally:
                self.hook_s += perf() - t

        return timed

    def before(self, st: StepTimes) -> None:
        self._ov0, self._hook0 = self.mon.overhead_s, self.hook_s

    def clip(self, params: Any) -> torch.Tensor:
        ov = self.mon.overhead_s
        norm = self.mon.clip_grad_norm_(params, CLIP)
        self._clip_counted = self.mon.overhead_s - ov
        return norm

    def end(self, step: int, loss: torch.Tensor, norm: torch.Tensor, step_t0: float, st: StepTimes) -> None:
        self.mon.step_end(step, loss=loss, tokens=BATCH * SEQ, samples=BATCH)

    def after(self, st: StepTimes) -> None:
        st.counted = self.mon.overhead_s - self._ov0
        st.clip_counted = self._clip_counted
        st.uncounted_hooks = self.hook_s - self._hook0

    def settle(self) -> None:
        self.mon.transport.flush(5.0)

    def close(self) -> None:
        t0 = perf()
        self.mon.close(timeout=10.0)
        self.close_s = perf() - t0


class Peer(Variant):
    """A peer logger: the 12 metrics are collected every step, then handed to ``log``."""

    kind = "peer"

    def __init__(self, name: str, label: str, batches: Any, make: Callable[[], tuple[Callable, Callable, Callable]]):
        super().__init__(name, label, batches)
        t0 = perf()
        self.log, self._settle, self._close = make()
        self.setup_s = perf() - t0
        self.ema = None
        self.last_end: float | None = None

    def end(self, step: int, loss: torch.Tensor, norm: torch.Tensor, step_t0: float, st: StepTimes) -> None:
        t0 = perf()
        loss_v = loss.item()
        pre = norm.item()
        coef = min(1.0, CLIP / (pre + 1e-6))  # as clip_grad_norm_ computes it: no second norm pass
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * PAGE
        self.ema = loss_v if self.ema is None else 0.98 * self.ema + 0.02 * loss_v
        step_time = t0 - step_t0
        metrics = {
            "loss": loss_v,
            "loss_ema": self.ema,
            "grad_norm": pre,
            "grad_norm_clipped": pre * coef,
            "clip_coef": coef,
            "lr": self.loop.opt.param_groups[0]["lr"],
            "step_time": step_time,
            "tokens": BATCH * SEQ * (step + 1),
            "samples": BATCH * (step + 1),
            "tokens_per_s": BATCH * SEQ / step_time,
            "samples_per_s": BATCH / step_time,
            "rss_bytes": rss,
        }
        t1 = perf()
        self.log(step, metrics)
        st.collect, st.call = t1 - t0, perf() - t1

    def settle(self) -> None:
        self._settle()

    def close(self) -> None:
        t0 = perf()
        self._close()
        self.close_s = perf() - t0


# -- the peers --------------------------------------------------------------------------------


def available(module: str) -> str | None:
    """None if ``module`` can be imported, else why not."""
    try:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    except (ImportError, ValueError) as exc:
        return f"{module}: {exc}"
    return None


def make_wandb(tmp: Path) -> tuple[Callable, Callable, Callable]:
    import wandb

    run = wandb.init(
        mode="offline",
        dir=str(tmp),
        project="trainmon-bench",
        config={"bench": "hook_overhead"},
        settings=wandb.Settings(silent=True, console="off"),
    )
    return (lambda step, m: run.log(m, step=step)), (lambda: None), run.finish


def make_tensorboard(tmp: Path) -> tuple[Callable, Callable, Callable]:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp / "tb"))  # defaults: max_queue=10, flush_secs=120

    def log(step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            writer.add_scalar(k, v, step)

    return log, writer.flush, writer.close


def make_mlflow(tmp: Path) -> tuple[Callable, Callable, Callable]:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3.x refuses the file store without it
    import mlflow

    mlflow.set_tracking_uri((tmp / "mlruns").as_uri())
    mlflow.set_experiment("trainmon-bench")
    mlflow.start_run()
    return (lambda step, m: mlflow.log_metrics(m, step=step)), (lambda: None), mlflow.end_run


PEERS: dict[str, tuple[str, str, Callable[[Path], tuple[Callable, Callable, Callable]]]] = {
    "wandb": ("wandb", "wandb offline, run.log", make_wandb),
    "tensorboard": ("tensorboard", "TensorBoard SummaryWriter, 12x add_scalar", make_tensorboard),
    "mlflow": ("mlflow", "MLflow file store, log_metrics", make_mlflow),
}


# -- the collector ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(tmp: Path) -> tuple[subprocess.Popen, str, Path]:
    """``trainmon serve`` in a subprocess, on a free port, once ``/healthz`` answers."""
    exe = shutil.which("trainmon", path=str(Path(sys.executable).parent)) or shutil.which("trainmon")
    if exe is None:
        raise RuntimeError("trainmon executable not found (pip install -e .)")
    db = tmp / "collector.sqlite"
    port = free_port()
    log = open(tmp / "collector.log", "wb")  # noqa: SIM115 - kept open for the subprocess
    proc = subprocess.Popen([exe, "serve", "--db", str(db), "--port", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url, db
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"collector did not start, see {tmp / 'collector.log'}")
        time.sleep(0.1)


def stop_collector(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def delivered_steps(db: Path, run: str) -> tuple[int, int | None]:
    """(step rows stored for ``run``, seq gaps the collector saw), read from its SQLite file."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        n = conn.execute("SELECT COUNT(*) FROM steps WHERE run = ?", (run,)).fetchone()[0]
        try:
            missing = conn.execute("SELECT SUM(missing) FROM streams WHERE run = ?", (run,)).fetchone()[0]
        except sqlite3.Error:
            missing = None
    return n, missing


def spooled_events(spool: Path, pattern: str = "*.jsonl") -> list[dict]:
    events = []
    for seg in sorted(spool.glob(pattern)):
        for line in seg.read_text(encoding="utf-8").splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


# -- torch's hook dispatch (not visible from inside the hooks) ---------------------------------


def hook_dispatch_s(n: int = 20000) -> float:
    """Extra cost per step of having hooks at all: the module pre/post hooks ``watch`` installs, the update
    recorder it gives the optimizer (C iterators that ``optimizer.step`` calls) and, on CPU, the gradient hook that
    marks the end of backward (C functions too after the first backward; on GPU it is Python, timed around it).

    Measured in isolation, the module hooks as no-ops (their bodies are counted by overhead_s), the recorder as it is
    (nothing counts it), and the C gradient hook called from a Python loop (the autograd engine's own dispatch of a
    hook is ~0.1 us). Iso timings are lower than in-step ones (warm caches), so this is a floor, and small.
    """
    m = torch.nn.Identity()
    x = torch.zeros(1)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    opt = torch.optim.SGD([p], lr=0.0)
    grad_hook = functools.partial(_timestamper(collections.deque(maxlen=1)), torch.zeros(1))  # as autograd calls it

    def timed(fn: Callable[[], Any]) -> float:
        best = math.inf
        for _ in range(5):
            t0 = perf()
            for _ in range(n // 5):
                fn()
            best = min(best, (perf() - t0) / (n // 5))
        return best

    bare = timed(lambda: m(x)) + timed(opt.step)
    handles = [m.register_forward_pre_hook(lambda *a: None), m.register_forward_hook(lambda *a: None)]
    record = _update_recorder(opt.param_groups, collections.deque(maxlen=1))
    setattr(opt, "_optimizer_step_code", record)  # noqa: B010 (as watch does; mypy: a method is not assignable)
    hooked = timed(lambda: m(x)) + timed(opt.step) + (timed(grad_hook) if DEVICE.type == "cpu" else 0.0)
    for h in handles:
        h.remove()
    delattr(opt, "_optimizer_step_code")
    return max(0.0, hooked - bare)


# -- statistics -------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass
class Results:
    steps: dict[str, list[StepTimes]] = field(default_factory=dict)  # measured steps per variant
    blocks: dict[str, list[float]] = field(default_factory=dict)  # block medians of step time, per variant
    ab: dict[str, list[float]] = field(default_factory=dict)  # per-round A/B ratios


def run_rounds(variants: list[Variant], rounds: int, block: int, seed: int, progress: bool) -> Results:
    res = Results()
    base, others = variants[0], variants[1:]
    for v in variants:
        res.steps[v.name], res.blocks[v.name], res.ab[v.name] = [], [], []
    rng = random.Random(seed)

    def run_block(v: Variant) -> float:
        v.run_step()  # dropped: the caches belong to the previous variant's model
        times = [v.run_step() for _ in range(block)]
        v.settle()
        res.steps[v.name].extend(times)
        m = med([t.step for t in times])
        res.blocks[v.name].append(m)
        return m

    t_start = perf()
    for r in range(rounds):
        order = others[:]
        rng.shuffle(order)
        before = run_block(base)
        for v in order:
            m = run_block(v)
            after = run_block(base)
            res.ab[v.name].append(m / ((before + after) / 2) - 1)
            before = after
        if progress and (r + 1) % max(1, rounds // 10) == 0:
            print(f"  round {r + 1}/{rounds}  {perf() - t_start:.0f}s", file=sys.stderr, flush=True)
    return res


# -- profile ----------------------------------------------------------------------------------


def profile_trainmon(batches: Any, tmp: Path, collector: str, steps: int) -> str:
    """cProfile of full instrumentation; the functions of hooks/ by own time per step."""
    v = Trainmon("profile", "profile", batches, collector, tmp / "spool-profile", "bench-profile")
    for _ in range(5):
        v.run_step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        v.run_step()
    prof.disable()
    v.close()
    stats = pstats.Stats(prof)
    rows = []
    for (filename, line, func), (_cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "/hooks/" in filename or "torch/cuda/" in filename:  # trainmon's own, and torch's CUDA calls it makes
            rows.append((tt, ct, nc, f"{Path(filename).name}:{line} {func}"))
        elif filename == "~":  # a torch op or builtin: the part of its time spent in calls from hooks/
            mine = [c for caller, c in callers.items() if "/hooks/" in caller[0]]
            if mine:
                rows.append((sum(c[2] for c in mine), sum(c[3] for c in mine), sum(c[1] for c in mine), func))
    rows.sort(reverse=True)
    out = [f"cProfile, {steps} steps of full instrumentation (profiler overhead inflates small functions):"]
    out.append(f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function")
    for tt, ct, nc, name in rows[:25]:
        out.append(f"{tt / steps * 1e6:12.1f} {ct / steps * 1e6:12.1f} {nc / steps:10.2f}  {name}")
    return "\n".join([*out, "", hook_costs_in_loop(batches, tmp, collector), "", hook_costs(batches, tmp)])


# The entries overhead_s counts, by the TrainMonitor attribute the loop or torch calls.
IN_LOOP_HOOKS = {
    "_on_forward_start": "forward pre-hook",
    "_on_forward_end": "forward hook",
    "clip_grad_norm_": "clip wrapper (after the clip)",
    "step_end": "step_end",
}


def hook_costs_in_loop(batches: Any, tmp: Path, collector: str, steps: int = 300) -> str:
    """Each entry's cost inside real training steps, where the model's work leaves the caches cold: the median
    over ``steps`` steps of the overhead_s each counted entry adds (its own timing, so the wrapper that reads it
    costs nothing here), the Python gradient hook timed around it, and what no timer inside the loop sees: torch's
    hook dispatch and the C-only hooks, measured in isolation (hook_dispatch_s); all threads on, sampled work
    included."""
    v = Trainmon("in-loop", "in-loop", batches, collector, tmp / "spool-in-loop", "bench-in-loop", per_hook=True)
    for _ in range(20):
        v.run_step()
    v.per_hook.clear()
    grad = []
    for i in range(steps):
        grad.append(v.run_step().uncounted_hooks)
        if i % 20 == 19:
            v.settle()  # as between the bench's blocks: the sender's backlog is not charged to the next steps
    v.close()
    out = [f"each entry's cost inside the loop, median us over {steps} steps (all threads on):"]
    dispatch = hook_dispatch_s()
    total = med(grad) + dispatch
    for attr, label in IN_LOOP_HOOKS.items():
        calls = v.per_hook[attr]
        out.append(f"{label:30s} {med(calls) * 1e6:8.2f}")
        total += med(calls)
    out.append(f"{'gradient hook, Python (timed)':30s} {med(grad) * 1e6:8.2f}")
    out.append(f"{'dispatch, C hooks (isolated)':30s} {dispatch * 1e6:8.2f}")
    out.append(f"{'a step (sum of medians)':30s} {total * 1e6:8.2f}")
    return "\n".join(out)


def hook_costs(batches: Any, tmp: Path, steps: int = 1000) -> str:
    """Each hook's own cost, its median over ``steps`` calls of the sequence a step makes, with the caches warm
    and with them cold (a pass over 8 MB before each call, as the model's own work leaves them), without the
    sampled work (checksum, update ratio: off here) and without the other threads (no collector, no health)."""
    lp = Loop(batches)
    mon = TrainMonitor(
        "bench-hooks",
        f"file://{tmp / 'hooks.jsonl'}",
        spool_dir=tmp / "spool-hooks",
        checksum_every=0,
        detail_every=0,
        health_interval=0,
    )
    mon.watch(lp.model, lp.opt, lp.sched)
    x, y = lp.batches[0]  # one real step: the hooks' state as in a run (the gradient hook kept on one parameter)
    _, loss = lp.model(x, y)
    loss.backward()
    mon.clip_grad_norm_(lp.model.parameters(), CLIP)
    lp.opt.step()
    mon.step_end(0, loss=loss, tokens=BATCH * SEQ)
    params = [p for p in lp.model.parameters() if p.grad is not None]
    grad_hook = mon._on_grad if DEVICE.type == "cuda" else _timestamper(mon._grad_ends)  # what watch keeps
    clip = (torch.ones((), device=DEVICE), CLIP, torch.ones(len(params), device=DEVICE), params)
    calls: dict[str, Callable[[int], Any]] = {
        "forward pre-hook": lambda i: mon._on_forward_start(lp.model, ()),
        "forward hook": lambda i: mon._on_forward_end(lp.model, (), None),
        "gradient hook": lambda i: grad_hook(params[0]),
        "update recorder": lambda i: lp.opt._optimizer_step_code(),  # what optimizer.step calls after the update
        "step_end": lambda i: (setattr(mon._s, "clip", clip), mon.step_end(i, loss=loss, tokens=BATCH * SEQ)),
    }
    flush = torch.zeros(2 << 20)  # 8 MB, past this machine's L2
    times: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
    for i in range(1, 2 * steps + 1):
        cold = i % 2 == 0
        for name, call in calls.items():
            if cold:
                flush.add_(1.0)
            t = perf()
            call(i)
            times[name, cold].append(perf() - t)
    mon.close(timeout=5.0)
    out = [
        f"each hook's own cost, median us over {steps} steps (no sampled work, no other thread):",
        f"{'hook':20s} {'caches warm':>12} {'caches cold':>12}",
    ]
    for name in calls:
        out.append(f"{name:20s} {med(times[name, False]) * 1e6:12.2f} {med(times[name, True]) * 1e6:12.2f}")
    warm = sum(med(times[n, False]) for n in calls) * 1e6
    cold = sum(med(times[n, True]) for n in calls) * 1e6
    out.append(f"{'a step (sum)':20s} {warm:12.2f} {cold:12.2f}")
    return "\n".join(out)


# -- main -------------------------------------------------------------------------------------


def fmt(x: float, nd: int = 1) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    global VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS, DEVICE, SYNC_DEBUG  # the model-size and device flags
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    ap.add_argument("--rounds", type=int, help="alternation rounds (default 40, --quick 4)")
    ap.add_argument("--block", type=int, help="measured steps per block, after 1 dropped (default 10, --quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 20/5)")
    ap.add_argument("--skip", action="append", default=[], help="leave out a peer (wandb, tensorboard, mlflow)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help="also cProfile trainmon for STEPS steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model trains")
    ap.add_argument("--layers", type=int, default=LAYERS, help="model size: blocks")
    ap.add_argument("--d-model", type=int, default=D_MODEL, help="model size: width")
    ap.add_argument("--heads", type=int, default=HEADS, help="model size: attention heads")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    ap.add_argument("--sync-debug", action="store_true", help="count the host syncs torch's sync-debug mode reports")
    ap.add_argument("--no-serve", action="store_true", help="collector up = a file:// JSONL, not trainmon serve")
    args = ap.parse_args(argv)
    VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS = args.vocab, args.seq, args.batch, args.d_model, args.heads, args.layers
    DEVICE, SYNC_DEBUG = torch.device(args.device), args.sync_debug
    rounds = args.rounds or (4 if args.quick else 40)
    block = args.block or (5 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    logging.getLogger("trainmon").setLevel(logging.ERROR)  # the collector-down variant warns on every retry
    wall0 = perf()
    tmp = Path(tempfile.mkdtemp(prefix="trainmon-bench-"))
    batches = make_batches(0)
    print(f"trainmon hook overhead bench  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(
        f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.platform()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(DEVICE)}" if DEVICE.type == "cuda" else "")
    )
    print(f"loop: GPT {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}, batch {BATCH},")
    print(
        f"      AdamW, clip {CLIP}, torch.set_num_threads(1), seed 0; {rounds} rounds x blocks of {block} (+1 dropped)"
    )

    if args.no_serve:
        proc, url, db = None, f"file://{tmp / 'up.jsonl'}", None
    else:
        proc, url, db = start_collector(tmp)
    variants: list[Variant] = []
    versions = []
    try:
        variants.append(Variant("baseline", "none (baseline)", batches))
        variants.append(Variant("aa", "none again (A/A noise floor)", batches))
        tm_up = Trainmon("trainmon", "trainmon, collector up", batches, url, tmp / "spool-up", "bench-up")
        tm_down = Trainmon(
            "down", "trainmon, collector down", batches, f"http://127.0.0.1:{free_port()}", tmp / "spool-down", "bd"
        )
        variants += [tm_up, tm_down]
        for key, (module, label, make) in PEERS.items():
            if key in args.skip:
                print(f"skip {key}: --skip")
                continue
            why = available(module)
            if why is None:
                try:
                    variants.append(Peer(key, label, batches, lambda make=make, key=key: make(tmp / key)))
                    mod = sys.modules.get(module)
                    versions.append(f"{key} {getattr(mod, '__version__', '?')}")
                    continue
                except Exception as exc:  # a peer that cannot start is skipped, not fatal
                    why = f"{type(exc).__name__}: {exc}"
            print(f"skip {key}: {why}")
        print("peers: " + (", ".join(versions) or "none"))
        for v in variants:
            for _ in range(warmup):
                v.run_step()
            v.settle()
        dispatch = hook_dispatch_s()
        res = run_rounds(variants, rounds, block, args.seed, progress=True)
        for v in variants:
            v.close()
        # What reached the collector (collector up) and what waits in the spool (collector down).
        up_stored, up_missing = math.nan, None
        deadline = time.monotonic() + (0 if db is None else 10)
        if db is None:  # the file collector: closed above, so every event is in the file
            up_stored = len({e["fields"]["step"] for e in spooled_events(tmp, "up.jsonl") if e["kind"] == "step"})
        while time.monotonic() < deadline:
            with contextlib.suppress(sqlite3.Error):
                up_stored, up_missing = delivered_steps(db, "bench-up")
                if up_stored >= tm_up.steps_run:
                    break
            time.sleep(0.2)
        spooled = spooled_events(tmp / "spool-down")
        profile = profile_trainmon(batches, tmp, url, args.profile) if args.profile else ""
    finally:
        if proc is not None:
            stop_collector(proc)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- figures --
    base_steps = [t.step for t in res.steps["baseline"]]
    base_ms = med(base_steps) * 1e3
    base_clip = med([t.clip for t in res.steps["baseline"]])
    base_sched = med([t.sched for t in res.steps["baseline"]])

    def trainmon_costs(name: str) -> tuple[list[float], dict[str, float]]:
        ts = res.steps[name]
        clip_extra = max(0.0, med([t.clip - t.clip_counted for t in ts]) - base_clip)
        sched_extra = max(0.0, med([t.sched for t in ts]) - base_sched)
        fixed = clip_extra + sched_extra + dispatch
        per_step = [t.counted + t.uncounted_hooks + fixed for t in ts]
        parts = {
            "counted": mean([t.counted for t in ts]),
            "backward hooks": mean([t.uncounted_hooks for t in ts]),
            "clip wrapper extra": clip_extra,
            "scheduler.step extra": sched_extra,
            "hook dispatch (iso)": dispatch,
        }
        return per_step, parts

    rows = []
    instep: dict[str, list[float]] = {}
    for v in variants:
        ts = res.steps[v.name]
        if v.kind == "trainmon":
            instep[v.name], _ = trainmon_costs(v.name)
        elif v.kind == "peer":
            instep[v.name] = [t.call for t in ts]
        else:
            instep[v.name] = [0.0 for _ in ts]
        ab = res.ab[v.name]
        rows.append(
            (
                v.label,
                med(instep[v.name]) * 1e6,
                mean(instep[v.name]) * 1e6,
                pct(instep[v.name], 0.99) * 1e6,
                max(instep[v.name]) * 1e6 if ts else math.nan,
                mean([t.collect for t in ts]) * 1e6 if v.kind == "peer" else math.nan,
                mean(instep[v.name]) / (base_ms / 1e3) * 100,
                med(res.blocks[v.name]) * 1e3,
                pct([t.step for t in ts], 0.99) * 1e3,
                med(ab) * 100 if ab else 0.0,
                pct(ab, 0.25) * 100 if ab else 0.0,
                pct(ab, 0.75) * 100 if ab else 0.0,
                v.setup_s,
                v.close_s,
            )
        )

    print()
    print(
        f"baseline step: median {base_ms:.2f} ms over {len(base_steps)} steps; block medians min/median/max "
        f"{min(res.blocks['baseline']) * 1e3:.2f} / {med(res.blocks['baseline']) * 1e3:.2f} / "
        f"{max(res.blocks['baseline']) * 1e3:.2f} ms"
    )
    print()
    hdr = (
        "| variant | in-step us median | in-step us mean | in-step us p99 | in-step us max | peer collect us mean "
        "| in-step mean % of baseline step | block median step ms | step p99 ms | A/B % median | A/B % p25 / p75 "
        "| setup s | close s |"
    )
    print(hdr)
    print("|" + "---|" * 13)
    for r in rows:
        print(
            f"| {r[0]} | {fmt(r[1])} | {fmt(r[2])} | {fmt(r[3])} | {fmt(r[4])} | {fmt(r[5])} | {fmt(r[6], 3)} "
            f"| {fmt(r[7], 2)} | {fmt(r[8], 2)} | {r[9]:+.2f} | {r[10]:+.2f} / {r[11]:+.2f} | {fmt(r[12], 2)} "
            f"| {fmt(r[13], 2)} |"
        )

    _, parts = trainmon_costs("trainmon")
    print()
    print("trainmon in-step cost, collector up, mean us/step by part:")
    for k, val in parts.items():
        print(f"  {k:22s} {val * 1e6:8.2f}")
    tm_clip = med([t.clip - t.clip_counted for t in res.steps["trainmon"]])
    print(
        f"  (clip call medians: plain clip_grad_norm_ {base_clip * 1e6:.1f} us in baseline, trainmon wrapper minus "
        f"its counted part {tm_clip * 1e6:.1f} us; scheduler.step {base_sched * 1e6:.1f} vs "
        f"{med([t.sched for t in res.steps['trainmon']]) * 1e6:.1f} us)"
    )
    print(
        "  counted = TrainMonitor.overhead_s: forward pre/post hooks, the sampled steps' optimizer pre-hook, the clip "
        "wrapper after the clip itself, step_end (record, CPU read-back, emit -> deque)."
    )
    print(
        "  not counted by overhead_s, added here: the gradient hook that marks the end of backward "
        "(timed around it; on CPU after the first backward, C functions: in the dispatch figure), the clip "
        "wrapper's extra work vs plain clip_grad_norm_ and any extra in scheduler.step (difference of medians "
        "vs baseline, floored at 0), torch's hook dispatch (no-op hooks, isolated) and the C-only hooks "
        "(isolated)."
    )

    tm = instep["trainmon"]
    tm_mean = mean(tm)
    # On a loaded machine the OS preempts the training thread inside trainmon's code too, which inflates the
    # mean; the mean over the steps with no runqueue wait at all is the cost without that.
    tm_quiet = [c for c, t in zip(tm, res.steps["trainmon"], strict=True) if t.runq < 1e-4]
    overhead_pct = tm_mean / (base_ms / 1e3) * 100
    ab_overhead_pct = med(res.ab["trainmon"]) * 100
    ratios = {}
    for key in PEERS:
        if key in instep:
            ratios[key] = mean(instep[key]) / tm_mean
    wandb_ratio = ratios.get("wandb", math.nan)
    wandb_incl = mean([t.call + t.collect for t in res.steps["wandb"]]) / tm_mean if "wandb" in res.steps else math.nan
    # Collector down: the training thread must never wait. Two views that machine load cannot fake:
    # trainmon's in-step time on the steps the OS did not preempt the thread (runqueue wait < 0.1 ms), and
    # the time the thread slept in a step (off CPU and not runnable: GIL, locks, I/O), anywhere in the step.
    down_ts = res.steps["down"]
    quiet = [c for c, t in zip(instep["down"], down_ts, strict=True) if t.runq < 1e-4]
    down_max_ms = max(quiet) * 1e3 if len(quiet) >= 5 else math.nan
    down_max_all_ms = max(instep["down"]) * 1e3
    down_blocked_ms = max(t.blocked for t in down_ts) * 1e3
    base_blocked_ms = max(t.blocked for t in res.steps["baseline"]) * 1e3
    down_ab = med(res.ab["down"]) * 100
    print()
    print(
        "| variant | steps preempted (runqueue wait > 0.1 ms) | runqueue wait ms mean | slept ms median / p99 / max |"
    )
    print("|---|---|---|---|")
    for v in variants:
        ts = res.steps[v.name]
        bl = [t.blocked * 1e3 for t in ts]
        print(
            f"| {v.label} | {sum(t.runq >= 1e-4 for t in ts) / len(ts) * 100:.0f} % "
            f"| {mean([t.runq for t in ts]) * 1e3:.2f} | {med(bl):.3f} / {pct(bl, 0.99):.3f} / {max(bl):.3f} |"
        )

    # Events: every step_end of the collector-down monitor must be on disk, seq numbers without gaps.
    down_steps = {e["fields"]["step"] for e in spooled if e.get("kind") == "step"}
    seqs = sorted(e["seq"] for e in spooled)
    seq_gaps = (seqs[-1] + 1 - len(set(seqs))) if seqs else 0
    lost = (
        (tm_down.steps_run - len(down_steps))
        + tm_down.mon.transport.dropped
        + tm_down.mon.transport.dropped_spool
        + seq_gaps
    )
    lost_up = (tm_up.steps_run - up_stored) if not math.isnan(up_stored) else math.nan
    print()
    print(
        f"collector down: {len(spooled)} events in the spool, {len(down_steps)} of the {tm_down.steps_run} steps; "
        f"seq gaps {seq_gaps}, dropped (queue full) {tm_down.mon.transport.dropped}, dropped (spool full) "
        f"{tm_down.mon.transport.dropped_spool}; sent {tm_down.mon.transport.sent}"
    )
    print(
        f"  trainmon in-step max {fmt(down_max_ms, 3)} ms over {len(quiet)} unpreempted steps "
        f"({down_max_all_ms:.3f} ms over all {len(down_ts)}, preemption included); thread slept at most "
        f"{down_blocked_ms:.3f} ms in a step (baseline: {base_blocked_ms:.3f} ms); A/B {down_ab:+.2f} %"
    )
    print(
        f"collector up: {tm_up.steps_run} steps emitted, {up_stored} stored by the collector "
        f"(seq gaps it saw: {up_missing}), sent {tm_up.mon.transport.sent}, spooled {tm_up.mon.transport.spooled}"
    )
    print(
        "ratios of peer in-step call cost (mean) to trainmon's: "
        + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
        + (f"; wandb incl. its metric collection {wandb_incl:.1f}x" if not math.isnan(wandb_incl) else "")
    )
    syncs = {v.name: v.syncs.sites for v in variants if v.syncs is not None}
    if SYNC_DEBUG:
        print()
        print(f"sync-debug ({'warn' if DEVICE.type == 'cuda' else 'off: no CUDA device'}), syncs reported per variant:")
        for name, sites in syncs.items():
            print(f"  {name:10s} {sum(sites.values()):5d}  " + ", ".join(f"{k} x{n}" for k, n in sites.most_common(5)))
    if profile:
        print()
        print(profile)
    print()
    print(f"wall time {perf() - wall0:.0f} s; command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
    kv = {
        "overhead_pct": fmt(overhead_pct, 3),
        "ab_overhead_pct": fmt(ab_overhead_pct, 2),
        "wandb_ratio": fmt(wandb_ratio, 1),
        "trainmon_instep_us": fmt(tm_mean * 1e6, 1),
        "trainmon_instep_median_us": fmt(med(tm) * 1e6, 1),
        "trainmon_instep_unpreempted_us": fmt(mean(tm_quiet) * 1e6 if len(tm_quiet) >= 5 else math.nan, 1),
        "unpreempted_steps": str(len(tm_quiet)),
        "wandb_instep_us": fmt(mean(instep["wandb"]) * 1e6 if "wandb" in instep else math.nan, 1),
        "tensorboard_ratio": fmt(ratios.get("tensorboard", math.nan), 1),
        "mlflow_ratio": fmt(ratios.get("mlflow", math.nan), 1),
        "baseline_step_ms": fmt(base_ms, 2),
        "aa_noise_pct": fmt(med(res.ab["aa"]) * 100, 2),
        "collector_down_max_added_ms": fmt(down_max_ms, 3),
        "collector_down_max_slept_ms": fmt(down_blocked_ms, 3),
        "baseline_max_slept_ms": fmt(base_blocked_ms, 3),
        "collector_down_ab_pct": fmt(down_ab, 2),
        "lost_events": str(lost),
        "lost_events_up": fmt(lost_up, 0),
        "rounds": str(rounds),
        "block": str(block),
        "device": str(DEVICE),
    }
    if SYNC_DEBUG:
        own = [trainmon_syncs(v, variants[0]) for v in variants if v.kind == "trainmon"]
        kv["sync_warnings_trainmon"] = str(sum(own))
        kv["sync_warnings_baseline"] = str(sum(syncs["baseline"].values()))
    print(" ".join(f"{k}={v}" for k, v in kv.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
