"""The node-health plot draws a trend, so it needs one: a rank's single sample is a dot that says
nothing (issue 26: "leave out what has nothing to say"), two samples over time are a line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.events import event
from trainmon.monitor.analysis import plots
from trainmon.monitor.analysis.postmortem import analyse, import_file
from trainmon.monitor.store.storage import Storage


def _run(samples: int, t0: float = 1.7e9) -> list[dict[str, Any]]:
    out = [event("run_start", {"world_size": 1}, run="h", seq=0, t=t0)]
    for i in range(20):
        out.append(event("step", {"step": i, "loss": 1.0, "step_time": 0.1}, run="h", seq=1 + i, t=t0 + 0.1 * i))
    gpu = {"index": 0, "temperature_c": 60.0, "utilization_ratio": 0.9}
    for j in range(samples):
        out.append(event("health", {"gpus": [gpu]}, run="h", seq=100 + j, t=t0 + 0.5 + j))
    out.append(event("run_end", {"status": "finished", "step": 19}, run="h", seq=200, t=t0 + 3.0))
    return out


@pytest.mark.parametrize(("samples", "drawn"), [(1, False), (2, True)])
def test_health_is_plotted_only_with_a_trend(tmp_path, samples: int, drawn: bool) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in _run(samples)) + "\n")
    storage = Storage(f"sqlite:///{tmp_path / 'db.sqlite'}")
    [run] = import_file(path, storage)
    a = analyse(storage, run)
    assert len(a.health) == samples
    assert (plots.plot_gpu_health(a) is not None) is drawn
