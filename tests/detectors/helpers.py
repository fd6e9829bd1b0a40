"""Streams and reference runs shared by the detector tests."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from tests.trainer_helpers import run_trainer
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.store.storage import Storage
from trainmon.wire import Event


def ev(kind: str, fields: dict, t: float = 0.0) -> Event:
    return Event(kind, "r", 0, "h", "s", 0, t, fields)


def start(**fields) -> Event:
    base = {"vocab_size": 256, "world_size": 1, "accum_steps": 1, "resumed": False}
    base.update(fields)
    return ev("run_start", base)


def curve(n: int, seed: int, noise: float, warmup: int = 20) -> list[float]:
    """A tiny model's loss: exponential decay from ln V to a floor, multiplicative noise."""
    rng = random.Random(seed)
    l0, floor, tau = math.log(256), rng.uniform(1.2, 2.5), rng.uniform(n / 8, n / 3)
    return [(floor + (l0 - floor) * math.exp(-t / tau)) * math.exp(noise * rng.gauss(0, 1)) for t in range(n)]


def feed(det: Detector, events: list[Event]) -> list[Finding]:
    out = []
    for e in events:
        out.extend(det.observe(e, 0))
    return out


def run_reference(tmp_path: Path, name: str, *args: str, steps: int = 120) -> tuple[list[dict], list[dict]]:
    """A short reference-trainer run analysed like `trainmon postmortem`: (anomalies, labels)."""
    out = tmp_path / name
    run_trainer(out, "--threads", "1", *args, steps=steps, run=name, timeout=180)
    storage = Storage("sqlite://")
    import_file(out / "events.jsonl", storage)
    anomalies = summarize(storage, name)["anomalies"]
    labels = json.loads((out / "labels.json").read_text()) if (out / "labels.json").exists() else []
    return anomalies, labels
