"""The ingest handles a batch by segment (its runs of consecutive events of one stream): what it stores of each
stream and run is what the event-by-event rules give (the oracle here), whatever the batches hold: streams
interleaved, seqs repeated, reversed, with gaps and gaps filled, kinds mixed.

The per-event rules, as the ingest applied them before it went by segment: an event is fresh when its stream's
``SeqSet.add`` takes it; each fresh one adds ``seq - highest - 1`` missing seqs when above the stream's highest,
and fills one below it; a stream counts its fresh events and was last active at the latest time of its last
batch's; a run was created at the earliest time of its first batch's fresh events and updated at the latest of all.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.seqs import SeqSet
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.store.storage import Storage, runs, steps, streams
from trainmon.wire import Event, validate_event

_STREAMS = {"s0": ("a", 0), "s1": ("a", 1), "s2": ("b", 0)}  # stream -> (run, rank)


def _event(stream: str, seq: int, t: float, kind: str) -> Event:
    run, rank = _STREAMS[stream]
    fields = {"step": seq, "loss": 1.0} if kind == "step" else {"step": seq, "loss": 2.0}
    raw = {"kind": kind, "run": run, "rank": rank, "host": "h", "stream": stream, "seq": seq, "time": t}
    return validate_event({**raw, "fields": fields})


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(sorted(_STREAMS)),
        st.integers(0, 12),
        st.floats(1000.0, 1010.0, allow_nan=False),
        st.sampled_from(["step", "step", "step", "eval"]),
    ),
    min_size=1,
    max_size=25,
)


class _Oracle:
    """What the event-by-event rules store."""

    def __init__(self) -> None:
        self.seqs: dict[str, SeqSet] = {}
        self.missing: dict[str, int] = {}
        self.events: dict[str, int] = {}
        self.last_time: dict[str, float] = {}
        self.created: dict[str, float] = {}
        self.updated: dict[str, float] = {}
        self.steps: set[tuple[str, int, int]] = set()

    def ingest(self, batch: list[Event]) -> tuple[int, int]:
        fresh = 0
        first_seen: dict[str, float] = {}
        latest: dict[str, float] = {}  # a stream's last time is the latest of its last batch's fresh events
        for ev in batch:
            seqs = self.seqs.setdefault(ev.stream, SeqSet())
            highest = seqs.last
            if not seqs.add(ev.seq):
                continue
            fresh += 1
            self.missing[ev.stream] = self.missing.get(ev.stream, 0) + (
                ev.seq - highest - 1 if ev.seq > highest else -1
            )
            self.events[ev.stream] = self.events.get(ev.stream, 0) + 1
            latest[ev.stream] = max(latest.get(ev.stream, -math.inf), ev.time)
            self.updated[ev.run] = max(self.updated.get(ev.run, -math.inf), ev.time)
            if ev.run not in self.created:
                first_seen[ev.run] = min(first_seen.get(ev.run, math.inf), ev.time)
            if ev.kind == "step":
                self.steps.add((ev.run, ev.rank, ev.fields["step"]))
        self.created.update(first_seen)
        self.last_time.update(latest)
        return fresh, len(batch) - fresh


@settings(max_examples=60, deadline=None)
@given(st.lists(_EVENTS, min_size=1, max_size=4))
def test_what_is_stored_of_streams_and_runs_is_what_the_per_event_rules_give(
    batches: list[list[tuple[str, int, float, str]]],
) -> None:
    storage = Storage("sqlite://")
    ingestor = Ingestor(storage, Engine(storage, DetectorsConfig(), detectors=()), None)
    oracle = _Oracle()
    for spec in batches:
        batch = [_event(*e) for e in spec]
        result = ingestor.ingest(batch)
        assert (result.accepted, result.duplicates) == oracle.ingest(batch)
    with storage.connect() as conn:
        stored = {r.stream: r for r in conn.execute(select(streams))}
        stored_runs = {r.run: r for r in conn.execute(select(runs))}
        stored_steps = {(r.run, r.rank, r.step) for r in conn.execute(select(steps))}
    assert set(stored) == set(oracle.seqs)
    for stream, row in stored.items():
        seqs = oracle.seqs[stream]
        assert (row.last_seq, row.missing, row.events, row.last_time) == (
            seqs.last,
            oracle.missing[stream],
            oracle.events[stream],
            oracle.last_time[stream],
        ), stream
        assert row.received == seqs.ranges()
    assert {r: (row.created_at, row.updated_at) for r, row in stored_runs.items()} == {
        r: (oracle.created[r], oracle.updated[r]) for r in oracle.created
    }
    assert stored_steps == oracle.steps
    storage.close()
