"""An exported run carries its sampled instability precursors: imported again, it gives the same
``instability_precursor`` findings as the live collector did (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.store.test_precursor_store import RUN, _events, _ingest, _precursor_findings
from trainmon.monitor.analysis.postmortem import import_file
from trainmon.monitor.store.export import export_lines
from trainmon.monitor.store.queries import anomaly_rows
from trainmon.monitor.store.storage import Storage


def test_an_exported_run_imports_with_its_precursors_and_the_same_findings(tmp_path: Path) -> None:
    live_store = Storage(str(tmp_path / "live.sqlite"))
    _ingest(live_store, _events())
    exported = tmp_path / "export.jsonl"
    with live_store.connect() as conn:
        live = _precursor_findings(anomaly_rows(conn, RUN))
        exported.write_bytes(b"".join(export_lines(conn, RUN)))
    live_store.close()
    assert live

    steps = {ev["fields"]["step"]: ev["fields"] for ev in map(json.loads, exported.read_text().splitlines())
             if ev["kind"] == "step"}  # fmt: skip
    assert steps[50]["attn_logit_max"] == {"blocks.0.attn": 2.0, "blocks.1.attn": 2.2}
    assert steps[50]["output_logz"] == "Infinity" and steps[30]["layer_grad_norms"] == {"w": 1.0}
    assert "attn_logit_max" not in steps[51]

    offline = Storage(":memory:")
    assert import_file(exported, offline) == [RUN]
    with offline.connect() as conn:
        assert _precursor_findings(anomaly_rows(conn, RUN)) == live
    offline.close()
