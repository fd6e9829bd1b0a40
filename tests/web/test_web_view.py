"""The collector's web view (issue 16.2): ``GET /`` lists the runs, ``GET /runs/{run}`` shows one
run's verdict, plots and findings, live.

A real collector on loopback is fed a reference-trainer run with injected faults (and, straight into
its store, a run whose name and message are hostile HTML); the pages are read over HTTP and rendered
in headless Chromium.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveCollector, start_collector
from tests.events import batch, event
from tests.trainer_helpers import TINY, run_trainer
from tests.web.test_web_plots import SPIKE_LOSS, SPIKE_STEP, drawn_top, pixel_row, spike_events
from trainmon.monitor.analysis.live_view import run_status, run_table
from trainmon.monitor.store.storage import anomalies, runs

RUN = "web-faulted"
SPIKY = "web-spiky"  # 2,000 steps, one loss spike of 111.9 at step 1,000 (issue 26)
HOSTILE_RUN = "<script>alert('run')</script>\"><img src=x onerror=alert(1)>"
HOSTILE_MESSAGE = "loss is </td><script>alert('msg')</script>"
HOSTILE_HINT = 'run `rm -rf / <b>now</b>` & "quote"'


def _web(lc: LiveCollector) -> Any:
    """The collector's WebView (its render lock and cache), as the server holds it."""
    return lc.server.server.config.app.api.state.web


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCollector]:
    """A collector holding: RUN (a loss spike at 20, NaN from 45, finished), a run still going (no
    run_end), SPIKY (one loss spike in a long run), and a run with a hostile name and message
    written into the store by another tool."""
    tmp = tmp_path_factory.mktemp("web")
    lc = start_collector(tmp / "trainmon.sqlite")
    try:
        run_trainer(tmp / "run", *TINY, "--threads", "1", "--collector", lc.url,
                    "--inject", "loss_spike@20:scale=50", "--inject", "nan@45", steps=60, run=RUN)  # fmt: skip
        live = [event("run_start", {"planned_steps": 100}, run="web-live", stream="l0", seq=0)]
        live += [_live_step(i, 0.01) for i in range(20)]
        status, body = lc.post(batch(live))
        assert status == 200, body
        spiky = spike_events(SPIKY)
        for i in range(0, len(spiky), 500):
            status, body = lc.post(batch(spiky[i : i + 500]))
            assert status == 200, body
        now = time.time()
        hostile = {"run": HOSTILE_RUN, "kind": "nan_inf", "rank": 0, "severity": "critical", "status": "open"}
        hostile |= {"first_step": 3, "last_step": 9, "opened_at": now, "updated_at": now, "evidence": {}}
        with lc.collector.storage.begin() as conn:
            conn.execute(runs.insert().values(run=HOSTILE_RUN, created_at=now, updated_at=now, status="failed"))
            conn.execute(anomalies.insert().values(**hostile, message=HOSTILE_MESSAGE, hint=HOSTILE_HINT))
        yield lc
    finally:
        lc.stop()


def _live_step(step: int, seconds: float) -> dict[str, Any]:
    fields = {"step": step, "loss": 3.0 - 0.01 * step, "tokens": 256, "step_time": seconds}
    return event("step", fields, run="web-live", stream="l0", seq=1 + step)


def _page(lc: LiveCollector, path: str, expect: int = 200) -> str:
    status, body = lc.get(path)
    assert status == expect, (status, body[:500])
    return body.decode()


pytestmark = pytest.mark.slow


def test_the_list_of_runs_says_health_progress_and_open_findings(served: LiveCollector) -> None:
    page = _page(served, "/")
    row = page[page.index(f'href="/runs/{RUN}"') :].split("</tr>")[0]
    assert "critical" in row and "nan_inf" in row and "60 / 60 (100%)" in row and "finished" in row
    live = page[page.index('href="/runs/web-live"') :].split("</tr>")[0]
    assert "healthy" in live and "20 / 100 (20%)" in live and "running" in live
    assert '<meta http-equiv="refresh"' in page  # runs come and go: the list reloads itself
    assert "<script" not in page and "<img" not in page  # nothing to run, nothing fetched


def test_a_run_page_opens_with_the_verdict_then_plots_and_findings(served: LiveCollector) -> None:
    page = _page(served, f"/runs/{RUN}")
    verdict = page.index('id="verdict"')
    assert verdict < page.index("<h2>Overview") < page.index("<h2>Loss") < page.index("<h2>Anomaly timeline")
    box = page[verdict : page.index("</section>")]
    assert "problems: 1 critical" in box and "nan_inf" in box and "steps 45-59" in box
    assert "still open at the end" in box and "Cost:" in box and "steps trained on non-finite values" in box
    assert "loss_spike" in page[page.index("<h2>Anomaly timeline") :]
    assert page.count('src="data:image/png;base64,') >= 4  # loss, grad norm, LR, throughput: inline
    assert "<h2>Ranks" not in page  # one rank: no per-rank table or heatmap
    assert '<meta http-equiv="refresh"' not in page  # the run ended: nothing more to show
    assert "http://" not in page and "https://" not in page and "<script" not in page  # works offline


def test_a_running_run_page_reloads_itself(served: LiveCollector) -> None:
    page = _page(served, "/runs/web-live")
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "healthy: no warnings or critical findings" in page


def test_hostile_run_name_and_message_are_shown_as_text(served: LiveCollector) -> None:
    status, body = served.get("/")
    assert status == 200
    index = body.decode()
    assert "<script>alert" not in index and "<img src=x" not in index
    assert "&lt;script&gt;alert(&#x27;run&#x27;)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in index
    link = "/runs/" + urllib.parse.quote(HOSTILE_RUN, safe="")
    assert f'href="{link}"' in index  # quoted: the name cannot end the attribute or the path
    page = _page(served, link)
    assert "<script>alert" not in page and "</td><script>" not in page and "<b>now</b>" not in page
    assert "loss is &lt;/td&gt;&lt;script&gt;alert(&#x27;msg&#x27;)&lt;/script&gt;" in page
    assert "<code>rm -rf / &lt;b&gt;now&lt;/b&gt;</code> &amp; &quot;quote&quot;" in page
    missing = _page(served, "/runs/%3Cscript%3Ealert(3)%3C%2Fscript%3E", expect=404)
    assert "<script>" not in missing and "&lt;script&gt;alert(3)&lt;/script&gt;" in missing


def test_pages_forbid_scripts_and_framing(served: LiveCollector) -> None:
    import urllib.request

    for path in ("/", f"/runs/{RUN}"):
        with urllib.request.urlopen(served.url + path, timeout=30) as resp:
            assert resp.headers["content-type"].startswith("text/html")
            csp = resp.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "script-src" not in csp
            assert resp.headers["x-content-type-options"] == "nosniff"


def test_a_render_in_progress_never_holds_up_ingest(served: LiveCollector) -> None:
    """The render lock held (a render that takes as long as it likes): the page request waits on the
    thread pool while batches are acknowledged and the JSON API answers; then the page arrives."""
    web = _web(served)
    answers: list[tuple[int, bytes]] = []
    with web._lock:
        web._cache.clear()
        reader = threading.Thread(target=lambda: answers.append(served.get(f"/runs/{RUN}")))
        reader.start()
        more = [_live_step(20 + i, 0.01) for i in range(5)]
        status, body = served.post(batch(more))
        assert status == 200 and body["accepted"] == 5, body
        assert served.get("/healthz")[0] == 200
        assert any(r["run"] == "web-live" for r in served.get_json("/v1/runs"))
        assert reader.is_alive() and not answers  # the page is still waiting for the render
    reader.join(120)
    ((status, page),) = answers
    assert status == 200 and b"problems: 1 critical" in page


def test_a_page_is_served_from_the_cache_between_renders(served: LiveCollector) -> None:
    web = _web(served)
    web._cache.clear()
    first = _page(served, f"/runs/{RUN}")
    assert _page(served, f"/runs/{RUN}") == first  # the same render (its timestamp included)
    assert list(web._cache) == [f"run:{RUN}"]


def test_status_runs_and_the_web_view_agree_on_tokens_per_second(served: LiveCollector) -> None:
    """One definition: every rank's tokens over the step time of the last 10 steps (a slow step
    counts), the same in ``trainmon status``, ``trainmon runs`` and the list of runs."""
    slow = [_live_step(30 + i, 0.09 if i == 9 else 0.01) for i in range(10)]  # the newest 10 steps
    assert served.post(batch(slow))[0] == 200
    expected = 10 * 256 / (9 * 0.01 + 0.09)  # 14,222 tokens/s; the median step says 25,600
    storage = served.collector.storage
    assert run_status(storage, "web-live")["tokens_per_second"] == pytest.approx(expected)
    row = next(r for r in run_table(storage) if r["run"] == "web-live")
    assert row["tokens_per_second"] == pytest.approx(expected)
    _web(served)._cache.clear()
    assert "<td>14,222</td>" in _page(served, "/")


def test_the_run_page_in_headless_chromium(served: LiveCollector, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    from PIL import Image

    shot = tmp_path / "run.png"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update", f"--user-data-dir={tmp_path / 'p'}",
           f"--screenshot={shot}", "--window-size=1280,2000", f"{served.url}/runs/{RUN}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2000)
    # The verdict box is at the top: its red border (#b00020) within the first 500 px.
    top = image.crop((0, 0, 1280, 500))
    red = sum(n for n, (r, g, b) in top.getcolors(1 << 20) if r > 150 and g < 40 and b < 60)
    assert red > 500, red
    # Plots are where the colours are: at least two 200-px bands hold hundreds of distinct colours.
    bands = [len(image.crop((0, y, 1280, y + 200)).getcolors(1 << 20) or []) for y in range(0, 2000, 200)]
    assert sum(n >= 300 for n in bands) >= 2, bands


def test_chromium_logs_in_to_a_guarded_collector_with_the_token_once(tmp_path: Path) -> None:
    """A collector started with a token: Chromium opens /?token=..., follows the redirect with the
    session cookie and shows the run list; without the token it shows how to log in."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    token = "s3cret-token-for-the-web-view-test"
    lc = start_collector(tmp_path / "guarded.sqlite", token=token)
    try:
        assert lc.post(batch([event("run_start", {"world_size": 1}, run="guarded-run", seq=0)]),
                       {"Authorization": f"Bearer {token}"})[0] == 200  # fmt: skip

        def dom(path: str) -> str:
            cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
                   "--disable-background-networking", "--disable-component-update",
                   f"--user-data-dir={tmp_path / 'p'}", "--dump-dom", lc.url + path]  # fmt: skip
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout

        assert "needs its token" in dom("/") and "guarded-run" not in dom("/")
        page = dom(f"/?token={token}")
        assert "guarded-run" in page and "needs its token" not in page
    finally:
        lc.stop()


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update", "--hide-scrollbars")  # fmt: skip
IMAGE_BORDER = (238, 238, 238)  # the report's img { border: 1px solid #eee }


def _chromium() -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    return chromium


def _screenshot(url: str, width: int, height: int, tmp_path: Path) -> Any:
    from PIL import Image

    shot = tmp_path / f"shot-{width}.png"
    cmd = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / f'p{width}'}", f"--screenshot={shot}",
           f"--window-size={width},{height}", url]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return Image.open(shot).convert("RGB")


def _first_image_box(image: Any, min_width: int = 200) -> tuple[int, int, int]:
    """(left, top, width) inside the border of the first image of the page: the first row, from the
    top, holding a run of at least ``min_width`` border-coloured pixels is that image's top border."""
    import numpy as np

    pixels = np.asarray(image).astype(int)
    border = (pixels == IMAGE_BORDER).all(axis=2)
    for y in range(border.shape[0]):
        xs = np.flatnonzero(border[y])
        if xs.size < min_width:
            continue
        runs = np.split(xs, np.flatnonzero(np.diff(xs) != 1) + 1)
        run = max(runs, key=len)
        if len(run) >= min_width:
            return int(run[0]) + 1, y + 1, len(run) - 2
    raise AssertionError("no image border on the page")


@pytest.mark.parametrize("width", [1280, 390])
def test_a_one_step_spike_shows_at_its_true_height_in_chromium(
    served: LiveCollector, tmp_path: Path, width: int
) -> None:
    """The run page's loss plot, as the browser draws it (scaled down to fit a phone's 390 px): the
    topmost pixel of the loss series above the spike's step is where 111.9 is on the plot's axis,
    within 2 screen pixels; the bin's mean (12) is drawn a quarter of the axis lower."""
    from trainmon.monitor.analysis import plots
    from trainmon.monitor.analysis.postmortem import analyse

    fig = plots.plot_loss(analyse(served.collector.storage, SPIKY))  # the figure the page embeds
    fig.draw_without_rendering()  # the constrained layout places the axes at draw time
    png_width = fig.get_figwidth() * plots.DPI
    image = _screenshot(f"{served.url}/runs/{SPIKY}", width, 3600, tmp_path)
    left, top, shown = _first_image_box(image)
    scale = shown / png_width
    assert (width == 1280) == (scale == 1.0), scale  # full size on a desktop, scaled down on a phone
    x = left + fig.axes[0].transData.transform((SPIKE_STEP + 0.5, 0.0))[0] * scale
    axes = fig.axes[0].get_window_extent()
    fig_height = fig.get_figheight() * plots.DPI
    box_top, box_bottom = top + (fig_height - axes.y1) * scale + 2, top + (fig_height - axes.y0) * scale - 2
    reach = max(2, round(6 * scale))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    row = drawn_top(buf.getvalue(), (int(x) - reach, int(box_top), int(x) + reach + 1, int(box_bottom)))
    assert row is not None, "no loss series near the spike's step"
    expected = top + pixel_row(fig, SPIKE_STEP, SPIKE_LOSS) * scale
    assert abs(row - expected) <= 2, (row, expected, top + pixel_row(fig, SPIKE_STEP, SPIKE_LOSS / 10) * scale)


@pytest.mark.parametrize("width", [1280, 390])
def test_the_run_lists_health_is_the_post_mortems_verdict_in_chromium(
    served: LiveCollector, tmp_path: Path, width: int
) -> None:
    """Each run's health in the list, as Chromium renders it, is the health word of the post-mortem
    of that run (one story), and each word is drawn in its colour at both widths."""
    from trainmon.monitor.analysis.postmortem import analyse
    from trainmon.monitor.analysis.verdict import verdict

    _web(served)._cache.clear()
    cmd = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'dom'}", f"--window-size={width},2000",
           "--dump-dom", served.url + "/"]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    shown = {
        urllib.parse.unquote(link): word
        for link, word in re.findall(r'<tr><td><a href="/runs/([^"]+)">.*?</a></td><td><span class="(\w+)">', dom)
    }
    assert {RUN, SPIKY, "web-live", HOSTILE_RUN} <= shown.keys(), shown
    storage = served.collector.storage
    for run, word in shown.items():
        assert word == verdict(analyse(storage, run).summary)["health"], run
    assert {shown[RUN], shown[SPIKY], shown["web-live"]} >= {"critical", "healthy"}
    image = _screenshot(served.url + "/", width, 1200, tmp_path)
    colours = {c for _, c in image.getcolors(1 << 20)}
    for word, colour in {"critical": (176, 0, 32), "warning": (179, 107, 0), "healthy": (27, 127, 59)}.items():
        assert (colour in colours) == (word in shown.values()), word
