"""The Python half of ``bench/gpu_check.sh``: the checks that are more than running a command.

Each subcommand prints what it saw, then one last line of ``key=value`` pairs that the script gathers into its
headline, and exits 1 when its check fails (2 on bad usage). Everything but ``findings`` runs on the device
machine from the source tree, with none of the daemon's dependencies:

- ``calibrate``: the batch for which ``bench/hook_overhead.py``'s loop takes 20-50 ms a step on this device;
- ``nvml``: one real NVML sample through ``trainmon.hooks.health.nvml_snapshot``, each field checked for a
  plausible value in the unit the wire format names (°C, W, Hz, bytes, a 0-1 ratio), against the driver's own
  limits for the same GPU (slowdown temperature, enforced power limit, maximum SM clock) where it has them;
- ``checksum``: ``trainmon.hooks.checksum.weights_checksum`` of trained weights on the device equals the CPU's
  for the same weights bit for bit (the bit-pattern sum is exact integer arithmetic, whatever the kernel order),
  two data-parallel replicas (the same gradient, each its own optimizer step, as after an all-reduce) agree, and
  a one-ulp change to one weight changes it;
- ``events``: the reference trainer's JSONL holds what the hooks must measure (every step, CUDA-event phase
  times, read-back losses in step order with the NaN where it was injected, weight checksums, GPU health);
- ``findings`` (CPU side, needs the daemon's dependencies): ``trainmon postmortem --json`` found each injected
  fault (``labels.json``) at its step, and nothing unrelated at warning level or above.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

# The same kinds bench/detection.py accepts beside a fault's own (a loss spike also spikes the grad norm ...).
RELATED = {
    "loss_spike": {"grad_explosion", "eval_regression"},
    "nan": {"loss_spike", "grad_explosion", "divergence", "eval_regression", "loss_scale_collapse"},
    "data_stall": set(),
}
MAX_DELAY = 10  # steps after a fault's last step within which its finding must start

# Plausible ranges in the wire format's units; a value off by 1000x is the unit NVML reports in (mW, MHz, m°C).
PLAUSIBLE = {
    "temperature_c": (5, 110),
    "power_w": (5, 2000),
    "sm_clock_hz": (5e7, 5e9),  # an idle GPU clocks down to a few hundred MHz
    "mem_total_bytes": (4 << 30, 1 << 40),
    "utilization_ratio": (0, 1),
}
REQUIRED_GPU_FIELDS = (*PLAUSIBLE, "uuid", "mem_used_bytes", "throttle_reasons", "ecc_corrected", "ecc_uncorrected")


def kv_line(**kv: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in kv.items())


# -- env ------------------------------------------------------------------------------------------------------


def cmd_env(args: argparse.Namespace) -> int:
    """The trainer side imports from the source tree (the shim), without the daemon's packages; the device."""
    import torch

    import trainmon
    import trainmon.hooks
    import trainmon.reference_trainer.train

    problems = [] if trainmon.__file__.startswith(args.shim) else [f"trainmon imports from {trainmon.__file__}"]
    for mod in ("sqlalchemy", "fastapi", "uvicorn", "orjson", "alembic"):
        try:
            __import__(mod)
            problems.append(f"{mod} imports on the trainer side")
        except ImportError:
            pass
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0).replace(" ", "_") if cuda else "none"
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, device {name}")
    print(f"trainmon from {Path(trainmon.__file__).parent}; " + ("; ".join(problems) or "daemon packages out of reach"))
    print(kv_line(cuda=int(cuda), gpu=name))
    return 1 if problems else 0


# -- nvml ---------------------------------------------------------------------------------------------------


def nvml_problems(gpu: dict[str, Any], limits: dict[str, float] | None = None) -> list[str]:
    """What is missing or implausible in one GPU of ``nvml_snapshot()``; ``limits`` are the driver's own
    (``slowdown_c``, ``power_limit_w``, ``max_sm_clock_hz``, ``torch_total_bytes``) where known."""
    problems = [f"{k} missing" for k in REQUIRED_GPU_FIELDS if gpu.get(k) is None]
    for key, (lo, hi) in PLAUSIBLE.items():
        v = gpu.get(key)
        if v is not None and not (isinstance(v, (int, float)) and lo <= v <= hi):
            problems.append(f"{key}={v!r} outside [{lo:g}, {hi:g}]")
    used, total = gpu.get("mem_used_bytes"), gpu.get("mem_total_bytes")
    if used is not None and total is not None and not 0 <= used <= total:
        problems.append(f"mem_used_bytes={used} not within 0..mem_total_bytes={total}")
    for key in ("throttle_reasons", "ecc_corrected", "ecc_uncorrected"):
        v = gpu.get(key)
        if v is not None and not (isinstance(v, int) and 0 <= v < 1 << 64):
            problems.append(f"{key}={v!r} is not a count or bit mask")
    uuid = gpu.get("uuid")
    if uuid is not None and not str(uuid).startswith(("GPU-", "MIG-")):
        problems.append(f"uuid={uuid!r} does not start with GPU-")
    limits = limits or {}
    checks = (
        ("temperature_c", "slowdown_c", 1.0),  # idle or training, below the slowdown threshold
        ("power_w", "power_limit_w", 1.25),  # power can overshoot the enforced limit briefly
        ("sm_clock_hz", "max_sm_clock_hz", 1.01),
    )
    for key, limit, slack in checks:
        v, lim = gpu.get(key), limits.get(limit)
        if isinstance(v, (int, float)) and lim and v > lim * slack:
            problems.append(f"{key}={v:g} above the driver's {limit}={lim:g}")
    torch_total = limits.get("torch_total_bytes")
    if isinstance(total, int) and torch_total and not 0.8 <= torch_total / total <= 1.05:
        problems.append(f"mem_total_bytes={total} vs torch's total_memory={torch_total}: more than the reserve apart")
    return problems


def driver_limits(index: int) -> dict[str, float]:
    """The driver's limits for GPU ``index`` in the wire format's units, from NVML and torch (what answers)."""
    from trainmon.hooks.health import _nvml, _try

    nv, out = _nvml(), {}
    if nv is None:
        return out
    h = nv.nvmlDeviceGetHandleByIndex(index)
    slowdown = _try(lambda: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
    power = _try(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))  # mW
    clock = _try(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))  # MHz
    for key, v in (("slowdown_c", slowdown), ("power_limit_w", power and power / 1000), ("max_sm_clock_hz", clock)):
        if v:
            out[key] = v * 1_000_000 if key == "max_sm_clock_hz" else v
    try:
        import torch

        if torch.cuda.is_available() and index < torch.cuda.device_count():
            out["torch_total_bytes"] = torch.cuda.get_device_properties(index).total_memory
    except Exception:
        pass
    return out


def cmd_nvml(_args: argparse.Namespace) -> int:
    from trainmon.hooks import health

    if health.pynvml is None:
        print("nvml: skipped, nvidia-ml-py (pynvml) is not installed")
        print(kv_line(nvml_ok="skipped"))
        return 0
    gpus = health.nvml_snapshot()
    if not gpus:
        print("nvml: skipped, no NVML driver or no GPU answers (nvmlInit failed or 0 devices)")
        print(kv_line(nvml_ok="skipped"))
        return 0
    bad = 0
    for gpu in gpus:
        limits = driver_limits(gpu["index"])
        problems = nvml_problems(gpu, limits)
        bad += bool(problems)
        try:
            from trainmon.monitor.detectors.node_health import decode_throttle

            reasons = decode_throttle(gpu.get("throttle_reasons") or 0)
        except Exception:  # the daemon side is not needed for this line
            reasons = [hex(gpu.get("throttle_reasons") or 0)]
        print(f"nvml gpu {gpu['index']}: {json.dumps(gpu)}")
        print(f"  driver limits: {json.dumps(limits)}; throttle reasons: {reasons or ['none']}")
        print("  " + ("; ".join(problems) if problems else "every field present and plausible"))
    g = gpus[0]
    print(
        kv_line(
            nvml_ok=int(not bad),
            nvml_temp_c=g.get("temperature_c"),
            nvml_power_w=f"{g.get('power_w', math.nan):.1f}",
            nvml_sm_clock_mhz=f"{g.get('sm_clock_hz', math.nan) / 1e6:.0f}",
            nvml_throttle=hex(g.get("throttle_reasons") or 0),
            nvml_ecc=f"{g.get('ecc_corrected')}/{g.get('ecc_uncorrected')}",
        )
    )
    return 1 if bad else 0


# -- checksum -----------------------------------------------------------------------------------------------


def checksum_report(device: str, steps: int = 3) -> dict[str, Any]:
    """Train a small GPT on ``device`` (bf16 autocast on CUDA), then compare weight checksums: device vs a CPU
    copy, two replicas that applied the same gradients, a copy with one weight one ulp away; and the same
    checksum twice. The bit halves and the left-out count must match exactly; the sum of squares is float
    arithmetic whose order differs between devices, so its relative difference is reported."""
    import torch

    from trainmon.hooks.checksum import weights_checksum
    from trainmon.reference_trainer.model import GPT, GPTConfig

    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0)
    a = GPT(cfg).to(dev)
    b = copy.deepcopy(a)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    for _ in range(steps):
        x = torch.randint(0, 256, (8, 65), device=dev)
        with autocast:
            _, loss = a(x[:, :-1], x[:, 1:])
        loss.backward()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            pb.grad = pa.grad.clone()  # what an all-reduce gives every replica
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)

    def cs(model: torch.nn.Module) -> list[float]:
        return weights_checksum(model.parameters()).cpu().tolist()

    on_device, again = cs(a), cs(a)
    on_cpu = cs(copy.deepcopy(a).cpu())
    replica = cs(b)
    nudged = copy.deepcopy(a)
    with torch.no_grad():
        w = next(nudged.parameters())
        flat = w.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, device=dev, dtype=w.dtype))
    off_by_ulp = cs(nudged)
    squares_rel = abs(on_device[2] - on_cpu[2]) / max(abs(on_cpu[2]), 1e-30)
    return {
        "device": str(dev),
        "checksum_device": on_device,
        "checksum_cpu": on_cpu,
        "checksum_replica": replica,
        "bitwise": on_device[:2] == on_cpu[:2] and on_device[3] == on_cpu[3],
        "squares_bitwise": on_device[2] == on_cpu[2],
        "squares_rel_diff": squares_rel,
        "replicas_agree": replica == on_device,
        "stable": again == on_device,
        "ulp_detected": off_by_ulp[:2] != on_device[:2],
    }


def cmd_checksum(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    r = checksum_report(device)
    print(
        f"checksum on {r['device']}: {r['checksum_device']}; CPU copy {r['checksum_cpu']}; "
        f"replica {r['checksum_replica']}"
    )
    print(
        f"  bits and left-out count equal to the CPU's: {r['bitwise']}; sum of squares bitwise {r['squares_bitwise']} "
        f"(relative difference {r['squares_rel_diff']:.2e}); replicas agree: {r['replicas_agree']}; the same "
        f"checksum twice: {r['stable']}; one weight one ulp away changes it: {r['ulp_detected']}"
    )
    ok = r["bitwise"] and r["replicas_agree"] and r["stable"] and r["ulp_detected"] and r["squares_rel_diff"] < 1e-4
    print(
        kv_line(
            checksum_ok=int(ok),
            checksum_device=r["device"],
            checksum_bitwise=int(r["bitwise"]),
            checksum_replicas_agree=int(r["replicas_agree"]),
            checksum_squares_rel=f"{r['squares_rel_diff']:.1e}",
        )
    )
    return 0 if ok else 1


# -- calibrate ----------------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time hook_overhead's loop (no monitoring) at a trial batch and scale the batch to ``--target-ms``."""
    import torch

    from trainmon.reference_trainer.model import GPT, GPTConfig

    dev = torch.device(args.device)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.d_model, dropout=0
    )
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step_ms(batch: int, n: int = 3) -> float:
        x = torch.randint(0, args.vocab, (batch, args.seq + 1), device=dev)
        times = []
        for _ in range(n + 2):  # two untimed: allocator and kernel selection
            t0 = time.perf_counter()
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times[2:])[n // 2]

    trial = args.batch
    ms = step_ms(trial)
    batch = max(1, min(args.max_batch, round(trial * args.target_ms / ms)))
    final = step_ms(batch) if batch != trial else ms
    print(f"calibrate on {dev}: batch {trial} -> {ms:.1f} ms/step; batch {batch} -> {final:.1f} ms/step")
    print(kv_line(batch=batch, step_ms=f"{final:.1f}"))
    return 0


# -- events -------------------------------------------------------------------------------------------------


def events_problems(events: list[dict[str, Any]], labels: list[dict[str, Any]], cuda: bool) -> tuple[list[str], dict]:
    """What the trainer's JSONL lacks of what the hooks must measure; and a few figures from it."""
    problems: list[str] = []
    start = next((e["fields"] for e in events if e["kind"] == "run_start"), None)
    end = next((e["fields"] for e in events if e["kind"] == "run_end"), None)
    steps = sorted((e["fields"] for e in events if e["kind"] == "step"), key=lambda f: f["step"])
    if start is None or end is None:
        return ["no run_start or run_end"], {}
    planned = start.get("planned_steps")
    if [f["step"] for f in steps] != list(range(planned or 0)):
        problems.append(f"steps logged {len(steps)} of {planned}, or not 0..{planned}-1 once each")
    if end.get("status") != "finished" or end.get("dropped_events"):
        problems.append(f"run_end {end}")
    device = str(start.get("device"))
    if device.startswith("cuda") != cuda:
        problems.append(f"trained on {device}")
    if cuda and (start.get("config") or {}).get("precision") != "bf16":
        problems.append(f"precision {(start.get('config') or {}).get('precision')}, not bf16")
    nan_from = min((lab["first_step"] for lab in labels if lab["kind"] == "nan"), default=None)
    wrong = [
        f["step"]
        for f in steps
        if not isinstance(f.get("loss"), (int, float, str))  # the wire format writes a NaN as "NaN"
        or (math.isnan(float(f["loss"])) != (nan_from is not None and f["step"] >= nan_from))
    ]
    if wrong:  # the read-back must bring each step's own loss: NaN exactly from the injected step on
        problems.append(f"losses finite/NaN at the wrong steps: {wrong[:5]}")
    device_phases = [
        sum((f.get("phases") or {}).get(p, 0.0) for p in ("forward", "backward", "optimizer")) for f in steps
    ]
    missing = [f["step"] for f, d in zip(steps, device_phases, strict=True) if d <= 0]
    if missing:
        problems.append(f"no forward/backward/optimizer time at steps {missing[:5]}")
    med = sorted(device_phases)[len(device_phases) // 2] if steps else math.nan
    med_step = sorted(f["step_time"] for f in steps)[len(steps) // 2] if steps else math.nan
    if not med <= 1.5 * med_step:  # CUDA-event times of a step cannot much exceed the step's wall time
        problems.append(f"median device phases {med * 1e3:.2f} ms vs median step {med_step * 1e3:.2f} ms")
    every = (start.get("config") or {}).get("checksum_every") or 0
    sums = [f["step"] for f in steps if isinstance(f.get("weights_checksum"), list)]
    if every and sums[:2] != [0, every]:
        problems.append(f"weight checksums at steps {sums[:3]}, expected 0, {every}, ...")
    if cuda and not all("mem_peak_bytes" in f for f in steps):
        problems.append("mem_peak_bytes missing (torch.cuda memory counters)")
    gpus = [e["fields"]["gpus"] for e in events if e["kind"] == "health" and e["fields"].get("gpus")]
    figures = {
        "trainer_steps": len(steps),
        "trainer_step_ms": f"{med_step * 1e3:.2f}",
        "trainer_health_gpus": len(gpus),
    }
    return problems, figures


def cmd_events(args: argparse.Namespace) -> int:
    out = Path(args.out)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    labels = json.loads((out / "labels.json").read_text())
    problems, figures = events_problems(events, labels, args.cuda)
    if args.cuda and args.nvml and not figures.get("trainer_health_gpus"):
        problems.append("no health event carries NVML gpus")
    print(f"trainer events ({len(events)} in {out / 'events.jsonl'}): " + ("; ".join(problems) or "as expected"))
    print(kv_line(trainer_ok=int(not problems), **figures))
    return 1 if problems else 0


# -- findings (CPU side) ------------------------------------------------------------------------------------


def findings_problems(report: dict[str, Any], labels: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(faults not found at their step, findings at warning level or above that no fault explains)."""
    anomalies = report.get("anomalies") or []
    missed = []
    for lab in labels:
        hit = [
            a
            for a in anomalies
            if a["kind"] == lab["expected_detection"]
            and a.get("first_step") is not None
            and lab["first_step"] <= a["first_step"] <= lab["last_step"] + MAX_DELAY
        ]
        if not hit:
            missed.append(f"{lab['spec']} ({lab['expected_detection']} from step {lab['first_step']})")
    allowed = {lab["expected_detection"] for lab in labels} | set().union(
        *(RELATED.get(lab["kind"], set()) for lab in labels)
    )
    extra = [
        f"{a['kind']} {a['severity']} at step {a.get('first_step')}: {a.get('message', '')[:120]}"
        for a in anomalies
        if a["kind"] not in allowed and a.get("severity") in ("warning", "critical")
    ]
    return missed, extra


def cmd_findings(args: argparse.Namespace) -> int:
    report = json.loads(Path(args.report).read_text())
    labels = json.loads(Path(args.labels).read_text())
    missed, extra = findings_problems(report, labels)
    for a in report.get("anomalies") or []:
        print(
            f"  finding {a['kind']} {a['severity']} steps {a.get('first_step')}-{a.get('last_step')}: "
            f"{a['message'][:110]}"
        )
    for m in missed:
        print(f"  MISSED {m}")
    for x in extra:
        print(f"  UNEXPECTED {x}")
    print(
        kv_line(
            findings_ok=int(not missed and not extra), faults=len(labels), missed=len(missed), unexpected=len(extra)
        )
    )
    return 1 if missed or extra else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env", help="the trainer side imports from the source tree, not the daemon's packages")
    p.add_argument("--shim", required=True, help="the folder the trainmon package must come from")
    p.set_defaults(fn=cmd_env)
    sub.add_parser("nvml", help="one real NVML sample, checked").set_defaults(fn=cmd_nvml)
    p = sub.add_parser("checksum", help="weight checksum: device vs CPU, replicas")
    p.add_argument("--device", help="default: cuda when there is one, else cpu")
    p.set_defaults(fn=cmd_checksum)
    p = sub.add_parser("calibrate", help="the batch that makes hook_overhead's step take --target-ms")
    for name, default in (("layers", 12), ("d-model", 768), ("heads", 12), ("seq", 256), ("vocab", 8192), ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda")
    p.add_argument("--target-ms", type=float, default=30.0)
    p.add_argument("--max-batch", type=int, default=256)
    p.set_defaults(fn=cmd_calibrate)
    p = sub.add_parser("events", help="check the reference trainer's JSONL")
    p.add_argument("out", help="the trainer's --out folder (events.jsonl, labels.json)")
    p.add_argument("--cuda", action="store_true", help="the run was on CUDA, bf16")
    p.add_argument("--nvml", action="store_true", help="NVML answers here: health events must carry GPUs")
    p.set_defaults(fn=cmd_events)
    p = sub.add_parser("findings", help="CPU side: the post-mortem found each injected fault")
    p.add_argument("report", help="output of trainmon postmortem FILE --json")
    p.add_argument("labels", help="the trainer's labels.json")
    p.set_defaults(fn=cmd_findings)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
