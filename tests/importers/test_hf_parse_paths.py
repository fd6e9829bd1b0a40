"""A trainer_state.json read by orjson gives what ``json`` gives, bit for bit (issue 24).

``hf._load`` reads a file with orjson where it cannot differ from ``json`` and with ``json`` otherwise: integers
outside [-2**63, 2**64) (orjson turns them into floats), ``NaN`` and ``Infinity``, lone surrogate escapes, numbers
past the largest float, bytes that are not UTF-8, a BOM, damaged files. The reference is ``json``'s own reading,
the only one before: the same state, the same points and notes, whichever path read it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bitwise import same
from trainmon.monitor.importers import hf
from trainmon.monitor.importers.common import ImportFormatError


def _text_path(path: Path) -> Any:
    """What ``parse_hf`` returns, or the error it raises, when ``json`` reads the file (as it did before)."""
    fast = hf._fast_loads
    hf._fast_loads = lambda data: None  # type: ignore[assignment]
    try:
        return _parse(path)
    finally:
        hf._fast_loads = fast  # type: ignore[assignment]


def _parse(path: Path) -> Any:
    try:
        items, meta = hf.parse_hf(path)
    except (ImportFormatError, RecursionError) as exc:
        return type(exc), str(exc)
    return items, meta.__dict__


def _check(path: Path) -> None:
    expected = _text_path(path)
    assert same(_parse(path), expected)
    state = hf._fast_loads(path.read_bytes())
    if state is not None:  # orjson read it: as json reads it, to the bit and the key order
        assert same(state, json.loads(path.read_text(encoding="utf-8", errors="replace")))


def _file(tmp_path: Path, body: bytes) -> Path:
    path = tmp_path / "trainer_state.json"
    path.write_bytes(body)
    return path


def _state(history: str, top: str = '"global_step": 3, "max_steps": 10') -> bytes:
    return ("{" + top + ', "log_history": [' + history + "]}").encode()


_ROW = '{{"step": {step}, "epoch": 0.5, "loss": {loss}, "learning_rate": 1e-4, "grad_norm": 1.0}}'


@pytest.mark.parametrize(
    "loss",
    [
        "2.5",
        str(2**63 - 1),
        str(2**63),
        str(2**64 - 1),
        str(10**19 - 1),
        str(2**64),  # orjson: 1.8446744073709552e+19
        str(-(2**63)),
        str(-(10**18)),
        str(-(2**63) - 1),  # orjson: a float
        "1" + "0" * 30,
        "NaN",
        "-Infinity",
        "1e400",  # json: inf; orjson refuses it
        "-0",
        "-0.0",
        "0.00019999999999999998",  # a long run of digits after the point: orjson still reads the file
        "2.4703282292062328e-324",
        "1.7976931348623158e308",
        "0." + "0" * 20 + "123456789" * 30,
    ],
)
def test_numbers_read_as_json_reads_them(tmp_path: Path, loss: str) -> None:
    rows = [_ROW.format(step=s, loss=loss if s == 2 else "2.0") for s in (1, 2, 3)]
    _check(_file(tmp_path, _state(", ".join(rows))))


@pytest.mark.parametrize(
    "body",
    [
        _state('{"step": 1, "loss": 2.0, "note": "\\ud800"}'),  # a lone surrogate escape: json reads it
        _state('{"step": 1, "loss": 2.0, "note": "?"}').replace(b"?", b"\xff"),  # not UTF-8: json reads it replaced
        _state('{"step": 1, "loss": 2.0, "note": "\\ud83d\\ude00 \u00e9"}'),
        b"\xef\xbb\xbf" + _state('{"step": 1, "loss": 2.0}'),  # json refuses a BOM: salvaged
        _state('{"step": 1, "loss": 2.0}').replace(b", ", b",\r\n"),
        _state('{"step": 1, "loss": 2.0, "loss": 3.0, "step": 2}'),  # repeated keys: the last value, first place
        _state('{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}, {"step": 3, "lo'),  # truncated: salvaged
        _state('{"step": 1, "loss": 2.0}', top='"global_step": 12345678901234567890123'),
        b"[" * 1500 + b"]" * 1500,
        b"12345678901234567890123",
        b'{"log_history": 1}',
        b"",
    ],
)
def test_files_read_as_json_reads_them(tmp_path: Path, body: bytes) -> None:
    _check(_file(tmp_path, body))


def test_orjson_reads_a_plain_file() -> None:
    """Long digit runs after a point, and HF's ``num_train_epochs`` of ``sys.maxsize`` when ``max_steps`` is set."""
    top = f'"max_steps": 100000, "num_train_epochs": {2**63 - 1}'
    body = _state(_ROW.format(step=1, loss="0.00019999999999999998"), top=top)
    assert same(hf._fast_loads(body), json.loads(body))


_NUMBER = st.one_of(
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-0.0, math.nan, math.inf, 2**63, 2**64, -(2**63) - 1, 10**19, 1e-5, 0.00012345678901234567]),
)
_VALUE = st.one_of(_NUMBER, st.none(), st.booleans(), st.text(max_size=4), st.lists(_NUMBER, max_size=2))
_KEYS = ["step", "loss", "learning_rate", "lr", "grad_norm", "epoch", "eval_loss", "eval_acc", "num_tokens", "x"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.dictionaries(st.sampled_from(_KEYS), _VALUE, max_size=6), max_size=8),
    top=st.dictionaries(st.sampled_from(["global_step", "max_steps", "logging_steps", "epoch"]), _NUMBER),
    ascii_only=st.booleans(),
)
def test_any_state_read_as_json_reads_it(
    tmp_path: Path, rows: list[dict[str, Any]], top: dict[str, Any], ascii_only: bool
) -> None:
    body = json.dumps({**top, "log_history": rows}, ensure_ascii=ascii_only)
    _check(_file(tmp_path, body.encode("utf-8", errors="surrogatepass")))
