"""Deduplication by identity (stream, seq), not by a high-water mark (issue 15, item 1).

Before: post seq 5, then seq 4 on the same stream, and the answer was ``{"accepted":0,"duplicates":1}``
with step 4 never stored; a reversed batch kept 1 of 10 events; resending unacknowledged batches
after newer ones were acknowledged (what a client does after a timeout) lost them as "duplicates".
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event, step_events
from trainmon.monitor.collector.seqs import MAX_RANGES, SeqSet
from trainmon.monitor.store.storage import Storage, steps, streams


def _steps(seqs: list[int], run: str = "d", stream: str = "s0") -> list[dict]:
    """Step events whose step number is their seq, in the order given."""
    out = []
    for s in seqs:
        (ev,) = step_events(1, run=run, stream=stream, start_seq=s)
        ev["fields"]["step"] = s
        out.append(ev)
    return out


def _stored(lc: LiveCollector, run: str = "d") -> list[int]:
    with lc.collector.storage.connect() as conn:
        return sorted(conn.execute(select(steps.c.step).where(steps.c.run == run)).scalars())


def _missing(lc: LiveCollector, stream: str = "s0") -> int:
    with lc.collector.storage.connect() as conn:
        return conn.execute(select(streams.c.missing).where(streams.c.stream == stream)).scalar_one()


def test_an_older_seq_after_a_newer_one_is_stored(live_collector: LiveCollector) -> None:
    lc = live_collector
    assert lc.post(batch([event("run_start", {"world_size": 1}, run="d", seq=0)])) == (
        200,
        {"accepted": 1, "duplicates": 0},
    )
    assert lc.post(batch(_steps([5]))) == (200, {"accepted": 1, "duplicates": 0})
    assert _missing(lc) == 4  # 1-4 not seen yet
    assert lc.post(batch(_steps([4]))) == (200, {"accepted": 1, "duplicates": 0})
    assert _stored(lc) == [4, 5]
    assert _missing(lc) == 3
    assert lc.post(batch(_steps([4]))) == (200, {"accepted": 0, "duplicates": 1})  # now it is one


def test_a_reversed_batch_is_stored_whole(live_collector: LiveCollector) -> None:
    lc = live_collector
    assert lc.post(batch(_steps(list(range(10, 0, -1))))) == (200, {"accepted": 10, "duplicates": 0})
    assert _stored(lc) == list(range(1, 11))
    assert lc.post(batch(_steps([3, 3, 11, 11]))) == (200, {"accepted": 1, "duplicates": 3})  # repeats in a batch


def test_resending_unacknowledged_batches_after_newer_ones_loses_nothing(live_collector: LiveCollector) -> None:
    """A client whose early batches timed out sends the later ones first, then resends the early ones,
    some of which the collector had in fact stored (the answer was lost)."""
    lc = live_collector
    batches = [list(range(k * 10 + 1, k * 10 + 11)) for k in range(20)]
    lost_answers = {2, 5}
    first, resent = batches[10:], batches[:10]
    assert lc.post(batch([event("run_start", {"world_size": 1}, run="d", seq=0)]))[0] == 200
    for b in [batches[k] for k in lost_answers] + first:
        assert lc.post(batch(_steps(b)))[0] == 200
    accepted = duplicates = 0
    for b in resent:
        status, body = lc.post(batch(_steps(b)))
        assert status == 200
        accepted, duplicates = accepted + body["accepted"], duplicates + body["duplicates"]
    assert (accepted, duplicates) == (80, 20)
    assert _stored(lc) == list(range(1, 201))
    assert _missing(lc) == 0


def test_stored_seqs_survive_a_collector_restart(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite"
    lc = start_collector(db)
    try:
        start = event("run_start", {"world_size": 1}, run="d", seq=0)
        assert lc.post(batch([start, *_steps([1, 2, 3, 8, 9])]))[1] == {"accepted": 6, "duplicates": 0}
    finally:
        lc.stop()
    lc = start_collector(db)
    try:
        assert lc.post(batch(_steps([2, 4, 5, 6, 7, 9])))[1] == {"accepted": 4, "duplicates": 2}
        assert _stored(lc) == list(range(1, 10))
        assert _missing(lc) == 0
    finally:
        lc.stop()


def test_a_stream_stored_before_ranges_were_kept_keeps_its_high_water_mark(tmp_path: Path) -> None:
    """Rows written by an older collector have no ranges: everything up to last_seq counts as stored."""
    db = tmp_path / "db.sqlite"
    lc = start_collector(db)
    try:
        assert lc.post(batch(_steps([1, 2, 3])))[0] == 200
    finally:
        lc.stop()
    store = Storage(str(db))
    with store.begin() as conn:
        conn.execute(streams.update().values(received=None))
    store.close()
    lc = start_collector(db)
    try:
        assert lc.post(batch(_steps([2, 4])))[1] == {"accepted": 1, "duplicates": 1}
    finally:
        lc.stop()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400), max_size=300))
def test_seqset_is_a_set(seqs: list[int]) -> None:
    s, model = SeqSet(), set()
    for q in seqs:
        assert s.add(q) == (q not in model)
        model.add(q)
    ranges = s.ranges()
    assert [q for a, b in ranges for q in range(a, b + 1)] == sorted(model)
    assert all(b + 1 < a2 for (_, b), (a2, _) in itertools.pairwise(ranges))  # disjoint, not adjacent
    assert s.last == max(model, default=-1)


def test_seqset_stays_bounded_by_closing_the_oldest_gaps() -> None:
    s = SeqSet()
    for q in range(0, 4 * MAX_RANGES, 2):  # every odd seq lost: one gap per event
        s.add(q)
    assert len(s.ranges()) == MAX_RANGES
    assert s.closed == 2 * MAX_RANGES - MAX_RANGES  # one odd seq per closed gap
    assert not s.add(1)  # inside a closed gap: reported as stored
    assert s.add(4 * MAX_RANGES - 3)  # a recent gap is still open
    shuffled = SeqSet()
    evens = list(range(0, 8 * MAX_RANGES, 2))
    random.Random(0).shuffle(evens)
    for q in evens:
        shuffled.add(q)
        assert len(shuffled.ranges()) <= MAX_RANGES
    assert not any(shuffled.add(q) for q in evens)  # nothing stored is ever stored twice
