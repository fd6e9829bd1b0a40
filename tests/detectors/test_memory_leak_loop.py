"""memory_leak end to end: a real CPU loop under TrainMonitor's defaults, file:// JSONL, post-mortem.

A loop that keeps 1 MiB per step must be caught within about a minute (issue 14: with ten-second
health samples alone it never was); the same loop without the leak stays silent. Also the cgroup
reading the time to OOM relies on, on real files in the cgroup v2 format.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.trainer_helpers import ROOT, of_kind, read_events, trainer_env
from trainmon.hooks.health import cgroup_memory
from trainmon.monitor.analysis.postmortem import import_file, summarize
from trainmon.monitor.store.storage import Storage

MIB = 1 << 20
SECONDS = 23  # health events (with the samples of the seconds before them) at 0, 10 and 20 s

LOOP = textwrap.dedent(
    """
    import sys, time
    import torch
    from trainmon import TrainMonitor

    out, seconds, leak_mib = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainMonitor("loop", collector="file://" + out)  # defaults: what a user gets
    mon.watch(model, opt)
    mon.start()
    kept = []
    start, step = time.time(), 0
    while time.time() - start < seconds:
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if leak_mib:
            kept.append(b"x" * (leak_mib << 20))  # written, so resident: kept every step, like a list of outputs
        mon.step_end(step, loss=loss)
        step += 1
        time.sleep(0.02)  # ~30-40 steps/s, as in the issue
    mon.close()
    """
)


def _start(path, leak_mib: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", LOOP, str(path), str(SECONDS), str(leak_mib)]
    return subprocess.Popen(cmd, cwd=ROOT, env=trainer_env(), stderr=subprocess.PIPE, text=True)


def _leaks(path) -> list[dict]:
    storage = Storage("sqlite://")
    import_file(path, storage)
    return [a for a in summarize(storage, "loop")["anomalies"] if a["kind"] == "memory_leak"]


def test_defaults_catch_one_mib_per_step_and_a_clean_loop_stays_silent(tmp_path) -> None:
    leak, clean = tmp_path / "leak.jsonl", tmp_path / "clean.jsonl"
    procs = [_start(leak, 1), _start(clean, 0)]  # side by side: both mostly sleep
    for p in procs:
        _, err = p.communicate(timeout=SECONDS + 120)
        assert p.returncode == 0, err[-3000:]

    events = read_events(leak)
    # the hooks sample the RSS every second and send the samples with the health event
    health = of_kind(events, "health")
    samples = [h["rss_samples"] for h in health]
    assert [len(s) for s in samples[1:]] >= [9, 9] and all(s == sorted(s) for s in samples[1:])
    assert 0.8 <= health[1]["rss_sample_interval"] <= 1.5

    (found,) = _leaks(leak)
    steps = {e["fields"]["step"]: e["time"] for e in events if e["kind"] == "step"}
    caught_after = steps[found["first_step"]] - steps[0]
    assert caught_after <= 60, found
    assert "out of memory (90% of the " in found["message"] and "MiB/step" in found["message"]
    assert 0.7 * MIB <= found["evidence"]["bytes_per_step"] <= 1.3 * MIB, found

    assert _leaks(clean) == []


def test_cgroup_memory_reads_limit_and_working_set(tmp_path) -> None:
    limit, usage, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    files = (str(limit), str(usage), str(stat))
    usage.write_text("3221225472\n")
    stat.write_text("anon 2147483648\nfile 1073741824\nactive_file 268435456\ninactive_file 805306368\n")
    limit.write_text("8589934592\n")
    assert cgroup_memory(files, host_total=64 << 30) == {
        "cgroup_mem_limit_bytes": 8 << 30,
        "cgroup_mem_used_bytes": (3 << 30) - 768 * MIB,  # the inactive file cache is reclaimed before an OOM kill
    }
    limit.write_text("max\n")
    assert cgroup_memory(files, host_total=64 << 30) == {}
    limit.write_text(str(128 << 30))  # a limit above the host's memory limits nothing
    assert cgroup_memory(files, host_total=64 << 30) == {}
