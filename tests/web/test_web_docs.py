"""``/docs`` works air-gapped (issue 26): the API reference needs nothing from another host.

FastAPI's ``/docs`` is Swagger UI, whose scripts and styles come from a CDN: on a cluster without
internet the page is blank. The collector serves its own reference instead, rendered from its
OpenAPI schema, with no script. Checked on a real collector over HTTP, and in headless Chromium
with the network cut off (``--host-resolver-rules`` sends every name nowhere).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from tests.conftest import LiveCollector, start_collector
from trainmon.monitor.web.pages import api_page, register_docs

# src=, href=, action=, srcset= and CSS url(...): everything a browser would fetch or follow.
_REFERENCE = re.compile(
    r"""(?:src|href|action|srcset|poster|data)\s*=\s*["']?([^"'\s>]+)|url\(\s*["']?([^"')]+)""", re.IGNORECASE
)


def external_references(page: str) -> list[str]:
    """The references of ``page`` that name a host (``scheme://host``, ``//host``): none may."""
    refs = [a or b for a, b in _REFERENCE.findall(page)]
    return [r for r in refs if re.match(r"^(?:[a-z][a-z0-9+.-]*:)?//", r, re.I)]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCollector]:
    lc = start_collector(tmp_path_factory.mktemp("docs") / "trainmon.sqlite")
    yield lc
    lc.stop()


def test_the_collectors_docs_page_references_no_other_host(collector: LiveCollector) -> None:
    status, body = collector.get("/docs")
    assert status == 200
    page = body.decode()
    assert external_references(page) == [], external_references(page)
    assert "<script" not in page.lower()  # nothing to load, nothing to run
    # It is the reference, not an empty shell waiting for a script: every operation is on the page.
    schema = collector.get_json("/openapi.json")
    for path, item in schema["paths"].items():
        for method in item:
            assert f"<code>{method.upper()} {path}</code>" in page, (method, path)
    assert 'href="/openapi.json"' in page
    # /redoc is Swagger's sibling, from the same CDN: not served.
    assert collector.get("/redoc")[0] == 404


def test_the_reference_shows_parameters_bodies_and_answers(collector: LiveCollector) -> None:
    page = collector.get("/docs")[1].decode()
    status = page[page.index("<code>GET /v1/runs/{run}</code></h2>") :].split("<h2")[0]
    assert "<code>window</code>" in status and "integer, minimum 2, maximum 2000, default 120" in status
    events = page[page.index("<code>POST /v1/events</code></h2>") :].split("<h2")[0]
    assert "Request body (application/json) required" in events and "&quot;events&quot;" in events
    assert "<td>429</td>" in events and "Retry-After" in events


def test_register_docs_on_an_app_without_swagger() -> None:
    """What ``create_app`` does: FastAPI's CDN pages off, this page on ``/docs``."""
    from fastapi.testclient import TestClient

    app = FastAPI(title="t <&>", version="9", docs_url=None, redoc_url=None)

    @app.get("/things/{name}", summary="A thing `by name`")
    def thing(name: str, n: int = 3) -> dict[str, int]:
        return {name: n}

    register_docs(app)
    with TestClient(app) as client:
        answer = client.get("/docs")
    assert answer.status_code == 200 and "script-src" not in answer.headers["content-security-policy"]
    assert "default-src 'none'" in answer.headers["content-security-policy"]
    page = answer.text
    assert "t &lt;&amp;&gt;" in page and "<code>GET /things/{name}</code>" in page and "default 3" in page
    assert "/docs" not in app.openapi()["paths"]  # the page is not part of the API it describes
    assert external_references(api_page(app.openapi())) == []


def test_external_references_finds_what_swagger_ui_loads() -> None:
    """The check itself: it sees the CDN in FastAPI's own Swagger page."""
    from fastapi.openapi.docs import get_swagger_ui_html

    swagger = get_swagger_ui_html(openapi_url="/openapi.json", title="x").body.decode()
    assert any("cdn.jsdelivr.net" in r for r in external_references(swagger))


def test_docs_in_headless_chromium_without_network(collector: LiveCollector, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update", f"--user-data-dir={tmp_path / 'p'}",
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # air-gapped: only the collector
           "--dump-dom", f"{collector.url}/docs"]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert "POST /v1/events" in dom and "GET /v1/runs/{run}/anomalies" in dom, dom[:2000]
