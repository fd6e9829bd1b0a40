"""The `trainmon` command line, run as users and scripts run it (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.events import batch, event, step_events
from trainmon.monitor.store.storage import Storage

TRAINMON = [sys.executable, "-m", "trainmon.monitor.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "collector exited"
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("collector did not become healthy")


def _write_jsonl(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _faulty_run() -> list[dict]:
    start = event("run_start", {"world_size": 1, "vocab_size": 64, "planned_steps": 40}, seq=0, run="faulty")
    steps = step_events(40, run="faulty", loss=lambda i: "NaN" if i == 31 else 4.1 - 0.01 * i)
    end = event("run_end", {"status": "failed", "step": 39}, seq=41, run="faulty")
    return [start, *steps, end]


def _open_anomalies(url: str, run: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/v1/runs/{run}/anomalies", timeout=10) as resp:
        return json.loads(resp.read())


def test_serve_runs_until_sigterm_and_stores_what_it_acknowledged(tmp_path: Path) -> None:
    port = _free_port()
    db = tmp_path / "store.sqlite"
    proc = subprocess.Popen(
        [*TRAINMON, "serve", "--db", str(db), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        req = urllib.request.Request(
            url + "/v1/events",
            data=json.dumps(batch(_faulty_run())).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read()) == {"accepted": 42, "duplicates": 0}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not _open_anomalies(url, "faulty"):
            time.sleep(0.2)  # the detectors run after the acknowledgement
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    console = proc.stderr.read()  # the collector says when runs start and end and anomalies open
    assert "run faulty started: attempt 1, 1 rank(s)" in console, console
    assert "anomaly opened: critical nan_inf on run faulty rank 0 at step 31" in console, console
    assert "run faulty failed at step" in console, console
    out = subprocess.run(
        [*TRAINMON, "postmortem", "faulty", "--db", str(db), "--json"], capture_output=True, text=True, check=True
    ).stdout
    summary = json.loads(out)
    assert (summary["run"], summary["steps"], summary["attempts"], summary["status"]) == ("faulty", 40, 1, "failed")
    assert summary["final_loss"] == pytest.approx(4.1 - 0.39)
    (nan,) = summary["anomalies"]
    assert (nan["kind"], nan["first_step"], nan["rank"], nan["severity"]) == ("nan_inf", 31, 0, "critical")
    assert nan["message"] and nan["hint"]
    runs = json.loads(
        subprocess.run(
            [*TRAINMON, "runs", "--db", str(db), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert [(r["run"], r["status"], r["step"], r["open_anomalies"]) for r in runs] == [("faulty", "failed", 39, 1)]


def test_postmortem_of_a_jsonl_file_runs_the_same_detectors(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _write_jsonl(path, _faulty_run())
    with open(path, "a") as f:
        f.write("{torn line\n")  # a truncated write is skipped, not fatal
    proc = subprocess.run([*TRAINMON, "postmortem", str(path), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert {"run", "steps", "attempts", "final_loss", "anomalies"} <= set(summary)
    assert [(a["kind"], a["first_step"]) for a in summary["anomalies"]] == [("nan_inf", 31)]
    human = subprocess.run(
        [*TRAINMON, "postmortem", str(path)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert human.returncode == 0 and "nan_inf" in human.stdout and "faulty" in human.stdout


def test_postmortem_errors_are_plain(tmp_path: Path) -> None:
    missing = subprocess.run(
        [*TRAINMON, "postmortem", str(tmp_path / "nope.jsonl"), "--json"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "is not a file or folder" in missing.stderr
    db = tmp_path / "empty.sqlite"
    absent = subprocess.run([*TRAINMON, "postmortem", "ghost", "--db", str(db)], capture_output=True, text=True)
    assert absent.returncode == 2 and "no store at" in absent.stderr and not db.exists()
    Storage(str(db)).close()
    unknown = subprocess.run([*TRAINMON, "postmortem", "ghost", "--db", str(db)], capture_output=True, text=True)
    assert unknown.returncode == 2 and "no run 'ghost'" in unknown.stderr


def test_bad_config_file_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("port = 9400\n[detectors.nan_inf]\nresolve_after = 'soon'\n")
    proc = subprocess.run([*TRAINMON, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "detectors.nan_inf.resolve_after: expected int, got 'soon'" in proc.stderr
    cfg.write_text("prot = 9400\n")
    proc = subprocess.run([*TRAINMON, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "prot: unknown field" in proc.stderr


def test_postmortem_of_a_folder_merges_the_ranks(tmp_path: Path) -> None:
    run = "ddp"
    start = [event("run_start", {"world_size": 2}, run=run, rank=r, stream=f"s{r}", seq=0, t=1000.0) for r in (0, 1)]
    ranks = [step_events(10, run=run, rank=r, stream=f"s{r}") for r in (0, 1)]
    for r, evs in enumerate(ranks):
        for i, e in enumerate(evs):
            e["time"] = 1001.0 + i + 0.5 * r
    _write_jsonl(tmp_path / "events.jsonl", [start[0], *ranks[0]])
    _write_jsonl(tmp_path / "events.rank1.jsonl", [start[1], *ranks[1]])
    (tmp_path / "labels.json").write_text("[]")  # other files in the folder are ignored
    proc = subprocess.run([*TRAINMON, "postmortem", str(tmp_path), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["run"], summary["world_size"], summary["steps"]) == ("ddp", 2, 10)


def _trainmon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAINMON, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _compared(summary: dict) -> dict:
    """What an exported run must keep of its post-mortem (issue 27: the round trip)."""
    return {
        "anomalies": [
            (a["kind"], a["severity"], a["rank"], a["first_step"], a["last_step"]) for a in summary["anomalies"]
        ],
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "goodput": summary["goodput"]["fraction"],
        "status": summary["status"],
    }


def test_export_writes_jsonl_the_postmortem_reads_back_to_the_same_report(tmp_path: Path) -> None:
    db, source, archive = tmp_path / "store.sqlite", tmp_path / "in.jsonl", tmp_path / "faulty.jsonl"
    _write_jsonl(source, _faulty_run())
    assert _trainmon("import", str(source), "--db", str(db)).returncode == 0

    done = _trainmon("export", "faulty", str(archive), "--db", str(db))

    assert done.returncode == 0, done.stderr
    assert f"exported run faulty to {archive}: 42 events" in done.stdout
    stored = json.loads(_trainmon("postmortem", "faulty", "--db", str(db), "--json").stdout)
    again = json.loads(_trainmon("postmortem", str(archive), "--json").stdout)
    assert _compared(again) == _compared(stored) and stored["anomalies"]
    missing = _trainmon("export", "ghost", str(tmp_path / "ghost.jsonl"), "--db", str(db))
    assert missing.returncode == 2 and "no run 'ghost'" in missing.stderr
    assert not (tmp_path / "ghost.jsonl").exists() and not (tmp_path / "ghost.jsonl.part").exists()


def test_delete_asks_first_and_refuses_without_a_terminal(tmp_path: Path) -> None:
    db, source = tmp_path / "store.sqlite", tmp_path / "in.jsonl"
    _write_jsonl(source, _faulty_run())
    assert _trainmon("import", str(source), "--db", str(db)).returncode == 0

    unasked = _trainmon("delete", "faulty", "--db", str(db))
    assert unasked.returncode == 2 and "confirm with --yes" in unasked.stderr
    assert [r["run"] for r in json.loads(_trainmon("runs", "--db", str(db), "--json").stdout)] == ["faulty"]

    done = _trainmon("delete", "faulty", "--db", str(db), "--yes")
    assert done.returncode == 0 and "deleted run faulty from" in done.stdout, done.stderr
    assert json.loads(_trainmon("runs", "--db", str(db), "--json").stdout) == []
    again = _trainmon("delete", "faulty", "--db", str(db), "--yes")
    assert again.returncode == 2 and "no run 'faulty'" in again.stderr


def test_delete_refuses_a_run_that_may_still_be_receiving(tmp_path: Path) -> None:
    db, source = tmp_path / "store.sqlite", tmp_path / "in.jsonl"
    _write_jsonl(source, _faulty_run()[:-1])  # no run_end, last event just now
    assert _trainmon("import", str(source), "--db", str(db)).returncode == 0
    refused = _trainmon("delete", "faulty", "--db", str(db), "--yes")
    assert refused.returncode == 2 and "may still be receiving events" in refused.stderr


def test_serve_prints_its_retention_and_deletes_and_exports_through_the_url(tmp_path: Path) -> None:
    port, token = _free_port(), "tm-cli-lifecycle-8fK2mQ"
    proc = subprocess.Popen(
        [*TRAINMON, "serve", "--db", str(tmp_path / "store.sqlite"), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TRAINMON_TOKEN": token},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        req = urllib.request.Request(
            url + "/v1/events",
            data=json.dumps(batch(_faulty_run())).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        urllib.request.urlopen(req, timeout=10).close()
        archive = tmp_path / "faulty.jsonl"
        exported = _trainmon("export", "faulty", str(archive), "--url", url, "--token", token)
        assert exported.returncode == 0, exported.stderr
        assert len(archive.read_text().splitlines()) == 42
        no_token = _trainmon("delete", "faulty", "--url", url, "--yes")
        assert no_token.returncode == 2 and "HTTP 401" in no_token.stderr
        deleted = _trainmon("delete", "faulty", "--url", url, "--token", token, "--yes")
        assert deleted.returncode == 0 and f"deleted run faulty from {url}" in deleted.stdout, deleted.stderr
        gone = _trainmon("delete", "faulty", "--url", url, "--token", token, "--yes")
        assert gone.returncode == 2 and "no run 'faulty'" in gone.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    console = proc.stderr.read()
    assert (
        "retention: deletes finished runs older than 90 days and the oldest finished runs while the store "
        "exceeds 50 GiB" in console
    ), console
