"""Early-warning benchmark: does ``instability_precursor`` name a divergence before the loss shows it?

Real CPU training runs of the reference trainer's tiny GPT (2 blocks, width 64, no qk-layernorm),
400 steps, the precursors sampled every 10 steps (``--detail-every 10``):

* instability: ``--inject lr_too_high@0`` (the declared peak LR x100, 0.3, reached by a 200-step
  warmup), over several seeds: the attention logits of a block grow, attention collapses and the
  loss diverges (1.5 -> 3.9 nats);
* clean: no fault, at peak LRs up to the largest stable one tried (1e-3, 3e-3, 1e-2, 3e-2: the loss
  trains normally at each; at 3e-2 the attention-logit bound grows 17-27x, after the warmup), over seeds;
* control (full mode): ``divergence@150`` (random targets ramping in): a loss-only failure the
  precursor must not claim;
* unscored (full mode): peak LR 0.1 (10-step warmup), past the largest stable one: what the precursor
  and the loss say there is printed, neither a hit nor a false warning.

For each run the events file is read back and validated as the collector would, fed to the
detector, and the post-mortem (``trainmon postmortem FILE --json``) gives the loss-based findings
(``loss_spike``, ``divergence``, ``nan_inf``, ``grad_explosion``: everything that read the loss and
the gradient norm before). ``lead_steps`` is the first loss-based finding's step minus the first
precursor warning's step; a fault run is recalled when the precursor warns strictly first. On the tiny
GPT that first warning is an episode of logit growth early in the warmup (LR ~0.05) that subsides
(the finding resolves) before the collapse that diverges the loss: ``open_lead_steps_median`` is the
lead of the warning still open when the first loss-based finding came (none open: not counted).
``clean_false_warnings`` counts precursor findings at warning or above on clean and control runs.
``overhead_pct`` is the capture's added time per step at the default sampling (``detail_every=100``): a sampled step's
forward hooks and reductions, timed against the plain training step in the same process, divided by
100 (the other steps pay one counter check).

    python bench/early_warning.py            # 7 fault seeds, 4 LRs x 3 seeds clean, the control
    python bench/early_warning.py --quick    # under a minute: 1 fault seed, 1 clean run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainmon.hooks.precursors import Precursors
from trainmon.monitor.detectors.base import Finding
from trainmon.monitor.detectors.instability_precursor import InstabilityPrecursor, InstabilityPrecursorConfig
from trainmon.reference_trainer.model import GPT, GPTConfig
from trainmon.wire import validate_event

LOSS_KINDS = ("loss_spike", "divergence", "nan_inf", "grad_explosion")
STEPS = 400
EVERY = 10


def train(out: Path, seed: int, lr: float | None, inject: str | None) -> Path:
    """One reference-trainer run; returns its events file."""
    cmd = [sys.executable, "-m", "trainmon.reference_trainer", "--run", "ew", "--steps", str(STEPS), "--out", str(out)]
    cmd += ["--seed", str(seed), "--detail-every", str(EVERY), "--threads", "1", "--checksum-every", "0"]
    cmd += ["--heartbeat-interval", "0", "--health-interval", "0"]
    if lr is not None:
        cmd += ["--lr", str(lr)]
    if inject is not None:
        cmd += ["--inject", inject]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out / "events.jsonl"


def largest_bound(events: Path) -> float:
    """The largest attention-logit bound any sampled step of the run sent."""
    steps = [json.loads(line)["fields"] for line in events.read_text().splitlines()]
    return max((max(f["attn_logit_max"].values()) for f in steps if "attn_logit_max" in f), default=0.0)


def precursor_findings(events: Path) -> list[Finding]:
    det = InstabilityPrecursor(InstabilityPrecursorConfig())
    return [f for line in events.read_text().splitlines() for f in det.observe(validate_event(json.loads(line)), 0)]


def _own(f: Finding) -> dict[str, Any] | None:
    """The finding's own episode among the anomaly's open ones (None: it settled)."""
    e = f.evidence
    return next((o for o in e["open"] if (o["mechanism"], o["module"]) == (e["mechanism"], e["module"])), None)


def warnings(found: list[Finding]) -> list[tuple[int | None, str]]:
    """The episodes that opened or escalated at warning or above, in order: (step, text). Info episodes (a growth at
    the LR's peak) ask nobody to act: they are neither warnings nor false ones."""
    return [
        (f.step, f"{own['severity']} step {f.step}: {f.message}")
        for f in found
        if (own := _own(f)) is not None and own["severity"] != "info"
    ]


def open_since(found: list[Finding], step: int) -> int | None:
    """The step of the earliest warning whose episode is still open at ``step`` (the anomaly's ``open`` list as of
    its latest finding by then): the episode the divergence came in."""
    warned: dict[tuple[str, str, int], int] = {}  # (mechanism, module, since) -> the step it first warned at
    still: list[dict[str, Any]] = []
    for f in found:
        if f.step is None or f.step > step:
            break
        if (own := _own(f)) is not None and own["severity"] != "info":
            warned.setdefault((own["mechanism"], own["module"], own["since_step"]), f.step)
        still = f.evidence["open"]
    return min(
        (w for o in still if (w := warned.get((o["mechanism"], o["module"], o["since_step"]))) is not None),
        default=None,
    )


def first_loss_finding(events: Path) -> tuple[int | None, str]:
    report = subprocess.run(
        [sys.executable, "-m", "trainmon", "postmortem", str(events), "--json"], check=True, capture_output=True
    )
    found = [a for a in json.loads(report.stdout)["anomalies"] if a["kind"] in LOSS_KINDS]
    if not found:
        return None, "none"
    a = min(found, key=lambda a: a["first_step"])
    return a["first_step"], f"{a['kind']} {a['severity']}"


def overhead_pct(reps: int) -> float:
    """The capture's cost per step at detail_every=100, from interleaved plain and sampled steps (percent)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    p = Precursors(model)
    p.set_vocab(64)
    x = torch.randint(64, (8, 64))

    def step(sampled: bool) -> float:
        t0 = time.perf_counter()
        if sampled:
            p.arm()
        _, loss = model(x, x)
        if sampled:
            p.collect()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for _ in range(5):
        step(True)
    plain, sampled = [], []
    for _ in range(reps):
        plain.append(step(False))
        sampled.append(step(True))
    base = min(plain)  # the least disturbed of each: other processes share the cores
    return (min(sampled) - base) / base / 100 * 100


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one fault seed and one clean run (under a minute)")
    args = ap.parse_args(argv)
    fault_seeds = [1337] if args.quick else [1337, 1, 2, 3, 4, 5, 6]
    clean = [(1e-2, 1337)] if args.quick else [(lr, s) for lr in (1e-3, 3e-3, 1e-2, 3e-2) for s in (1337, 1, 2)]
    controls = [] if args.quick else [("divergence@150", 1337)]
    above = [] if args.quick else [0.1]  # past the largest stable LR: reported, not scored
    leads: list[int] = []
    open_leads: list[int] = []
    recalled = false_warnings = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in fault_seeds:
            events = train(Path(tmp) / f"fault{seed}", seed, None, "lr_too_high@0")
            found = precursor_findings(events)
            warned = warnings(found)
            warn = warned[0][0] if warned else None
            loss_step, loss_kind = first_loss_finding(events)
            lead: Any = None
            still: Any = None
            if warn is not None and loss_step is not None:
                lead = loss_step - warn
                leads.append(lead)
                since = open_since(found, loss_step)
                still = None if since is None else loss_step - since
                if still is not None:
                    open_leads.append(still)
            recalled += warn is not None and (loss_step is None or warn < loss_step)
            print(
                f"lr_too_high seed={seed}: first warning step {warn}, loss-based {loss_step} ({loss_kind}), "
                f"lead {lead}; warning open at the loss finding: lead {still}"
            )
            for _, text in warned[:1]:
                print(f"  {text}")
        for lr, seed in clean:
            events = train(Path(tmp) / f"c{lr}-{seed}", seed, lr, None)
            messages = [t for _, t in warnings(precursor_findings(events))]
            false_warnings += len(messages)
            print(
                f"clean lr={lr} seed={seed}: largest bound {largest_bound(events):.3g}, warnings {len(messages)}"
                + (f" ({messages[0]})" if messages else "")
            )
        for inject, seed in controls:
            events = train(Path(tmp) / f"control{seed}", seed, None, inject)
            messages = [t for _, t in warnings(precursor_findings(events))]
            false_warnings += len(messages)
            loss_step, loss_kind = first_loss_finding(events)
            print(
                f"control {inject} seed={seed}: precursor warnings {len(messages)}, loss-based {loss_step} {loss_kind}"
            )
        for lr in above:
            events = train(Path(tmp) / f"above{lr}", 1337, lr, None)
            texts = [t for _, t in warnings(precursor_findings(events))]
            loss_step, loss_kind = first_loss_finding(events)
            final = [json.loads(line)["fields"] for line in events.read_text().splitlines()]
            last = [f["loss"] for f in final if "loss" in f and "step" in f][-20:]
            print(
                f"unscored lr={lr} seed=1337: largest bound {largest_bound(events):.3g}, warnings {len(texts)}"
                + (f" (first: {texts[0]})" if texts else "")
                + f", loss-based {loss_step} ({loss_kind}), mean loss of the last 20 steps {statistics.fmean(last):.3f}"
            )
    overhead = overhead_pct(20 if args.quick else 100)
    median = statistics.median(leads) if leads else float("nan")
    open_median = statistics.median(open_leads) if open_leads else float("nan")
    print(
        f"lead_steps_median={median:g} precursor_recall={recalled / len(fault_seeds):.2f} "
        f"clean_false_warnings={false_warnings} overhead_pct={overhead:.3f} open_lead_steps_median={open_median:g}"
    )


if __name__ == "__main__":
    main()
