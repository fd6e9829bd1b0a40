"""Under a synthetic clock the post-mortem's goodput feeds the ledger each attempt's first and last step only
(``goodput.from_store``): the step counts that stand (``recomputed_steps``, ``failures``) are what the whole
timeline gives, on runs of several attempts with resumes from anywhere, checkpoints, hangs and every end."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.events import batch, event
from trainmon.monitor.analysis.postmortem import _attempts, _extents
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.core import goodput
from trainmon.monitor.store.queries import stream_rows
from trainmon.monitor.store.storage import Storage
from trainmon.wire import validate_batch

_attempt = st.tuples(
    st.integers(0, 40),  # first step: a resume from anywhere (before, at or past the previous end)
    st.integers(0, 40),  # steps after it
    st.integers(1, 4),  # logged every k steps
    st.sampled_from([None, "finished", "failed", "interrupted", "unknown"]),  # run_end status (None: no run_end)
    st.integers(0, 12),  # a checkpoint every n logged steps (0: none)
)


def _events(attempts: list[tuple[int, int, int, str | None, int]]) -> list[dict[str, Any]]:
    out, t = [], 1000.0
    for i, (first, span, every, end, ckpt_every) in enumerate(attempts):
        stream = f"s{i}"
        out.append(event("run_start", {"world_size": 1}, stream=stream, seq=0, t=t))
        seq = 1
        for j, step in enumerate(range(first, first + span + 1, every)):
            t += 0.5 + (j % 7) * 0.1
            out.append(event("step", {"step": step, "step_time": 0.4}, stream=stream, seq=seq, t=t))
            seq += 1
            if ckpt_every and (j + 1) % ckpt_every == 0:
                out.append(event("checkpoint", {"step": step, "duration": 0.2}, stream=stream, seq=seq, t=t))
                seq += 1
        if end is not None:
            t += 1.0
            out.append(event("run_end", {"status": end}, stream=stream, seq=seq, t=t))
        t += 3.0
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_attempt, min_size=1, max_size=4), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8))))
def test_the_step_counts_under_a_synthetic_clock_are_the_whole_timelines(
    attempts: list[tuple[int, int, int, str | None, int]], hang_spans: list[tuple[int, int]]
) -> None:
    storage = Storage("sqlite://")
    try:
        ingestor = Ingestor(storage, Engine(storage, DetectorsConfig(), detectors=()), LiveState())
        ingestor.ingest(validate_batch(batch(_events(attempts))))
        hangs = [{"kind": "hang", "first_step": lo, "last_step": lo + n} for lo, n in hang_spans]
        with storage.connect() as conn:
            streams = stream_rows(conn, "r1")
            rows = _attempts(streams, _extents(conn, "r1", streams))
            whole = goodput.from_store(conn, "r1", 0, rows, hangs)
            counted = goodput.from_store(conn, "r1", 0, rows, hangs, clock="synthetic")
    finally:
        storage.close()
    assert {k: counted[k] for k in ("recomputed_steps", "failures")} == {
        k: whole[k] for k in ("recomputed_steps", "failures")
    }
    assert set(counted) == set(whole) and all(counted[k] is None for k in goodput.CLOCK_KEYS)
