"""Grafana dashboards as code: the JSON model is well formed, and every query returns data.

No Grafana server runs here, so the dashboards are checked through what Grafana would do with
them: the JSON model (ids, grid, datasource references, variables) statically, and every PromQL
expression (panels, variables, annotations) against a real Prometheus that scraped a live
collector fed by the reference trainer with faults injected.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.conftest import start_collector
from tests.prometheus import (
    PROMTOOL,
    REPO,
    Prometheus,
    fake_nvml_env,
    needs_prometheus,
    start_prometheus,
    stopping,
    write_test_rules,
)
from trainmon.monitor.cli import main as cli_main

DASHBOARDS = REPO / "dashboards"
FILES = ("trainmon-run.json", "trainmon-fleet.json")
RUN = "dash-run"

# Grafana's built-in variables may appear in queries without being defined by the dashboard.
BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__dashboard"}
# What the built-ins and the dashboards' variables become when a query is run by hand.
SUBSTITUTE = {"__rate_interval": "5s", "__interval": "1s", "__range": "1m", "run": RUN, "rank": "0"}

# Series a CPU run of the reference trainer cannot produce (the panels stay, the data comes on
# GPU runs): MFU needs peak_flops in run_start, which the reference trainer does not declare;
# peak device memory is only measured on CUDA.
NO_DATA_ON_CPU = {
    "trainmon_device_memory_peak_bytes": "peak memory is measured on CUDA only",
}

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def load_generator() -> ModuleType:
    """dashboards/generate.py, imported from its path (dashboards/ is not a package)."""
    spec = importlib.util.spec_from_file_location("trainmon_dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / name).read_text())


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # panels inside collapsed rows


def provisioned_datasource() -> dict[str, Any]:
    doc = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "trainmon.yml").read_text())
    (source,) = doc["datasources"]
    assert source["type"] == "prometheus"
    return source


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every query the dashboard makes: panels, variables, annotations."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", ()):
            out.append((f"panel {panel['id']} '{panel['title']}' {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]["query"]))
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            out.append((f"annotation {ann['name']}", ann["expr"]))
    return out


def variables_used(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _VAR.finditer(text)}


def substitute(expr: str) -> str:
    return _VAR.sub(lambda m: SUBSTITUTE[next(g for g in m.groups() if g)], expr)


@pytest.mark.parametrize("name", FILES)
def test_committed_json_is_what_generate_py_writes(name: str) -> None:
    """The JSON is generated; a hand edit would be lost at the next generation."""
    generate = load_generator()
    assert (DASHBOARDS / name).read_text() == generate.render(generate.DASHBOARDS[name]), (
        "run python dashboards/generate.py"
    )


@pytest.mark.parametrize("name", FILES)
def test_dashboard_model(name: str) -> None:
    d = load(name)
    assert d["schemaVersion"] >= 39
    assert d["uid"] and d["title"]
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    selected = {"type": "prometheus", "uid": "${datasource}"}
    for panel in all_panels(d):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == selected, panel["title"]
        assert panel["targets"], f"panel {panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == selected, (panel["title"], target["refId"])
            assert target["expr"].strip()
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == selected, var["name"]
    for ann in d["annotations"]["list"]:
        if not ann.get("builtIn"):
            assert ann["datasource"] == selected, ann["name"]


@pytest.mark.parametrize("name", FILES)
def test_datasource_is_a_variable_the_import_dialog_fills(name: str) -> None:
    """No datasource uid is written into the dashboards (a Grafana whose Prometheus has another uid
    broke on import): the `datasource` variable selects it, and its default is the `__inputs` entry
    Grafana's import dialog asks for."""
    d = load(name)
    assert provisioned_datasource()["uid"] not in (DASHBOARDS / name).read_text()
    (source,) = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert source["name"] == "datasource" and source["query"] == "prometheus"
    assert not source["multi"] and not source["includeAll"]
    (put,) = d["__inputs"]
    assert put == {**put, "type": "datasource", "pluginId": "prometheus"}
    assert source["current"] == {"text": f"${{{put['name']}}}", "value": f"${{{put['name']}}}"}
    assert {"type": "datasource", "id": "prometheus"}.items() <= d["__requires"][1].items()
    panel_types = {p["type"] for p in all_panels(d)} - {"row"}
    assert panel_types == {r["id"] for r in d["__requires"] if r["type"] == "panel"}


@pytest.mark.parametrize("name", FILES)
def test_every_variable_used_is_defined(name: str) -> None:
    d = load(name)
    defined = {v["name"] for v in d["templating"]["list"]} | BUILTINS
    for where, expr in expressions(d):
        assert variables_used(expr) <= defined, f"{name} {where}: undefined {variables_used(expr) - defined}"
    for panel in all_panels(d):
        for text in (panel.get("title", ""), panel.get("description", "")):
            assert variables_used(text) <= defined, (name, text)
    if name == "trainmon-run.json":
        assert {"run", "rank"} <= defined
        for var in d["templating"]["list"]:
            if var["type"] == "query":
                assert var["query"]["query"].startswith("label_values("), var


@pytest.mark.parametrize("name", FILES)
def test_grid_positions_are_sane(name: str) -> None:
    """Inside the 24-column grid, positive sizes, and no two panels on the same cells."""
    taken: dict[tuple[int, int], str] = {}
    for panel in load(name)["panels"]:
        g = panel["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_run_dashboard_covers_the_required_signals() -> None:
    exprs = " ".join(e for _, e in expressions(load("trainmon-run.json")))
    for metric in (
        "trainmon_loss",
        "trainmon_eval_loss",
        "trainmon_anomalies_total",
        "trainmon_learning_rate_expected",
        "trainmon_grad_norm_clipped",
        "trainmon_grad_clip_coefficient",
        "trainmon_tokens_total",
        "trainmon_mfu_ratio",
        "trainmon_phase_seconds",
        "trainmon_step_time_seconds",
        "trainmon_gpu_temperature_celsius",
        "trainmon_host_memory_used_bytes",
    ):
        assert metric in exprs, metric
    types = {p["type"] for p in load("trainmon-run.json")["panels"]}
    assert "heatmap" in types


def test_provisioning_matches_the_compose_example() -> None:
    """The provider path is where docker-compose mounts the JSON; the datasource uid is the panels'."""
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "trainmon.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((DASHBOARDS / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    for name in FILES:
        assert f"./{name}:{path}/{name}:ro" in mounts
    assert provisioned_datasource()["isDefault"] is True  # the variable's choice where nothing else fills it
    prom = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["job_name"] == "trainmon"  # TrainmonCollectorDown's job


def promtool_check_config(config: Path) -> subprocess.CompletedProcess:
    """``promtool check config`` on ``config``: its syntax, and that the rule and credential files it
    names exist where Prometheus would look (relative paths from the config's folder)."""
    return subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package 'prometheus')")
def test_the_local_prometheus_config_is_valid_as_shipped() -> None:
    """The README's local setup (``trainmon serve``, then ``prometheus --config.file=...``): the file
    is valid as it is, loads the rules, and scrapes the loopback collector without a token."""
    config = DASHBOARDS / "prometheus.yml"
    proc = promtool_check_config(config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout and "rules found" in proc.stdout  # loaded, not skipped
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]  # `trainmon serve`'s default address
    assert "authorization" not in job  # a loopback collector has no token


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package 'prometheus')")
def test_the_docker_prometheus_config_is_valid_where_compose_mounts_it(tmp_path: Path) -> None:
    """The Prometheus container's files laid out as docker-compose.yml mounts them (volumes and the
    token secret, under a temporary root), then ``promtool check config`` on the file its
    ``--config.file`` names: the rules and the token are where the config looks for them."""
    compose = yaml.safe_load((DASHBOARDS / "docker-compose.yml").read_text())
    service = compose["services"]["prometheus"]
    root = tmp_path / "container"
    mounts = []
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):  # a file of the repository; named volumes hold data
            mounts.append((DASHBOARDS / source, target))
    token = tmp_path / "trainmon.token"
    token.write_text("a-token-of-at-least-16-characters\n")  # the user writes it before the first start
    for secret in service["secrets"]:
        assert Path(compose["secrets"][secret["source"]]["file"]).name == token.name
        mounts.append((token, secret["target"]))
    for source, target in mounts:
        assert source.is_file(), source
        placed = root / target.lstrip("/")
        placed.parent.mkdir(parents=True, exist_ok=True)
        placed.write_bytes(source.read_bytes())
    (flag,) = [c for c in service["command"] if c.startswith("--config.file=")]
    config = root / flag.removeprefix("--config.file=").lstrip("/")
    proc = promtool_check_config(config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rules found" in proc.stdout
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    assert job["authorization"]["credentials_file"] and job["static_configs"][0]["targets"] == ["collector:9400"]


def test_gpu_panels_have_one_unit_each_and_decode_throttling() -> None:
    """Watts and hertz on separate panels with their units; the throttle bitmask is not drawn as a
    number but decoded into named reasons on a state timeline."""
    panels = {p["title"]: p for p in all_panels(load("trainmon-run.json"))}
    assert panels["GPU power"]["fieldConfig"]["defaults"]["unit"] == "watt"
    assert panels["GPU SM clock"]["fieldConfig"]["defaults"]["unit"] == "hertz"
    for panel in panels.values():
        if panel["type"] == "timeseries":
            assert not any("throttle_reasons" in t["expr"] for t in panel["targets"]), panel["title"]
    throttle = panels["GPU throttle reasons"]
    assert throttle["type"] == "state-timeline"
    assert "{{reason}}" in throttle["targets"][0]["legendFormat"]
    texts = {
        value: option["text"]
        for m in throttle["fieldConfig"]["defaults"]["mappings"]
        for value, option in m["options"].items()
    }
    assert texts == {"1": "benign", "2": "slowing the GPU"}


def test_fleet_table_links_each_run_to_the_run_dashboard() -> None:
    fleet, run = load("trainmon-fleet.json"), load("trainmon-run.json")
    (table,) = [p for p in all_panels(fleet) if p["type"] == "table"]
    (override,) = [o for o in table["fieldConfig"]["overrides"] if o["matcher"] == {"id": "byName", "options": "run"}]
    (links,) = [p["value"] for p in override["properties"] if p["id"] == "links"]
    (link,) = links
    path, _, query = link["url"].partition("?")
    assert path.startswith(f"/d/{run['uid']}/")
    params = query.split("&")
    assert "var-run=${__value.raw:percentencode}" in params  # the row's run, into the run variable
    assert "${datasource:queryparam}" in params and "${__url_time_range}" in params  # same Prometheus and time
    assert {v["name"] for v in run["templating"]["list"]} >= {"run", "datasource"}
    assert "datasource" in {v["name"] for v in fleet["templating"]["list"]}


# --- every query against a real Prometheus --------------------------------------------------


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, float, float]]:
    """Prometheus (with the trainmon rules, for the recording rules) that scraped a faulted run.

    The run covers every panel: fp16 (loss scale), evaluation (eval loss), a data stall and a NaN
    (anomalies), a fake NVML GPU (GPU panels) and psutil (host panels)."""
    tmp = tmp_path_factory.mktemp("dashboards")
    collector = start_collector(tmp / "trainmon.sqlite")
    rules = write_test_rules(tmp / "rules.yml", for_="0s")
    prom = start_prometheus(tmp / "prom", [collector.url.removeprefix("http://")], [rules])
    with stopping(collector, prom):
        start = time.time()
        cmd = [
            sys.executable,
            "-m",
            "trainmon.reference_trainer",
            "--run",
            RUN,
            "--steps",
            "160",
            "--out",
            str(tmp / "out"),
        ]
        cmd += ["--collector", collector.url, "--threads", "1", "--seq-len", "32", "--precision", "fp16"]
        cmd += ["--heartbeat-interval", "1", "--health-interval", "1", "--eval-every", "20", "--peak-flops", "1e11"]
        cmd += ["--inject", "data_stall@100:seconds=1,steps=3", "--inject", "nan@140"]
        env = fake_nvml_env(tmp / "fake_nvml", temperature_c=80, throttle=0x4)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        time.sleep(3)  # a few more scrapes and rule evaluations after the run's last events
        yield prom, start, time.time()


@pytest.mark.slow
@needs_prometheus
@pytest.mark.parametrize("name", FILES)
def test_every_query_returns_data(scraped: tuple[Prometheus, float, float], name: str) -> None:
    prom, start, end = scraped
    empty = []
    for where, expr in expressions(load(name)):
        if where.startswith("variable"):
            # label_values(metric, label): Grafana lists that label's values among the metric's series.
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", substitute(expr))
            assert m, expr
            values = {s["metric"].get(m[2]) for s in prom.query(m[1])}
            assert {"run": RUN, "rank": "0"}[m[2]] in values, (where, values)
            continue
        query = substitute(expr)
        result = prom.query_range(query, start, end, step=1.0)
        if not any(series["values"] for series in result):
            if any(metric in query for metric in NO_DATA_ON_CPU):
                continue
            empty.append(f"{where}: {query}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


@pytest.mark.slow
@needs_prometheus
def test_throttle_reasons_decode_in_prometheus(scraped: tuple[Prometheus, float, float]) -> None:
    """The throttle panel's PromQL on the scraped run (fake NVML: SW power cap, 0x4) and on a mask with
    SW thermal, HW thermal and the power cap set (0x64): each set bit is one series naming its reason."""
    prom, _, _ = scraped
    generate = load_generator()

    def decoded(mask: str) -> dict[str, float]:
        return {s["metric"]["reason"]: float(s["value"][1]) for s in prom.query(generate._throttle_reasons(mask))}

    assert decoded(f'trainmon_gpu_throttle_reasons{{run="{RUN}"}}') == {"SW power cap": 1.0}
    assert decoded("vector(100)") == {"SW power cap": 1.0, "SW thermal": 2.0, "HW thermal": 2.0}
    assert decoded("vector(0)") == {}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package 'prometheus')")
def test_fleet_critical_stat_counts_only_runs_still_running(tmp_path: Path) -> None:
    """A finished run's series outlive it by 5 minutes, its open critical anomaly included: the fleet
    stat counted it all that time. promtool evaluates the panel's query on both kinds of run."""
    (query,) = [e for w, e in expressions(load("trainmon-fleet.json")) if "Runs with open critical" in w]
    series = {
        'trainmon_anomalies_active{run="live", rank="0", kind="nan_inf", severity="critical"}': "1x10",
        'trainmon_anomalies_active{run="done", rank="0", kind="nan_inf", severity="critical"}': "1x10",
        'trainmon_anomalies_active{run="done", rank="1", kind="hang", severity="critical"}': "1x10",
        'trainmon_anomalies_active{run="warned", rank="0", kind="loss_spike", severity="warning"}': "1x10",
        'trainmon_run_running{run="live", attempt="1"}': "1x10",
        'trainmon_run_running{run="done", attempt="1"}': "1 1 1 1 1 0 0 0 0 0 0",
        'trainmon_run_running{run="warned", attempt="1"}': "1x10",
    }
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "promql_expr_test": [
                    {"expr": query, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 2}]},
                    {"expr": query, "eval_time": "8m", "exp_samples": [{"labels": "{}", "value": 1}]},
                ],
            }
        ],
    }
    path = tmp_path / "fleet.test.yml"
    path.write_text(json.dumps(test))  # JSON is YAML
    proc = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- trainmon grafana provision against a fake Grafana HTTP API ----------------------------


class FakeGrafana:
    """The three Grafana API calls provisioning makes, on loopback, recording every request.

    There is no Grafana server here (no Debian package, no Docker), so this stands in for it; the
    payload assertions are what a real Grafana's API reference requires."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.folders: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append(
                    {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"), "json": body}
                )
                return body

            def do_GET(self) -> None:
                self._record()
                if self.path.split("?")[0] == "/api/folders":
                    return self._answer(200, fake.folders)
                return self._answer(404, {"message": "not found"})

            def do_POST(self) -> None:
                body = self._record()
                if self.path == "/api/folders":
                    folder = {"id": len(fake.folders) + 1, "uid": body.get("uid") or "gen", "title": body["title"]}
                    fake.folders.append(folder)
                    return self._answer(200, folder)
                if self.path == "/api/dashboards/db":
                    uid = body["dashboard"]["uid"]
                    return self._answer(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1})
                return self._answer(404, {"message": "not found"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana()
    yield fake
    fake.stop()


TOKEN = "glsa_s3cret-token-for-the-test"


def test_grafana_provision_creates_the_folder_and_uploads_both_dashboards(
    fake_grafana: FakeGrafana, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert cli_main(["grafana", "provision", "--url", fake_grafana.url, "--folder", "ML runs"]) == 0
    reqs = fake_grafana.requests
    assert [(r["method"], r["path"].split("?")[0]) for r in reqs] == [
        ("GET", "/api/folders"),
        ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"),
        ("POST", "/api/dashboards/db"),
    ]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in reqs)
    assert reqs[1]["json"] == {"title": "ML runs", "uid": "ml-runs"}
    uploaded = {r["json"]["dashboard"]["uid"]: r["json"] for r in reqs[2:]}
    assert set(uploaded) == {"trainmon-run", "trainmon-fleet"}
    for name in FILES:
        payload = uploaded[load(name)["uid"]]
        assert payload["folderUid"] == "ml-runs" and payload["overwrite"] is True
        assert payload["dashboard"] == {**load(name), "id": None}
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err
    assert "folder 'ML runs' (created, uid ml-runs)" in out.out

    # Second run: the folder exists, the dashboards are overwritten; the token from --token wins.
    fake_grafana.requests.clear()
    monkeypatch.delenv("GRAFANA_TOKEN")
    args = ["grafana", "provision", "--url", fake_grafana.url, "--token", "other", "--folder", "ML runs"]
    assert cli_main([*args, "--datasource-uid", "my-prom"]) == 0
    reqs = fake_grafana.requests
    assert [r["method"] for r in reqs] == ["GET", "POST", "POST"]
    assert all(r["auth"] == "Bearer other" for r in reqs)
    for r in reqs[1:]:
        variables = {v["name"]: v for v in r["json"]["dashboard"]["templating"]["list"]}
        assert variables["datasource"]["current"] == {"text": "my-prom", "value": "my-prom"}
        assert "${DS_PROMETHEUS}" not in json.dumps(r["json"])
    assert "(existing, uid ml-runs)" in capsys.readouterr().out


def test_grafana_provision_needs_a_token_and_hides_it_in_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert cli_main(["grafana", "provision", "--url", "http://127.0.0.1:9"]) == 2
    assert "GRAFANA_TOKEN" in capsys.readouterr().err
    # Nothing listens on the discard port: a connection error, reported without the token.
    assert cli_main(["grafana", "provision", "--url", "http://127.0.0.1:9", "--token", TOKEN]) == 1
    out = capsys.readouterr()
    assert "trainmon grafana provision:" in out.err
    assert TOKEN not in out.out + out.err
