"""The collector's configuration, in one typed place, with defaults that work on a laptop.

A TOML file may override any field (``trainmon serve --config FILE``); an unknown or mistyped
field is named in the error instead of being silently ignored.

What a finding's severity means, for every detector (their thresholds below follow it):

* ``info`` -- worth knowing when reading the run afterwards; nobody needs to act. A blip that
  recovered by itself, a note about the data (a constant or all-zero series), a condition the
  evidence does not call harmful (eval loss rising while the task metric improves).
* ``warning`` -- the run is, or will be, worse off if nothing changes: someone should look at it
  today. A spike that has not recovered, an LR off its schedule, a straggler or a throughput drop
  that is sustained, an eval metric that got worse at several evals in a row.
* ``critical`` -- the run is burning compute now or is about to fail: act now (this pages). It
  needs both magnitude and duration: non-finite losses, a rank stalled for minutes, a loss that
  diverged and stays up, memory exhausted within the hour. Nothing that can clear by itself within
  a minute is critical when first seen; a finding escalates while its condition grows and
  de-escalates when it eases.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BadResumeConfig",
    "CollectorConfig",
    "ConfigError",
    "DegenerateConfig",
    "DetectorsConfig",
    "DivergenceConfig",
    "EvalRegressionConfig",
    "GradExplosionConfig",
    "HangConfig",
    "InitLossConfig",
    "InstabilityPrecursorConfig",
    "LossNoiseConfig",
    "LossScaleCollapseConfig",
    "LossSpikeConfig",
    "LrScheduleDriftConfig",
    "MemoryLeakConfig",
    "NanInfConfig",
    "NodeHealthConfig",
    "NotifyConfig",
    "NotifyTargetConfig",
    "ReplicaDivergenceConfig",
    "SeriesLimits",
    "StragglerConfig",
    "ThroughputCollapseConfig",
    "detectors_config",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration file or flag is wrong; the message names the field."""


@dataclass
class NanInfConfig:
    """``nan_inf``: any non-finite loss or grad norm, and a loss that is exactly 0.0 where no real
    loss can be (the way HF Trainer logs a window of NaN steps)."""

    resolve_after: int = 20
    """Consecutive finite steps after which the anomaly is marked resolved."""
    precursor_window: int = 20
    """Steps of grad-norm and loss history used to tell a numerical blow-up from a sudden fault."""
    precursor_z: float = 3.0
    """A log grad-norm z-score above this before the NaN means it was building up..."""
    precursor_norm_ratio: float = 2.0
    """...if the norm also reached this many times its recent median: on a quiet series a 1.4x step is
    3 sigma, and calling a sudden NaN after it numerical instability sends the user to the LR instead
    of the batch or the hardware (2 of 102 synthetic sudden NaNs did)."""
    precursor_loss_rise: float = 1.3
    """The median of the last 3 finite losses at this many times the lowest loss before them (within
    ``precursor_window``) means the loss was climbing into the NaN: a numerical blow-up, which is all
    a log without grad norms shows (nanochat's SFT went 5.5 -> 9.5 -> NaN). Multiplicative noise of
    5% puts that ratio near 1.15, so 1.3 is a real climb."""
    early_steps: int = 10
    """Fewer finite steps than this before the first non-finite one are too little history to call
    it a sudden fault (the grad-norm precursor needs a baseline): the hint points at the setup (LR,
    warmup, init scale, fp16) instead of a bad batch or the hardware."""
    zero_confirm: int = 3
    """Consecutive logged losses of exactly 0.0 before the zero rule speaks: three logging windows
    in a row with no finite-loss step, not one odd window."""
    zero_jump_min_loss: float = 0.1
    """A loss of exactly 0.0 right after a logged loss at least this large (or with no nonzero loss
    before it) is not convergence: a converging loss passes through small values first (HF rounds to
    4 digits and averages each window, so a classification fine-tune shows 0.0003, 0.0002, 0.0001
    before its zeros), while HF's ``logging_nan_inf_filter`` turns an all-NaN window into 0.0 straight
    after a real loss (LLaMA-Factory: 122.14, then 0.0 for 36 windows). Falling 2000x from 0.1 to
    under 5e-5 within one logging window is not a descent."""


@dataclass
class LossSpikeConfig:
    """``loss_spike``: robust deviation of the loss from its recent trend; recoverable or not."""

    window: int = 64
    """Accepted (non-spike) losses that form the baseline: their median is the level."""
    min_history: int = 16
    """Accepted losses needed before the robust rule can fire (no baseline in the first steps)."""
    early_ratio: float = 3.0
    """Before ``min_history``: a loss at least this many times every earlier one (two at least) is an
    explosion seen with few points (Megatron logs: 12.4, 12.4 -> 44 at the 3rd entry). A fine-tune's
    first interval means move 2x (0.27 -> 0.57 -> 0.46) and are not."""
    early_vocab_ratio: float = 2.0
    """...or a loss at least this many times ln(vocab) (an untrained model's loss) and above every
    earlier one (a 10-iteration log interval: 12.1 -> 26.5 at the 2nd entry, ln V = 10.8)."""
    early_confirm_ratio: float = 2.0
    """With one earlier loss only, a loss this many times it is held, and is a spike when the loss is back in
    the band before it within ``quick_steps`` entries (a 10-iteration log interval: 12.1 -> 26.5 -> 13.8 ->
    10.2); one that does not come back is the run's own level (a fine-tune's first interval means 0.27 ->
    0.57 -> 0.46 -> 0.57), and the held losses join the baseline."""
    early_spread: float = 5.0
    """...and at least this many times the spread of the earlier losses above the highest of them (a
    signed or near-zero loss is not measured by a ratio)."""
    z: float = 6.5
    """A loss more than this many robust sigma above the baseline median is a spike. sigma comes from
    the MAD of the last ``2 * window`` accepted step-to-step differences, so a trend does not
    inflate it and earlier spikes (never admitted) do not either; it is inflated by
    (1 + 1.7/sqrt(n)) while few differences are known (a MAD of 20 values can be 2x too small)."""
    min_rel: float = 0.1
    """...and at least this fraction of the baseline above it (ignores tiny-but-many-sigma blips)."""
    min_abs: float = 0.05
    """...and at least this many nats above it."""
    recover_steps: int = 20
    """A spike whose loss is back within the band within this many steps is recoverable;
    otherwise the anomaly escalates to critical with a rollback hint."""
    recover_z: float = 4.0
    """The band a recovered loss must be back in, in robust sigma above the baseline median."""
    skip_back: int = 2
    """Batches before the spike step to suggest skipping, [X - skip_back, X]."""
    precursor_steps: int = 3
    """Steps before the spike inspected for a grad-norm rise (BLOOM ordering)."""
    precursor_ratio: float = 2.0
    """A grad norm this many times its baseline median in those steps means it rose first."""
    norm_jump_ratio: float = 10.0
    """A grad norm this many times its median at the spike step itself is an instability in evidence
    (recurring spikes that each carry a 20-78x norm); below that, a norm that rises with the loss is
    what one hard batch does to the gradient, and names no cause."""
    lr_jump_ratio: float = 3.0
    """An LR that is this many times the LR of the entry before it (in the precursor steps) jumped.
    Entry to entry, so a linear warmup from a tiny LR (4x over four steps) is a ramp, not a jump."""
    quick_steps: int = 3
    """A spike whose loss is back in the band within this many logged entries came back at once: a
    hard batch. Heavy-tailed healthy runs (56_modded-nanogpt-1b: ~60 excursions of 1.3-1.9x) come back
    in 1-3 steps; a spike still up after that opens (or stays) a warning."""
    keep_warning_ratio: float = 10.0
    """A spike at least this many times the baseline stays a warning even when the loss is back at once:
    noise does not reach 10x, a corrupt sample or a tokenizer bug does, and it is worth a look."""
    warn_rel: float = 1.0
    """A spike with no cause in evidence (no grad-norm rise, no LR jump) opens as a warning only when
    the loss is at least (1 + warn_rel) x the baseline and outside the run's own tail; a smaller one
    opens as info and escalates only if it does not come back within ``quick_steps``. Real logs' readings
    call one-step excursions of up to 1.9x (48, 56) and 2.3x (57) single-batch noise, and a wrong
    warning costs more than a late one: the rule that fires still fires on the spike step."""
    tail_min_z: float = 3.0
    """An accepted loss this many robust sigma above the baseline is an excursion the run's tail is
    learned from (with the spikes that came back at once): the MAD sigma describes the core of the
    noise, not a heavy tail."""
    tail_factor: float = 1.5
    """A spike is inside the run's tail when at least ``tail_count`` remembered excursions were at
    least 1/tail_factor of its size (relative to the baseline). A pattern that grows by more than
    tail_factor ** (1/tail_count) (14%) per spike therefore never counts as its own tail."""
    tail_count: int = 3
    """...this many excursions (one large excursion is not a tail; PaLM/BLOOM spikes came alone)."""
    tail_memory: int = 64
    """Excursions remembered for the tail (the most recent ones)."""
    tail_horizon: int = 2000
    """...and only those of the last this many logged entries (a run that calmed down forgets its
    noisy start)."""
    descent_drop: float = 0.35
    """The level is in a fast descent (in practice the initial one) while it falls by more than this
    fraction per ``window`` entries (median of the oldest quarter of the window against the newest).
    The benchmark's slowest synthetic curves fall ~20% per window where spikes are injected."""
    descent_ratio: float = 4.0
    """During a fast descent a spike with no cause in evidence must be this many times the baseline:
    the band is stale and per-batch losses of a model that changes this fast jump 1.3-3.7x (34 false
    warnings in one real first descent). A spike with a cause (LR jump, grad norm) uses the normal rule."""
    growth_min: int = 3
    """Spikes needed before an episode can be called growing: the last this many significant spikes
    (with a cause, or outside the tail) each larger than the one before ..."""
    growth_ratio: float = 1.5
    """... the last at least this many times the first of them (or, for frequency, the last two gaps
    both this many times shorter than the median gap before). A growing episode is critical."""
    episode_quiet: int = 200
    """An episode (one anomaly for a run of repeated spikes) closes, resolved, after this many logged
    entries with no spike, or ``episode_quiet_periods`` of its period if longer, or at the run's end."""
    episode_quiet_periods: float = 3.0
    """...in units of the median interval between the run's recent spikes (across episodes: two spikes
    are too few to know a period); a run that spikes every ~200 steps keeps one episode open."""
    episode_quiet_max: int = 1000
    """...but never more than this many entries."""


@dataclass
class GradExplosionConfig:
    """``grad_explosion``: pre-clip grad-norm spike episodes (graded by magnitude and consequence) or a rising
    clip rate."""

    window: int = 64
    """Accepted (non-spike) log grad norms forming the baseline."""
    min_history: int = 16
    """Accepted grad norms needed before the spike rule can fire."""
    z: float = 8.0
    """A log grad norm more than this many robust sigma (MAD of differences) above the median fires."""
    min_ratio: float = 3.0
    """...and at least this many times the baseline median norm (noise on a flat norm is tiny in sigma)."""
    tail_ratio: float = 2.0
    """...and at least this many times the ``tail_quantile`` of all recent norms, spikes included: a
    run whose norms are bimodal (a fifth of the batches at 3-7x the median, multimodal data) has no
    spike inside its own tail, however many sigma of the main mode it is."""
    tail_quantile: float = 0.9
    """Quantile of the last ``window`` norms (spikes included) that the tail rule compares with."""
    warn_ratio: float = 10.0
    """An episode whose largest spike is this many times the median (an order of magnitude: with
    clipping off, an update that size) is a warning; smaller ones are a note (info) unless the loss
    followed or the norm stayed up. Magnitude alone never makes it critical: healthy runs spike
    3-17x (real logs 09, 15, 33, 39, 52) and even 2200x (57) with no loss consequence."""
    sustain_entries: int = 3
    """Consecutive spike entries that make it an explosion rather than one bad batch: with at least
    ``warn_ratio`` it is critical while it lasts and until its loss watch ends (BLOOM's first spike
    grew over five steps; the real logs' healthy spikes are back at the next entry)."""
    follow_entries: int = 5
    """Entries after a spike whose loss is watched: a rise there is the spike's consequence and
    escalates the episode (the loss peaks a few steps after the norm in BLOOM and OLMo 2)."""
    loss_rise: float = 0.1
    """A watched loss counts as following the spike when it is this fraction above the median loss
    before the spike ..."""
    loss_z: float = 5.0
    """... and this many robust sigma (MAD of entry-to-entry differences) above it: real log 57's
    per-step loss swings 0.4-2.3 around 1.16 without any spike."""
    quiet_entries: int = 200
    """In-band entries after the last spike that end an episode (the run's end also does). Healthy
    runs with heavy-tailed norms repeat their spikes every 10-400 entries (real logs 09, 57): a
    shorter stretch splits one behaviour into many near-identical findings (issue 14: 26 on 09).
    Kept below ``DetectorsConfig.replay_window`` so a restarted collector rebuilds an open episode."""
    degenerate_share: float = 0.5
    """Share of the last ``window`` losses that are exactly 0.0 or equal to the previous one above
    which the loss is degenerate (nothing learned, labels all masked, NaNs logged as 0): gradients
    are ~0 there and their spikes are not judged; one note says so."""
    max_listed: int = 20
    """Spikes an episode's evidence lists (the largest; the count covers all): bounded state."""
    clip_recent: int = 50
    """Steps in the recent clip-rate window."""
    clip_baseline: int = 200
    """Steps before the recent window that form the clip-rate baseline."""
    clip_rise: float = 0.4
    """The recent clip rate must exceed the baseline rate by this much ..."""
    clip_min_rate: float = 0.6
    """... and be at least this high, to report a rising clip rate."""
    shift_entries: int = 20
    """A norm that stays ``min_ratio`` x above its median before a spike episode for this many entries in a
    row (spikes or not: once the run's tail has caught up, the new level no longer reads as spikes) has
    shifted level: a warning naming its likely causes, never "back in band"."""


@dataclass
class DivergenceConfig:
    """``divergence``: loss trending up over many steps."""

    window: int = 20
    """Short slope window (logged entries): catches a fast ramp."""
    long_window: int = 200
    """Long slope window (logged entries): catches a slow creep of a fraction of a percent per step."""
    median_of: int = 5
    """Width of the running median that removes single spikes before smoothing."""
    ema_alpha: float = 0.3
    """Smoothing of the median-filtered loss (robust EMA)."""
    min_steps: int = 30
    """Never fire before this step, nor before the declared warmup ends."""
    min_rise_rel: float = 0.15
    """Over the short window the smoothed loss must rise by at least this fraction ..."""
    long_min_rise_rel: float = 0.1
    """... or over the long window by at least this fraction ..."""
    min_rise_sigma: float = 2.0
    """... and by this many robust sigma of the raw per-entry loss noise (clean noisy fine-tunes
    reach 1.3 over 20 entries; a real divergence several) ..."""
    min_rise_abs: float = 0.05
    """... and by this many nats: 5 % in perplexity, the least rise worth acting on whatever its
    relative size (a memorised loss doubling from 0.008 is not a divergence; a fine-tune's loss
    wandering 0.09-0.12 moves 0.03 nats, issue 14). It binds only below a loss of 0.5, where
    ``long_min_rise_rel`` asks for less ..."""
    up_fraction: float = 0.8
    """... with this share of lagged pairs (value half a window later vs now) going up (a trend) ..."""
    max_jump_share: float = 0.5
    """... no 5-step stretch of the smoothed loss carrying more than this share of the rise (a jump
    that stays up is a non-recovered spike, not a trend) ..."""
    above_min_rel: float = 0.1
    """... and the smoothed loss this fraction above its running minimum ..."""
    band_halflife: int = 1000
    """... and ``band_factor`` x as far above it as it had strayed before the current excursion
    began, an excursion being forgotten with this half-life in entries (issue 14: a plateau loss
    wandering 0.09-0.12 rose +21 % over 200 entries with 95 % of its increments up, exactly like a
    slow divergence, but it had been there before; a healthy falling run strays a few percent,
    its smoothed noise) ..."""
    band_factor: float = 3.0
    """... (a wander's new record is a little above its old ones; a divergence leaves them far
    behind: the benchmark's slow divergences open 12-70 % above a band of 1-5 %)."""
    short_sustain: int = 3
    """A rise seen by the short window only must hold on this many consecutive entries before it
    opens (the long window's is sustained over 200 entries by construction): a window that
    crosses the bars for an entry or two is not a sustained rise; a ramp holds (2 entries' delay)."""
    healthy_rel: float = 0.05
    """At its healthy level: within this fraction of the best loss (for the rollback advice and
    for the band: the excursion starts after the last entry within it)."""
    critical_rel: float = 0.5
    """Critical once the loss has stayed this fraction above its best for ``critical_entries``
    entries: half again the best loss, held, undoes most of what the run learned (real log 59:
    +60-74 % for 1,500 steps, a failed fine-tune; 53: +150 %)."""
    critical_entries: int = 10
    """Entries the loss must stay ``critical_rel`` above its best before critical (a large *and*
    sustained rise; sparse logs: ``sparse_points`` points)."""
    critical_release: float = 0.7
    """Back to warning below this fraction of ``critical_rel`` (hysteresis: no flapping)."""
    update_rel: float = 0.1
    """While open, say it again when the loss level moved by this fraction ..."""
    update_every: int = 50
    """... or after this many entries (the anomaly's last step and evidence stay current)."""
    sparse_min_interval: int = 100
    """Entries at least this many steps apart (median) make a sparse log: each logged loss is a
    mean over that many steps, the trend rule has too few entries (real log 59: five in 2,640
    steps) and a jump between two points cannot be told from a trend. Logs every 25 steps are
    not sparse: their points are still noisy (real log 52, batch 2: 0.27, 0.57, 0.46, 0.97)."""
    sparse_rise_rel: float = 0.6
    """Sparse logs: the last ``sparse_points`` logged losses all this fraction above the best
    earlier one. Without enough points to measure their noise the bar is the size: a run whose
    mean loss stays 60 % above its best for two logging windows is not learning (59: 1.24 ->
    2.03 -> 2.16; clean logs' points fall, or wander well under this) ..."""
    sparse_points: int = 2
    """... (the rise sustained over this many consecutive logging windows, never back to the best) ..."""
    sparse_rise_sigma: float = 5.0
    """... and, once there are six point-to-point changes to measure the points' own noise on, this
    many robust sigma of it above the best (the best of many noisy points is a low outlier: a flat
    log whose points scatter 15 % has pairs of points 60 % above its lowest one)."""


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


@dataclass
class LrScheduleDriftConfig:
    """``lr_schedule_drift``: actual LR per group against the declared (or inferred) schedule."""

    rel_tol: float = 0.01
    """Relative LR difference from the expected value that counts as off schedule (failure-modes L1-L3: 1%)."""
    min_steps: int = 2
    """Consecutive off-schedule steps before firing (one odd step is a logging glitch, two are a trend)."""
    resolve_after: int = 3
    """Consecutive on-schedule steps after which the anomaly is resolved."""
    history: int = 8
    """Recent (step, LR) observations kept to diagnose the drift (accumulation, restart, frozen, length)."""
    infer_points: int = 5
    """Logged steps needed before a schedule is inferred when none is declared."""
    frozen_steps: int = 50
    """Inferred schedules only: steps of an exactly flat LR after a decay before calling it frozen (R1)."""
    scheduler_steps_min: int = 2
    """Consecutive steps reporting ``scheduler_steps`` > 1 before firing (L1: the ratio must be 1)."""
    frozen_level_ratio: float = 4.0
    """Inferred schedules only: a flat LR is frozen only when it lasts this many times the previous LR
    level too (a rounded LR, e.g. llm.c's ``lr 5.97e-04``, moves in levels lasting tens of steps)."""
    reset_min_level: float = 0.3
    """Inferred schedules only: an LR that jumps back up from at least this fraction of its peak (or
    falls by half from there and climbs again) restarted mid-decay: a scheduler reset, a warning.
    Warm-restart and cyclic schedules rise from the floor of their decay: a note (info)."""
    frozen_max_drop: float = 0.3
    """Inferred schedules only: an LR held for 3+ logged points and then cut by more than this fraction
    is a step schedule (StepLR, MultiStepLR, ReduceLROnPlateau: x0.1, x0.5), which holds each level
    as long as it likes, so no flat stretch after it is frozen. A smooth decay moves every point, or
    by a printed quantum (~1%) after a held level; only its last points into a floor of 0 drop more."""
    quantum_min_values: int = 8
    """Distinct logged LRs needed before their printed resolution is trusted (half a quantum is tolerated)."""
    restart_points: int = 3
    """Logged steps into a resumed attempt within which an LR going wrong is the schedule restarting there."""
    update_every: int = 25
    """While a drift lasts, its finding is restated at least every this many steps (magnitude, extent)..."""
    update_ratio: float = 1.25
    """...and as soon as how far off the LR is moved by this factor either way."""


@dataclass
class BadResumeConfig:
    """``bad_resume``: composite check of the first steps after a resume."""

    keep_checkpoints: int = 16
    """Checkpoint fingerprints remembered per rank (the resume may load an older one)."""
    rel_tol: float = 1e-3
    """Relative tolerance when comparing saved and restored floats (moment norms, loss scale)."""
    check_steps: int = 3
    """Steps after a resume whose batches and losses are checked (step, replay, loss continuity)."""
    batch_memory: int = 2048
    """Recent batch fingerprints remembered for the replay check (plus the run's first ``batch_head``)."""
    batch_head: int = 256
    """Batch fingerprints of the run's first steps kept for good: a replay usually restarts from 0."""
    loss_window: int = 32
    """Losses before the resume used as the baseline of the loss-continuity check."""
    loss_mads: float = 8.0
    """Loss-continuity check: jump in robust deviations (1.4826 x MAD) of the pre-resume losses..."""
    loss_rel: float = 0.25
    """...and as a fraction of their median; both must be exceeded (tiny models are noisy, R3/R5)."""
    lr_jump: float = 2.0
    """A resume seen in a log: the first LR after it this many times the last one before is a re-warm..."""
    lr_floor: float = 0.01
    """...and so is a schedule decayed under this fraction of its peak..."""
    lr_restart: float = 0.1
    """...starting again at this fraction of the peak or more (82: 0.0 -> 1.38e-3 of a 2e-3 peak)."""
    gn_shock: float = 10.0
    """The first updates' grad norm this many times the median before the resume (or, for a log that starts at a
    resume, the first one against the median of the ``shock_steps`` after it) is a shock..."""
    gn_mads: float = 6.0
    """...and this many robust deviations of the log grad norm above it."""
    shock_steps: int = 20
    """Steps of a log that starts at a resume whose grad norms and losses are the reference for its first update."""


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


@dataclass
class HangConfig:
    """``hang``: no step (or no heartbeat) from a rank within a learnt timeout."""

    timeout_factor: float = 20.0
    """Timeout as a multiple of the rank's median step interval (P6 uses 5x, P3 10x; a margin for jitter)."""
    pause_factor: float = 2.0
    """...or this multiple of the longest recent step interval or checkpoint/eval pause, so routine
    saves and periodic pauses (GC) do not fire."""
    min_timeout: float = 60.0
    """Floor of the timeout in seconds: a pause shorter than this is not a hang however fast the steps
    are (a busy host, a GC, an unwrapped save); P6 uses 120 s on large jobs. Tests lower it."""
    recurring_factor: float = 5.0
    """A step interval at least this multiple of the median is a long pause; long pauses that recur
    every K steps (saves or evals not wrapped in ``phase()``) are allowed ``pause_factor`` times their
    length at the steps where they recur."""
    critical_after: float = 120.0
    """Seconds an open hang must last beyond its timeout before it is critical (someone must act
    now); until then it is a warning. A stall seen only after it ended stays a warning."""
    first_step_timeout: float = 300.0
    """Seconds allowed until a step interval is known: before the first step (imports, compilation,
    data loading) and between the first and the second (whose interval is then learnt, however long)."""
    dead_factor: float = 3.0
    """No event at all for this multiple of the rank's heartbeat interval (and the timeout) means dead."""
    history: int = 64
    """Step intervals kept per rank to learn the timeout."""


@dataclass
class NodeHealthConfig:
    """``node_health``: NVML/psutil thresholds and counters."""

    gpu_temp_warning_c: float = 85.0
    """GPU temperature (C) worth acting on this shift (data-centre GPUs slow down near 87-90 C, P7)."""
    gpu_temp_critical_c: float = 92.0
    """GPU temperature (C) at which to page."""
    throttle_mask: int = 0xE8
    """NVML clock-event reasons that matter: HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, power brake 0x80."""
    ecc_corrected_rise: int = 10
    """Rise of corrected ECC errors within ``ecc_window`` samples that counts as rising (H1)."""
    ecc_window: int = 60
    """Health samples over which the corrected-ECC rise is measured."""
    gpu_mem_fraction: float = 0.99
    """GPU memory used over total at which the GPU is near full (allocator caches keep it above 90%)."""
    host_mem_fraction: float = 0.95
    """Host memory used over total that means memory pressure."""
    host_mem_critical_fraction: float = 0.98
    """Host memory used over total at which to page (the OOM killer is next)."""
    rss_fraction: float = 0.9
    """Process resident memory over host total that means the process is about to be OOM-killed."""
    sustain: int = 2
    """Consecutive samples a level condition must hold (one hot sample is noise); counters fire at once."""
    resolve_after: int = 3
    """Consecutive clean samples after which the anomaly is resolved."""


@dataclass
class MemoryLeakConfig:
    """``memory_leak``: memory rising across many steps."""

    warmup_steps: int = 10
    """Steps ignored at the start of each attempt (the caching allocator fills, buffers are created)."""
    points: int = 64
    """Samples judged (the latest of up to twice as many kept, decimated: the window spans the recent
    half or more of the attempt, P4's long window)."""
    min_points: int = 16
    """Samples needed before judging a trend."""
    min_growth_fraction: float = 0.05
    """Growth over the window, as a share of its start, below which nothing fires."""
    min_growth_bytes: int = 64 << 20
    """Growth over the window in bytes below which nothing fires."""
    min_quarter_share: float = 0.15
    """Each quarter of the window must add this share of the total growth (a spread-out rise, not
    one or two step-like increases)."""
    horizon_hours: float = 6.0
    """Fire when the trend reaches ``limit_fraction`` of the memory within this many hours (P4: 6 h)."""
    critical_hours: float = 0.5
    """Projected exhaustion sooner than this is critical."""
    limit_fraction: float = 0.9
    """Share of the device or host memory taken as the exhaustion point (P4: 90% of RAM)."""
    big_growth_fraction: float = 0.5
    """Growth over the window that fires even when the memory size is unknown."""
    min_rate_ratio: float = 0.6
    """The later half of the window must rise at least this fraction as fast as the earlier half: a
    cache filling ever slower is heading for its ceiling, a leak keeps its pace."""
    max_plateaus: int = 1
    """Of the increases between the medians of the window's eighths, at most this many may be flat
    (under a quarter of the mean) when the series is quiet enough to tell: caches that fill in a few
    jumps with flat stretches between them are not a leak."""
    update_seconds: float = 10.0
    """An open finding's slope and time to exhaustion are refreshed at most this often (each refresh
    is a store write)."""


@dataclass
class DegenerateConfig:
    """``degenerate``: a saturated objective, no-op steps, a model stuck at chance, a classifier collapsed to one
    class (the principle of each in ``trainmon.monitor.detectors.degenerate``)."""

    saturated_entries: int = 2
    """Logged losses of exactly 0.0 in a row (with a vanishing, nonzero gradient) before the objective is saturated."""
    saturated_margin: float = 10.0
    """Without a logged grad norm: a preference margin (rewards/margins) at least this large, with accuracies 1.0,
    makes the zeros real (a sigmoid loss of log(1 + e^-10) = 4.5e-5 prints as 0.0)."""
    vanished_ratio: float = 1e-4
    """The grad norm at those entries, against its median before them, below which no gradient is left."""
    noop_share: float = 0.2
    """Share of logged grad norms exactly 0.0 (with a finite loss) that makes no-op steps a finding; at least as many
    must be nonzero (a norm always 0.0 is a placeholder)."""
    noop_min: int = 10
    """... and at least this many of them."""
    noop_update: int = 50
    """The no-op finding is restated every this many more zero grad norms (its extent)."""
    chance_evals: int = 5
    """Evals, all at ln K, before a run is stuck at chance."""
    chance_tol: float = 0.002
    """How close to ln K (relative) every eval loss must be: 83's 1.3856-1.3863 against ln 4 = 1.3863 is 0.05%."""
    chance_separation: float = 10.0
    """ln K counts only when ln (K+1) - ln K is at least this many tolerances (or K is the declared vocabulary):
    for a large K the log of some integer is always near (4.13 is within 0.2% of ln 62)."""
    chance_train_below: float = 0.1
    """Not stuck when the train loss is this fraction below ln K (memorising is another story)."""
    chance_acc_band: float = 0.1
    """The accuracy, when logged, must be within this of 1/K."""
    collapse_tol: float = 5e-4
    """Recall 1.0 and accuracy = precision to within this: one class predicted for every example."""
    collapse_margin: float = 0.05
    """The collapse clears when accuracy rises this far above the base rate it collapsed to."""
    collapse_evals: int = 3
    """Without precision/recall: evals from the first with the very same accuracy (and the eval loss at the entropy
    of that split) before the classifier has collapsed to its majority class ..."""
    collapse_entropy_tol: float = 0.05
    """... the eval loss within this fraction of that entropy."""


@dataclass
class InitLossConfig:
    """``init_loss``: first loss against ln(vocab)."""

    tolerance: float = 0.5
    """|loss0 - ln V| above this many nats is a warning (a fresh model predicts ~uniformly)."""
    first_steps: int = 3
    """The first this-many losses must all be past the tolerance on the same side (one noisy
    first batch is not a bad init)."""
    accum_match: float = 0.2
    """loss0 / ln V within this relative distance of accum_steps points to a summed GA loss."""
    leak_loss: float = 0.1
    """A loss below this many nats early in a run known to start from scratch (run_start declares
    ``vocab_size`` and the first loss is near ln V) means the labels leak. Not applied to
    fine-tunes or to runs that do not say how they started: their loss may legitimately go lower."""
    floor_fraction: float = 0.85
    """A loss below this fraction of the declared data-entropy floor (run_start ``loss_floor``)
    is impossible without leakage; a declared floor replaces ``leak_loss``."""
    early_steps: int = 2000
    """The leakage rule watches steps before this."""
    leak_consecutive: int = 3
    """Consecutive steps under the floor needed (one lucky batch is not a leak)."""
    choice_max: int = 16
    """A first loss that is ln K for an integer K up to this is a K-way choice at its uniform start (DPO's ln 2), not a
    cross-entropy over the vocabulary ..."""
    choice_tol: float = 1e-3
    """... to this relative tolerance (the printed digits: 0.6931 against ln 2 = 0.693147)."""


@dataclass
class LossScaleCollapseConfig:
    """``loss_scale_collapse``: fp16 loss scale falling repeatedly."""

    window: int = 100
    """Steps over which halvings and skips are counted."""
    halvings: int = 3
    """This many scale decreases within the window is a warning."""
    consecutive_skips: int = 5
    """This many skipped steps in a row is critical."""
    max_skip_rate: float = 0.05
    """A skip rate above this over a full window is a warning."""
    min_scale: float = 1.0
    """A scale below this is critical: fp16 gradients are underflowing."""
    resolve_after: int = 100
    """Steps with no decrease (and the scale above min_scale) after which it resolves."""


@dataclass
class EvalRegressionConfig:
    """``eval_regression``: the task metric worsening, validation loss rising, or jumping after a resume."""

    rising_evals: int = 2
    """Consecutive eval-loss increases needed (three evals in a row going up)."""
    min_rise_rel: float = 0.01
    """Total rise over those evals, as a fraction of the first, to be beyond eval noise ..."""
    min_rise_abs: float = 0.02
    """... and in nats."""
    above_best_rel: float = 0.05
    """The latest eval must also be this fraction above the best eval seen."""
    train_window: int = 20
    """Train losses whose median is the train level at each eval."""
    resume_jump_rel: float = 0.1
    """First eval after a resume this fraction above the last one before it is a jump ..."""
    resume_jump_abs: float = 0.05
    """... and in nats."""
    history: int = 16
    """Evals remembered (per metric: the window the metric's eval-to-eval noise is measured on)."""
    metric_evals: int = 2
    """A task metric (WER, accuracy, BLEU...: the number the user cares about, read in its own direction) must be
    worse than its best at this many evals in a row to be a regression: one bad eval on a small eval set is noise,
    two is a trend (53_whisper-tr: WER 17.7 -> 29.6 -> 31.3 is flagged at the second)."""
    metric_worse_rel: float = 0.05
    """... worse by this fraction of its best value ..."""
    metric_noise_k: float = 4.0
    """... and by this many times its eval-to-eval noise (a sigma from the distance of each eval to the mean of its
    neighbours, once five evals came before the ones judged): ROUGE on a 100-sample eval set moves 10% between evals
    (22_mt5-az-summ), and the best is the luckiest of many noisy evals, so an ordinary eval lands 2-3 sigma above
    it. The eval loss must have risen beyond the same multiple of its own noise (or ``above_best_rel``) with it."""
    metric_unmeasured_rel: float = 0.2
    """Until the metric's noise can be measured (five evals before the ones judged), it must be this fraction worse
    than its best: early evals of a noisy metric move 10-20% by themselves, a real degradation early on is larger
    (53_whisper-tr: +67% at the second eval)."""
    noise_evals: int = 8
    """Evals before the rising ones needed to trust their eval-to-eval scatter as the eval loss's noise (before
    that, a rise must be ``metric_unmeasured_rel`` of the best: a tiny validation set's first evals swing)."""
    critical_rel: float = 0.25
    """A task-metric regression is critical when the metric is this fraction worse than its best ..."""
    critical_evals: int = 3
    """... at this many evals in a row: large and sustained, the run is making the model worse, not wobbling."""
    zero_metric_evals: int = 10
    """A metric exactly 0.0 at this many evals from the start, while others move, gets one note: it is almost always
    computed wrong (60_cantillation: f1/precision/recall 0.0 at all 100 evals while accuracy rises 0.49 -> 0.69)."""
    unusable_error_rate: float = 0.85
    """An error rate (WER, CER) whose best value is at least this (as a fraction; 85 when logged in percent) means no
    checkpoint of the run is a model worth rolling back to (59_whisper-braj: best WER 89.9%). Kept high because
    unsegmented CJK text makes word error rates of working models look poor (01_whisper-large-v2-ja: 0.74)."""
    max_metrics: int = 32
    """Distinct eval metrics tracked per run (bounded state; the rest are ignored)."""
    max_sets: int = 8
    """Eval sets besides the run's own eval (``SET/loss`` in its metrics) judged each on its own (bounded state)."""


@dataclass
class ReplicaDivergenceConfig:
    """``replica_divergence``: data-parallel replicas whose weights differ, or tensor-parallel shards that are
    identical at start (ranks grouped by the run's declared layout; see trainmon.hooks.checksum)."""

    rtol: float = 0.0
    """0 compares the replicas' weight bit patterns exactly: DDP and ZeRO-1/2 replicas are bitwise identical.
    Above 0, replicas agree when their sums of squares are within this relative difference (replicas on mixed
    hardware or libraries whose kernels round differently)."""
    critical_rel_diff: float = 1e-3
    """Replicas whose weight norms differ by this relative amount are critical (they train visibly different
    models); below it the difference is a warning (a few bits apart, growing step by step)."""
    max_pending: int = 64
    """Checksummed steps held while waiting for every rank to report them (bounded memory)."""
    history: int = 8
    """Checks at which a two-replica group agreed, kept to tell which replica jumped when they part."""
    jump_factor: float = 10.0
    """With two replicas there is no majority: one is named as the one that changed only when its weight norm
    moved this many times the group's usual change between two checks while the other's stayed within it."""


@dataclass
class LossNoiseConfig:
    """``loss_noise``: the loss's step-to-step noise sustained well above the attempt's own baseline at a steady
    LR (SmolLM3's loader that read documents' sequences in order: one long or odd document filled whole batches).
    Noise is the MAD of the first differences of the log loss (relative) and of the loss (absolute): differences
    cancel the trend, the log cancels the level, and both must rise (a falling loss raises only the relative
    noise, a rising one only the absolute). A warning: the run learns worse from less diverse batches; never
    critical."""

    window: int = 50
    """Recent logged entries whose noise is compared with the baseline's."""
    baseline: int = 150
    """Earlier entries of the same attempt forming the baseline, judged once it holds this many: MADs of 50
    against 50 iid entries differ 2x once in 500 windows, 50 against 150 once in 10^5."""
    ratio: float = 2.2
    """The relative noise this many times the baseline's ... (clean real logs wander 1.7-2x for 100+ entries:
    39_llmc-gpt2-124m around step 9,700, 56_modded-nanogpt-1b around 11,150 and 12,100; a doubling cannot be
    told from that, the reference trainer's unshuffled batches reach 3-4x) ..."""
    sustain: int = 80
    """... and both noises at least ``admit_ratio`` x since the relative one first got there, for this many
    consecutive entries, opens the finding (the absolute noise must rise too: a falling loss raises only the
    relative one). A single spike moves a MAD by nothing; the longest such streak in the real logs is 43 entries
    (56_modded-nanogpt-1b at 12,100); a loader that stopped shuffling stays noisy to the end."""
    admit_ratio: float = 1.6
    """Entries leave the recent window into the baseline only while the relative or the absolute noise is under
    this many times the baseline's: a rise is judged against the noise before it, a slow drift is followed."""
    release_ratio: float = 1.2
    """Once open, both noises under this many times the baseline's for ``sustain`` entries resolve it."""
    trend_max: float = 0.5
    """Entries whose window's median log-loss change exceeds this share of its noise are a descent (the first
    fast fall, a decay's drop) and never join the baseline: a consistent fall makes differences look quiet."""
    lr_rise: float = 0.1
    """No finding while the recent window's median LR is more than this fraction above the baseline's: a
    higher LR is noisier by itself (warmup, a restart, a re-warm)."""
    level_drift: float = 0.15
    """No finding unless the recent window's median loss is within this fraction of the oldest third of the
    baseline's: noise is compared at one level (a pretraining descent's relative noise grows as the loss falls,
    MiniMind's 1.5-2x from loss 6 to 4; the reference trainer's unshuffled batches move the level 5%)."""


@dataclass
class InstabilityPrecursorConfig:
    """``instability_precursor``: attention logits growing before the loss moves (issue 28).

    Calibrated on the reference trainer's tiny GPT (bench/early_warning.py): the attention-logit bound
    stays within 0.3-6 on clean runs at peak LRs 1e-3 to 1e-2 over three seeds each, grows to 130-270
    after the warmup at 3e-2 while the loss trains normally (info, see ``lr_headroom``), and passes 20 in
    the warmup to 0.3 (``lr_too_high``), 50-120 steps before the first loss-based finding."""

    window: int = 10
    """Sampled values per module that make its level (their median), the run's own history; values in a
    growth episode never join it."""
    min_baseline: int = 3
    """Samples needed before a growth can be judged."""
    growth_ratio: float = 10.0
    """A sample this many times the module's level is growth (an order of magnitude: the clean runs' bound
    wanders 2-3x around its level after the first steps)."""
    min_logit: float = 20.0
    """And the bound must be at least this, however fast it rose from a small level (early training
    multiplies it 5-20x from its initial ~0.3): a floor in the value's own units, 2.5x above the largest
    bound the clean runs reached (8)."""
    sustain: int = 2
    """Consecutive sampled steps of growth before a warning: one sampled batch is not a trend."""
    critical_ratio: float = 100.0
    """Growth to this many times the level is critical: attention is collapsing now (the loss follows
    within tens of steps on the tiny GPT)."""
    lr_headroom: float = 2.0
    """A growth seen in the declared schedule's warmup, its peak LR at least this many times the step's LR, is a
    warning: the LR that made the logits grow is still going up (the growth follows the LR, Wortsman et al.
    2023). At the peak, or with no declared schedule, a growth is info until ``critical_ratio``: at a peak
    of 3e-2 the tiny GPT's bound grows 17-27x and its loss trains as the clean runs' (1.17 after 400 steps)."""
    max_modules: int = 1024
    """Attention modules tracked per rank (bounded state)."""


@dataclass
class DetectorsConfig:
    replay_window: int = 512
    """Stored steps per rank replayed into fresh detectors after a collector restart."""
    nan_inf: NanInfConfig = field(default_factory=NanInfConfig)
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    grad_explosion: GradExplosionConfig = field(default_factory=GradExplosionConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    throughput_collapse: ThroughputCollapseConfig = field(default_factory=ThroughputCollapseConfig)
    lr_schedule_drift: LrScheduleDriftConfig = field(default_factory=LrScheduleDriftConfig)
    bad_resume: BadResumeConfig = field(default_factory=BadResumeConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    node_health: NodeHealthConfig = field(default_factory=NodeHealthConfig)
    memory_leak: MemoryLeakConfig = field(default_factory=MemoryLeakConfig)
    init_loss: InitLossConfig = field(default_factory=InitLossConfig)
    loss_scale_collapse: LossScaleCollapseConfig = field(default_factory=LossScaleCollapseConfig)
    eval_regression: EvalRegressionConfig = field(default_factory=EvalRegressionConfig)
    replica_divergence: ReplicaDivergenceConfig = field(default_factory=ReplicaDivergenceConfig)
    loss_noise: LossNoiseConfig = field(default_factory=LossNoiseConfig)
    degenerate: DegenerateConfig = field(default_factory=DegenerateConfig)
    instability_precursor: InstabilityPrecursorConfig = field(default_factory=InstabilityPrecursorConfig)


@dataclass
class NotifyTargetConfig:
    """One destination of the collector's own notifications (``[[notify.targets]]`` in TOML)."""

    type: str = "webhook"
    """``webhook`` (generic JSON), ``slack`` (Slack-compatible incoming webhook) or ``alertmanager`` (API v2)."""
    url: str = ""
    """Endpoint; for Alertmanager its base URL (``http://alertmanager:9093``). Secret URLs belong in ``url_env``."""
    url_env: str = ""
    """Environment variable holding the URL; wins over ``url`` when set, so a Slack hook stays out of the file."""
    token: str = ""
    """Sent as ``Authorization: Bearer TOKEN``; empty sends no header."""
    token_env: str = ""
    """Environment variable holding the token; wins over ``token`` when set."""
    timeout: float = 5.0
    """Seconds one delivery attempt may take: a slow receiver must not hold the queue for long."""


@dataclass
class NotifyConfig:
    """Notifications sent by the collector itself, for users without Alertmanager routing."""

    targets: list[NotifyTargetConfig] = field(default_factory=list, metadata={"item": NotifyTargetConfig})
    """Where to send; none (the default) turns notifications off."""
    min_severity: str = "info"
    """Anomalies below this severity (``info`` < ``warning`` < ``critical``) are not sent."""
    group_wait: float = 10.0
    """Seconds changes of one run are collected before they go out as one message per target."""
    cooldown: float = 300.0
    """An anomaly that re-opens within this many seconds of its resolve is not notified again (a flap)
    unless it is still open when the cooldown ends."""
    max_attempts: int = 5
    """Delivery attempts on connection errors, 5xx and 429 before the message is dropped and counted."""
    backoff: float = 1.0
    """Seconds before the first retry; doubled after each failed attempt."""
    max_backoff: float = 30.0
    """Longest wait between two attempts."""
    resend_interval: float = 60.0
    """Open anomalies are re-posted to Alertmanager this often, so its resolve_timeout does not close them."""
    queue_size: int = 10000
    """Anomaly changes waiting for the notifier; more are dropped (and counted) rather than slowing ingest."""
    collector_url: str = ""
    """This collector's external URL, for links in the messages; empty leaves links out."""


@dataclass
class SeriesLimits:
    """How many series ``/metrics`` holds, whatever the world size (issue 27: five runs of 1,000 ranks were
    92,653 series, 6.4 MB a scrape; Prometheus' guidance is the low hundreds of thousands per target)."""

    rank_detail: int = 64
    """A run of up to this many ranks is exported one series per rank. A wider one is exported as cross-rank
    aggregates (``rank="min"``, ``"median"``, ``"max"``: the series of the rank holding that value, with its
    ``node`` and ``gpu``; counters as ``rank="all"``, their sum) plus one series per rank for the ranks its
    open findings name (at most ``open_findings.MAX_FINDINGS``), and ``trainmon_rank_holding_max`` says
    which rank holds each maximum. Per-rank detail of every rank stays in the API and the post-mortem."""
    max_series: int = 200_000
    """Training series a scrape holds at most. Runs are taken most recently heard from first; a run that
    would not fit is left out whole, and ``trainmon_exporter_series_left_out`` counts its series."""


@dataclass
class CollectorConfig:
    db: str = "trainmon.sqlite"
    """SQLite file path or SQLAlchemy URL (``postgresql+psycopg://...``)."""
    host: str = "127.0.0.1"
    port: int = 9400
    max_body_bytes: int = 8 << 20
    """Largest accepted POST body; bigger batches get 413 and the sender splits them."""
    max_pending_batches: int = 4096
    """Batches received and waiting for the writer beyond which new ones get 503 (the producers spool and
    retry): bounds the collector's memory when it cannot keep up."""
    token: str = field(default="", repr=False)
    """Bearer token every endpoint but ``/healthz`` requires when set (``--token``, ``$TRAINMON_TOKEN``).
    Required to bind a non-loopback address unless ``insecure`` is set. Never logged or printed."""
    insecure: bool = False
    """Allow a non-loopback bind without a token (trusted network only); must be asked for explicitly."""
    metrics_public: bool = False
    """Serve ``/metrics`` without the token (for scrapers that cannot send one); Prometheus can:
    ``authorization: {credentials: TOKEN}`` in the scrape config, so it stays protected by default."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Extra names the ``Host`` header may carry on a loopback bind (a local reverse proxy). Any other
    name is refused: a web page whose DNS name was rebound to 127.0.0.1 must not read or write runs."""
    shutdown_grace_seconds: float = 20.0
    """On SIGTERM/SIGINT the collector stops within this long whatever its parts do: half of it for the
    requests in flight to be answered, half for the queued batches to be committed and detected. A
    detection that is not done by then is dropped (logged); acknowledged events are always stored."""
    evict_after_seconds: float = 600.0
    """A run that ended (rank 0 sent ``run_end``) leaves memory (detectors, live state) this long
    after its last event; it stays in storage. Keep it above the exporter's 300 s final-scrape window."""
    evict_idle_seconds: float = 3600.0
    """A run that sent nothing for this long leaves memory too (crashed without ``run_end``). A hung
    rank is found long before (the hang detector's timeout); the run stays in storage."""
    web_cache_seconds: float = 2.0
    """The web view (``GET /``, ``GET /runs/{run}``) serves a rendered page again for this long (or three
    times its render time, if longer) before rendering it anew: open tabs cost no extra work."""
    web_refresh_seconds: int = 5
    """How often the web view's list of runs, and the page of a running run, reload themselves."""
    max_live_runs: int = 256
    """Runs held in memory (detectors, live state, exported series) at once; a batch that would start
    one more is answered 429 (its producer spools and retries) until finished runs are evicted."""
    max_ranks_per_run: int = 8192
    """Ranks of one run; a 1,024-rank job fits eight times over. Beyond: 429."""
    max_runs_per_batch: int = 16
    """Distinct runs in one batch (a producer sends one): creating runs costs detector priming, and a
    batch of thousands of new runs would stall every other producer. Beyond: 429."""
    max_inflight_bytes: int = 256 << 20
    """Request bytes being received plus waiting for the writer; beyond, new bodies get 503 at once.
    Bounds the memory stalled or slow uploads can hold."""
    header_timeout_seconds: float = 10.0
    """A connection must send its request headers within this long, or it is closed (slow-header)."""
    body_timeout_seconds: float = 30.0
    """A request body must arrive within this long, or it is answered 408 and dropped (slow-body)."""
    series: SeriesLimits = field(default_factory=SeriesLimits)
    """What ``/metrics`` exports of wide runs (``[series]`` in the TOML)."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)


def _apply(obj: Any, raw: dict, prefix: str) -> None:
    known = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown field, expected one of {sorted(known)}")
        current = getattr(obj, key)
        item = known[key].metadata.get("item")
        if item is not None:
            # A list of tables (``[[notify.targets]]``): each entry is checked like a section.
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{name}: expected a list of tables, got {value!r}")
            entries = []
            for i, table in enumerate(value):
                entry = item()
                _apply(entry, table, f"{name}[{i}].")
                entries.append(entry)
            setattr(obj, key, entries)
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a table, got {value!r}")
            _apply(current, value, f"{name}.")
            continue
        expected = type(current)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{name}: expected {expected.__name__}, got {value!r}")
        setattr(obj, key, value)


def detectors_config(raw: dict[str, Any]) -> DetectorsConfig:
    """A ``DetectorsConfig`` from its dict form (``dataclasses.asdict``), checked like a config file."""
    config = DetectorsConfig()
    _apply(config, raw, "detectors.")
    return config


def load_config(path: str | Path | None = None, **overrides: Any) -> CollectorConfig:
    """Defaults, then the TOML file, then explicit overrides (command-line flags)."""
    config = CollectorConfig()
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        _apply(config, raw, "")
    _apply(config, {k: v for k, v in overrides.items() if v is not None}, "")
    return config
