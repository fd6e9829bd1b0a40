"""A detector's :meth:`Detector.observe_batch` reports what its :meth:`~Detector.observe` reports one event at a
time, for every cut of a stream into batches, and leaves the detector as ``observe`` would.

Overrides decide many events at once to be cheaper (a long log's import calls each detector a million times);
this is the proof that they find nothing else. Every detector is checked, overridden or not, on the detection
benchmark's fault traces and clean controls, on every real log of the dev set, and on hostile streams (fields of
every wrong type, non-finite values, steps going backwards, resumes, other kinds between the steps), fed as the
engine feeds it: its (run, rank)'s events (the run's, for run-scope detectors) of the kinds it reads, cut at random
into batches with a tick on the stream's clock between them, and in one batch of everything.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator

import pytest

from bench.synthetic import clean_controls, fault_traces
from tests.detectors.test_detector_loss_noise import _run as noise_trace
from tests.detectors.test_detector_memory_leak import MIB, gpu_trace
from tests.detectors.test_detector_replica_divergence import trace as replica_trace
from tests.detectors.test_detector_straggler import trace as straggler_trace
from tests.real_log_types import REAL_LOGS
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, Detector, Finding
from trainmon.monitor.importers import read_events
from trainmon.wire import EVENT_KINDS, Event, WireError, validate_event

Stream = list[tuple[Event, int]]


def _attempts(events: list[Event]) -> Stream:
    """Events with their attempt: a (run, rank)'s run_starts counted, as the store counts resumes."""
    starts: dict[tuple[str, int], int] = {}
    out = []
    for ev in events:
        key = (ev.run, ev.rank)
        if ev.kind == "run_start":
            starts[key] = starts.get(key, -1) + 1
        out.append((ev, max(0, starts.get(key, 0))))
    return out


def _plausible(rng: random.Random, spec_type: str, level: float) -> object:
    odd = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e308, 5e-324, 0, 7, True, None, "1.5", []]
    if rng.random() < 0.15:
        return rng.choice(odd)
    return {
        "int": rng.choice([0, 1, 512, 10**6]),
        "float": level * rng.choice([1.0, 1.0, 1.0, 0.5, 2.0, 30.0]),
        "float_list": [level * 1e-3] * rng.choice([1, 1, 2]),
        "float_map": {"accuracy": level},
        "str": "x",
        "bool": rng.random() < 0.5,
        "json": {"warmup_steps": rng.choice([0, 10, 100]), "name": "cosine", "peak_lr": 1e-3, "total_steps": 2000},
    }.get(spec_type)


def _admitted(raw: dict) -> Event | None:
    """The event as the collector would take it: fields the wire format refuses dropped one by one."""
    while True:
        try:
            return validate_event(raw)
        except WireError as exc:
            field = exc.path.removeprefix("event.fields.").split(".")[0].split("[")[0]
            if not exc.path.startswith("event.fields.") or field not in raw["fields"]:
                return None
            del raw["fields"][field]


def _hostile(seed: int) -> list[Event]:
    """Every kind, with fields of any value the wire format lets through, two ranks, steps that go back and jump,
    resumes, long silences, a loss that trends, spikes and goes non-finite."""
    rng = random.Random(seed)
    kinds = sorted(EVENT_KINDS)
    events: list[Event] = []
    t, steps = 1e9, [0, 0]
    for i in range(3000):
        rank = rng.randrange(2)
        t += rng.choice([0.1, 0.1, 0.1, 0.12, 5.0, 900.0])
        kind = "run_start" if i < 2 else "step" if rng.random() < 0.9 else rng.choice(kinds)
        level = 3.0 * math.exp(-i / 2000) + 0.05 * rng.gauss(0, 1)
        if kind == "step":
            steps[rank] += rng.choice([1, 1, 1, 1, 1, 1, 0, -3, 50])
        elif kind == "run_start":
            steps[rank] = rng.choice([0, steps[rank] // 2, steps[rank]])
        specs = EVENT_KINDS[kind].items()
        fields = {name: _plausible(rng, spec.type, level) for name, spec in specs if rng.random() < 0.6}
        if "step" in EVENT_KINDS[kind]:
            fields["step"] = steps[rank]
        if kind == "step":
            fields["loss"] = level if rng.random() < 0.95 else _plausible(rng, "float", level)
            fields["lr"] = [1e-3 * (1 + i // 1000)]
        if kind == "eval":
            fields["loss"] = level
        raw = {"kind": kind, "run": "hostile", "rank": rank, "host": "h", "stream": f"s{rank}", "seq": i, "time": t}
        ev = _admitted({**raw, "fields": fields})
        if ev is not None:
            events.append(ev)
    return events


def _real_logs() -> Iterator[tuple[str, list[Event]]]:
    for path in sorted(REAL_LOGS.iterdir()):
        if path.name not in ("manifest.json", "README.md"):
            yield path.name, list(read_events(path))


def _faults() -> dict[str, Stream]:
    """Faults the detection benchmark's traces have no kind of, from the detectors' own tests."""
    growth = [0.3, 1.4, 2.0, 2.4, 2.1, 30.0, 40.0, 90.0, 400.0, 2.0, 2.2] * 3
    precursor = [Event("run_start", "p", 0, "h", "s", 0, 0.0, {"vocab_size": 64})]
    for i, v in enumerate(growth):
        bounds = {"blocks.0.attn": 2.0, "blocks.1.attn": v}
        fields = {"step": i * 10, "loss": 2.0, "lr": [0.1], "attn_logit_max": bounds}
        precursor.append(Event("step", "p", 0, "h", "s", 2 * i + 1, float(i), fields))
        precursor.append(Event("step", "p", 0, "h", "s", 2 * i + 2, i + 0.5, {"step": i * 10 + 1, "loss": 2.0}))
    return {
        "straggler": _attempts(straggler_trace(slow=lambda r, s: 3.0 if r == 1 and 50 <= s < 120 else 1.0)),
        "memory_leak": _attempts(gpu_trace(leak=lambda s: max(0, s - 300) * 60 * MIB)),
        "replica_divergence": replica_trace(4, model=lambda r, s: 1 if r == 2 and 30 <= s < 70 else 0),
        "instability_precursor": _attempts(precursor),
        "loss_noise": _attempts(noise_trace(2, louder_from=600, fingerprints=True)),
        "loss_noise_quiet_again": _attempts(noise_trace(3, louder_from=400) + noise_trace(4, 0.01)[1:]),
    }


@functools.cache
def _streams() -> dict[str, Stream]:
    synthetic = [*fault_traces(1, seed=5), *clean_controls(2, seed=5)]
    out = {f"synthetic/{t.name}": _attempts([validate_event(e) for e in t.events]) for t in synthetic}
    out.update({f"fault/{name}": stream for name, stream in _faults().items()})
    out.update({f"hostile/{seed}": _attempts(_hostile(seed)) for seed in range(4)})
    if REAL_LOGS.exists():
        out.update({f"real/{name}": _attempts(events) for name, events in _real_logs()})
    return out


def _groups(cls: type[Detector], stream: Stream) -> list[Stream]:
    """What the engine hands one instance: its (run, rank)'s events, or its run's, of the kinds it reads."""
    groups: dict[object, Stream] = {}
    for ev, attempt in stream:
        if cls.consumes is None or ev.kind in cls.consumes:
            key = (ev.run, ev.rank) if cls.scope == "rank" else ev.run
            groups.setdefault(key, []).append((ev, attempt))
    return list(groups.values())


def _shown(outputs: list[list[Finding]]) -> list[str]:
    return [repr(out) for out in outputs]  # repr: a NaN in the evidence equals itself


def _check(cls: type[Detector], stream: Stream, rng: random.Random) -> int:
    config = getattr(DetectorsConfig(), cls.kind)
    found = 0
    for group in _groups(cls, stream):
        one, cut, whole = cls(config), cls(config), cls(config)
        expected: list[list[Finding]] = []
        got: list[list[Finding]] = []
        ticks_expected, ticks_got = [], []
        i = 0
        while i < len(group):
            n = rng.choice([1, 2, 3, rng.randint(1, 64), rng.randint(64, 2000)])
            batch = group[i : i + n]
            i += n
            events, attempts = [e for e, _ in batch], [a for _, a in batch]
            expected.extend(map(one.observe, events, attempts))
            cut.observe_batch(events, attempts, got)
            now = events[-1].time + rng.choice([0.0, 1.0, 30.0, 900.0])
            ticks_expected.append(repr(one.tick(now)))
            ticks_got.append(repr(cut.tick(now)))
        assert len(got) == len(group), f"{cls.kind}: {len(got)} outputs for {len(group)} events"
        assert _shown(got) == _shown(expected), f"{cls.kind}: outputs differ at some cut"
        assert ticks_got == ticks_expected, f"{cls.kind}: ticks differ after batches"
        everything: list[list[Finding]] = []
        whole.observe_batch([e for e, _ in group], [a for _, a in group], everything)
        reference = type(one)(config)
        assert _shown(everything) == _shown(list(map(reference.observe, *zip(*group, strict=True)))), cls.kind
        found += sum(map(len, expected))
    return found


@pytest.mark.parametrize("cls", ALL_DETECTORS, ids=lambda c: c.kind)
def test_observe_batch_reports_what_observe_reports_at_every_cut(cls: type[Detector]) -> None:
    rng = random.Random(cls.kind)
    found = sum(_check(cls, stream, rng) for stream in _streams().values())
    assert found, f"{cls.kind} found nothing in any stream: the check proves nothing for it"
