"""Post-mortem at scale: a synthetic run of 1,000,000 steps x 8 ranks, analysed end to end.

The target (issue 8): everything ``trainmon postmortem --json`` computes, on a run that long, in
at most 10 s and 2 GiB of peak RSS on this machine. The run is written straight into a SQLite
store with the collector's schema (bulk insert, no detectors: the anomalies a collector would
have stored are inserted with it), then ``trainmon.monitor.analysis.postmortem.summarize`` reads it back.

What the run holds, so the analysis has something to find: a loss curve decaying to a floor
with noise and a spike at 40% of the run, a crash at 60% and a resume from the last checkpoint
(so the steps since it are repeated by attempt 1), a slow rank 5 (a straggler), a data stall
window, a checkpoint every 1,000 steps, an eval every 1,000 steps, per-layer grad norms every
100 steps, node-health samples every 60 s per rank, and the anomalies a collector would have
raised for all that.

``--quick`` uses 100k steps. ``--plots`` also renders the PNGs and the HTML report (reported
separately: the target is for the analysis). ``--db PATH`` keeps the store (it is reused when
it already holds the run with the same size, which saves the minute the full generation takes).

Last line: ``seconds=... peak_rss_mib=...``: the wall time of ``trainmon postmortem RUN --db DB
--json`` as a user runs it (interpreter start-up and imports included) and that process's peak
RSS. The store is built in another child process, because Linux charges a child the RSS high-water
mark of the process it was forked from.

``--foreign`` (issue 24): the post-mortem of a foreign log as a user runs it, ``trainmon postmortem
FILE --json``, on a W&B-style CSV (``_step,train/loss,train/learning_rate,train/grad_norm``) of
200,000 and 1,000,000 rows and on an HF ``trainer_state.json`` of 300,000 ``log_history`` entries
(every step logged, an eval every 1,000), all with noise, a loss spike and warmup + cosine LR. The
peers ``losslint check FILE --format json`` and ``runmedic diagnose FILE --json`` run on the same
files when they are installed (``nan`` when not). The store run above is measured too, and the last
line holds both: ``foreign_1m_seconds foreign_1m_rss_mib best_peer_1m_seconds ratio_to_best_peer``
(trainmon's seconds over the fastest peer's: below 1 is faster) ``seconds peak_rss_mib``. With
``--quick`` the files are 20,000 / 100,000 rows and 30,000 entries (the ``1m`` keys then hold the
larger CSV) and the store run 100,000 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainmon.monitor.store.storage import PHASE_COLUMNS  # noqa: E402  (after the path above)
from trainmon.monitor.store.storage import steps as steps_table  # noqa: E402

RUN = "bench-1m"
RANKS = 8
LAYERS = [f"blocks.{i}.{p}" for i in range(12) for p in ("attn.qkv.weight", "mlp.fc.weight")] + ["lm_head.weight"]
PHASES = PHASE_COLUMNS
# The steps table's columns, in its order: the generator writes rows straight into SQLite for speed.
STEP_COLUMNS = tuple(c.name for c in steps_table.columns)


def _schedule(n: int) -> dict:
    return {"name": "cosine", "peak_lr": 3e-4, "total_steps": n, "warmup_steps": 2000, "min_ratio": 0.1}


def _lr(sched: dict, steps: np.ndarray) -> np.ndarray:
    w, n, peak, lo = sched["warmup_steps"], sched["total_steps"], sched["peak_lr"], sched["min_ratio"]
    progress = np.clip((steps - w) / max(1, n - w), 0, 1)
    cos = lo + (1 - lo) * 0.5 * (1 + np.cos(np.pi * progress))
    return peak * np.where(steps < w, steps / max(1, w), cos)  # as Schedule: warmup from 0 (HF, torch)


def generate(db: Path, n: int, seed: int = 0) -> dict:
    """Write the synthetic run into a fresh store at ``db``; returns what was injected where."""
    from trainmon.monitor.store.storage import Storage

    Storage(str(db)).close()  # the collector's schema, migrated
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("PRAGMA cache_size=-262144")
    rng = np.random.default_rng(seed)
    sched = _schedule(n)
    spike = int(0.4 * n)
    crash = int(0.6 * n) + 437  # not on a checkpoint: the resume repeats 437 steps
    ckpt_every, eval_every, layer_every = 1000, 1000, 100
    resume_from = (crash // ckpt_every) * ckpt_every
    stall = (int(0.75 * n), int(0.75 * n) + 200)
    slow_rank = 5
    t0 = 1.7e9
    tokens = 4096
    base = 0.5
    # wall time of each step of attempt 0 / attempt 1 (same for all ranks: they step in lockstep)
    segments = [(0, np.arange(0, crash + 1)), (1, np.arange(resume_from + 1, n))]
    ins = f"INSERT INTO steps ({','.join(STEP_COLUMNS)}) VALUES ({','.join('?' * len(STEP_COLUMNS))})"
    clock = t0
    restart_gap = 600.0
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    step_times: dict[int, np.ndarray] = {}
    chunk = 50_000
    for attempt, seg in segments:
        m = len(seg)
        st = base * np.exp(0.05 * rng.standard_normal(m))
        st[(seg >= stall[0]) & (seg < stall[1])] += 1.5
        ck = (seg % ckpt_every == 0) & (seg > 0)
        st[ck] += 20.0
        ev = (seg % eval_every == 0) & (seg > 0)
        st[ev] += 5.0
        if attempt == 1:
            clock = ends[0] + restart_gap
        starts[attempt] = clock
        times = clock + np.cumsum(st)
        ends[attempt] = float(times[-1])
        clock = ends[attempt]
        step_times[attempt] = st
        lr = _lr(sched, seg)
        loss_clean = 2.0 + 8.8 * np.exp(-seg / (0.05 * n)) + 0.3 * np.exp(-seg / (0.5 * n))
        for rank in range(RANKS):
            noise = rng.standard_normal(m)
            loss = loss_clean * np.exp(0.02 * noise)
            gn = 0.3 + 2.0 * np.exp(-seg / 3000) + 0.05 * np.abs(rng.standard_normal(m))
            if attempt == 0:
                at = seg == spike
                loss[at] *= 8.0
                gn[at] *= 40.0
            rst = st * (1.0 + 0.003 * rng.standard_normal(m))
            if rank == slow_rank:
                rst = rst * 1.0  # lockstep: the slow rank shows as compute time, the others as comm wait
            compute = 0.8 * base * np.exp(0.02 * rng.standard_normal(m))
            if rank == slow_rank:
                compute *= 1.25
            comm = np.maximum(0.005, rst - compute - 0.02 - 0.01)
            data = np.full(m, 0.01)
            stalled = (seg >= stall[0]) & (seg < stall[1])
            data[stalled] += 1.5
            comm[stalled] = np.maximum(0.005, comm[stalled] - 1.5)
            ckpt = np.where(ck, 20.0, 0.0)
            comm = np.maximum(0.005, comm - ckpt)
            evl = np.where(ev, 5.0, 0.0)
            comm = np.maximum(0.005, comm - evl)
            clip = np.minimum(1.0, 1.0 / gn)
            cols = {
                "rank": rank,
                "attempt": attempt,
                "step": seg,
                "time": times + 0.001 * rank,
                "loss": loss,
                "grad_norm": gn,
                "grad_norm_clipped": gn * clip,
                "clip_coef": clip,
                "lr": lr,
                "step_time": rst,
                "phase_data": data,
                "phase_forward": compute * 0.33,
                "phase_backward": compute * 0.62,
                "phase_comm": comm,
                "phase_optimizer": compute * 0.05,
                "phase_checkpoint": ckpt,
                "phase_eval": evl,
                "phase_other": np.full(m, 0.02),
                "mem_allocated_bytes": (30e9 + 1e3 * seg).astype(np.int64),
            }
            for lo in range(0, m, chunk):
                hi = min(m, lo + chunk)
                sl = slice(lo, hi)
                k = hi - lo
                lists = {name: (v[sl].tolist() if isinstance(v, np.ndarray) else [v] * k) for name, v in cols.items()}
                rows = zip(
                    [RUN] * k,
                    lists["rank"],
                    lists["attempt"],
                    lists["step"],
                    lists["time"],
                    lists["loss"],
                    lists["grad_norm"],
                    lists["grad_norm_clipped"],
                    lists["clip_coef"],
                    lists["lr"],
                    [f"[{x!r}]" for x in lists["lr"]],
                    [None] * k,
                    [0] * k,
                    [tokens] * k,
                    [4] * k,
                    [1] * k,
                    [1] * k,
                    lists["step_time"],
                    *[lists[f"phase_{p}"] for p in PHASES],
                    lists["mem_allocated_bytes"],
                    lists["mem_allocated_bytes"],
                    [f"{(s * 2654435761 + rank) & 0xFFFFFFFFFFFF:016x}" for s in lists["step"]],
                    [None] * k,
                    strict=True,
                )
                con.executemany(ins, rows)
            # second level: per-layer grad norms every 100 steps and around the spike
            ls_steps = seg[(seg % layer_every == 0) | ((seg >= spike - 20) & (seg <= spike))]
            ls_rows = []
            for s in ls_steps.tolist():
                i = s - int(seg[0])
                norms = {name: 0.1 * (1 + (j % 5)) for j, name in enumerate(LAYERS)}
                if attempt == 0 and s == spike:
                    norms["blocks.7.attn.qkv.weight"] *= 300.0
                ls_rows.append((RUN, rank, attempt, s, float(times[i]), json.dumps(norms)))
            con.executemany(
                "INSERT INTO layer_stats (run, rank, attempt, step, time, grad_norms) VALUES (?,?,?,?,?,?)", ls_rows
            )
    # checkpoints, evals, resume, health, streams, run, anomalies
    for attempt, seg in segments:
        times = starts[attempt] + np.cumsum(step_times[attempt])
        first = int(seg[0])
        for s in seg[(seg % ckpt_every == 0) & (seg > 0)].tolist():
            t = float(times[s - first])
            for rank in range(RANKS):
                con.execute(
                    "INSERT INTO checkpoints (run, rank, attempt, step, time, path, duration, bytes) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (RUN, rank, attempt, s, t, f"/ckpt/step{s}", 20.0, 12 << 30),
                )
            con.execute(
                "INSERT INTO evals (run, rank, attempt, step, time, loss, duration) VALUES (?,?,?,?,?,?,?)",
                (RUN, 0, attempt, s, t, 2.1 + 8.8 * math.exp(-s / (0.05 * n)), 5.0),
            )
    for rank in range(RANKS):
        con.execute(
            "INSERT INTO resumes (run, rank, attempt, step, time, path, duration) VALUES (?,?,?,?,?,?,?)",
            (RUN, rank, 1, resume_from, starts[1], f"/ckpt/step{resume_from}", 40.0),
        )
    health_rows = []
    for attempt in (0, 1):
        for t in np.arange(starts[attempt], ends[attempt], 60.0).tolist():
            for rank in range(RANKS):
                temp = 70.0 + 3 * math.sin(t / 3600) + (14.0 if rank == slow_rank else 0.0)
                gpu = {
                    "index": rank % 8,
                    "temperature_c": temp,
                    "utilization_ratio": 0.95,
                    "power_w": 650.0,
                    "sm_clock_hz": 1.98e9 * (0.8 if rank == slow_rank else 1.0),
                    "mem_used_bytes": 60 << 30,
                    "mem_total_bytes": 80 << 30,
                    "ecc_corrected": 0,
                    "ecc_uncorrected": 0,
                }
                data = {"host_mem_used_bytes": 400 << 30, "host_mem_total_bytes": 1 << 40, "gpus": [gpu]}
                health_rows.append((RUN, rank, attempt, f"node-{rank // 8}", t, json.dumps(data)))
    con.executemany("INSERT INTO health (run, rank, attempt, host, time, data) VALUES (?,?,?,?,?,?)", health_rows)
    start = {
        "world_size": RANKS,
        "planned_steps": n,
        "vocab_size": 50257,
        "n_params": 1_555_126_400,
        "global_batch_tokens": tokens * RANKS,
        "flops_per_token": 6 * 1_555_126_400,
        "peak_flops": 989e12,
        "schedule": sched,
    }
    for attempt in (0, 1):
        for rank in range(RANKS):
            last = crash if attempt == 0 else n - 1
            con.execute(
                "INSERT INTO streams (stream, run, rank, attempt, host, started_at, last_seq, last_time, events, "
                "missing, start, end_status, end_step) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    f"s{attempt}r{rank}",
                    RUN,
                    rank,
                    attempt,
                    f"node-{rank // 8}",
                    starts[attempt],
                    last,
                    ends[attempt],
                    last,
                    0,
                    json.dumps({**start, "resumed": attempt == 1}),
                    "failed" if attempt == 0 else "finished",
                    last,
                ),
            )
    meta = {k: v for k, v in start.items() if k != "schedule"}
    con.execute(
        "INSERT INTO runs (run, created_at, updated_at, status, world_size, planned_steps, vocab_size, config, "
        "schedule, meta) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (RUN, t0, ends[1], "finished", RANKS, n, 50257, json.dumps({}), json.dumps(sched), json.dumps(meta)),
    )
    found = [
        ("loss_spike", "warning", 0, spike, spike, f"loss spike at step {spike}: 8x the median", "bad batch?"),
        ("grad_explosion", "warning", 0, spike, spike, "pre-clip grad norm 40x its median", "LR or batch"),
        ("straggler", "warning", slow_rank, 1000, n - 1, f"rank {slow_rank} computes 25% slower", "slow node"),
        ("throughput_collapse", "critical", -1, stall[0], stall[1], "throughput down 75%; data phase grew", "data"),
        ("hang", "critical", 3, crash, crash, "rank 3 silent for 600 s", "NCCL hang"),
        ("node_health", "warning", slow_rank, 5000, n - 1, f"GPU of rank {slow_rank} at 84 C, clocks -20%", "cool"),
    ]
    for kind, sev, rank, first, last, msg, hint in found:
        con.execute(
            "INSERT INTO anomalies (run, kind, rank, severity, status, first_step, last_step, opened_at, updated_at, "
            "message, hint, evidence) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (RUN, kind, rank, sev, "resolved", first, last, t0, t0, msg, hint, json.dumps({"step": first})),
        )
    con.commit()
    con.close()
    return {"steps": n, "spike": spike, "crash": crash, "resume_from": resume_from, "stall": stall}


class _Run(NamedTuple):
    seconds: float  # wall, interpreter start-up and imports included
    rss_mib: float  # the child's own peak RSS (wait4)
    cpu_seconds: float  # its user + system time: what a busy shared machine stretches least
    rc: int
    stdout: str
    stderr: str


def _timed(cmd: list[str]) -> _Run:
    """Run ``cmd`` as a user would, measured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
        seconds = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        cpu = usage.ru_utime + usage.ru_stime
        return _Run(seconds, usage.ru_maxrss / 1024, cpu, proc.returncode, out_f.read(), err_f.read())  # KiB


def _postmortem(db: Path, out: Path | None) -> tuple[float, float, dict]:
    """``trainmon postmortem RUN --db DB --json [--out DIR]``: wall seconds, peak RSS in MiB, its JSON."""
    cmd = [sys.executable, "-m", "trainmon.monitor.cli", "postmortem", RUN, "--db", str(db), "--json"]
    if out is not None:
        cmd += ["--out", str(out)]
    seconds, rss, _, rc, stdout, stderr = _timed(cmd)
    if rc:
        raise SystemExit(f"postmortem failed ({rc}):\n{stderr[-3000:]}")
    return seconds, rss, json.loads(stdout)


# -- foreign logs (--foreign) --------------------------------------------------------------------


def _foreign_curve(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, loss, LR and grad norm of a run of ``n`` logged steps: a decaying loss with 2% noise,
    warmup (2% of the run) then cosine to 10%, and one loss spike with its grad-norm burst at 40%."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    lr = _lr({"peak_lr": 3e-4, "total_steps": n, "warmup_steps": max(1, n // 50), "min_ratio": 0.1}, steps + 1)
    loss = 2.0 + 8.8 * np.exp(-steps / (0.05 * n)) + 0.3 * np.exp(-steps / (0.5 * n))
    loss = loss * np.exp(0.02 * rng.standard_normal(n))
    gn = 0.3 + 2.0 * np.exp(-steps / 3000) + 0.05 * np.abs(rng.standard_normal(n))
    spike = int(0.4 * n)
    loss[spike] *= 8.0
    gn[spike] *= 40.0
    return steps, loss, lr, gn


def _write_csv(path: Path, n: int) -> None:
    """A W&B history export: ``_step`` (from 0), the train loss, LR and grad norm, printed as W&B does."""
    steps, loss, lr, gn = _foreign_curve(n, seed=n)
    with open(path, "w") as f:
        f.write("_step,train/loss,train/learning_rate,train/grad_norm\n")
        f.writelines(
            f"{s},{a!r},{b!r},{c!r}\n"
            for s, a, b, c in zip(steps.tolist(), loss.tolist(), lr.tolist(), gn.tolist(), strict=True)
        )


def _write_trainer_state(path: Path, n: int) -> None:
    """An HF ``trainer_state.json`` with ``logging_steps=1``: ``n`` log_history entries (steps 1..),
    an eval entry after every 1,000th step."""
    steps, loss, lr, gn = _foreign_curve(n, seed=n + 1)
    per_epoch = max(1, n // 3)
    history: list[dict] = []
    for s, a, b, c in zip(steps.tolist(), loss.tolist(), lr.tolist(), gn.tolist(), strict=True):
        step = s + 1
        epoch = round(step / per_epoch, 4)
        history.append({"epoch": epoch, "grad_norm": c, "learning_rate": b, "loss": round(a, 4), "step": step})
        if step % 1000 == 0:
            history.append({"epoch": epoch, "eval_loss": round(a * 1.05, 4), "eval_runtime": 12.5, "step": step})
    state = {
        "best_metric": None,
        "epoch": 3.0,
        "global_step": n,
        "log_history": history,
        "logging_steps": 1,
        "max_steps": n,
        "num_train_epochs": 3,
        "train_batch_size": 8,
    }
    path.write_text(json.dumps(state, indent=2))


def _foreign_sizes(quick: bool) -> dict[str, tuple[str, int]]:
    """Label -> (file name, rows). The ``1m`` label is the file the headline keys report."""
    if quick:
        return {
            "csv_200k": ("wandb-20k.csv", 20_000),
            "csv_1m": ("wandb-100k.csv", 100_000),
            "hf_300k": ("trainer_state.json", 30_000),
        }
    return {
        "csv_200k": ("wandb-200k.csv", 200_000),
        "csv_1m": ("wandb-1m.csv", 1_000_000),
        "hf_300k": ("trainer_state.json", 300_000),
    }


def _generate_foreign(folder: Path, quick: bool) -> None:
    for label, (name, rows) in _foreign_sizes(quick).items():
        (_write_trainer_state if label.startswith("hf") else _write_csv)(folder / name, rows)


def _peer_commands(path: Path) -> dict[str, list[str]]:
    """The peers installed next to this interpreter (or on PATH), as their docs run them."""
    found = {}
    for name, args in (
        ("losslint", ["check", str(path), "--format", "json"]),
        ("runmedic", ["diagnose", str(path), "--json"]),
    ):
        exe = Path(sys.executable).with_name(name)
        exe_s = str(exe) if exe.exists() else shutil.which(name)
        if exe_s:
            found[name] = [exe_s, *args]
    return found


def _foreign(folder: Path, quick: bool) -> dict[str, float]:
    """Time trainmon and the peers on each foreign file; the headline figures of the ``1m`` file."""
    t = time.perf_counter()
    gen = [sys.executable, __file__, "--generate-foreign", str(folder)] + (["--quick"] if quick else [])
    subprocess.run(gen, check=True)  # in a child, so this process (the timed ones' parent) stays small
    print(f"generated the foreign logs in {time.perf_counter() - t:.1f} s")
    head: dict[str, float] = {}
    for label, (name, rows) in _foreign_sizes(quick).items():
        path = folder / name
        seconds, rss, cpu, rc, stdout, stderr = _timed(
            [sys.executable, "-m", "trainmon.monitor.cli", "postmortem", str(path), "--json"]
        )
        if rc:
            raise SystemExit(f"trainmon postmortem {path} failed ({rc}):\n{stderr[-3000:]}")
        summary = json.loads(stdout)
        kinds = sorted({a["kind"] for a in summary["anomalies"]})
        print(
            f"{name} ({rows:,} rows): trainmon {seconds:.2f} s (CPU {cpu:.2f} s), peak RSS {rss:.0f} MiB, "
            f"anomalies {kinds}, load {os.getloadavg()[0]:.1f}"
        )
        peers: dict[str, float] = {}
        for peer, cmd in _peer_commands(path).items():
            p = _timed(cmd)
            ok = p.stdout.strip().startswith(("{", "["))
            print(
                f"{name}: {peer} {p.seconds:.2f} s (CPU {p.cpu_seconds:.2f} s), peak RSS {p.rss_mib:.0f} MiB "
                f"(exit {p.rc}{'' if ok else ', no JSON'})"
            )
            if ok:
                peers[peer] = p.seconds
        if label == "csv_1m":
            best = min(peers.values()) if peers else math.nan
            head = {
                "foreign_1m_seconds": seconds,
                "foreign_1m_rss_mib": rss,
                "best_peer_1m_seconds": best,
                "ratio_to_best_peer": seconds / best,
            }
    if not _peer_commands(folder):
        print("no peer installed (pip install losslint runmedic): best_peer_1m_seconds=nan")
    return head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k steps instead of 1M")
    parser.add_argument("--steps", type=int, help="steps per rank (default 1,000,000; 100,000 with --quick)")
    parser.add_argument("--db", help="keep the store here (reused when it already holds a run of this size)")
    parser.add_argument("--plots", action="store_true", help="also time --out (PNG plots and the HTML report)")
    parser.add_argument("--foreign", action="store_true", help="also time foreign logs (CSV, trainer_state.json)")
    parser.add_argument("--generate-only", metavar="DB", help=argparse.SUPPRESS)  # the child that builds the store
    parser.add_argument("--generate-foreign", metavar="DIR", help=argparse.SUPPRESS)  # the child writing the logs
    args = parser.parse_args(argv)
    if args.generate_only:
        print(json.dumps(generate(Path(args.generate_only), args.steps)))
        return 0
    if args.generate_foreign:
        _generate_foreign(Path(args.generate_foreign), args.quick)
        return 0
    n = args.steps or (100_000 if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory(prefix="trainmon-bench-") as tmp:
        foreign = _foreign(Path(tmp), args.quick) if args.foreign else {}
        db = Path(args.db) if args.db else Path(tmp) / "bench.sqlite"
        if not _holds(db, n):
            db.unlink(missing_ok=True)
            t = time.perf_counter()
            # Built in a child: a child's peak RSS counts its parent's at the fork, so the process
            # that starts the timed `trainmon postmortem` must stay small.
            gen = [sys.executable, __file__, "--generate-only", str(db), "--steps", str(n)]
            info = json.loads(subprocess.run(gen, check=True, capture_output=True, text=True).stdout)
            size = db.stat().st_size / 2**20
            print(f"generated {n:,} steps x {RANKS} ranks in {time.perf_counter() - t:.1f} s ({size:,.0f} MiB): {info}")
        seconds, rss, summary = _postmortem(db, None)
        found = sorted({a["kind"] for a in summary["anomalies"]})
        print(
            f"trainmon postmortem {RUN} --db ... --json: {seconds:.2f} s, peak RSS {rss:.0f} MiB "
            f"({summary['steps']:,} steps, {summary['attempts']} attempts, anomalies {found}, "
            f"sample stride {summary['sample']['stride']})"
        )
        if args.plots:
            p_seconds, p_rss, _ = _postmortem(db, Path(tmp) / "report")
            print(f"with --out (6 PNGs + report.html): {p_seconds:.2f} s, peak RSS {p_rss:.0f} MiB")
    print(f"target: <= 10 s and <= 2048 MiB for 1,000,000 x {RANKS}" + (" (this run is smaller)" if n < 1e6 else ""))
    head = " ".join(
        f"{k}={v:.2f}" if k.endswith("seconds") or k.startswith("ratio") else f"{k}={v:.0f}" for k, v in foreign.items()
    )
    print(f"{head} seconds={seconds:.2f} peak_rss_mib={rss:.0f}".lstrip())
    return 0


def _holds(db: Path, n: int) -> bool:
    if not db.exists():
        return False
    try:
        con = sqlite3.connect(db)
        row = con.execute("SELECT planned_steps FROM runs WHERE run = ?", (RUN,)).fetchone()
        con.close()
    except sqlite3.Error:
        return False
    return row is not None and row[0] == n


if __name__ == "__main__":
    sys.exit(main())
