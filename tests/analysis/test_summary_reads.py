"""``summarize`` (what ``postmortem --json`` prints) is ``analyse(...).summary`` without the plots' reads.

The summary needs no curve: the per-range loss, grad-norm and LR aggregates are half of SQLite's work
on a log of a million steps, so ``summarize`` leaves them out and asks the steps only whether they
carry each signal (``coverage.not_checked``). These tests hold the two paths to one answer on the
inputs where "carries" is subtle (NaN losses, infinite grad norms, a column missing), and
``summarize`` to reading no curve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

from trainmon.monitor.analysis.postmortem import analyse, import_file, summarize
from trainmon.monitor.store.storage import Storage
from trainmon.wire import json_safe

STEPS = 300


def _write(path: Path, columns: dict[str, list[float]]) -> Path:
    names = ["_step", *columns]
    lines = [",".join(names)]
    lines += [",".join([str(i), *(repr(columns[c][i]) for c in columns)]) for i in range(STEPS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _loss(i: int) -> float:
    return 3.0 - i / STEPS + 0.01 * math.sin(i)


LOGS = {
    "every_signal": {
        "train/loss": [_loss(i) for i in range(STEPS)],
        "train/grad_norm": [1.0 + 0.1 * math.cos(i) for i in range(STEPS)],
        "train/learning_rate": [1e-4] * STEPS,
    },
    "nan_losses_only": {
        "train/loss": [math.nan] * STEPS,
        "train/grad_norm": [1.0] * STEPS,
    },
    "infinite_grad_norms_only": {
        "train/loss": [_loss(i) for i in range(STEPS)],
        "train/grad_norm": [math.inf] * STEPS,
        "train/learning_rate": [1e-4] * STEPS,
    },
    "no_grad_norm_no_lr": {
        "train/loss": [_loss(i) for i in range(STEPS)],
    },
    "late_grad_norm": {
        "train/loss": [_loss(i) for i in range(STEPS)],
        "train/grad_norm": [math.nan] * (STEPS - 1) + [2.0],
    },
}


@pytest.fixture
def imported(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Storage, str]]:
    storage = Storage("sqlite://")
    (run,) = import_file(_write(tmp_path / f"{request.param}.csv", LOGS[request.param]), storage)
    yield storage, run
    storage.close()


def _signals(summary: dict) -> set[str]:
    return {gap["signal"] for gap in summary["not_checked"]}


@pytest.mark.parametrize("imported", sorted(LOGS), indirect=True)
def test_summarize_is_the_analysis_summary(imported: tuple[Storage, str]) -> None:
    storage, run = imported
    dump = lambda s: json.dumps(json_safe(s), allow_nan=False)  # noqa: E731 - NaN-safe equality
    assert dump(summarize(storage, run)) == dump(analyse(storage, run).summary)


@pytest.mark.parametrize(
    ("imported", "missing", "carried"),
    [
        ("every_signal", set(), {"loss", "grad norm", "learning rate"}),
        ("nan_losses_only", {"learning rate"}, {"loss", "grad norm"}),  # a NaN loss is a loss the log has
        ("infinite_grad_norms_only", {"grad norm"}, {"loss", "learning rate"}),  # no finite norm to weigh
        ("no_grad_norm_no_lr", {"grad norm", "learning rate"}, {"loss"}),
        ("late_grad_norm", {"learning rate"}, {"loss", "grad norm"}),  # one finite norm, the last step's
    ],
    indirect=["imported"],
)
def test_signals_carried_are_the_ones_some_step_holds(
    imported: tuple[Storage, str], missing: set[str], carried: set[str]
) -> None:
    storage, run = imported
    signals = _signals(summarize(storage, run))
    assert missing <= signals
    assert not carried & signals


@pytest.mark.parametrize("imported", ["every_signal"], indirect=True)
def test_summarize_reads_no_curve(imported: tuple[Storage, str]) -> None:
    """No statement of ``summarize`` aggregates the loss (the plots' curve); ``analyse`` does."""
    storage, run = imported
    statements: list[str] = []

    def seen(_conn, _cursor, statement: str, *_args) -> None:
        statements.append(" ".join(statement.split()).lower())

    event.listen(storage.engine, "before_cursor_execute", seen)
    try:
        summarize(storage, run)
        curve = [s for s in statements if "avg(case when" in s and "steps.loss" in s]
        assert not curve
        analyse(storage, run)
        assert any("avg(case when" in s and "steps.loss" in s for s in statements)
    finally:
        event.remove(storage.engine, "before_cursor_execute", seen)
