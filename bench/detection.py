"""Detection benchmark: precision, recall, F1 and delay per fault kind, against the anchors' rules.

Scenarios:
  * the reference trainer's fault catalog: real CPU training runs with one injected fault each
    (resume faults as an interrupted run resumed with the fault; straggler and hang under
    torchrun with 2 gloo ranks), plus clean runs and a correct resume as controls;
  * synthetic traces (``bench/synthetic.py``): hundreds of runs with varied noise, trends and
    fault magnitudes, plus clean controls (warmup, epoch boundaries, eval and checkpoint
    windows, a declared WSD decay).

Every scenario goes through the collector's own ingest path and detectors (an in-memory store
per scenario), exactly like ``trainmon postmortem FILE``. A label is detected when an anomaly of
its ``expected_detection`` kind starts within ``[first_step, last_step + MAX_DELAY[kind]]``.
An anomaly counts as a false positive when no label of the scenario expects or explains its kind
(``RELATED``: an LR burst also shows as a grad explosion); on clean controls every anomaly is a
false positive. The loss-spike scenarios are scored again with the rules the anchors ship. Each detected
label's findings are also checked for naming its cause (``DIAGNOSIS``): ``diagnosis_ok`` on the last line is the
share of detected labels whose every matching finding names it.

A busy machine slows the trainer runs themselves (every phase together). A throughput finding no label
explains is the environment, not a false alarm, when the host was measurably slow at the time: the trainer's
own step clock shows the slow steps (the finding's steps, by their event times), and either the trainer's own
CPU clock says those steps waited for a core (its CPU seconds per wall second, read from ``/proc/PID/stat``
every 20 ms, fell ``ENV_SLOWDOWN`` times under its run's average: descheduled, not working) or an independent
measure of the same host (``HostProbe``: runnable tasks per core, sampled every 20 ms by a separate process)
says it stretched CPU work at least ``ENV_SLOWDOWN`` times more than usual during those steps. Those are counted as
``env_slowdowns`` on the last line, neither false positives nor clean-control alerts; a throughput finding
at a time the probe ran at its normal pace stays a false alarm.

    python bench/detection.py            # full: all trainer faults, 100 synthetic traces per kind
    python bench/detection.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synthetic import Trace, clean_controls, fault_traces
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import CollectorConfig, DetectorsConfig
from trainmon.monitor.detectors.hang import HangConfig
from trainmon.monitor.store.storage import Storage
from trainmon.reference_trainer.command import trainer_command, trainer_env
from trainmon.wire import validate_event

MAX_DELAY = {  # steps after the fault's last step within which a detection still counts
    "nan_inf": 1,
    "loss_spike": 1,
    "grad_explosion": 1,
    "throughput_collapse": 10,
    "bad_resume": 1,
    "lr_schedule_drift": 50,
    "divergence": 200,
    "straggler": 30,
    "hang": 1000,
    "node_health": 5,
    "memory_leak": 1000,
    "init_loss": 50,
    "loss_scale_collapse": 30,
    "eval_regression": 1000,
    "replica_divergence": 10,  # the reference trainer checksums the weights every 10 steps
    "loss_noise": 200,  # a sustained rise: the recent window must fill, then hold for 80 entries
}
RELATED = {  # kinds a fault legitimately raises besides its expected one
    "loss_spike": {"grad_explosion", "eval_regression"},
    "lr_burst": {"grad_explosion", "eval_regression", "lr_schedule_drift"},
    "weight_scale": {"grad_explosion", "eval_regression"},
    "nan": {"loss_spike", "grad_explosion", "divergence", "eval_regression", "loss_scale_collapse"},
    "divergence": {"loss_spike", "grad_explosion", "eval_regression", "lr_schedule_drift"},
    "grad_explosion": {"loss_spike"},
    "lr_per_microbatch": {"loss_spike", "eval_regression"},
    "lr_wrong_total": {"eval_regression"},
    "lr_frozen": {"eval_regression"},
    "data_stall": {"straggler", "hang"},
    "checkpoint_stall": {"straggler"},
    "gc_pause": {"straggler", "memory_leak"},  # the fault keeps 10% of its garbage: RSS really grows
    "straggler": {"throughput_collapse"},
    "hang": {"throughput_collapse", "straggler"},
    "memory_leak": {"throughput_collapse", "node_health"},
    "labels_unshifted": {"loss_spike", "divergence", "eval_regression"},
    "gpu_overheat": {"throughput_collapse"},
    "overflow_storm": {"loss_spike", "grad_explosion"},
    "overfit": set(),
    "bad_init": {"loss_spike", "grad_explosion"},
    "replica_desync": set(),
    "tp_same_seed": set(),
    "unshuffled": {"loss_spike", "grad_explosion"},  # one-document batches: odd batches spike, clipping rises
}
for _kind in (
    "resume_no_scheduler",
    "resume_no_optimizer",
    "resume_data_replay",
    "resume_no_rng",
    "resume_step_reset",
    "resume_no_scaler",
    "resume_batch_change",
):
    RELATED[_kind] = {
        "lr_schedule_drift",
        "loss_spike",
        "grad_explosion",
        "eval_regression",
        "loss_scale_collapse",
        "throughput_collapse",
        "init_loss",
    }


# -- diagnosis -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """What a finding must say about an injected fault for its diagnosis to be right.

    A detection at the right step that names the wrong cause sends the on-call engineer the wrong way,
    so each fault kind states its cause: ``evidence`` checks the detector's own structured naming of it
    (``evidence["cause"]``, ``["diagnosis"]``, ``["failed"]``, the rank) where the detector has one, ``says``
    are patterns the message or hint must all match, and ``not_says`` name a contradicting cause, which
    none may match. Patterns are case-insensitive regular expressions."""

    evidence: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None
    says: tuple[str, ...] = ()
    not_says: tuple[str, ...] = ()

    def right(self, label: dict[str, Any], anomaly: dict[str, Any], device: str | None) -> bool:
        evidence = anomaly.get("evidence") or {}
        if self.evidence is not None and not self.evidence(label, evidence):
            return False
        text = f"{anomaly.get('message') or ''}\n{anomaly.get('hint') or ''}"
        # on a CPU run no cause may be the GPU; a log that does not name its device may mention both
        wrong = (*self.not_says, *((_GPU,) if device == "cpu" else ()))
        return all(re.search(p, text, re.I) for p in self.says) and not any(re.search(p, text, re.I) for p in wrong)


_GPU = r"nvidia-smi|GPU clocks?|GPU throttl"
_LR_CAUSE = r"LR of param group \d+ jumped"
_BATCH_CAUSE = r"data of this batch|inspect (the )?batch|bad batch"


def _cause(*causes: str) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    return lambda label, ev: ev.get("cause") in causes


def _lr_diagnosis(*diagnoses: str) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    return lambda label, ev: ev.get("diagnosis") in diagnoses


def _resume_check(group: str) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    return lambda label, ev: group in (ev.get("failed") or ())


def _same_rank(label: dict[str, Any], ev: dict[str, Any]) -> bool:
    return ev.get("rank") == label.get("rank")


def _nan_cause(label: dict[str, Any], ev: dict[str, Any]) -> bool:
    # NaN from the first step: nothing finite ever, so the setup; later, injected at once with no build-up
    return ev.get("cause") == ("setup" if label["first_step"] == 0 else "sudden")


DIAGNOSIS: dict[str, Diagnosis] = {  # fault kind (labels.json "kind") -> what its finding must say
    "loss_spike": Diagnosis(  # a batch of random tokens: the batch, not the LR or a build-up
        evidence=lambda label, ev: "lr_jump" not in ev, says=(_BATCH_CAUSE,), not_says=(_LR_CAUSE, "rose first")
    ),
    "lr_burst": Diagnosis(evidence=lambda label, ev: "lr_jump" in ev, says=(_LR_CAUSE,), not_says=(_BATCH_CAUSE,)),
    "weight_scale": Diagnosis(  # the weights changed at once: not a data problem, not the LR
        evidence=lambda label, ev: "lr_jump" not in ev, says=(r"change to the weights",), not_says=(_LR_CAUSE,)
    ),
    "nan": Diagnosis(
        evidence=_nan_cause, says=(r"setup|initiali[sz]ation|no build-up",), not_says=(r"numerical instability",)
    ),
    "divergence": Diagnosis(says=(r"slow divergence|not learning",)),
    "lr_too_high": Diagnosis(says=(r"attention logits",)),  # the mechanism and its module, before the loss moves
    "grad_explosion": Diagnosis(  # the norm alone spiked: the loss did not follow
        says=(r"grad[- ]norm|spikes passed",), not_says=(r"the loss rose after the spike", _LR_CAUSE)
    ),
    "lr_per_microbatch": Diagnosis(
        evidence=_lr_diagnosis("per_microbatch", "too_fast"), says=(r"scheduler\.step\(\)", r"micro-batch")
    ),
    "lr_wrong_total": Diagnosis(
        evidence=_lr_diagnosis("wrong_length", "too_fast"), says=(r"num_training_steps|built with the wrong total",)
    ),
    "lr_frozen": Diagnosis(evidence=_lr_diagnosis("frozen"), says=(r"scheduler\.step\(\) is no longer called",)),
    "resume_no_scheduler": Diagnosis(evidence=_resume_check("scheduler"), says=(r"scheduler",)),
    "resume_no_optimizer": Diagnosis(evidence=_resume_check("optimizer"), says=(r"optimizer",)),
    "resume_data_replay": Diagnosis(evidence=_resume_check("data"), says=(r"replayed",)),
    "resume_no_rng": Diagnosis(evidence=_resume_check("rng"), says=(r"RNG",)),
    "resume_step_reset": Diagnosis(evidence=_resume_check("step"), says=(r"step counter was reset",)),
    "resume_no_scaler": Diagnosis(evidence=_resume_check("loss_scale"), says=(r"GradScaler|loss scale",)),
    "resume_batch_change": Diagnosis(evidence=_resume_check("topology"), says=(r"batch",)),
    "data_stall": Diagnosis(evidence=_cause("data"), says=(r"input pipeline|dataloader",)),
    "checkpoint_stall": Diagnosis(evidence=lambda label, ev: ev.get("phase") == "checkpoint", says=(r"checkpoint",)),
    "gc_pause": Diagnosis(says=(r"\bGC\b|garbage",)),
    "memory_leak": Diagnosis(says=(r"keeps references",)),
    "straggler": Diagnosis(evidence=_same_rank, says=(r"rank \d+ \(host",)),
    "hang": Diagnosis(evidence=_same_rank, says=(r"rank \d+ on", r"(before|between|stuck in) step")),
    "labels_unshifted": Diagnosis(says=(r"not shifted",), not_says=(r"confidently wrong",)),
    "bad_init": Diagnosis(says=(r"init std|initiali",), not_says=(r"not shifted|leakage",)),
    "gpu_overheat": Diagnosis(says=(r"hot|thermal|temperature",)),
    "overflow_storm": Diagnosis(says=(r"overflow",)),
    "overfit": Diagnosis(says=(r"overfitting",)),
    "unshuffled": Diagnosis(says=(r"shuffling",)),
    "replica_desync": Diagnosis(evidence=_same_rank),
    "tp_same_seed": Diagnosis(says=(r"same seed",)),
}


@dataclass
class Result:
    name: str
    labels: list[dict[str, Any]]
    anomalies: list[dict[str, Any]]
    clean: bool
    losses: list[float] = field(default_factory=list)
    source: str = "synthetic"
    device: str | None = None  # the run_start's device: a CPU run's findings must not blame the GPU
    clock: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (end time, step seconds), rank 0
    cpu: list[tuple[float, float]] = field(default_factory=list)  # the trainer's (wall time, CPU seconds)


# -- the host's own pace -------------------------------------------------------------------------

ENV_SLOWDOWN = 1.25  # the probe's median during the finding's steps over its median of the whole run
_PROBE = r"""
import os, sys, time
out = open(sys.argv[1], "w", buffering=1)
cpus = os.cpu_count() or 1
while True:
    try:  # runnable tasks now, the probe itself left out: the stretch a CPU-bound step sees
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
        stretch = max(1.0, (running - 1) / cpus)
    except (OSError, StopIteration, ValueError):  # no /proc: time a fixed piece of work instead
        t0 = time.perf_counter()
        sum(i * i for i in range(20000))
        stretch = time.perf_counter() - t0
    out.write(f"{time.time():.4f} {stretch:.6f}\n")
    time.sleep(0.02)
"""


class HostProbe:
    """An independent measure of the host's pace: a separate process samples, every 20 ms, how many tasks
    are runnable per core (``/proc/stat``'s ``procs_running``): the factor by which a CPU-bound step is
    stretched when more tasks want the cores than there are (without ``/proc``, the time of a fixed piece
    of work). It costs the host next to nothing, so it does not add the load it measures."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._proc: subprocess.Popen | None = None
        self._samples: list[tuple[float, float]] | None = None

    def __enter__(self) -> HostProbe:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(self.path)])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def samples(self) -> list[tuple[float, float]]:
        if self._samples is None or self._proc is None or self._proc.poll() is None:
            rows = []
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2:
                        rows.append((float(parts[0]), float(parts[1])))
            self._samples = rows
        return self._samples

    def slowdown(self, t0: float, t1: float) -> float | None:
        """The probe's mean between wall times ``t0`` and ``t1`` (bursts of contention count) over its
        median over everything it measured; None with fewer than 3 samples there."""
        rows = self.samples()
        inside = [d for t, d in rows if t0 <= t <= t1]
        if len(inside) < 3 or len(rows) < 20:
            return None
        return statistics.fmean(inside) / statistics.median(d for _, d in rows)


_HOST_CAUSES = ("host", "compute", "other", "unexplained", "unsplit")  # what a slow host looks like to the detector


def environment(res: Result, anomaly: dict[str, Any], probe: HostProbe | None) -> bool:
    """A throughput finding on a trainer run whose steps the trainer's clock shows slow (or a straggler among
    CPU ranks) while the host probe ran ``ENV_SLOWDOWN`` times slower than usual: the machine was busy (see
    the module docstring)."""
    if anomaly["kind"] not in ("throughput_collapse", "straggler") or not res.clock:
        return False
    ev = anomaly.get("evidence") or {}
    if (
        anomaly["kind"] == "throughput_collapse"
        and ev.get("cause") not in _HOST_CAUSES
        and ev.get("pattern") != "intermittent"
    ):
        return False
    if anomaly["kind"] == "straggler" and res.device != "cpu":
        return False  # ranks sharing a contended host's cores: uneven slices of it
    first = anomaly.get("first_step")
    last = anomaly.get("last_step") if anomaly.get("last_step") is not None else first
    steps = [s for s in res.clock if first is not None and first <= s <= last]
    if not steps:
        return False
    durations = sorted(d for _, d in res.clock.values())
    typical = durations[len(durations) // 2]
    if anomaly["kind"] == "throughput_collapse" and max(res.clock[s][1] for s in steps) < ENV_SLOWDOWN * typical:
        return False  # the trainer's own clock does not show the slow steps (a straggler's evidence is its clock)
    t0 = res.clock[min(steps)][0] - res.clock[min(steps)][1]
    t1 = res.clock[max(steps)][0]
    share = _descheduled(res.cpu, t0, t1)
    if share is not None and share >= ENV_SLOWDOWN:
        return True  # the trainer's own CPU clock: the slow steps waited for a core
    ratio = None if probe is None else probe.slowdown(t0 - 0.1, t1 + 0.1)
    return ratio is not None and ratio >= ENV_SLOWDOWN


def _descheduled(cpu: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """How much less of a core the trainer got between wall times ``t0`` and ``t1`` than over its whole run:
    its CPU seconds per wall second overall over the same inside the span (None without samples there)."""
    inside = [(t, c) for t, c in cpu if t0 <= t <= t1]
    if len(inside) < 3 or len(cpu) < 20:
        return None
    wall, used = inside[-1][0] - inside[0][0], inside[-1][1] - inside[0][1]
    total_wall, total_used = cpu[-1][0] - cpu[0][0], cpu[-1][1] - cpu[0][1]
    if wall <= 0 or total_wall <= 0 or total_used <= 0:
        return None
    return (total_used / total_wall) / max(used / wall, 1e-9)


# -- scenarios -----------------------------------------------------------------------------------

TRAINER_FAULTS: list[tuple[str, list[str], int]] = [  # (fault spec, extra args, steps)
    ("loss_spike@80:scale=50", [], 120),
    ("lr_burst@80", [], 120),
    ("weight_scale@80", [], 120),
    ("nan@80", [], 120),
    ("nan@0", [], 30),  # nothing finite from the first step: the setup, not a batch
    ("divergence@60", [], 160),
    ("lr_per_microbatch@0", ["--accum", "4"], 80),
    ("lr_wrong_total@0", [], 120),
    ("lr_frozen@60", [], 120),
    ("data_stall@80:seconds=0.5,steps=5", [], 120),
    ("checkpoint_stall@80:seconds=2", ["--checkpoint-every", "40"], 120),
    ("gc_pause@60", [], 120),
    ("memory_leak@20:mb=16", [], 160),
    ("labels_unshifted@0", [], 100),
    ("bad_init@0", [], 80),
    ("unshuffled@280", [], 440),  # the noise baseline needs ~250 steps after the first descent
]
RESUME_FAULTS = [
    "resume_no_scheduler",
    "resume_no_optimizer",
    "resume_data_replay",
    "resume_no_rng",
    "resume_step_reset",
    "resume_batch_change",
    "resume_no_scaler",
]
DDP_FAULTS: list[tuple[str, int]] = [("straggler@20:rank=1,ms=40", 60), ("hang@30:rank=1,seconds=8", 60)]
# The hang detector's timeout has a 60 s floor (HangConfig.min_timeout): on a live run a pause of a few seconds
# is a busy host, not a hang. A hang past that floor would add a minute to the benchmark, so the hang scenario
# is analysed with the floor lowered to 3 s (its learnt timeout, 20x the median step, is below it); every other
# scenario keeps the defaults, which is what the clean controls check.
HANG_CONFIG = CollectorConfig(detectors=DetectorsConfig(hang=HangConfig(min_timeout=3.0)))
# (name, fault spec or None for a clean control, extra args, ranks, steps): the weights' layout across ranks. The
# desync runs 3 replicas so that a majority names the rank; the clean control's 4 ranks are 2 tensor-parallel
# groups of 2 data-parallel replicas each, so both checks see a clean run.
REPLICA_SCENARIOS: list[tuple[str, str | None, list[str], int, int]] = [
    ("t-replica_desync", "replica_desync@24:rank=1", [], 3, 40),
    ("t-tp_same_seed", "tp_same_seed@0", ["--layout", "tp=2"], 2, 30),
    ("t-replica-clean", None, ["--layout", "tp=2", "--checkpoint-every", "20"], 4, 40),
]
QUICK_FAULTS = {
    "loss_spike@80:scale=50",
    "nan@80",
    "nan@0",
    "lr_frozen@60",
    "data_stall@80:seconds=0.5,steps=5",
    "unshuffled@280",
}

_ENV = trainer_env(threads=1)


def _trainer(out: Path, run: str, steps: int, *args: str) -> None:
    cmd = trainer_command(run, steps, out, extra=("--threads", "1", *args))
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=_ENV)
        cpu = _cpu_clock(proc, time.monotonic() + 900)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"trainer failed: {' '.join(cmd)}\n{err.read()[-2000:]}")
    out.mkdir(parents=True, exist_ok=True)
    with (out / _CPU_CLOCK).open("a") as f:
        f.writelines(f"{t:.4f} {c:.4f}\n" for t, c in cpu)


_CPU_CLOCK = "cpu-clock.txt"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_clock(proc: subprocess.Popen, deadline: float) -> list[tuple[float, float]]:
    """The trainer process's CPU seconds (user + system, ``/proc/PID/stat``) against wall time, every 20 ms
    until it exits: a step whose wall time grew while its CPU time did not waited for a core."""
    rows: list[tuple[float, float]] = []
    stat = Path(f"/proc/{proc.pid}/stat")
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("trainer timed out")
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            rows.append((time.time(), (int(fields[11]) + int(fields[12])) / _TICK))
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.02)
    return rows


def _cpu_share(out: Path) -> list[tuple[float, float]]:
    """The trainer's CPU clock as written by :func:`_trainer` (wall time, CPU seconds), or []."""
    path = out / _CPU_CLOCK
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((float(parts[0]), float(parts[1])))
    return rows


def _torchrun(out: Path, run: str, steps: int, *args: str, nproc: int = 2) -> None:
    cmd = trainer_command(run, steps, out, extra=("--threads", "1", *args), ranks=nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_ENV, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def _analyse_files(name: str, out: Path, clean: bool, source: str, config: CollectorConfig | None = None) -> Result:
    storage = Storage("sqlite://")
    runs = import_file(out, storage, config)  # every rank's events*.jsonl, merged in time order
    labels = json.loads((out / "labels.json").read_text()) if (out / "labels.json").exists() else []
    summary = summarize(storage, runs[0])
    return Result(
        name,
        labels,
        summary["anomalies"],
        clean,
        source=source,
        device=_device(out),
        clock=_clock(out),
        cpu=_cpu_share(out),
    )


def _clock(out: Path) -> dict[int, tuple[float, float]]:
    """Rank 0's steps as the trainer's own clock saw them: step -> (event time, step seconds)."""
    clock: dict[int, tuple[float, float]] = {}
    path = out / "events.jsonl"
    if not path.exists():
        return clock
    with path.open() as f:
        for line in f:
            event = json.loads(line)
            fields = event.get("fields") or {}
            if event.get("kind") == "step" and isinstance(fields.get("step_time"), int | float):
                clock[fields["step"]] = (float(event["time"]), float(fields["step_time"]))
    return clock


def _device(out: Path) -> str | None:
    """The device the run's ``run_start`` names (rank 0's events file)."""
    for path in sorted(out.glob("events*.jsonl")):
        with path.open() as f:
            for line in f:
                event = json.loads(line)
                if event.get("kind") == "run_start":
                    return (event.get("fields") or {}).get("device")
    return None


def trainer_scenarios(quick: bool, workdir: Path) -> list[Result]:
    jobs: list[tuple[str, Any]] = []
    for spec, args, steps in TRAINER_FAULTS:
        if quick and spec not in QUICK_FAULTS:
            continue
        name = "t-" + spec.split(":")[0].replace("@", "-")

        def job(name=name, spec=spec, args=args, steps=steps) -> Result:
            out = workdir / name
            _trainer(out, name, steps, "--inject", spec, *args)
            return _analyse_files(name, out, False, "trainer")

        jobs.append((name, job))
    for i in range(1 if quick else 3):

        def clean_job(i=i) -> Result:
            out = workdir / f"t-clean-{i}"
            _trainer(out, f"t-clean-{i}", 120, "--seed", str(100 + i), "--eval-every", "40", "--checkpoint-every", "50")
            return _analyse_files(f"t-clean-{i}", out, True, "trainer")

        jobs.append((f"t-clean-{i}", clean_job))
    if not quick:
        for fault in [*RESUME_FAULTS, None]:
            name = f"t-{fault or 'resume-clean'}"

            def resume_job(name=name, fault=fault) -> Result:
                out = workdir / name
                # the scale must have backed off before the crash for a fresh scaler to differ
                fp16 = ["--precision", "fp16", "--init-scale", "16777216"] if fault == "resume_no_scaler" else []
                _trainer(out, name, 60, "--checkpoint-every", "20", "--stop-at", "45", *fp16)
                inject = ["--inject", f"{fault}@0"] if fault else []
                _trainer(out, name, 60, "--checkpoint-every", "20", "--resume", str(out), *inject, *fp16)
                return _analyse_files(name, out, fault is None, "trainer")

            jobs.append((name, resume_job))
        for spec, steps in DDP_FAULTS:
            name = "t-" + spec.split("@")[0]

            def ddp_job(name=name, spec=spec, steps=steps) -> Result:
                out = workdir / name
                _torchrun(out, name, steps, "--inject", spec)
                return _analyse_files(name, out, False, "trainer", HANG_CONFIG if spec.startswith("hang@") else None)

            jobs.append((name, ddp_job))
    for name, spec, args, ranks, steps in REPLICA_SCENARIOS:

        def replica_job(name=name, spec=spec, args=args, ranks=ranks, steps=steps) -> Result:
            out = workdir / name
            _torchrun(out, name, steps, *(["--inject", spec] if spec else []), *args, nproc=ranks)
            return _analyse_files(name, out, spec is None, "trainer")

        jobs.append((name, replica_job))
    results = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {pool.submit(fn): name for name, fn in jobs}
        for fut, name in futures.items():
            try:
                results.append(fut.result())
            except Exception as exc:  # a broken scenario is reported, not fatal
                print(f"  ! scenario {name} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
    return results


def analyse_trace(trace: Trace) -> Result:
    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())
    events = [validate_event(e) for e in trace.events]
    for i in range(0, len(events), 2000):
        chunk = events[i : i + 2000]
        ingestor.ingest(chunk)
        ingestor.engine.tick(chunk[-1].time)
    losses = [e.fields.get("loss") for e in events if e.kind == "step" and e.rank == 0]
    summary = summarize(storage, trace.name)
    storage.close()
    return Result(trace.name, trace.labels, summary["anomalies"], trace.clean, losses)


# -- scoring -------------------------------------------------------------------------------------


def _hit(label: dict[str, Any], anomaly: dict[str, Any]) -> bool:
    kind = label["expected_detection"]
    if anomaly["kind"] != kind or anomaly["first_step"] is None:
        return False
    # a replica named by the majority must be the right one: the run (-1) names no rank
    ranks = (label.get("rank"),) if kind == "replica_divergence" else (label.get("rank"), -1)
    if (
        label.get("rank") is not None
        and kind in ("straggler", "hang", "replica_divergence")
        and anomaly["rank"] not in ranks
    ):
        return False
    hi = label["last_step"] + MAX_DELAY.get(kind, 10)
    if label["first_step"] <= anomaly["first_step"] <= hi:
        return True
    # One anomaly for recurring spikes (an episode) lists each spike: a fault inside it is detected there.
    evidence = anomaly.get("evidence") or {}
    steps = evidence.get("spike_steps") or (evidence.get("episode") or {}).get("spike_steps") or ()
    return any(isinstance(s, int) and label["first_step"] <= s <= hi for s in steps)


@dataclass
class Score:
    tp: int = 0
    fn: int = 0
    fp: int = 0
    delays: list[int] = field(default_factory=list)
    diagnosed: int = 0  # true positives whose fault kind states what its diagnosis must say
    diagnosis_ok: int = 0  # ... and whose every matching finding says it

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0


def score(
    results: list[Result], probe: HostProbe | None = None, env: list[str] | None = None
) -> tuple[dict[str, Score], int, list[str], dict[str, list[int]]]:
    """Per-kind scores, alerts on clean controls, the misses and misdiagnoses, and per fault kind
    ``[diagnosis_ok, diagnosed]``. Slowdowns of the host itself (:func:`environment`) go to ``env``."""
    scores: dict[str, Score] = collections.defaultdict(Score)
    by_fault: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    clean_alerts = 0
    misses: list[str] = []
    for res in results:
        explained: set[str] = set()
        for lab in res.labels:
            kind = lab["expected_detection"]
            explained |= {kind, *RELATED.get(lab["kind"], ())}
            hits = [a for a in res.anomalies if _hit(lab, a)]
            if hits:
                scores[kind].tp += 1
                scores[kind].delays.append(min(a["first_step"] for a in hits) - lab["first_step"])
                diagnosis = DIAGNOSIS.get(lab["kind"])
                if diagnosis is not None:
                    scores[kind].diagnosed += 1
                    by_fault[lab["kind"]][1] += 1
                    wrong = [a for a in hits if not diagnosis.right(lab, a, res.device)]
                    if wrong:
                        misses.append(
                            f"{res.name}: {lab['kind']}@{lab['first_step']} misdiagnosed by {kind}@"
                            f"{wrong[0]['first_step']}: {wrong[0]['message']} | {wrong[0]['hint']}"
                        )
                    else:
                        scores[kind].diagnosis_ok += 1
                        by_fault[lab["kind"]][0] += 1
            else:
                scores[kind].fn += 1
                misses.append(
                    f"{res.name}: {lab['kind']}@{lab['first_step']} not detected as {kind}; got "
                    f"{[(a['kind'], a['first_step']) for a in res.anomalies]}"
                )
        matched = {id(a) for lab in res.labels for a in res.anomalies if _hit(lab, a)}
        for a in res.anomalies:
            if id(a) in matched:
                continue
            if (res.clean or a["kind"] not in explained) and environment(res, a, probe):
                if env is not None:
                    env.append(f"{res.name}: the host was slow: {a['kind']}@{a['first_step']}: {a['message']}")
                continue
            if res.clean:
                clean_alerts += 1
                scores[a["kind"]].fp += 1
                misses.append(f"{res.name}: false alarm {a['kind']}@{a['first_step']}: {a['message']}")
            elif a["kind"] not in explained:
                scores[a["kind"]].fp += 1
                misses.append(f"{res.name}: unexpected {a['kind']}@{a['first_step']}: {a['message']}")
    return scores, clean_alerts, misses, by_fault


def anchor_comparison(results: list[Result]) -> dict[str, float]:
    """F1 of each anchor rule and of trainmon on the synthetic loss-spike scenarios (+ clean controls)."""
    from trainmon.monitor.detectors import anchors

    pool = [r for r in results if r.source == "synthetic" and (r.clean or r.name.startswith("spike-"))]
    out = {}
    rules = {name: fn for name, fn in anchors.ANCHOR_RULES.items()}
    for name, rule in rules.items():
        sc = Score()
        for res in pool:
            flagged = sorted(rule(res.losses))
            for lab in res.labels:
                hit = [s for s in flagged if lab["first_step"] <= s <= lab["last_step"] + MAX_DELAY["loss_spike"]]
                sc.tp += bool(hit)
                sc.fn += not hit
            window = [(lab["first_step"], lab["last_step"] + MAX_DELAY["loss_spike"]) for lab in res.labels]
            sc.fp += len(_episodes([s for s in flagged if not any(a <= s <= b for a, b in window)]))
        out[name] = sc.f1
    sc = Score()
    for res in pool:
        for lab in res.labels:
            hit = any(_hit(lab, a) for a in res.anomalies)
            sc.tp += hit
            sc.fn += not hit
        sc.fp += sum(
            1 for a in res.anomalies if a["kind"] == "loss_spike" and not any(_hit(lab, a) for lab in res.labels)
        )
    out["trainmon"] = sc.f1
    return out


def _episodes(steps: list[int]) -> list[int]:
    """Consecutive flagged steps count as one alarm, as an anomaly would."""
    return [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1] + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few trainer faults and 10 traces per kind (< 1 min)")
    parser.add_argument("--per-kind", type=int, default=None, help="synthetic traces per fault kind")
    parser.add_argument("--no-trainer", action="store_true", help="synthetic traces only")
    parser.add_argument("--verbose", action="store_true", help="list every miss and false alarm")
    args = parser.parse_args()
    per_kind = args.per_kind or (10 if args.quick else 100)
    t0 = time.perf_counter()
    probe: HostProbe | None = None
    traces = [*fault_traces(per_kind), *clean_controls(per_kind * 2)]
    results = []
    for trace in traces:
        results.append(analyse_trace(trace))
    print(f"synthetic: {len(traces)} traces analysed in {time.perf_counter() - t0:.1f}s")
    if not args.no_trainer:
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="trainmon-bench-") as tmp:
            with HostProbe(Path(tmp) / "host-probe.txt") as probe:
                trainer = trainer_scenarios(args.quick, Path(tmp))
            probe.samples()  # read before the folder goes
        results.extend(trainer)
        print(f"reference trainer: {len(trainer)} runs in {time.perf_counter() - t1:.1f}s")
    env: list[str] = []
    scores, clean_alerts, misses, by_fault = score(results, probe, env)
    print()
    header = ("kind", "TP", "FN", "FP", "precision", "recall", "F1", "delay p50", "max", "diagnosis")
    print("{:22} {:>5} {:>5} {:>5} {:>9} {:>7} {:>6} {:>9} {:>5} {:>9}".format(*header))
    for kind in sorted(scores):
        s = scores[kind]
        p50 = statistics.median(s.delays) if s.delays else float("nan")
        mx = max(s.delays) if s.delays else float("nan")
        diag = f"{s.diagnosis_ok}/{s.diagnosed}" if s.diagnosed else "-"
        print(
            f"{kind:22} {s.tp:5d} {s.fn:5d} {s.fp:5d} {s.precision:9.3f} {s.recall:7.3f} {s.f1:6.3f} {p50:9.1f} "
            f"{mx:5.0f} {diag:>9}"
        )
    print("\ndiagnosis right by fault: " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in sorted(by_fault.items())))
    anchor_f1 = {}
    try:
        anchor_f1 = anchor_comparison(results)
        print("\nloss-spike scenarios, F1 by rule: " + ", ".join(f"{k} {v:.3f}" for k, v in anchor_f1.items()))
    except ImportError as exc:
        print(f"\nanchor rules unavailable: {exc}")
    if args.verbose or len(misses) <= 20:
        print("\n" + "\n".join(misses[:200]))
    if env:
        print("\nslowdowns of the host itself (the probe ran slow then; not false alarms):\n" + "\n".join(env))
    labelled = [s for s in scores.values() if s.tp + s.fn]
    min_f1 = min((s.f1 for s in scores.values()), default=float("nan"))
    max_delay = max((max(s.delays) for s in labelled if s.delays), default=0)
    best_anchor = max((v for k, v in anchor_f1.items() if k != "trainmon"), default=float("nan"))
    diagnosed = sum(s.diagnosed for s in scores.values())
    diagnosis_ok = sum(s.diagnosis_ok for s in scores.values()) / diagnosed if diagnosed else float("nan")
    print(
        f"\nmin_f1={min_f1:.3f} clean_alerts={clean_alerts} max_delay_steps={max_delay} "
        f"diagnosis_ok={diagnosis_ok:.3f} "
        f"spike_f1={anchor_f1.get('trainmon', float('nan')):.3f} best_anchor_spike_f1={best_anchor:.3f} "
        f"scenarios={len(results)} env_slowdowns={len(env)} seconds={time.perf_counter() - t0:.1f}"
    )


if __name__ == "__main__":
    main()
