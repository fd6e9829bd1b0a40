"""The post-mortem plots the sampled instability precursors with the findings marked (issue 28)."""

from __future__ import annotations

from pathlib import Path

from tests.store.test_precursor_store import BOUNDS, RUN, _events, _ingest
from trainmon.monitor.analysis.plots import plot_precursors, render_plots
from trainmon.monitor.analysis.postmortem import analyse
from trainmon.monitor.store.storage import Storage


def test_the_precursors_are_plotted_with_the_layer_the_finding_names_and_its_step(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "db.sqlite"))
    _ingest(storage, _events())
    analysis = analyse(storage, RUN)
    storage.close()
    assert [row.step for row in analysis.precursors] == list(range(0, 120, 10))
    fig = plot_precursors(analysis)
    assert fig is not None
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == [
        "attention-logit bound",
        "attention entropy (nats)",
        "linear output RMS",
        "output log Z",
        "share of Adam v < eps²",
    ]
    bound = axes[0]
    lines = {line.get_label(): line for line in bound.get_lines()}
    assert list(lines["largest module"].get_ydata()) == [max(2.0, b) for b in BOUNDS]  # blocks.0.attn holds 2.0
    named = lines["blocks.1.attn (named by a finding)"]
    assert list(named.get_xdata()) == list(range(0, 120, 10))
    marks = [line for line in bound.get_lines() if line.get_linestyle() == "--"]
    assert 70 in [m.get_xdata()[0] for m in marks]  # the finding's first step, dashed (with the loss plot's kinds)
    assert bound.get_yscale() == "log"
    assert "precursors" in render_plots(analysis)


def test_a_run_without_precursors_has_no_precursor_plot(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "db.sqlite"))
    _ingest(storage, [ev for ev in _events() if ev["kind"] == "run_start" or ev["fields"]["step"] % 10])
    analysis = analyse(storage, RUN)
    storage.close()
    assert analysis.precursors == [] and plot_precursors(analysis) is None
