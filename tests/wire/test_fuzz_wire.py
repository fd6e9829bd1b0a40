"""Property-based fuzzing of the wire format: any input is either accepted or refused by name."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmon import wire
from trainmon.hooks.transport import encode_event

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def _finite_json(value: object) -> bool:
    """What free-form JSON fields accept: finite numbers, integers within 64 bits."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int):
        return abs(value) < 2**63
    if isinstance(value, list):
        return all(_finite_json(v) for v in value)
    return all(_finite_json(v) for v in value.values())  # type: ignore[union-attr]


_VALUES = {
    "int": st.integers(0, 2**40),
    "float": st.floats(allow_nan=False, allow_infinity=False, width=64),
    "str": st.text(max_size=30),
    "bool": st.booleans(),
    "json": st.dictionaries(st.text(max_size=8), json_values, max_size=3).filter(_finite_json),
    "float_map": st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    "float_list": st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=4),
    "phases": st.dictionaries(st.sampled_from(wire.PHASES), st.floats(0, 100), max_size=4),
    "gpus": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "index": st.integers(0, 16),
                "uuid": st.text(max_size=20),
                "temperature_c": st.floats(0, 120),
                "throttle_reasons": st.integers(0, 2**40),
            },
        ),
        max_size=3,
    ),
}


@st.composite
def valid_events(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(list(wire.EVENT_KINDS)))
    fields = {}
    for name, spec in wire.EVENT_KINDS[kind].items():
        if spec.required or draw(st.booleans()):
            value = draw(_VALUES[spec.type])
            if spec.type == "float" and spec.nonfinite and draw(st.integers(0, 4)) == 0:
                value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
            fields[name] = value
    return {
        "kind": kind,
        "run": draw(st.from_regex(wire.RUN_ID_PATTERN, fullmatch=True)),
        "rank": draw(st.integers(0, 4096)),
        "host": draw(st.text(max_size=20)),
        "stream": draw(st.from_regex(wire.STREAM_PATTERN, fullmatch=True)),
        "seq": draw(st.integers(0, 2**40)),
        "time": draw(st.floats(0, 4e9)),
        "fields": fields,
    }


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_arbitrary_json_is_accepted_or_refused_by_name(raw: object) -> None:
    try:
        wire.validate_batch(raw)
    except wire.WireError as exc:
        assert exc.path and exc.problem
    try:
        wire.validate_batch({"version": 1, "events": [raw]})
    except wire.WireError as exc:
        assert exc.path.startswith("events[0]") or exc.path == "events"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(valid_events(), st.data())
def test_valid_events_survive_encoding_and_any_single_corruption_is_named(event: dict, data: st.DataObject) -> None:
    line = encode_event(event)  # what the hooks put on the wire: strict JSON
    (decoded,) = wire.validate_batch({"version": 1, "events": [json.loads(line)]})
    assert decoded.kind == event["kind"] and decoded.seq == event["seq"]
    for name, value in event["fields"].items():
        got = decoded.fields[name]
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got)
        else:
            assert got == value
    # break one header field: the error must name exactly that field
    key = data.draw(st.sampled_from(sorted(wire.HEADER_FIELDS)))
    broken = {**json.loads(line), key: data.draw(st.sampled_from([None, [], {"x": 1}, -1, "NaN", True]))}
    try:
        wire.validate_batch({"version": 1, "events": [broken]})
    except wire.WireError as exc:
        assert exc.path.startswith(f"events[0].{key}")
