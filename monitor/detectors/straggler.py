"""``straggler``: one rank computes slower than the others, step after step.

Why the rule is what it is (``failure-modes.md`` P1, traceopt-ai/traceml#252): DDP's all-reduce
evens out the step time of every rank (the fast ones wait for the slow one), so step time alone
cannot name the culprit. Compute time can: the straggler has the highest forward + backward time
and the lowest exposed communication wait. The detector aligns the ranks' records by step,
divides each rank's compute time by the median of the other ranks' at the same step, and fires
when that ratio reaches ``min_ratio`` in ``min_share`` of the last ``window`` aligned steps
(sustained, P1; CPU ranks sharing cores show 2-5x bursts on single steps from noisy
neighbours). Without a phase split it falls back to step time.
"""

from __future__ import annotations

import bisect
import statistics

from trainmon.hooks.wire import Event
from trainmon.monitor.config import StragglerConfig
from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.rolling import RollingWindow

__all__ = ["Straggler"]


def _times(fields: dict) -> tuple[float, float] | None:
    """(compute seconds, comm seconds) of a step record, or None when it has no timing."""
    phases = fields.get("phases") or {}
    compute = phases.get("forward", 0.0) + phases.get("backward", 0.0)
    if compute <= 0:
        compute = fields.get("step_time") or 0.0
    if compute <= 0:
        return None
    return compute, phases.get("comm", 0.0)


def _median_without(ordered: list[float], value: float) -> float:
    """Median of ``ordered`` (sorted) with one occurrence of ``value`` left out, in O(1)."""
    i = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else 0.5 * (at(n // 2 - 1) + at(n // 2))


class Straggler(Detector):
    """Per-rank compute time against the median of the other ranks at the same step."""

    kind = "straggler"
    scope = "run"

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._world = 0
        self._pending: dict[int, dict[int, tuple[float, float]]] = {}
        self._ratios: dict[int, RollingWindow] = {}
        self._comm: dict[int, RollingWindow] = {}
        # median comm over all ranks, per step: what the others wait (for the message only, so one
        # run-wide window rather than one per rank; with two ranks "own <= median" still means "own <= other")
        self._step_comm = RollingWindow(config.window)
        self._open: dict[int, float] = {}  # rank -> median ratio when reported
        self._hosts: dict[int, str] = {}
        self._device = ""  # run_start's device: a CPU run's straggler is not a throttled GPU

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        if event.kind == "run_start":
            self._world = max(self._world, int(event.fields.get("world_size") or 0), event.rank + 1)
            self._device = str(event.fields.get("device") or "")
            self._pending.clear()
            return []
        if event.kind != "step":
            return []
        self._world = max(self._world, event.rank + 1)
        self._hosts[event.rank] = event.host
        if self._world < 2:
            return []
        times = _times(event.fields)
        if times is None:
            return []
        step = event.fields["step"]
        row = self._pending.setdefault(step, {})
        row[event.rank] = times
        if len(self._pending) > self.config.max_pending:
            del self._pending[min(self._pending)]
        if len(row) < self._world:
            return []
        del self._pending[step]
        return self._judge(step, row)

    def _judge(self, step: int, row: dict[int, tuple[float, float]]) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        computes = sorted(c for c, _ in row.values())
        comms = sorted(m for _, m in row.values())
        self._step_comm.add(statistics.median(comms))
        for rank, (compute, comm) in row.items():
            ref = _median_without(computes, compute)
            if ref <= 0:
                continue
            ratios = self._ratios.setdefault(rank, RollingWindow(cfg.window))
            ratios.add(compute / ref)
            self._comm.setdefault(rank, RollingWindow(cfg.window)).add(comm)
            if not ratios.full:
                continue
            median = ratios.median()
            if rank in self._open:
                if median < cfg.resolve_ratio:
                    del self._open[rank]
                    out.append(self._resolved(rank, step, median))
                elif median > 1.5 * self._open[rank]:  # markedly worse: update the evidence
                    self._open[rank] = median
                    out.append(self._finding(rank, step, median))
            elif ratios.quantile(1 - cfg.min_share) >= cfg.min_ratio:
                self._open[rank] = median
                out.append(self._finding(rank, step, median))
        return out

    def _finding(self, rank: int, step: int, median: float) -> Finding:
        own_comm = self._comm[rank].median()
        others_comm = self._step_comm.median()
        host = self._hosts.get(rank, "?")
        waits_least = own_comm <= others_comm
        signature = (
            f"while waiting least in collectives ({own_comm * 1e3:.3g} ms vs {others_comm * 1e3:.3g} ms)"
            if waits_least and others_comm > 0
            else ""
        )
        if self._device.lower().startswith("cpu"):
            check = (
                "other processes competing for its cores (noisy neighbour: top/htop), CPU frequency or thermal "
                "limits, more threads than free cores (torch.get_num_threads(), OMP_NUM_THREADS), dataloader "
                "contention"
            )
        else:
            check = (
                "GPU clocks, temperature and throttle reasons (node_health, nvidia-smi -q -d PERFORMANCE), other "
                "processes on it (noisy neighbour), CPU/dataloader contention"
            )
        return Finding(
            kind=self.kind,
            severity="warning",
            step=step,
            message=(
                f"rank {rank} on {host} computes {median:.2f}x the median of the other ranks over the last "
                f"{self.config.window} steps {signature}".rstrip()
            ),
            hint=(
                f"Rank {rank} (host {host}) is a straggler and every other rank waits for it in the all-reduce. "
                f"Check that node: {check}. If it persists, drain or exclude {host} and restart from the last "
                "checkpoint."
            ),
            evidence={
                "rank": rank,
                "host": host,
                "ratio_to_median_of_others": round(median, 3),
                "comm_s": round(own_comm, 6),
                "others_comm_s": round(others_comm, 6),
                "window": self.config.window,
            },
            rank=rank,
        )

    def _resolved(self, rank: int, step: int, median: float) -> Finding:
        return Finding(
            kind=self.kind,
            severity="info",
            step=step,
            message=f"rank {rank} back in line with the other ranks ({median:.2f}x their median)",
            hint="No action needed.",
            evidence={"rank": rank, "ratio_to_median_of_others": round(median, 3)},
            resolved=True,
            rank=rank,
        )
