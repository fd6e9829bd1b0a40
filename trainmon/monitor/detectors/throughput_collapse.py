"""``throughput_collapse``: a sustained drop of throughput, naming the part of the step that slowed.

Why the rule is what it is (``failure-modes.md``):

- **P3 / P2** (input stalls, GC pauses): a collapse shows in the step time, and only the phase
  split says why. The detector keeps a robust baseline of seconds per token (per step when the run
  logs no token counts) from the normal steps *before* the recent window, so a collapse never
  becomes its own baseline, and two rules read the recent steps against it:

  * the **window rule** (``window`` steps, within 8 steps of the onset): the window is ``slowdown``
    x the baseline median on average even without its worst step, holds ``min_slow_steps`` slow
    steps (a sustained drop, or periodic spikes such as gen-2 GC pauses, not one blip) and lost
    ``min_excess_seconds``. Both bars are also at least ``spread_margin`` x the baseline's
    ``spread_quantile`` (its q90): a run whose step time varies 3x by design (unpacked
    variable-length batches, real log 57) routinely has 8-step windows at 1.5-2.5x its median,
    and only a window slower than its routinely slow steps is news there;
  * the **level rule** (``level_window`` steps): the median step of the longer window is beyond the
    run's own spread (above the baseline q90, and ``slowdown`` x its median): the typical step is
    now slower than nine in ten normal ones, which catches a sustained shift of a variable run
    that the window rule's higher bar would miss (the median of 24 steps of log 57 stays under
    0.92x its baseline q90). Each rule has its own baseline, taken before its own window: the
    window rule's lags 8 steps (short runs get a verdict), the level rule's 24, so a shift is never
    read against a baseline it has already entered (a variable run's q90 climbs within 20 steps of
    a 2x shift otherwise). After a collapse resolves, its steps are never admitted.

- **P5** (checkpoint/eval stalls): routine saves and evaluations are not a collapse, so their
  phases are taken out of the step time. A save is reported when it is ``checkpoint_ratio`` x
  slower than the median of the earlier saves *and* costs more than ``checkpoint_fraction`` of
  the time since the previous save *and* exceeds the typical save by ``checkpoint_min_seconds``
  (the first save, with no median, must cost ``checkpoint_first_fraction`` of the time before
  it, and only after ``checkpoint_first_min_interval`` seconds of training). Either P5
  condition alone fires on healthy runs that save often or whose saves take milliseconds; both
  together single out a save that stalled.

What the finding says (issue 14, findings a person can trust):

- **The cause** comes from the phase split of the slow steps against the baseline's, in seconds
  per step: one phase that carries ``dominant_share`` of the growth is named (data: the input
  pipeline; comm: the collectives; ...); every phase slowing together, host-side ones included,
  is the host (another process competing for the CPU, frequency limits); forward/backward alone
  is compute; fewer tokens per step at the same step time is said as such (no phase grew). Device
  advice follows the ``device`` of ``run_start``: GPU advice (throttling, nvidia-smi) only on GPU
  runs, CPU contention on CPU runs, and when the log does not say (imported logs) the hint says so
  instead of assuming a GPU. A log without phases is told as such, not as "the data phase grew by
  0 s".
- **The unit** is tokens/s when the steps carry token counts, steps/s otherwise.
- **Severity** follows magnitude *and* duration (see ``ThroughputCollapseConfig``): ``info`` for
  a drop that has not lasted, ``warning`` once it lasted ``warning_steps`` and ``warning_seconds``,
  ``critical`` only when throughput stayed under 1/``critical_slowdown`` of the baseline for
  ``critical_steps`` and ``critical_seconds``. An anomaly keeps the highest severity it reached.
- **Intermittent slow steps are not a collapse** (:mod:`.intermittent`): on a steady run, slow steps
  among normal ones at several times the run's own rate are one finding of their own ("intermittent
  slow steps", never critical), from the first slow step to the last; a level shift supersedes it.
- **One incident, one cause**: a stall of one phase (data, comm, optimizer) inside a slowdown of the
  whole step (the host) closes that finding and opens its own, with its own onset: a busy machine
  must not swallow the data stall that happens during it.
- **The finding follows the condition** until it resolves: a new finding (message, evidence,
  last step) whenever the severity, the cause or the magnitude (by ``update_ratio``) changes, at
  least every ``update_every`` steps while it lasts, and once more at its last slow step (its
  extent and totals) before it resolves.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.intermittent import _WINDOW as _INTER_WINDOW
from trainmon.monitor.detectors.intermittent import Intermittent
from trainmon.monitor.detectors.quiet import observe_quiet, steps_without
from trainmon.monitor.detectors.rolling import RollingWindow
from trainmon.wire import Event

__all__ = ["ThroughputCollapse", "ThroughputCollapseConfig"]

_QUIET_UNTIL = steps_without("step_time", "phases")


@dataclass
class ThroughputCollapseConfig:
    """``throughput_collapse``: sustained throughput drop, naming the part of the step that slowed.

    Throughput is tokens/s when the steps carry token counts, steps/s otherwise. Severity says
    what a person should do, so it needs magnitude *and* duration, never a few slow steps alone:

    * ``info``: throughput is measurably down (the window or level rule holds) but the drop has
      not lasted ``warning_steps`` steps and ``warning_seconds``: recorded, nothing to do yet (a
      short input stall, another job on the host for a few seconds).
    * ``warning``: the drop has lasted that long: it costs real time, look into it when you can.
    * ``critical``: throughput has stayed under 1/``critical_slowdown`` of the baseline, both over
      the whole episode and in the current window, for ``critical_steps`` steps and
      ``critical_seconds``: most of the run's compute is being lost, someone should act now.

    An open anomaly keeps the highest severity it reached; its message and evidence follow the
    condition until it resolves.
    """

    baseline_window: int = 100
    """Steps in the baseline of seconds per token (taken before the recent window, failure-modes P3/P5)."""
    min_baseline: int = 20
    """Baseline steps needed before anything can fire (no verdict without a baseline)."""
    warmup_steps: int = 5
    """Steps ignored after each (re)start: first iterations are slow for benign reasons."""
    window: int = 8
    """Recent steps compared with the baseline by the window rule; also bounds its detection delay."""
    slowdown: float = 1.5
    """Recent mean time per token over the baseline median that counts as a collapse (throughput -33%)."""
    slow_step: float = 1.5
    """A step slower than this multiple of the baseline median counts as a slow step."""
    min_slow_steps: int = 2
    """Slow steps the recent window must hold: one slow step is a blip, not a collapse."""
    min_excess_seconds: float = 0.25
    """Seconds the recent window must lose against the baseline (ignores millisecond jitter of tiny runs)."""
    spread_quantile: float = 0.9
    """The baseline quantile that measures the run's own spread: how slow a routinely slow normal step is.
    A steady run's q90 is ~1.07x its median; an SFT run on unpacked variable-length batches (real log
    57: steps of 0.8-4.9 s by design) has its q90 at 2-2.6x its median."""
    spread_margin: float = 1.25
    """The window rule's bars (window mean, slow step) are at least this multiple of that q90: only a
    window slower than the run's routinely slow steps is news. On real log 57 no 8-step window (without
    its worst step) ever reaches 0.92x its baseline q90, so 1.25 leaves a margin; on a steady run
    1.25 x 1.07 stays under ``slowdown`` and the rule is unchanged."""
    level_window: int = 24
    """Steps whose median the level rule compares with its own baseline (the ``baseline_window`` steps
    before them): it fires when the typical step is above that baseline's q90 and ``slowdown`` x its
    median (a sustained shift of a variable run, which the window rule's higher bar misses). The
    median of 24 steps of real log 57 never reaches its baseline q90 (at most 0.92x; the median of 8
    steps does); a shift shows after about half the window."""
    warning_steps: int = 16
    """Steps a drop must have lasted (since its first slow step) to be a warning rather than info..."""
    warning_seconds: float = 30.0
    """...and seconds (the steps' own durations, summed: imported logs have no real clock): 16 steps
    of a 50 ms CPU loop are a moment, not a warning."""
    critical_slowdown: float = 4.0
    """Slowdown (throughput under a quarter) the episode and the current window must both show to be critical..."""
    critical_steps: int = 30
    """...for at least this many steps (four windows: no burst of slow steps is critical)..."""
    critical_seconds: float = 120.0
    """...and this many seconds (summed step times): two minutes at a quarter of the speed is worth a page,
    ten seconds are not."""
    resolve_after: int = 10
    """Consecutive normal steps after which the anomaly is resolved."""
    update_every: int = 25
    """While a collapse lasts, its finding is restated at least every this many steps (extent, totals)..."""
    update_ratio: float = 1.25
    """...and as soon as the slowdown moved by this factor either way (or the severity or the cause changed)."""
    dominant_share: float = 0.6
    """A phase that carries this share of the step's growth is named as the cause."""
    phase_min_share: float = 0.02
    """Phases under this share of the baseline step are too small to judge whether they slowed too."""
    together_growth: float = 0.5
    """Every phase slowed together (the host, not one stage) when each phase present, host-side ones
    (data, other) included, grew by at least this fraction of the step's relative growth."""
    checkpoint_ratio: float = 3.0
    """A save slower than this multiple of the median of earlier saves is a stall (P5)..."""
    checkpoint_fraction: float = 0.05
    """...and it must also cost more than this share of the time since the previous save (P5)..."""
    checkpoint_min_seconds: float = 0.5
    """...and exceed the typical save by at least this many seconds (jitter of millisecond saves)."""
    checkpoint_first_fraction: float = 0.25
    """The first save has no median to compare with: it must cost this share of the time before it."""
    checkpoint_first_min_interval: float = 10.0
    """...and only after this many seconds of training: the share of a few seconds is noise (a 2 s CPU
    run whose first save took 0.6 s on a loaded machine was told its checkpoints cost 31%)."""


_TIMED = ("data", "forward", "backward", "comm", "optimizer", "other")
_EXCLUDED = ("checkpoint", "eval")
_HOST_SIDE = ("data", "other")  # phases the host runs whatever the device
_COMPUTE = ("forward", "backward")
_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
_DIFFUSE = ("host", "unexplained", "compute")  # causes of a slowdown of the whole step
_SPECIFIC = ("data", "comm", "optimizer")  # one stage of the step

# A recent step: (step, seconds per token, step seconds, tokens, per-phase seconds in _TIMED order
# (the untimed rest of the step counted as "other", as the hooks do) or None without a phase split)
_Rec = tuple[int, float, float, float, "tuple[float, ...] | None"]

_UNKNOWN_DEVICE = "the log does not say which device ran the steps"

_HINTS: dict[str, dict[str, str]] = {  # cause -> device class ("cuda", "accelerator", "cpu", "unknown") -> hint
    "data": {
        "any": (
            "input pipeline stall: the data phase grew. Check the dataloader (num_workers, prefetch, "
            "tokenisation in collate_fn) and the storage it reads from (network filesystem, disk I/O)."
        ),
    },
    "comm": {
        "cuda": (
            "communication: time waiting in collectives grew. Check the network/NCCL (NCCL_DEBUG=INFO, "
            "link errors, a congested switch) and whether another rank is straggling."
        ),
        "any": (
            "communication: time waiting in collectives grew. Check the network and the collective "
            "backend (link errors, a congested switch, the interface gloo binds to) and whether another "
            "rank is straggling."
        ),
    },
    "optimizer": {
        "any": (
            "the optimizer step grew: check optimizer-state offload, gradient clipping on the host, "
            "or extra synchronisations added to the step."
        ),
    },
    "compute": {
        "cuda": (
            "compute slowed ({phases} grew): suspect GPU throttling (thermal or power, see node_health) "
            "or a slow/shared GPU; check clocks and temperature with nvidia-smi."
        ),
        "accelerator": (
            "compute slowed ({phases} grew) on {device}: suspect throttling (thermal or power) or a device "
            "shared with another job; check the device's clocks and temperature."
        ),
        "cpu": (
            "compute slowed ({phases} grew) on a CPU run: the cores are contended or slower: another "
            "process competing for them (top/htop), CPU frequency or thermal limits, or more threads "
            "than free cores (torch.get_num_threads(), OMP_NUM_THREADS)."
        ),
        "unknown": (
            "compute slowed ({phases} grew), and " + _UNKNOWN_DEVICE + ": on a GPU suspect throttling "
            "(thermal or power) or a shared GPU, check clocks and temperature with nvidia-smi; on a CPU, "
            "another process competing for the cores (top/htop) or CPU frequency limits."
        ),
    },
    "other": {
        "any": (
            "host-side work between phases grew: Python GC pauses (time gen-2 collections with "
            "gc.callbacks, try gc.freeze() / scheduled gc), logging or metric syncs, or a CPU-starved host."
        ),
    },
    "host": {
        "cpu": (
            "every phase slowed together, so the host is the cause, not one stage: another process "
            "competing for the CPU cores (check top/htop for other jobs), CPU frequency scaling or "
            "thermal limits, or more threads than free cores (torch.get_num_threads(), OMP_NUM_THREADS)."
        ),
        "cuda": (
            "every phase slowed together, host-side ones (data, other) included, so the host is the cause "
            "rather than the GPU: another process competing for the CPU cores starves the thread that "
            "feeds the GPU (check top/htop for other jobs), CPU frequency limits, or memory pressure "
            "(swapping)."
        ),
        "unknown": (
            "every phase slowed together, host-side ones (data, other) included, so the host is the usual "
            "cause: another process competing for the CPU cores (check top/htop for other jobs), CPU "
            "frequency limits, or memory pressure (swapping); " + _UNKNOWN_DEVICE + "."
        ),
    },
    "tokens": {
        "any": (
            "fewer tokens per step at the same step time: shorter sequences or more padding in the "
            "batches (length-grouped or unpacked data), a smaller batch (a changed config, the partial "
            "last batch of an epoch), or tokens counted differently. The hardware is not slower; check "
            "the batch composition."
        ),
    },
    "unexplained": {
        "any": (
            "the phases logged do not account for the slower steps ({device}): check what the step "
            "timer covers that the phases do not, the input pipeline and the host load (top/htop)."
        ),
    },
    "unsplit": {
        "any": (
            "the log has no per-phase timing, so the part of the step that slowed cannot be named "
            "({device}). Check the input pipeline (dataloader workers, storage), the host load (another "
            "process competing for the CPU: top/htop) and the device; recording phases (trainmon's "
            "hooks) lets the cause be named."
        ),
    },
}
_HINTS["host"]["accelerator"] = _HINTS["host"]["cuda"].replace("the GPU", "the device")


@dataclass(slots=True)
class _Episode:
    """One open collapse: where it started, what it cost so far, and what was last said about it."""

    onset: int  # its first slow step
    level: bool  # opened by the level rule, which then also judges the recovery
    base: float  # the baseline median (seconds per token) of the rule that opened it
    steps: int = 0  # steps since the onset, seconds and tokens (or steps) of those steps
    seconds: float = 0.0
    tokens: float = 0.0
    last_slow: int = -1
    at_last_slow: tuple[int, float, float] = (0, 0.0, 0.0)  # (steps, seconds, tokens) up to it
    severity: str = "info"
    cause: str = ""
    reported_step: int = -1
    reported_ratio: float = 0.0
    view: dict[str, Any] = field(default_factory=dict)  # the numbers of the last report

    def add(self, step: int, seconds: float, tokens: float, slow: bool) -> None:
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens
        if slow:
            self.last_slow = step
            self.at_last_slow = (self.steps, self.seconds, self.tokens)


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.4g}"


def _device_class(device: str | None) -> str:
    if not device:
        return "unknown"
    d = device.lower()
    if d.startswith("cpu"):
        return "cpu"
    if d.startswith("cuda"):
        return "cuda"
    return "accelerator"  # mps, xpu, npu, hpu, xla: not an NVIDIA GPU, no nvidia-smi


class ThroughputCollapse(Detector):
    """Throughput against a lagged robust baseline that knows the run's spread, with checkpoint/eval
    time taken out; the cause read from the phase split and the device."""

    kind = "throughput_collapse"
    config_class = ThroughputCollapseConfig
    order = 40
    priority = 90
    plots = ("throughput",)
    localised = False
    consumes = frozenset(("run_start", "checkpoint", "step"))

    def __init__(self, config: ThroughputCollapseConfig) -> None:
        self.config = config
        self._long = max(config.window, config.level_window)
        # Seconds per token of normal steps, taken before each rule's own window so that a shift is
        # never part of the baseline it is read against: the window rule's (lagged ``window`` steps,
        # so short runs get a verdict) and the level rule's (lagged ``level_window`` steps).
        self._base = RollingWindow(config.baseline_window)
        self._base_long = RollingWindow(config.baseline_window)
        # (seconds, tokens, phase seconds in _TIMED order or None) of the window rule's baseline steps:
        # read only to say what slowed when a collapse is found, so kept raw, not as sorted windows
        self._base_steps: collections.deque[tuple[float, float, tuple[float, ...] | None]] = collections.deque(
            maxlen=config.baseline_window
        )
        self._recent: collections.deque[_Rec] = collections.deque()  # the last ``_long`` steps, oldest first
        self._short_spt: collections.deque[float] = collections.deque()  # spt of the last ``window`` (C sum)
        self._since_start = 0
        self._clean_from = -math.inf  # steps before this belong to the last collapse: never admitted
        self._device: str | None = None
        self._unit: str | None = None  # "tokens/s" or "steps/s", of the baselines
        self._open: str | None = None  # "steps" or "checkpoint" while an anomaly is open
        self._normal_run = 0
        self._episode: _Episode | None = None
        self._saves = RollingWindow(16)
        self._last_save_time: float | None = None
        self._first_step_time: float | None = None
        self._save_seen_since_step = False
        self._intermittent = Intermittent(config.spread_margin, config.spread_quantile, config.slow_step, config.window)
        self._inter_reported: tuple[int, str] = (-1, "")  # step and severity of the last intermittent report

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        kind = event.kind
        if kind == "step":
            save_seen = self._save_seen_since_step
            if save_seen:
                self._save_seen_since_step = False
            if self._first_step_time is None:
                self._first_step_time = event.time
            f = event.fields
            if "step_time" in f or "phases" in f:  # most imported logs carry no timings: one test a step
                return self._on_step(event, save_seen)
            return []
        if kind == "run_start":
            self._since_start = 0
            self._recent.clear()
            self._short_spt.clear()
            self._clean_from = -math.inf  # a resume may number its steps from an earlier one
            self._first_step_time = None
            self._last_save_time = None
            device = event.fields.get("device")
            self._device = device if isinstance(device, str) and device else None
            return []
        if kind == "checkpoint":
            duration = event.fields.get("duration")
            self._save_seen_since_step = True
            return self._check_save(event.fields["step"], duration, event.time)
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step without timings is quiet (:mod:`.quiet`): it only ends a save's wait and may be the first step."""
        observe_quiet(self.observe, events, attempts, out, _QUIET_UNTIL)

    # -- steps ---------------------------------------------------------------------------------

    def _on_step(self, event: Event, save_seen: bool) -> list[Finding]:
        """A step with timings (``save_seen``: a checkpoint event came since the previous step)."""
        f = event.fields
        step = f["step"]
        phases: dict[str, float] = f.get("phases") or {}
        out: list[Finding] = []
        if not save_seen and phases.get("checkpoint", 0.0) > 0:
            # No checkpoint event (another framework): judge the save from its phase.
            out += self._check_save(max(0, step - 1), phases["checkpoint"], event.time)
        seconds = f.get("step_time")
        if seconds is None or not math.isfinite(seconds):
            return out
        seconds -= sum(phases.get(p, 0.0) for p in _EXCLUDED)
        if seconds <= 0:
            return out
        tokens = f.get("tokens")
        unit = "tokens/s" if tokens else "steps/s"
        tokens = tokens or 1
        if unit != self._unit:  # seconds per token and per step do not mix: start the baselines over
            self._unit = unit
            self._base.clear()
            self._base_long.clear()
            self._base_steps.clear()
            self._recent.clear()
            self._short_spt.clear()
            self._intermittent.clear()
            if self._open == "intermittent":
                self._open = None
        spt = seconds / tokens
        self._since_start += 1
        if self._since_start <= self.config.warmup_steps:
            return out
        cfg = self.config
        inter = self._intermittent.observe(
            step, spt, seconds, tokens, admit=self._open in (None, "intermittent"), since=self._clean_from
        )
        if self._open == "intermittent":
            out += self._on_intermittent(inter, step)
        elif inter == "opened":
            if self._open is None:
                self._open = "intermittent"
                out += self._on_intermittent(inter, step)
            else:
                self._intermittent.end()  # another finding holds the anomaly
        split: tuple[float, ...] | None = None
        if any(phases.get(p, 0.0) > 0 for p in _TIMED):
            timed = [max(0.0, phases.get(p, 0.0)) for p in _TIMED]
            timed[-1] += max(0.0, seconds - sum(timed))  # the untimed rest of the step is "other"
            split = tuple(timed)
        self._recent.append((step, spt, seconds, tokens, split))
        self._short_spt.append(spt)
        admit = self._open != "steps"  # a collapse never enters its own baseline
        if len(self._short_spt) > cfg.window:
            self._short_spt.popleft()
            rec = self._recent[-cfg.window - 1]
            if admit and rec[0] >= self._clean_from:
                self._base.add(rec[1])
                self._base_steps.append((rec[2], rec[3], rec[4]))
        if len(self._recent) > self._long:
            rec = self._recent.popleft()
            if admit and rec[0] >= self._clean_from:
                self._base_long.add(rec[1])
        if len(self._base) < cfg.min_baseline or len(self._short_spt) < cfg.window:
            return out
        base = self._base.median()
        if base <= 0:
            return out
        spread = self._base.quantile(cfg.spread_quantile)  # a routinely slow normal step
        bar = max(cfg.slowdown * base, cfg.spread_margin * spread)  # the window rule's mean
        step_bar = max(cfg.slow_step * base, cfg.spread_margin * spread)  # one slow step
        level_bar = math.inf  # the level rule's median, once its own baseline is there
        if len(self._base_long) >= cfg.min_baseline and self._base_long.median() > 0:
            level_bar = max(cfg.slowdown * self._base_long.median(), self._base_long.quantile(cfg.spread_quantile))
        mean = sum(self._short_spt) / len(self._short_spt)
        slow_now = spt > step_bar
        if self._open == "intermittent":
            # Intermittent slow steps hold the anomaly: only a level shift (the typical step slower) is
            # news beyond them, and it supersedes them.
            if not (mean >= level_bar and self._level_rule(level_bar)):
                return out
            out += self._close_intermittent(step)
        if self._open != "steps" and mean < min(bar, level_bar):
            # Neither rule can hold: the window mean is under the window rule's bar, and a level
            # shift (a median of the longer window over its bar) shows in the window mean first.
            return out + self._checkpoint_recovery(slow_now, step, mean / base, base)
        short = list(self._recent)[-cfg.window :]
        window_rule = self._window_rule(short, base, bar, step_bar)
        level_rule = self._level_rule(level_bar)
        if self._open == "steps" and self._episode is not None:
            ep = self._episode
            slow_now = slow_now or (ep.level and spt > level_bar)
            # the extent ends at the last slow step while a rule held (not at a long step of the
            # recovered run, which a variable run has one in ten of)
            ep.add(step, seconds, tokens, slow_now and (window_rule or level_rule or mean >= bar))
            # The rule that opened it judges the recovery, and the level rule does on a variable run
            # (its window rule's bar is raised by the spread, so a lasting shift can sit under it).
            variable = cfg.spread_margin * spread > cfg.slowdown * base
            holding = slow_now or mean >= bar or ((ep.level or variable) and level_rule)
            self._normal_run = 0 if holding else self._normal_run + 1
            if self._normal_run >= cfg.resolve_after:
                if ep.last_slow > ep.reported_step:  # the extent and totals up to the last slow step
                    out.append(self._finding(ep.last_slow, *ep.at_last_slow))
                self._clean_from = ep.last_slow + 1
                self._open, self._episode = None, None
                out.append(self._resolved(step, mean / base, base))
            elif window_rule and slow_now and self._new_incident(short, step_bar):
                # One phase stalls inside a slowdown of the whole host: a second incident with its own
                # cause and onset, not an update of the first (a data stall swallowed by a busy host)
                if ep.last_slow > ep.reported_step:
                    out.append(self._finding(ep.last_slow, *ep.at_last_slow))
                self._clean_from = ep.last_slow + 1
                self._open, self._episode = None, None
                out.append(self._resolved(max(ep.last_slow, step - 1), mean / base, base))
                return out + self._open_episode(step, short, window_rule, False, step_bar, level_bar, base)
            elif (
                (window_rule or level_rule) and slow_now and self._assess(step, short, window_rule, step_bar, level_bar)
            ):
                out.append(self._finding(step, ep.steps, ep.seconds, ep.tokens))
            return out
        out += self._checkpoint_recovery(slow_now, step, mean / base, base)
        if window_rule or level_rule:
            out += self._open_episode(step, short, window_rule, level_rule, step_bar, level_bar, base)
        return out

    def _open_episode(
        self,
        step: int,
        short: list[_Rec],
        window_rule: bool,
        level_rule: bool,
        step_bar: float,
        level_bar: float,
        base: float,
    ) -> list[Finding]:
        self._open, self._normal_run = "steps", 0
        if window_rule:
            # the first slow step of the window that no earlier finding covered
            onset = next((r[0] for r in short if r[1] > step_bar and r[0] >= self._clean_from), short[-1][0])
            ep = _Episode(onset=onset, level=False, base=base)
        else:
            ep = _Episode(onset=self._level_onset(level_bar), level=True, base=self._base_long.median())
        self._episode = ep
        for r in self._recent:
            if r[0] >= ep.onset:
                ep.add(r[0], r[2], r[3], r[1] > (level_bar if ep.level else step_bar))
        self._assess(step, short, window_rule, step_bar, level_bar, force=True)
        return [self._finding(step, ep.steps, ep.seconds, ep.tokens)]

    def _new_incident(self, short: list[_Rec], step_bar: float) -> bool:
        """The open episode blames the whole host (or nothing in particular) and the window's slow steps
        now name one phase: a stall of its own inside the slowdown."""
        ep = self._episode
        if ep is None or ep.cause not in _DIFFUSE:
            return False
        slow = [r for r in short if r[1] > step_bar and r[0] > ep.onset]
        if len(slow) < self.config.min_slow_steps:
            return False
        return self._diagnose(slow)[0] in _SPECIFIC

    # -- intermittent slow steps (monitor/detectors/intermittent.py) ----------------------------

    def _on_intermittent(self, what: str | None, step: int) -> list[Finding]:
        ep = self._intermittent.episode
        if ep is None:
            return []
        if what == "ended":
            return self._close_intermittent(step)
        severity = self._intermittent_severity()
        last_step, last_severity = self._inter_reported
        if what == "opened":
            self._inter_reported = (-1, "")
            return [self._intermittent_finding(ep.onset)]  # the anomaly starts where the condition started
        if what == "grew" and (severity != last_severity or step - last_step >= self.config.update_every):
            return [self._intermittent_finding(ep.last_slow)]
        return []

    def _intermittent_severity(self) -> str:
        """Info; a warning once the episode cost ``warning_seconds`` and a tenth of its time. Never critical:
        the typical step is not slower."""
        ep = self._intermittent.episode
        assert ep is not None
        cfg = self.config
        if ep.lost >= cfg.warning_seconds and ep.lost >= 0.1 * ep.seconds:
            return "warning"
        return "info"

    def _close_intermittent(self, step: int) -> list[Finding]:
        ep = self._intermittent.episode
        out = []
        if ep is not None and self._inter_reported[0] != ep.last_slow:
            out.append(self._intermittent_finding(ep.last_slow))  # its extent and totals
        self._intermittent.end()
        self._open = None
        unit = self._unit or "tokens/s"
        out.append(
            self.resolve(
                step,
                f"intermittent slow steps over at step {step}: the steps are back at the baseline's pace",
                "No action needed; if the episodes recur, compare their times with the host's load.",
                {"pattern": "intermittent", "unit": unit},
            )
        )
        return out

    def _intermittent_finding(self, step: int) -> Finding:
        ep = self._intermittent.episode
        assert ep is not None
        severity = self._intermittent_severity()
        if _SEVERITY_RANK[severity] < _SEVERITY_RANK[self._inter_reported[1] or "info"]:
            severity = self._inter_reported[1]
        self._inter_reported = (step, severity)
        unit = self._unit or "tokens/s"
        share = ep.lost / ep.seconds if ep.seconds > 0 else 0.0
        median = self._intermittent.median_ratio()
        msg = (
            f"intermittent slow steps since step {ep.onset}: {ep.slow} of {ep.steps} steps slower than "
            f"{ep.bar / ep.base:.2g}x the baseline (the worst {ep.worst:.2g}x), {ep.lost:.3g} s lost "
            f"({share:.0%} of those steps' {ep.seconds:.3g} s); the median of the last {_INTER_WINDOW} steps is "
            f"{median:.2g}x the baseline ({_rate(1 / ep.base)} {unit}): slow steps among normal ones, not a collapse"
        )
        device = _device_class(self._device)
        where = (
            "the node's other processes and load at those times (top, the job scheduler), Python GC pauses, "
            "a shared filesystem or network storage that is sometimes slow, an input pipeline that is "
            "sometimes late, collective retries"
        )
        if device == "cuda":
            where += ", GPU clock dips (node_health)"
        return Finding(
            kind=self.kind,
            severity=severity,
            step=step,
            message=msg,
            hint=(
                f"Isolated slow steps, not a slower run: something intermittent holds some steps. Check {where}. "
                "Trainmon's phase timing names the part of the step that stalls."
            ),
            evidence={
                "pattern": "intermittent",
                "since_step": ep.onset,
                "steps": ep.steps,
                "slow_steps": ep.slow,
                "slow_bar_ratio": round(ep.bar / ep.base, 3),
                "worst_ratio": round(ep.worst, 3),
                "median_ratio": round(median, 3),
                "duration_s": round(ep.seconds, 3),
                "lost_s": round(ep.lost, 3),
                "unit": unit,
                "baseline_rate": round(1 / ep.base, 6),
                "device": self._device,
            },
        )

    def _checkpoint_recovery(self, latest_slow: bool, step: int, ratio: float, base: float) -> list[Finding]:
        if self._open != "checkpoint":
            return []
        self._normal_run = 0 if latest_slow else self._normal_run + 1
        if self._normal_run < self.config.resolve_after:
            return []
        self._open = None
        return [self._resolved(step, ratio, base)]

    def _window_rule(self, short: list[_Rec], base: float, bar: float, step_bar: float) -> bool:
        cfg = self.config
        slow = sum(1 for r in short if r[1] > step_bar)
        if slow < cfg.min_slow_steps:
            return False
        # Sustained: the window must be slow even without its worst step (one long step is a hang
        # or a blip, reported by ``hang`` if long enough; two or more are a collapse).
        worst = max(short, key=lambda r: r[1])
        mean_rest = (sum(r[1] for r in short) - worst[1]) / (len(short) - 1)
        excess_rest = sum(r[2] - base * r[3] for r in short) - (worst[2] - base * worst[3])
        return mean_rest >= bar and excess_rest >= cfg.min_excess_seconds

    def _level_rule(self, level_bar: float) -> bool:
        cfg = self.config
        if level_bar == math.inf or len(self._recent) < cfg.level_window:
            return False
        window = list(self._recent)[-cfg.level_window :]
        if statistics.median(r[1] for r in window) < level_bar:
            return False
        base = self._base_long.median()
        return sum(r[2] - base * r[3] for r in window) >= cfg.min_excess_seconds

    def _level_onset(self, level_bar: float) -> int:
        """The level rule's onset: the earliest slow step from which the steps' median is over the bar
        (an occasional long step before the shift, which a variable run has, is not the onset)."""
        window = list(self._recent)[-self.config.level_window :]
        for i, r in enumerate(window):
            if r[1] > level_bar and statistics.median(x[1] for x in window[i:]) >= level_bar:
                return r[0]
        return window[-1][0]

    # -- what the finding says -------------------------------------------------------------------

    def _assess(
        self,
        step: int,
        short: list[_Rec],
        window_rule: bool,
        step_bar: float,
        level_bar: float,
        *,
        force: bool = False,
    ) -> bool:
        """Read the collapse as it is now into the episode; True when it changed enough to be said again."""
        cfg = self.config
        ep = self._episode
        assert ep is not None
        window = short if window_rule else list(self._recent)[-cfg.level_window :]
        ratio = sum(r[1] for r in window) / (len(window) * ep.base)
        slow = [r for r in window if r[1] > (step_bar if window_rule else level_bar)] or window
        cause, text, phase, growth = self._diagnose(slow)
        ep_ratio = ep.seconds / (ep.base * ep.tokens)
        severity = "info"
        if ep.steps >= cfg.warning_steps and ep.seconds >= cfg.warning_seconds:
            severity = "warning"
            if (
                min(ratio, ep_ratio) >= cfg.critical_slowdown
                and ep.steps >= cfg.critical_steps
                and ep.seconds >= cfg.critical_seconds
            ):
                severity = "critical"
        if _SEVERITY_RANK[severity] < _SEVERITY_RANK[ep.severity]:
            severity = ep.severity  # an anomaly keeps the highest severity it reached
        changed = (
            force
            or severity != ep.severity
            or cause != ep.cause
            or (
                window_rule == ep.view.get("window_rule")  # the same measure: the two rules' differ
                and abs(math.log(ratio / ep.reported_ratio)) >= math.log(cfg.update_ratio)
            )
            or step - ep.reported_step >= cfg.update_every
        )
        if changed:
            ep.severity, ep.cause, ep.reported_ratio = severity, cause, ratio
            ep.view = {
                "ratio": ratio,
                "window": len(window),
                "window_rule": window_rule,
                "text": text,
                "phase": phase,
                "growth": growth,
                "slow": [r[0] for r in slow],
            }
        return changed

    def _finding(self, step: int, steps: int, seconds: float, tokens: float) -> Finding:
        """The episode's last reading as a finding at ``step``, with its totals up to that step."""
        ep = self._episode
        assert ep is not None
        ep.reported_step = step
        v = ep.view
        unit = self._unit or "tokens/s"
        base, ratio = ep.base, v["ratio"]
        lost = seconds - base * tokens
        level = "" if v["window_rule"] else ", their median step slower than 9 in 10 normal steps"
        msg = (
            f"throughput down {1 - 1 / ratio:.0%} over the last {v['window']} steps ({_rate(1 / (base * ratio))} "
            f"vs {_rate(1 / base)} {unit} baseline{level}), since step {ep.onset} ({steps} steps, {seconds:.3g} s, "
            f"{lost:.3g} s lost); {v['text']}"
        )
        hints = _HINTS[ep.cause]
        hint = hints.get(_device_class(self._device)) or hints.get("any") or hints["unknown"]
        hint = hint.format(
            phases=" and ".join(p for p in _COMPUTE if p in (v["phase"] or "")) or "forward/backward",
            device=self._device or _UNKNOWN_DEVICE,
        )
        return Finding(
            kind=self.kind,
            severity=ep.severity,
            step=step,
            message=msg,
            hint=f"Likely cause: {hint}",
            evidence={
                "slowdown": round(ratio, 3),
                "window_steps": v["window"],
                "rule": "window mean" if v["window_rule"] else "window median",
                "unit": unit,
                "baseline_rate": round(1 / base, 6),
                "recent_rate": round(1 / (base * ratio), 6),
                "since_step": ep.onset,
                "steps": steps,
                "duration_s": round(seconds, 3),
                "lost_s": round(lost, 3),
                "slow_steps": v["slow"],
                "cause": ep.cause,
                "phase": v["phase"],
                "phase_growth_s": None if v["growth"] is None else round(v["growth"], 6),
                "device": self._device,
            },
        )

    def _diagnose(self, slow: list[_Rec]) -> tuple[str, str, str | None, float | None]:
        """(cause, message text, phase named in the evidence, its growth in s per step) of the slow steps."""
        cfg = self.config
        if self._unit == "tokens/s" and self._base_steps:
            # Throughput also falls when the steps carry fewer tokens at the same step time: then
            # no phase is slower, and saying one is would be wrong.
            ref_tokens = statistics.median(b[1] for b in self._base_steps)
            ref_seconds = statistics.median(b[0] for b in self._base_steps)
            tokens = sum(r[3] for r in slow) / len(slow)
            seconds = sum(r[2] for r in slow) / len(slow)
            if ref_tokens / tokens - 1 > seconds / ref_seconds - 1:
                text = (
                    f"tokens per step fell to {tokens:,.0f} from {ref_tokens:,.0f} while the step time "
                    f"changed {seconds / ref_seconds:.2g}x: the batches are smaller, the steps are not slower"
                )
                return "tokens", text, None, None
        split = [r for r in slow if r[4] is not None]
        base_split = [b[2] for b in self._base_steps if b[2] is not None]
        if not split or not base_split:
            return "unsplit", "no phase split in this log to say which part of the step slowed", None, None
        # seconds per step of each phase: the slow steps' mean against the normal steps' median
        ref = [statistics.median(b[i] for b in base_split) for i in range(len(_TIMED))]
        now = [sum(r[4][i] for r in split) / len(split) for i in range(len(_TIMED))]
        grew = {p: now[i] - ref[i] for i, p in enumerate(_TIMED)}
        total = sum(g for g in grew.values() if g > 0)
        if total <= 0:
            return "unexplained", "no phase of the slow steps grew against the baseline's split", None, None
        top = max(grew, key=lambda p: grew[p])
        base_total = sum(ref)
        overall = sum(now) / base_total if base_total > 0 else math.inf
        present = [p for i, p in enumerate(_TIMED) if base_total > 0 and ref[i] >= cfg.phase_min_share * base_total]
        factor = {p: now[_TIMED.index(p)] / ref[_TIMED.index(p)] for p in present}
        together = (
            len(present) >= 2
            and any(p in _HOST_SIDE for p in present)
            and any(p not in _HOST_SIDE for p in present)
            and all(factor[p] - 1 >= cfg.together_growth * (overall - 1) for p in present)
        )
        if together:
            parts = ", ".join(f"{p} x{factor[p]:.2g}" for p in present)
            return "host", f"every phase slowed together ({parts})", "all", total
        share = grew[top] / total
        if share >= cfg.dominant_share:
            cause = "compute" if top in _COMPUTE else top
            return (
                cause,
                f"the {top} phase grew by {grew[top]:.2g} s per step ({share:.0%} of the slowdown)",
                top,
                grew[top],
            )
        compute = sum(max(0.0, grew[p]) for p in _COMPUTE)
        if compute / total >= cfg.dominant_share:
            text = f"compute grew: forward +{grew['forward']:.2g} s, backward +{grew['backward']:.2g} s per step"
            return "compute", text, "forward/backward", compute
        second = max((p for p in _TIMED if p != top), key=lambda p: grew[p])
        text = (
            f"the {top} phase grew by {grew[top]:.2g} s and the {second} phase by {grew[second]:.2g} s per step "
            f"({(grew[top] + max(0.0, grew[second])) / total:.0%} of the slowdown)"
        )
        return ("compute" if top in _COMPUTE else top), text, top, grew[top]

    def _resolved(self, step: int, ratio: float, base: float) -> Finding:
        unit = self._unit or "tokens/s"
        return self.resolve(
            step,
            f"throughput recovered at step {step} ({_rate(1 / (base * ratio))} {unit}, baseline {_rate(1 / base)})",
            "No action needed; compare with the stall's window if it recurs.",
            {"slowdown": round(ratio, 3), "unit": unit},
        )

    # -- saves ---------------------------------------------------------------------------------

    def _check_save(self, step: int, duration: Any, now: float) -> list[Finding]:
        cfg = self.config
        if duration is None or not math.isfinite(duration) or duration < 0:
            return []
        since = self._last_save_time if self._last_save_time is not None else self._first_step_time
        self._last_save_time = now
        typical = self._saves.median() if len(self._saves) else None
        interval = (now - since) if since is not None else None
        slow_vs_typical = typical is None or duration > cfg.checkpoint_ratio * typical
        share_limit = cfg.checkpoint_fraction if typical is not None else cfg.checkpoint_first_fraction
        costly = interval is not None and interval > 0 and duration > share_limit * interval
        if typical is None and (interval or 0.0) < cfg.checkpoint_first_min_interval:
            costly = False  # a share of a few seconds of training says nothing yet
        excess = duration - (typical or 0.0)
        if not (slow_vs_typical and costly and excess >= cfg.checkpoint_min_seconds):
            self._saves.add(duration)
            return []
        self._saves.add(duration)  # a stalled save joins the history: repeated stalls raise the bar
        if self._open is not None:
            return []
        self._open, self._normal_run = "checkpoint", 0
        share = duration / interval if interval else math.inf
        typical_text = f"{typical:.3g} s typical" if typical is not None else "the first save of the run"
        return [
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"checkpoint at step {step} took {duration:.3g} s ({typical_text}), "
                    f"{share:.0%} of the {interval:.3g} s since the previous save"
                ),
                hint=(
                    "Likely cause: checkpoint I/O stall: slow or contended storage (NFS/object-store "
                    "throughput, full disk) or a synchronous save. Check the filesystem's write "
                    "throughput, save asynchronously or shard the save, or save less often (P5)."
                ),
                evidence={
                    "phase": "checkpoint",
                    "duration_s": round(duration, 4),
                    "typical_s": None if typical is None else round(typical, 4),
                    "interval_s": round(interval, 3) if interval else None,
                    "share": round(share, 4) if math.isfinite(share) else str(share),
                },
            )
        ]
