"""One unusable value in a foreign log never fails the log.

A log is read as data: a cell that cannot be a value of its wire field (a step or token count that is
not finite, beyond 2**53, or negative; text where a number belongs) is left out (the row, for its step;
the field, for anything else) and the rest of the log is analysed. Before, ``inf`` in a CSV's step or
``nan`` in its token column raised from ``int()``/``round()``, and a ``1e30`` step or token count failed
the whole import at the wire's range check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmon.monitor.importers import read_events

ROWS = 40
BAD_ROW = 20

_CSV_BAD = ["nan", "inf", "-inf", "1e400", "-5", "1e30", "-1e30", "abc", "2.5"]
_JSON_BAD = ["NaN", "Infinity", "-Infinity", "1e400", "-5", "1e30", "-1e30", '"abc"', "null", "true", "[]", "{}", "2.5"]


def _steps(path: Path) -> dict[int, dict]:
    return {e.fields["step"]: e.fields for e in read_events(path) if e.kind == "step"}


def _csv(tmp_path: Path, column: str, value: str) -> Path:
    names = ["step", "loss", "lr", "grad_norm", "tokens"]
    lines = [",".join(names)]
    for s in range(1, ROWS):
        row = {"step": s, "loss": 2.0 - s * 0.01, "lr": 1e-4, "grad_norm": 1.0, "tokens": 1000 * s}
        cells = [value if (s == BAD_ROW and n == column) else str(row[n]) for n in names]
        lines.append(",".join(cells))
    path = tmp_path / "metrics.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("value", _CSV_BAD)
@pytest.mark.parametrize("column", ["step", "tokens", "loss", "grad_norm", "lr"])
def test_a_csv_cell_its_field_cannot_hold_costs_that_cell_only(tmp_path: Path, column: str, value: str) -> None:
    steps = _steps(_csv(tmp_path, column, value))
    others = set(range(1, ROWS)) - {BAD_ROW}
    assert others <= set(steps), "rows other than the bad one were lost"
    assert all(0 <= s < 2**53 for s in steps)
    if column == "tokens":
        assert all(steps[s]["tokens"] == 1000 * s for s in others)
        tokens = steps[BAD_ROW].get("tokens")
        assert tokens is None or (isinstance(tokens, int) and 0 <= tokens < 2**53)


def _trainer_state(tmp_path: Path, key: str, value: str) -> Path:
    history: list[dict] = []
    for s in range(1, ROWS):
        entry = {
            "step": s,
            "loss": 2.0 - s * 0.01,
            "grad_norm": 1.0,
            "learning_rate": 1e-4,
            "epoch": s / ROWS,
            "num_input_tokens_seen": s * 1000,
        }
        if s % 10 == 0:
            history.append({"step": s, "eval_loss": 2.0, "epoch": s / ROWS})
        if s == BAD_ROW:
            entry[key] = "__BAD__"
            if key == "step":
                history[-1]["step"] = "__BAD__"  # the eval logged at the same step
        history.append(entry)
    text = json.dumps({"log_history": history, "global_step": ROWS - 1, "max_steps": ROWS - 1})
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    path = folder / "trainer_state.json"
    path.write_text(text.replace('"__BAD__"', value))
    return path


@pytest.mark.parametrize("value", _JSON_BAD)
@pytest.mark.parametrize("key", ["step", "num_input_tokens_seen", "loss", "grad_norm", "learning_rate"])
def test_a_trainer_state_value_its_field_cannot_hold_costs_that_value_only(
    tmp_path: Path, key: str, value: str
) -> None:
    steps = _steps(_trainer_state(tmp_path, key, value))
    assert set(range(1, ROWS)) - {BAD_ROW} <= set(steps)
    assert all(0 <= s < 2**53 for s in steps)


_TEXT_LOGS = {
    "nanogpt.log": "iter {step}: loss {loss:.4f}, time 12.34ms, mfu 1.23%",
    "llmc.log": "step {step:>4}/100 | train loss {loss:.6f} | norm 1.0000 | lr 1.00e-04 | (12.34 ms | 1000 tok/s)",
}


@pytest.mark.parametrize("name", sorted(_TEXT_LOGS))
def test_a_text_log_line_with_a_step_beyond_the_wire_costs_that_line_only(tmp_path: Path, name: str) -> None:
    form = _TEXT_LOGS[name]
    lines = [form.format(step=s, loss=2.0 - s * 0.01) for s in range(1, ROWS)]
    lines[BAD_ROW - 1] = form.format(step=10**23, loss=1.5)
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    steps = _steps(path)
    assert set(range(1, ROWS)) - {BAD_ROW} <= set(steps)
    assert all(0 <= s < 2**53 for s in steps)


@pytest.mark.parametrize("value", _JSON_BAD)
@pytest.mark.parametrize("key", ["step", "tokens", "loss", "grad_norm", "lr"])
def test_a_metrics_jsonl_value_its_field_cannot_hold_costs_that_value_only(
    tmp_path: Path, key: str, value: str
) -> None:
    lines = []
    for s in range(1, ROWS):
        row = {"step": s, "loss": 2.0 - s * 0.01, "lr": 1e-4, "grad_norm": 1.0, "tokens": 1000 * s}
        if s == BAD_ROW:
            row[key] = "__BAD__"
        lines.append(json.dumps(row).replace('"__BAD__"', value))
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    steps = _steps(path)
    assert set(range(1, ROWS)) - {BAD_ROW} <= set(steps)
    assert all(0 <= s < 2**53 for s in steps)
