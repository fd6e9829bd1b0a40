"""``straggler``: the rank the other ranks wait for, step after step, whatever it is slow in.

Principle: **a straggler is the rank the others wait for**, not the rank with the slowest forward
pass. DDP's all-reduce evens out the step time of every rank (the fast ones wait for the slow one
in the collective), so step time alone cannot name the culprit; what can is where each rank's
time goes. A rank's *own time* is its step time minus the time it waited in collectives
(``comm``) and minus its scheduled ``checkpoint``/``eval`` phases: data loading, forward,
backward, optimizer and whatever ran outside any timed phase (``other``) all count, because a
rank slow in any of them holds up the all-reduce alike (a data-loading straggler spends its
extra time in ``data`` while rank 0 spends 93 % of each step in ``comm``; compute time alone
called that run healthy). The others' excess wait is the same evidence seen from their side:
the delay a rank imposes is how much longer the other ranks wait than it does. So the detector
aligns the ranks' records by step and, per rank, measures

    ratio = (median own time of the others + (median wait of the others - own wait)) / median own time of the others

which is the plain own-time ratio when the delay lies inside the rank's step and still sees a
delay between its steps (the others' wait grows, its own does not). It fires when that ratio
reaches ``min_ratio`` in ``min_share`` of the last ``window`` aligned steps (sustained, P1; CPU
ranks sharing cores show 2-5x bursts on single steps from noisy neighbours), and the message says
the phase the extra time went to (the one that grew most against the other ranks' median of the
same phase), or that it went outside every timed phase. Without a ``comm`` phase (no DDP comm
hook) the waiting lands in an unknown phase, so the rank's forward + backward time is compared,
and without a phase split its step time. Units of the timing's own resolution: on a CPU run the
excess must also reach one scheduler time slice per step (``_CPU_SLICE_S``) in those steps; a
rank 0 that spends 7 ms more than its peer on 7 ms steps of a loaded host is not a straggler worth
a warning.

Onset, extent, persistence: the finding opens at the step the window first holds the condition,
is renewed every ``4 x window`` aligned steps while it lasts (its last step follows the
condition), and once more at ``run_end`` with the last step judged, so an anomaly still open
at the end covers the steps it covered.
"""

from __future__ import annotations

import bisect
import operator
import statistics
from dataclasses import dataclass
from itertools import compress

from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.wire import Event

__all__ = ["Straggler", "StragglerConfig"]

_RANK = operator.attrgetter("rank")


@dataclass
class StragglerConfig:
    """``straggler``: one rank's step or compute time against the other ranks."""

    window: int = 16
    """Aligned steps over which a rank's ratio must hold (its median is used: sustained, P1)."""
    min_ratio: float = 1.5
    """Rank compute time over the median of the other ranks at the same step that counts as slow. CPU
    ranks sharing cores jitter by 2-5x on single steps; GPUs by a few percent (lower it there)."""
    min_share: float = 0.75
    """Share of the window's steps that must be slow: sustained (P1), not a burst of a noisy neighbour."""
    resolve_ratio: float = 1.2
    """The anomaly resolves when the rank's median ratio falls below this."""
    max_pending: int = 128
    """Steps kept while waiting for every rank to report them (bounded memory)."""


_CPU_SLICE_S = 0.010
"""On a CPU run a rank shares cores with other processes and is descheduled for whole scheduler time
slices (several ms): an excess under this per step is the timing's resolution there, not evidence."""
_SCHEDULED = ("checkpoint", "eval")  # a rank that saves or evaluates on schedule is not straggling
_OWN_PHASES = ("data", "forward", "backward", "optimizer", "other")
_PHASE_WORDS = {
    "data": "loading data (its data phase)",
    "forward": "the forward pass",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
    "other": "work outside every timed phase",
}

# A rank's record at one step: (own seconds, wait seconds, per-phase own seconds in _OWN_PHASES order
# or None, whether the wait was measured)
_Rec = tuple[float, float, "tuple[float, ...] | None", bool]


def _times(fields: dict) -> _Rec | None:
    """A step record as (own seconds, wait seconds, own phases, wait measured), or None without timing."""
    phases = fields.get("phases") or {}
    step_time = fields.get("step_time") or 0.0
    if "comm" in phases:
        scheduled = sum(phases.get(p) or 0.0 for p in _SCHEDULED)
        comm = phases.get("comm") or 0.0
        total = step_time if step_time > 0 else sum(v or 0.0 for v in phases.values())
        own = total - comm - scheduled
        if own <= 0:
            return None
        split = [phases.get(p) or 0.0 for p in _OWN_PHASES]
        timed = sum(split)
        split[-1] += max(0.0, own - timed)  # the untimed rest of the step, as the hooks count "other"
        return own, comm, tuple(split), True
    compute = (phases.get("forward") or 0.0) + (phases.get("backward") or 0.0)
    if compute <= 0:
        compute = step_time
    if compute <= 0:
        return None
    return compute, 0.0, None, False


def _median_without(ordered: list[float], value: float) -> float:
    """Median of ``ordered`` (sorted) with one occurrence of ``value`` left out, in O(1)."""
    i = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else 0.5 * (at(n // 2 - 1) + at(n // 2))


class Straggler(Detector):
    """Per rank, the time the other ranks wait for it, against their own time at the same step."""

    kind = "straggler"
    config_class = StragglerConfig
    order = 50
    priority = 100
    plots = ("throughput",)
    localised = False
    consumes = frozenset(("run_start", "run_end", "step"))
    batch_from = 32  # per event, looked at against observed: 2 events 2.2 us against 1.2, 64 0.17 against 0.22
    scope = "run"

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._world = 0
        self._pending: dict[int, dict[int, _Rec]] = {}
        self._ratios: dict[int, RollingWindow] = {}
        self._held: dict[int, RollingWindow] = {}  # seconds the rank holds a step: the others' own + what they wait
        self._excess: dict[int, RollingWindow] = {}  # seconds the rank holds a step beyond the others' own
        self._others: dict[int, RollingWindow] = {}  # the others' median own seconds
        self._wait: dict[int, RollingWindow] = {}  # own wait in collectives
        self._others_wait: dict[int, RollingWindow] = {}  # the others' median wait
        self._extra: dict[int, list[tuple[float, ...]]] = {}  # per step: extra seconds per phase (+ between steps)
        self._open: dict[int, tuple[float, int]] = {}  # rank -> (ratio when reported, step reported)
        self._hosts: dict[int, str] = {}
        self._device = ""  # run_start's device: a CPU run's straggler is not a throttled GPU
        self._last_step: int | None = None

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            rank = event.rank
            self._hosts[rank] = event.host
            if rank >= self._world:
                self._world = rank + 1
            return self._on_step(event) if self._world > 1 else []
        if kind == "run_start":
            self._world = max(self._world, int(event.fields.get("world_size") or 0), event.rank + 1)
            self._device = str(event.fields.get("device") or "")
            self._pending.clear()
            return []
        if kind == "run_end":
            return self._at_end()
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step of rank 0 while the run has no other rank is quiet (:mod:`.quiet`): it only names the rank's host.
        The world never shrinks: once it holds two ranks, every step is observed."""
        if self._world > 1:
            super().observe_batch(events, attempts, out)
        else:
            observe_quiet(self.observe, events, attempts, out, self._quiet_until)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        if self._world > 1:
            return i
        end = batch.quiet_end(i)
        if batch.rank is not None:  # every event's (an import's batch): no look at each
            return end if batch.rank == 0 else i
        return next(compress(range(i, end), map(_RANK, batch.events[i:end])), end)

    def _on_step(self, event: Event) -> list[Finding]:
        """A step of a run of several ranks: its timings join those of the other ranks at that step."""
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

    def _at_end(self) -> list[Finding]:
        """Once more for every open finding, at the last step judged: the anomaly covers its extent."""
        if self._last_step is None:
            return []
        out = []
        for rank, (ratio, reported) in list(self._open.items()):
            if reported != self._last_step:
                self._open[rank] = (ratio, self._last_step)
                out.append(self._finding(rank, self._last_step))
        return out

    def _judge(self, step: int, row: dict[int, _Rec]) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        self._last_step = step
        owns = sorted(r[0] for r in row.values())
        waits = sorted(r[1] for r in row.values())
        splits = [r[2] for r in row.values()]
        phase_sorted = (
            [sorted(s[i] for s in splits) for i in range(len(_OWN_PHASES))]  # type: ignore[index]
            if all(s is not None for s in splits)
            else None
        )
        measured = all(r[3] for r in row.values())
        for rank, (own, wait, split, _) in row.items():
            others_own = _median_without(owns, own)
            if others_own <= 0:
                continue
            others_wait = _median_without(waits, wait) if measured else wait
            imposed = max(0.0, others_wait - wait)  # how much longer the others wait than this rank
            held = others_own + imposed if measured else own
            ratio = held / others_own
            for store, value in (
                (self._ratios, ratio),
                (self._excess, held - others_own),
                (self._held, held),
                (self._others, others_own),
                (self._wait, wait),
                (self._others_wait, others_wait),
            ):
                store.setdefault(rank, RollingWindow(cfg.window)).add(value)
            if split is not None and phase_sorted is not None:
                extra = [split[i] - _median_without(phase_sorted[i], split[i]) for i in range(len(_OWN_PHASES))]
                extra.append(
                    max(0.0, imposed - (own - others_own))
                )  # between steps: the others waited, it did not work
                kept = self._extra.setdefault(rank, [])
                kept.append(tuple(extra))
                del kept[: -cfg.window]
            ratios = self._ratios[rank]
            if not ratios.full:
                continue
            median = ratios.median()
            if rank in self._open:
                reported_ratio, reported_step = self._open[rank]
                if median < cfg.resolve_ratio:
                    del self._open[rank]
                    out.append(self._resolved(rank, step, median))
                elif median > 1.5 * reported_ratio or step - reported_step >= 4 * cfg.window:
                    # markedly worse, or renewed while it lasts: the anomaly's extent follows it
                    self._open[rank] = (max(median, reported_ratio), step)
                    out.append(self._finding(rank, step))
            elif ratios.quantile(1 - cfg.min_share) >= cfg.min_ratio and (
                not self._device.lower().startswith("cpu")
                or self._excess[rank].quantile(1 - cfg.min_share) >= _CPU_SLICE_S
            ):
                self._open[rank] = (median, step)
                out.append(self._finding(rank, step))
        return out

    def _where(self, rank: int) -> tuple[str, dict[str, float]]:
        """Where the rank's extra time went (words) and the extra seconds per phase (evidence)."""
        rows = self._extra.get(rank)
        if not rows:
            return "", {}
        names = (*_OWN_PHASES, "between_steps")
        mean = {n: statistics.fmean(r[i] for r in rows) for i, n in enumerate(names)}
        grown = {n: v for n, v in mean.items() if v > 0}
        total = sum(grown.values())
        if total <= 0:
            return "", {}
        named = sorted((n for n, v in grown.items() if v >= 0.2 * total), key=lambda n: -grown[n])
        words = [
            (
                "outside its steps (between one step's end and the next one's start)"
                if n == "between_steps"
                else _PHASE_WORDS[n]
            )
            + (f" ({grown[n] / total:.0%})" if len(named) > 1 else "")
            for n in named
        ]
        where = "the extra time in " + " and ".join(words)
        return where, {n: round(max(0.0, v), 6) for n, v in mean.items()}

    def _finding(self, rank: int, step: int) -> Finding:
        held = self._held[rank].median()
        others = self._others[rank].median()
        ratio = held / others if others > 0 else float("nan")
        own_wait = max(0.0, self._wait[rank].median())
        others_wait = max(0.0, self._others_wait[rank].median())
        host = self._hosts.get(rank, "?")
        where, extra = self._where(rank)
        window = self.config.window
        if own_wait < others_wait:
            waits = (
                f"; the other ranks wait {others_wait * 1e3:.3g} ms per step in collectives, "
                f"it waits {own_wait * 1e3:.3g} ms"
            )
        else:
            waits = ""
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
        top = max(extra, key=extra.__getitem__) if extra else ""
        if top == "data":
            check = (
                "its input pipeline first (dataloader workers, storage or network reads, preprocessing on that "
                "host), then " + check
            )
        return Finding(
            kind=self.kind,
            severity="warning",
            step=step,
            message=(
                f"rank {rank} on {host} is the rank the others wait for: it holds each step {ratio:.2f}x the "
                f"other ranks' own time ({held * 1e3:.3g} ms vs {others * 1e3:.3g} ms, medians over the last "
                f"{window} steps)" + (f", {where}" if where else "") + waits
            ),
            hint=(
                f"Rank {rank} (host {host}) is a straggler and every other rank waits for it in the all-reduce. "
                f"Check that node: {check}. If it persists, drain or exclude {host} and restart from the last "
                "checkpoint."
            ),
            evidence={
                "rank": rank,
                "host": host,
                "ratio_to_median_of_others": round(ratio, 3),
                "held_s": round(held, 6),
                "others_own_s": round(others, 6),
                "comm_s": round(own_wait, 6),
                "others_comm_s": round(others_wait, 6),
                "extra_s_by_phase": extra,
                "window": window,
            },
            rank=rank,
        )

    def _resolved(self, rank: int, step: int, median: float) -> Finding:
        return self.resolve(
            step,
            f"rank {rank} back in line with the other ranks ({median:.2f}x their own time)",
            "No action needed.",
            {"rank": rank, "ratio_to_median_of_others": round(median, 3)},
            rank=rank,
        )
