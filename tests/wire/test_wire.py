"""Wire format v1: what is accepted, and that every rejection names the field."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.events import batch, event, step_events
from trainmon import wire


def test_every_kind_round_trips_through_validation() -> None:
    examples = [
        event("run_start", {"world_size": 2, "vocab_size": 256, "schedule": {"name": "cosine"}}),
        *step_events(1, start_seq=1),
        event("eval", {"step": 3, "loss": 2.5}, seq=2),
        event("checkpoint", {"step": 3, "path": "/x", "duration": 1.5, "fingerprint": {"adam_step": 4}}, seq=3),
        event("resume", {"step": 3, "path": "/x", "fingerprint": {"adam_step": 4}}, seq=4),
        event("health", {"cpu_percent": 50.0, "rss_bytes": 10, "gpus": [{"index": 0}]}, seq=5),
        event("heartbeat", {"step": 3}, seq=6),
        event("stack", {"reason": "no_step", "step": 3, "stack": {"frames": [{"file": "t.py", "line": 1}]}}, seq=7),
        event("run_end", {"status": "finished", "step": 3}, seq=8),
    ]
    events = wire.validate_batch(batch(examples))
    assert [e.kind for e in events] == list(wire.EVENT_KINDS)
    assert events[1].fields["phases"]["forward"] == 0.02


def test_nonfinite_markers_allowed_only_where_the_schema_says() -> None:
    (ev,) = wire.validate_batch(batch([event("step", {"step": 1, "loss": "NaN", "grad_norm": "Infinity"})]))
    assert math.isnan(ev.fields["loss"]) and ev.fields["grad_norm"] == math.inf
    with pytest.raises(wire.WireError) as err:
        wire.validate_batch(batch([event("step", {"step": 1, "step_time": "NaN"})]))
    assert err.value.path == "events[0].fields.step_time"
    # Python's json emits bare NaN tokens; they decode to float nan and follow the same rule.
    raw = json.loads('{"version":1,"events":[' + json.dumps(event("step", {"step": 1, "loss": math.nan})) + "]}")
    assert math.isnan(wire.validate_batch(raw)[0].fields["loss"])


@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        ([], "batch", "expected an object"),
        ({"events": []}, "version", "missing"),
        ({"version": 2, "events": []}, "version", "unsupported version 2"),
        ({"version": True, "events": []}, "version", "unsupported"),
        ({"version": 1, "events": {}}, "events", "expected a list"),
        ({"version": 1, "events": [], "extra": 1}, "extra", "unknown field"),
        (batch([{"kind": "step"}]), "events[0].run", "missing"),
        (batch([event("bogus", {})]), "events[0].kind", "unknown kind"),
        (batch([event("step", {})]), "events[0].fields.step", "missing required"),
        (batch([event("step", {"step": "3"})]), "events[0].fields.step", "expected an integer"),
        (batch([event("step", {"step": 1.5})]), "events[0].fields.step", "expected an integer"),
        (batch([event("step", {"step": 2**53 + 1})]), "events[0].fields.step", "between 0 and 2**53"),
        (batch([event("step", {"step": -1})]), "events[0].fields.step", "between 0"),
        (batch([event("step", {"step": 1, "loss": "high"})]), "events[0].fields.loss", "expected a number"),
        (batch([event("step", {"step": 1, "loss": True})]), "events[0].fields.loss", "expected a number"),
        (batch([event("step", {"step": 1, "lr": [1e-3, "x"]})]), "events[0].fields.lr[1]", "expected a number"),
        (batch([event("step", {"step": 1, "phases": {"gpu": 1.0}})]), "events[0].fields.phases.gpu", "unknown phase"),
        (batch([event("step", {"step": 1, "color": 3})]), "events[0].fields.color", "unknown field"),
        (batch([event("step", {"step": 1}, run="../etc")]), "events[0].run", "invalid run id"),
        (batch([event("step", {"step": 1}, run="")]), "events[0].run", "invalid run id"),
        (batch([event("step", {"step": 1}, stream="a/b")]), "events[0].stream", "invalid stream"),
        (batch([{**event("step", {"step": 1}), "time": "now"}]), "events[0].time", "expected a number"),
        (batch([{**event("step", {"step": 1}), "time": "NaN"}]), "events[0].time", "must be finite"),
        (batch([event("run_end", {})]), "events[0].fields.status", "missing required"),
    ],
)
def test_malformed_input_is_rejected_naming_the_field(raw: object, path: str, words: str) -> None:
    with pytest.raises(wire.WireError) as err:
        wire.validate_batch(raw)
    assert err.value.path == path
    assert words in str(err.value)


def test_integral_floats_are_integers_as_in_json_schema() -> None:
    (ev,) = wire.validate_batch(batch([event("step", {"step": 52.0, "tokens": 1e3})]))
    assert ev.fields["step"] == 52 and isinstance(ev.fields["step"], int) and ev.fields["tokens"] == 1000


def test_optional_fields_may_be_null() -> None:
    (ev,) = wire.validate_batch(batch([event("step", {"step": 1, "loss": None})]))
    assert "loss" not in ev.fields


def test_batch_size_is_capped() -> None:
    with pytest.raises(wire.WireError, match="at most"):
        wire.validate_batch(batch(step_events(wire.MAX_EVENTS_PER_BATCH + 1)))


def test_json_schema_covers_every_kind_and_field() -> None:
    schema = wire.json_schema()
    variants = schema["properties"]["events"]["items"]["oneOf"]
    assert [v["properties"]["kind"]["const"] for v in variants] == list(wire.EVENT_KINDS)
    for v in variants:
        kind = v["properties"]["kind"]["const"]
        assert set(v["properties"]["fields"]["properties"]) == set(wire.EVENT_KINDS[kind])
    json.dumps(schema)  # serialisable for the OpenAPI document


def test_wire_module_does_not_import_torch() -> None:
    code = (
        "import sys, trainmon, trainmon.wire, trainmon.schedules, trainmon.monitor.web.server, "
        "trainmon.monitor.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_precursor_fields_validate() -> None:
    fields = {"step": 10, "attn_logit_max": {"blocks.0.attn": 3.5, "blocks.1.attn": "Infinity"}, "output_logz": "NaN"}
    (ev,) = wire.validate_batch(batch([event("step", {**fields, "output_logit_max": 12.0})]))
    assert ev.fields["attn_logit_max"]["blocks.0.attn"] == 3.5 and math.isnan(ev.fields["output_logz"])
    with pytest.raises(wire.WireError) as err:
        wire.validate_batch(batch([event("step", {"step": 10, "attn_logit_max": [3.5]})]))
    assert err.value.path == "events[0].fields.attn_logit_max"


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("attn_entropy", "blocks.0.attn"),
        ("linear_out_rms", "blocks.0.mlp.proj"),
        ("group_update_ratio", "0"),
        ("adam_eps_frac", "1"),
    ],
)
def test_new_precursor_maps_validate(field: str, key: str) -> None:
    """Issue 28's later signals travel as maps of finite floats or the non-finite markers, like attn_logit_max."""
    (ev,) = wire.validate_batch(batch([event("step", {"step": 10, field: {key: 0.25, "other": "NaN"}})]))
    assert ev.fields[field][key] == 0.25 and ev.fields[field]["other"] == "NaN"  # stored as sent
    with pytest.raises(wire.WireError) as err:
        wire.validate_batch(batch([event("step", {"step": 10, field: 0.25})]))
    assert err.value.path == f"events[0].fields.{field}"
    with pytest.raises(wire.WireError) as err:
        wire.validate_batch(batch([event("step", {"step": 10, field: {key: "high"}})]))
    assert err.value.path.startswith(f"events[0].fields.{field}.") and key in err.value.path  # the entry named


def test_the_sent_header_is_advisory() -> None:
    """A producer's send time is read when plausible and ignored otherwise: it never refuses a batch."""
    assert wire.parse_sent(b"1763771234.25") == 1763771234.25
    assert wire.parse_sent("1763771234") == 1763771234.0
    for bad in (None, b"", b"soon", b"nan", b"inf", b"-5", b"0", str(2.0**33).encode()):
        assert wire.parse_sent(bad) is None, bad
