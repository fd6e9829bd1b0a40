"""The sampled instability precursors are stored, so every view of a run sees what the live one saw.

The live detectors get the precursor maps with each sampled step; the store keeps them in
``layer_stats.precursors`` and its replay hands them back, so a restarted collector, a
``trainmon postmortem --db`` and a post-mortem of the trainer's ``file://`` JSONL agree on the
``instability_precursor`` findings (issue 28).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

from tests.events import batch, event
from trainmon.monitor.analysis.postmortem import import_file
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.event_reads import layer_norms_at, precursor_samples
from trainmon.monitor.store.queries import anomaly_rows
from trainmon.monitor.store.replay import recent_events
from trainmon.monitor.store.storage import Storage, layer_stats
from trainmon.wire import validate_batch

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]
RUN = "precursing"
# The attention-logit bound of blocks.1 on sampled steps (every 10th): a level of ~2, then it grows.
BOUNDS = [0.3, 1.4, 2.0, 2.4, 2.1, 2.2, 30.0, 40.0, 90.0, 400.0, 2.0, 2.2]


def _events() -> list[dict[str, Any]]:
    schedule = {"name": "cosine", "peak_lr": 0.3, "warmup_steps": 500, "total_steps": 2000}
    out = [event("run_start", {"vocab_size": 64, "schedule": schedule}, run=RUN, seq=0, t=1000.0)]
    for step in range(10 * len(BOUNDS)):
        fields: dict[str, Any] = {"step": step, "loss": 2.0, "lr": [0.1]}
        if step % 10 == 0:
            fields |= {
                "attn_logit_max": {"blocks.0.attn": 2.0, "blocks.1.attn": BOUNDS[step // 10]},
                "attn_entropy": {"blocks.0.attn": 2.5, "blocks.1.attn": "NaN"},
                "linear_out_rms": {"blocks.0.attn.c_proj": 0.5},
                "group_update_ratio": {"0": 1e-3},
                "adam_eps_frac": {"0": 0.0},
                "output_logz": "Infinity" if step == 50 else 4.0,
                "output_logit_max": 9.5,
            }
        if step == 30:
            fields["layer_grad_norms"] = {"w": 1.0}
        out.append(event("step", fields, run=RUN, seq=step + 1, t=1001.0 + step))
    return out


def _ingest(storage: Storage, events: list[dict[str, Any]]) -> None:
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig()), LiveState())  # a fresh collector
    ingestor.ingest(validate_batch(batch(events)))


def _precursor_findings(anomalies: list[dict[str, Any]]) -> list[tuple]:
    return [
        (a["kind"], a["severity"], a["status"], a["first_step"], a["last_step"], a["evidence"]["module"])
        for a in anomalies
        if a["kind"] == "instability_precursor"
    ]


def test_replay_gives_back_the_precursors_as_the_detectors_got_them(store: Storage) -> None:
    _ingest(store, _events())
    with store.connect() as conn:
        replayed = {ev.fields["step"]: ev.fields for ev, _ in recent_events(conn, RUN, 0) if ev.kind == "step"}
        rows = conn.execute(select(layer_stats.c.step, layer_stats.c.grad_norms, layer_stats.c.precursors)).all()
    sampled = replayed[50]
    assert sampled["attn_logit_max"] == {"blocks.0.attn": 2.0, "blocks.1.attn": 2.2}
    assert sampled["attn_entropy"] == {"blocks.0.attn": 2.5, "blocks.1.attn": "NaN"}  # a map as sent, as live
    assert sampled["output_logz"] == math.inf and sampled["output_logit_max"] == 9.5  # a scalar decoded, as live
    assert (sampled["group_update_ratio"], sampled["adam_eps_frac"]) == ({"0": 1e-3}, {"0": 0.0})
    assert "attn_logit_max" not in replayed[51]  # unsampled steps have none
    # One row per sampled step; the grad norms' column is SQL NULL where the trainer sent none.
    assert len(rows) == len(BOUNDS)
    assert [r.step for r in rows if r.grad_norms is not None] == [30]
    assert all(r.precursors is not None for r in rows)


def test_the_post_mortem_reads_the_sampled_steps_and_the_grad_norms_apart(store: Storage) -> None:
    _ingest(store, _events())
    with store.connect() as conn:
        samples = precursor_samples(conn, RUN, 0)
        norms = layer_norms_at(conn, RUN, 0, 20, within=10)  # step 20: precursors only; step 30: both
        missing = precursor_samples(conn, RUN, 1)
    assert [(r.attempt, r.step) for r in samples] == [(0, s) for s in range(0, 120, 10)]
    assert samples[9].precursors["attn_logit_max"]["blocks.1.attn"] == 400.0
    assert samples[5].precursors["output_logz"] == "Infinity"  # stored as the wire writes it
    assert (norms.step, norms.grad_norms) == (30, {"w": 1.0}) and list(missing) == []


def test_a_restarted_collector_judges_the_growth_against_the_stored_level(store: Storage, tmp_path: Path) -> None:
    events = _events()
    uninterrupted = Storage(str(tmp_path / "whole.sqlite"))
    _ingest(uninterrupted, events)
    with uninterrupted.connect() as conn:
        live = _precursor_findings(anomaly_rows(conn, RUN))
    uninterrupted.close()
    assert live == [("instability_precursor", "critical", "resolved", 70, 90, "blocks.1.attn")]

    _ingest(store, events[:61])  # the baseline samples (steps 0-59), then the collector restarts
    _ingest(store, events[61:])  # the new one primes its detectors from the stored history
    with store.connect() as conn:
        assert _precursor_findings(anomaly_rows(conn, RUN)) == live


def test_postmortem_of_the_store_and_of_the_file_stream_agree_with_the_live_findings(tmp_path: Path) -> None:
    db = tmp_path / "live.sqlite"
    live_store = Storage(str(db))
    _ingest(live_store, _events())
    with live_store.connect() as conn:
        live = _precursor_findings(anomaly_rows(conn, RUN))
    live_store.close()
    assert live

    stored = json.loads(
        subprocess.run(
            [*TRAINMON, "postmortem", RUN, "--db", str(db), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert _precursor_findings(stored["anomalies"]) == live

    jsonl = tmp_path / "trainer.jsonl"  # what a file:// target writes: one event per line
    jsonl.write_text("".join(json.dumps(ev) + "\n" for ev in _events()))
    offline = Storage(":memory:")
    assert import_file(jsonl, offline) == [RUN]
    with offline.connect() as conn:
        assert _precursor_findings(anomaly_rows(conn, RUN)) == live
    offline.close()
