"""One story (issue 23): a run's health has one definition (``verdict.health``), and ``trainmon
runs``, ``trainmon status``, the collector's web index and the post-mortem all tell it.

The run the issue saw: a loss spike that recovered (the post-mortem says "PROBLEMS: 1 WARNING")
while ``runs`` and the web index said "healthy, 0 open findings" and ``status`` listed only the
open LR drift.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from tests.trainer_helpers import TINY, run_trainer
from trainmon.monitor.analysis.live_view import render_status, run_status, run_table
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.analysis.report import print_runs
from trainmon.monitor.analysis.verdict import health, verdict
from trainmon.monitor.store.storage import Storage
from trainmon.monitor.web.pages import WebView

RUN = "story"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """A reference-trainer run whose loss spikes 50x at step 20 and recovers, imported into a store."""
    tmp = tmp_path_factory.mktemp("story")
    out = tmp / "run"
    run_trainer(out, *TINY, "--threads", "1", "--collector", f"file://{out / 'events.jsonl'}",
                "--inject", "loss_spike@20:scale=50", steps=60, run=RUN)  # fmt: skip
    storage = Storage(f"sqlite:///{tmp / 'store.sqlite'}")
    import_file(out / "events.jsonl", storage)
    return storage


def _text(renderable) -> str:
    buf = io.StringIO()
    Console(file=buf, width=120, emoji=False, color_system=None).print(renderable)
    return buf.getvalue()


def test_every_view_tells_the_post_mortems_health(store: Storage) -> None:
    summary = summarize(store, RUN)
    v = verdict(summary)
    spikes = [a for a in summary["anomalies"] if a["kind"] == "loss_spike" and a["level"] == 1]
    assert spikes and spikes[0]["status"] != "open", summary["anomalies"]  # the setting: it recovered
    assert not v["healthy"] and v["health"] == "warning" and "warning" in v["headline"]

    (row,) = [r for r in run_table(store) if r["run"] == RUN]
    st = run_status(store, RUN)
    for h in (row["health"], st["health"]):
        assert (h["word"], h["headline"], h["healthy"]) == (v["health"], v["headline"], v["healthy"])
        assert [p["kind"] for p in h["problems"]][: len(v["findings"])] == [f["kind"] for f in v["findings"]]
    assert health(summary["anomalies"], summary["failures"], summary["steps"])["headline"] == v["headline"]

    # status lists the recovered spike, not only what is still open
    assert any(a["kind"] == "loss_spike" for a in st["recovered_anomalies"])
    status_text = _text(render_status(st))
    assert v["headline"] in status_text and "loss_spike" in status_text and "recovered" in status_text

    # trainmon runs: the run is not silently fine
    buf = io.StringIO()
    print_runs([row], Console(file=buf, width=200, emoji=False, color_system=None))
    assert v["headline"] in buf.getvalue() and "loss_spike warning (recovered)" in buf.getvalue()

    # the web index: the health word and the same problems
    page = WebView(store)._render_index()
    cells = re.findall(r"<td>(.*?)</td>", page[page.index(f'href="/runs/{RUN}"') :].split("</tr>")[0])
    assert f'class="{v["health"]}"' in cells[0] and "healthy" not in cells[0]  # the cell after the name
    assert v["headline"] in page and "loss_spike warning (recovered)" in page


def test_a_clean_run_is_healthy_everywhere(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_trainer(out, *TINY, "--threads", "1", "--collector", f"file://{out / 'events.jsonl'}", steps=30, run="clean")
    storage = Storage(f"sqlite:///{tmp_path / 'store.sqlite'}")
    import_file(out / "events.jsonl", storage)
    v = verdict(summarize(storage, "clean"))
    (row,) = run_table(storage)
    assert v["healthy"] and row["health"]["healthy"] and run_status(storage, "clean")["health"]["word"] == "healthy"
    assert row["health"]["headline"] == v["headline"]


def test_a_finding_open_at_the_end_says_so() -> None:
    """A straggler open from step 23 to the end of a 300-step run read "steps 23-23"."""
    straggler = {"kind": "straggler", "severity": "warning", "status": "open", "rank": 1, "first_step": 23}
    straggler |= {"last_step": 23, "message": "m", "hint": "h", "evidence": {}, "level": 1}
    summary = {"anomalies": [straggler], "last_step": 299, "steps": 300, "failures": 0}
    (finding,) = verdict(summary)["findings"]
    assert finding["when"] == "step 23, still open at the end (step 299)"
    closed = verdict(summary | {"anomalies": [straggler | {"status": "resolved"}]})["findings"][0]
    assert closed["when"] == "step 23"
