"""The plots keep extremes (issue 26): a one-step spike in a long run is drawn at its true height.

The plots draw ~200 step bins; each bin holds its mean, min and max. A band through the bin
centres narrows to a sliver at a lone extreme, so a loss spike of 111.9 among losses of 0.77 was
drawn near the bin's mean (12) and a grad norm of 1,286 near 130. The run is imported from a
JSONL file through the real importer and detectors, the PNG is rendered as the post-mortem and
the collector's run page render it, and the topmost pixel of the series' colour is read back.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
from matplotlib.figure import Figure

from tests.events import event
from trainmon.monitor.analysis import plots
from trainmon.monitor.analysis.postmortem import analyse, import_file
from trainmon.monitor.store.storage import Storage

STEPS, SPIKE_STEP = 2000, 1000  # ten steps a bin: the spike is one step of its bin
SPIKE_LOSS, SPIKE_GRAD_NORM = 111.9, 1286.0  # the values of issue 26
SERIES_BLUE = (31, 119, 180)  # #1f77b4: the loss (first attempt) and the pre-clip grad norm


def spike_events(run: str, steps: int = STEPS, at: int = SPIKE_STEP, t0: float = 1.7e9) -> list[dict[str, Any]]:
    """A finished run whose loss (~0.77) and grad norm (~1) are noisy, with one step at ``at``
    where the loss is 111.9 and the grad norm 1,286."""
    rng = np.random.default_rng(0)
    out = [event("run_start", {"world_size": 1, "planned_steps": steps}, run=run, seq=0, t=t0)]
    for i in range(steps):
        loss, gn = 0.77 + 0.02 * float(rng.standard_normal()), 1.0 + 0.05 * float(rng.standard_normal())
        if i == at:
            loss, gn = SPIKE_LOSS, SPIKE_GRAD_NORM
        fields = {"step": i, "loss": loss, "grad_norm": gn, "lr": [1e-3], "tokens": 512, "step_time": 0.05}
        out.append(event("step", fields, run=run, seq=1 + i, t=t0 + 0.05 * i))
    out.append(event("run_end", {"status": "finished", "step": steps - 1}, run=run, seq=steps + 1, t=t0 + 0.05 * steps))
    return out


def drawn_top(png: bytes, box: tuple[int, int, int, int], colour: tuple[int, int, int] = SERIES_BLUE) -> int | None:
    """The topmost pixel row in ``box`` (left, top, right, bottom, in the image's pixels) whose
    colour is the series' hue (the band and its edge are ``colour`` over white, more or less faded;
    grid lines are grey, anomaly marks orange or red). ``None`` when none is."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    left, top, right, bottom = box
    region = image[top:bottom, left:right]
    r, g, b = region[..., 0], region[..., 1], region[..., 2]
    # Faded towards white, #1f77b4 keeps b > g > r; grey has r == g == b, orange and red r > b.
    blue = (b - r >= 12) & (g - r >= 6) & (b >= g)
    assert colour == SERIES_BLUE  # the test above is written for this hue
    rows = np.where(blue.any(axis=1))[0]
    return None if rows.size == 0 else top + int(rows.min())


def png_of(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=plots.DPI)  # as render_plots saves it
    return buf.getvalue()


def pixel_row(fig: Figure, step: float, value: float) -> float:
    """The PNG row (from the top) where ``value`` at ``step`` is drawn on the figure's first axes."""
    ax = fig.axes[0]
    return fig.get_figheight() * plots.DPI - ax.transData.transform((step, value))[1]


def spike_columns(fig: Figure, step: float, half_width_px: int = 8) -> tuple[int, int]:
    """PNG columns around ``step`` on the figure's first axes."""
    x = fig.axes[0].transData.transform((step, 0.0))[0]
    return int(x) - half_width_px, int(x) + half_width_px + 1


@pytest.fixture(scope="module")
def spiky(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("spiky")
    log = tmp / "spiky.jsonl"
    log.write_text("\n".join(json.dumps(e) for e in spike_events("spiky")) + "\n")
    storage = Storage(str(tmp / "store.sqlite"))
    (run,) = import_file(log, storage)
    return analyse(storage, run)


@pytest.mark.parametrize(
    ("draw", "value"), [(plots.plot_loss, SPIKE_LOSS), (plots.plot_grad_norm, SPIKE_GRAD_NORM)], ids=["loss", "grad"]
)
def test_a_one_step_spike_is_drawn_at_its_true_height(spiky: Any, draw: Any, value: float) -> None:
    assert len(spiky.bins) >= 150 and int(spiky.bins["count"].max()) >= 10  # many steps per bin
    fig = draw(spiky)
    png = png_of(fig)
    bbox = fig.axes[0].get_window_extent()
    height = fig.get_figheight() * plots.DPI
    left, right = spike_columns(fig, SPIKE_STEP + 0.5)
    top = drawn_top(png, (left, int(height - bbox.y1) + 2, right, int(height - bbox.y0) - 2))
    assert top is not None
    expected = pixel_row(fig, SPIKE_STEP, value)
    # Within 2 px (the edge line's half width and antialiasing); the bin's mean is ~100 px lower.
    assert abs(top - expected) <= 2, (top, expected, pixel_row(fig, SPIKE_STEP, value / 10))
    # The axes reach the spike: nothing is clipped at the top.
    assert fig.axes[0].get_ylim()[1] > value
