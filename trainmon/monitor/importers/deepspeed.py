"""DeepSpeed stdout: DeepSpeed-Chat's training steps and scripts that train through a DeepSpeed engine.

A DeepSpeed engine prints, from rank 0, every ``steps_per_print`` optimizer steps, ``[stamp] [INFO]
[logging.py:96:log_dist] [Rank 0] step=N, skipped=K, lr=[a, b], mom=[...]`` and a throughput line
(``timer.py ... CurrSamplesPerSec=...``); the engine's and the launcher's own lines are described and
matched in :mod:`.deepspeed_engine`. What the training script prints around them depends on the
script; these shapes are read (a multi-node launcher's ``host: `` prefix is removed first):

* **DeepSpeed-Chat step 1 and 2** (supervised fine-tuning, reward model, DPO: ``cmd = ... main.py
  ...``, ``Beginning of Epoch e/E, Total Micro Batches M``). Without ``--print_loss`` there is no
  training loss at all: one step point per ``log_dist`` line, with its LR and its wall-clock stamp,
  and the import says the log has no loss curve (``loss_series`` with no terms). With
  ``--print_loss`` every rank prints ``Epoch: e, Step: s, Rank: r, loss = X`` for each micro-batch:
  one step point per optimizer update (step base 0), its loss the mean over the ranks and the
  update's GA micro-batches (the global batch's loss). Evaluations follow an ``***** Evaluating
  perplexity|reward(s), Epoch e/E *****`` banner on one line of ``name: value`` pairs: ``ppl: X[,
  loss: Y]`` is an eval whose loss is Y when printed, else ``ln X`` (perplexity is the exponential
  of the mean token NLL; kept as the ``perplexity`` metric); DPO's ``chosen: X, rejected: Y, loss:
  Z`` an eval with its loss; a reward model's ``chosen_last_scores (higher is better) : X, ...
  acc (higher is better) : Y`` has no loss, so it is recorded in the config (``reward_evals``) and a
  note, not made into an eval. ``Epoch e/E with loss X`` is a mean over the whole epoch: recorded
  (``epoch_mean_losses``), not a step's loss.
* **DeepSpeed-Chat step 3** (PPO, ``epoch: 0|step: N|ppo_ep: 1|act_loss: X|cri_loss: Y|unsuper_loss:
  Z``, newer ``Epoch: 0 | Step: N | PPO Epoch: 1 | Actor Loss: X | Critic Loss: Y | Unsupervised
  Loss: Z``): one step point per generation batch, ``step`` being the batch's index counted over the
  epochs (``Total Generation Batches`` per epoch; step base 0). The actor's and the critic's losses
  are RL terms, not a loss curve (as :mod:`.structure` states for every importer: the actor's is a
  signed policy-gradient surrogate, the critic's chases returns that move as the policy improves):
  left out of the loss and said so, their non-finite values still imported as a NaN loss; the
  unsupervised LM loss is the loss when the run trains one (0.0 on every line when it is off). The
  ``average reward score`` of each batch, the run's task metric (higher is better), and the critic's
  loss are summarised in the config (first and last tenth). ``E2E latency`` / ``End-to-End =>
  Latency`` is the step time and, summed from the first stamp, the clock.
* **Scripts with a step counter of their own** (DeepSpeedExamples' fine-tuning scripts:
  ``'step':N, 'ppl':X, 'seq_len':L, ...`` every few batches): one step point and one eval per such
  line, ``N`` being the script's batch index (step base 0), the eval loss ``ln ppl``.
* **DeepSpeed's pipeline engine** (``steps: N loss: X [name: Y ...] iter time (s): T samples/sec: S``,
  every ``steps_per_print`` steps, after the ``log_dist`` line of the same N): one step point per
  line, step base 1, the loss of that step (its micro-batches aggregated), ``T`` the mean step time
  since the previous line.
* Otherwise (any script): the ``log_dist`` lines alone, as in step 1.

A Megatron-DeepSpeed stdout holds the engine's lines too: a file with Megatron iteration lines is
Megatron's (:mod:`.megatron`), wherever they start.

Semantics, as DeepSpeed defines them:

* **Step base.** ``log_dist``'s ``step=N`` is the engine's ``global_steps`` after the update, skipped
  ones included: logged after N optimizer steps (step base 1). The script counters above are step
  base 0. With gradient accumulation (``gradient_accumulation_steps`` in the config dump or on the
  command line) a script counting batches is GA batches per engine step. The LR printed with
  ``step=N`` is the scheduler's after N updates: the one update N uses (where points are updates,
  it goes on point N).
* **Skipped steps and the LR.** ``skipped=K`` counts the steps the fp16 loss scaler skipped on an
  overflow. DeepSpeed does not step the LR scheduler on a skipped step, so the LR printed at step N
  is the schedule's value at ``N - K``: it lags the step counter by the skipped count (said in
  ``lr_relation``; the LR detector tolerates that lag through ``skipped``). A point is ``skipped``
  when every step of its interval was (the counter grew by the interval), not skipped when the
  counter did not move, unknown in between; in PPO mode a batch is skipped when an overflow line
  was printed while it trained (DeepSpeed prints every overflow on rank 0).
* **Loss scale.** Read from the scaler's own messages: ZeRO's ``[deepspeed] OVERFLOW! Rank 0
  Skipping step. Attempted loss scale: A, reducing to B`` (or ``but hysteresis is h``: skipped, scale
  kept), and FP16_Optimizer's ``Reducing/Increasing dynamic loss scale from A to B`` and
  ``Overflow detected. Skipping step. Attempted loss scale: A, reducing to B``. FP16_Optimizer prints
  its increases too, so the scale is known at every step and emitted on every point. ZeRO's scaler
  doubles the scale silently after each clean window, so a carried value would be stale: there the
  scale is emitted only on the point right after a message stated it.
* **Ranks printing the same line.** FP16_Optimizer prints its scaler messages on every rank (16
  copies of each on 16 GPUs): a message that repeats a change already applied (from A to B when the
  scale is already B) is a copy, counted and dropped.
* **Several engines.** A script that trains several models (DeepSpeed-Chat's actor and critic) has
  one engine each, all printing ``step=N`` lines under the same N, in the order they step (the actor
  first). They are kept apart by that order: each engine has its own skip counter and LR schedule;
  the step's ``lr`` lists every engine's param groups, engine by engine (``engines`` in the config
  names them), and each engine's skip total is recorded. The loss scale, one per engine, is not
  emitted then (the wire has one per step); the overflow count is recorded.
* **Clock.** The stamps of the ``log_dist`` / scaler lines (read as UTC); lines without one take the
  last stamp before them (PPO: the E2E latencies summed from the first stamp).
* **Status.** ``finished`` when the launcher reports its processes exiting successfully, or when
  the script says it saves its model after reaching its planned steps; ``interrupted`` when the
  launcher reports a process failing short of them; unknown otherwise. The planned length comes
  from the epochs and batches per epoch the script prints (or its ``Total optimization steps``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.monitor.importers.common import (
    ANSI_ESCAPE,
    EvalPoint,
    ImportFormatError,
    Item,
    LogMeta,
    TrainPoint,
    to_float,
)
from trainmon.monitor.importers.deepspeed_engine import (
    EXIT_BAD,
    EXIT_OK,
    FUSED_CHANGE,
    FUSED_SKIP,
    GA_CLI,
    GA_DUMP,
    NUM,
    PRECISION_DUMP,
    STAMP,
    STEP_LINE,
    WORLD,
    ZERO_SCALE,
    Engine,
    Scale,
    read_lrs,
)
from trainmon.monitor.importers.megatron import looks_like_megatron, parse_megatron
from trainmon.monitor.importers.textclock import ISO_STAMP, iso_to_epoch

__all__ = ["looks_like_deepspeed", "parse_deepspeed"]

# PPO step lines, older ``epoch: 0|step: 5|ppo_ep: 1|act_loss: X|cri_loss: Y|unsuper_loss: Z`` and newer
# ``Epoch: 0 | Step: 5 | PPO Epoch: 1 | Actor Loss: X | Critic Loss: Y | Unsupervised Loss: Z``
_PPO = re.compile(r"^epoch:\s*(\d+)\s*\|\s*step:\s*(\d+)\s*\|(.*)$", re.IGNORECASE)
_REWARD = re.compile(r"^average reward score:\s*(" + NUM + r")", re.IGNORECASE)
# ``--print_loss``: every rank prints its own micro-batch loss (a tensor, or a number)
_RANK_LOSS = re.compile(
    r"^Epoch:\s*(\d+),\s*Step:\s*(\d+),\s*Rank:\s*(\d+),\s*loss\s*=\s*(?:tensor\(\s*)?(" + NUM + r")"
)
# DeepSpeed's pipeline engine: ``steps: N loss: X [name: Y ...] iter time (s): T samples/sec: S``
_PIPE = re.compile(
    r"^steps:\s*(\d+)\s+loss:\s*(" + NUM + r")\s+(.*?)iter time \(s\):\s*(" + NUM + r")\s+samples/sec:\s*(" + NUM + r")"
)
# a launcher's host prefix on multi-node runs (``worker-0: [2023-...] ...``)
_HOST = re.compile(
    r"^[\w.\-]+:\s+(?=\[\d{4}-|epoch:|Epoch:|'step'|ppl:|\*{3,}|average reward|Average reward|Beginning of Epoch|"
    r"chosen|saving|End-to-End|\|E2E)"
)
_E2E = re.compile(r"(?:E2E latency=|End-to-End => Latency:\s*)(" + NUM + r")s")
_EVAL_HEAD = re.compile(r"Evaluating (perplexity|rewards?), Epoch (\d+)/(\d+)")
# an evaluation's result line: ``ppl: X[, loss: Y]``, ``chosen: X, rejected: Y, loss: Z``,
# ``chosen_last_scores (higher is better) : X, acc (higher is better) : Y``
_EVAL_KV = re.compile(r"([A-Za-z_][\w ]*?)\s*(?:\(([a-z]+) is better\))?\s*:\s*(" + NUM + r")(?=\s*(?:,|$))")
_DICT = re.compile(r"^'step'\s*:\s*(\d+),\s*'ppl'\s*:\s*(" + NUM + r")")
_EPOCH = re.compile(r"Beginning of Epoch (\d+)/(\d+), Total (Micro|Generation) Batches (\d+)")
_EPOCH_LOSS = re.compile(r"^Epoch (\d+)/(\d+) with loss (" + NUM + r")")
_TOTAL = re.compile(r"Total optimization steps = (\d+)")


def looks_like_deepspeed(head: str) -> bool:
    """A DeepSpeed engine's ``[Rank 0] step=N, skipped=K, lr=[...]`` line, a DeepSpeed-Chat PPO step line
    (with the actor's and critic's losses) or a ``--print_loss`` line."""
    for raw in head.splitlines():
        line = _HOST.sub("", raw.strip(), count=1)
        if "skipped=" in line and STEP_LINE.search(line):
            return True
        if line[:6].lower() == "epoch:" and (_ppo_line(line) or _RANK_LOSS.match(line)):
            return True
        if line.startswith("steps:") and _PIPE.match(line):
            return True
    return False


def _ppo_line(line: str) -> re.Match[str] | None:
    """A PPO step line: the step shape with the actor's and the critic's losses on it."""
    m = _PPO.match(line)
    if m is None:
        return None
    low = m.group(3).lower()
    return m if ("act_loss" in low or "actor loss" in low) and ("cri_loss" in low or "critic loss" in low) else None


@dataclass
class _State:
    items: list[Item] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    scale: Scale = field(default_factory=Scale)
    stamp: float | None = None
    first_stamp: float | None = None
    ga: int | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    epochs: int | None = None
    per_epoch: int | None = None
    batches_kind: str | None = None
    total_steps: int | None = None
    chat: bool = False
    ppo: bool = False
    dict_lines: bool = False
    rank_losses: bool = False
    pipe: bool = False
    extra_losses: dict[str, float] = field(default_factory=dict)  # the pipeline engine's additional losses (last)
    # --print_loss: (epoch, step) -> the ranks' losses; update index -> its micro-batches' losses, stamp, scale
    micro_index: dict[tuple[int, int], int] = field(default_factory=dict)
    updates: dict[int, list[float]] = field(default_factory=dict)
    update_time: dict[int, float | None] = field(default_factory=dict)
    update_scale: dict[int, float | None] = field(default_factory=dict)
    open_update: int | None = None
    exits_ok: int = 0
    exits_bad: int = 0
    world_size: int | None = None  # the launcher's dist_world_size
    saved: bool = False  # the script printed that it saves its (final) model
    overflows: int = 0
    eval_kind: str | None = None
    eval_epoch: int = 0
    reward_evals: list[dict[str, float]] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    ppo_terms: list[tuple[TrainPoint, dict[str, float]]] = field(default_factory=list)
    loss_series: dict[str, Any] | None = None
    critic_losses: list[float] = field(default_factory=list)
    copies_of_step_lines: int = 0
    # log_dist lines of the current engine step: (step, skipped, lrs) per engine, in print order
    round: list[tuple[int, int, list[float], str]] = field(default_factory=list)
    # PPO: what was printed while the next generation batch trained
    ppo_overflows: int = 0
    ppo_lrs: list[list[float]] = field(default_factory=list)
    ppo_clock: float = 0.0
    last_point: TrainPoint | None = None
    last_logged: tuple[int, int] | None = None  # (step, skipped) of engine 0 at the last step point
    dist_lines: list[tuple[int, int, list[float], float | None]] = field(default_factory=list)  # engine 0


def parse_deepspeed(path: Path) -> tuple[list[Item], LogMeta]:
    st = _State()
    # Which lines make the step points is known before reading: a script that prints its own step
    # lines (PPO, 'step':N) makes them; otherwise the engine's log_dist lines do.
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = _HOST.sub("", raw.strip(), count=1)
            if line[:6].lower() == "epoch:" and _ppo_line(line):
                st.ppo = True
                break
            if line.startswith("'step'") and _DICT.match(line):
                st.dict_lines = True
                break
            if line.startswith("Epoch:") and _RANK_LOSS.match(line):
                st.rank_losses = True
                break
            if line.startswith("steps:") and _PIPE.match(line):
                st.pipe = True
                break
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = _HOST.sub("", ANSI_ESCAPE.sub("", raw).strip(), count=1)
            if "iteration" in line and "|" in line and looks_like_megatron(line):
                # Megatron-DeepSpeed prints the engine's lines beside its own iteration lines: its reader's file
                return parse_megatron(path)
            if line:
                _line(line, st)
    if st.ppo:
        _flush_round(st)
        _ppo_loss(st)
    if st.rank_losses:
        _close_update(st)
        _loss_points(st)
    _fill_times(st.items)
    if not any(isinstance(it, TrainPoint) for it in st.items):
        raise ImportFormatError(f"{path}: no DeepSpeed step lines found")
    return st.items, _meta(st)


def _fill_times(items: list[Item]) -> None:
    """Lines printed before the first stamp (the evaluation before training) take the first stamp
    after them; a PPO step printed without its latency line (the last one) ends no earlier than the
    step before it."""
    nxt: float | None = None
    for it in reversed(items):
        if isinstance(it, (TrainPoint, EvalPoint)):
            if it.time is None:
                it.time = nxt
            else:
                nxt = it.time
    prev: float | None = None
    for it in items:
        if isinstance(it, (TrainPoint, EvalPoint)):
            if it.time is None:
                it.time = prev
            prev = it.time


def _line(line: str, st: _State) -> None:
    sm = STAMP.match(line)
    if sm is not None:
        im = ISO_STAMP.match(sm.group(1))
        t = iso_to_epoch(im) if im is not None else None
        if t is not None:
            st.stamp = t
            if st.first_stamp is None:
                st.first_stamp = t
    if "skipped=" in line:
        m = STEP_LINE.search(line)
        if m is not None:
            lrs = read_lrs(m.group(3))
            _step_line(int(m.group(1)), int(m.group(2)), lrs, line[m.start() :], st)
            return
    if "loss scale" in line:
        _scale_line(line, st)
        return
    if line[:6].lower() == "epoch:":
        m = _ppo_line(line)
        if m is not None:
            _ppo_step(int(m.group(1)), int(m.group(2)), m.group(3), st)
            return
        m = _RANK_LOSS.match(line)
        if m is not None:
            _rank_loss(int(m.group(1)), int(m.group(2)), float(m.group(4)), st)
            return
    if line.startswith("steps:"):
        m = _PIPE.match(line)
        if m is not None:
            _pipe_line(m, st)
            return
    if line.startswith("'step'"):
        m = _DICT.match(line)
        if m is not None:
            _dict_line(int(m.group(1)), float(m.group(2)), st)
            return
    _other(line, st)


def _scale_line(line: str, st: _State) -> None:
    at = st.last_point.step if st.last_point is not None else None
    m = ZERO_SCALE.search(line)
    if m is not None:
        st.overflows += 1
        st.ppo_overflows += 1
        old = float(m.group(1))
        if m.group(2) is not None:
            st.scale.change(old, float(m.group(2)), at, per_rank=False)
        else:
            st.scale.state(old)  # hysteresis: skipped, the scale kept
        return
    m = FUSED_SKIP.search(line)
    if m is not None:  # rank 0's summary of the change its FP16_Optimizer also prints (on every rank)
        st.overflows += 1
        st.ppo_overflows += 1
        st.scale.change(float(m.group(1)), float(m.group(2)), at, per_rank=True)
        return
    m = FUSED_CHANGE.search(line)
    if m is not None:
        st.scale.prints_increases = True
        st.scale.rank_lines += 1
        st.scale.change(float(m.group(2)), float(m.group(3)), at, per_rank=True)


def _step_line(step: int, skipped: int, lrs: list[float], text: str, st: _State) -> None:
    """A ``log_dist`` line. Several engines print under the same step, in the order they step."""
    if st.round and st.round[-1][3] == text:
        st.copies_of_step_lines += 1  # the same line twice (a tee'd or duplicated stdout)
        return
    if st.round and st.round[0][0] != step:
        _flush_round(st)
    st.round.append((step, skipped, lrs, text))
    k = len(st.round) - 1
    while len(st.engines) <= k:
        st.engines.append(Engine())
    eng = st.engines[k]
    eng.skipped = skipped
    eng.lines += 1
    if eng.lr_first is None:
        eng.lr_first = lrs
    eng.lr_peak = max([eng.lr_peak, *lrs])
    if k == 0:
        st.dist_lines.append((step, skipped, lrs, st.stamp))
        if not st.ppo and not st.dict_lines and not st.rank_losses and not st.pipe:
            _dist_point(step, skipped, lrs, st)


def _flush_round(st: _State) -> None:
    if st.round and st.ppo:
        lrs = [x for (_, _, lr, _) in st.round for x in lr]
        st.ppo_lrs.append(lrs)
    st.round = []


def _dist_point(step: int, skipped: int, lrs: list[float], st: _State) -> None:
    """A step point from engine 0's ``log_dist`` line (no training loss in such logs)."""
    prev = st.last_logged
    skip: bool | None = None
    if prev is not None and step > prev[0]:
        done = skipped - prev[1]
        skip = True if done >= step - prev[0] else (False if done == 0 else None)
    elif prev is None:
        skip = True if skipped >= step > 0 else (False if skipped == 0 else None)
    point = TrainPoint(step=step, lr=lrs or None, time=st.stamp, skipped=skip)
    point.loss_scale = st.scale.take()
    st.items.append(point)
    st.last_point = point
    st.last_logged = (step, skipped)


def _ppo_step(epoch: int, batch: int, rest: str, st: _State) -> None:
    st.ppo = True
    _flush_round(st)
    parts = {_term(k): v.strip() for k, _, v in (p.partition(":") for p in rest.split("|")) if k.strip()}
    terms = {k: x for k, v in parts.items() if k.endswith("loss") and (x := to_float(v)) is not None}
    step = epoch * st.per_epoch + batch if st.per_epoch else batch
    lrs: list[float] | None = None
    if st.ppo_lrs:
        lrs = st.ppo_lrs[-1]
    point = TrainPoint(step=step, lr=lrs)
    st.ppo_terms.append((point, terms))
    cri = terms.get("critic_loss")
    if st.ppo_overflows or st.overflows or st.fp16:
        point.skipped = st.ppo_overflows > 0
    st.ppo_overflows = 0
    st.ppo_lrs = []
    if cri is not None:
        st.critic_losses.append(cri)
    st.items.append(point)
    st.last_point = point


_RL_TERM = (
    "a PPO term in a run judged by its reward: the actor's loss is a signed policy-gradient surrogate, the "
    "critic's chases returns that move as the policy improves"
)


_TERMS = {"act_loss": "actor_loss", "cri_loss": "critic_loss", "unsuper_loss": "unsupervised_loss"}


def _term(name: str) -> str:
    """One name per PPO term across DeepSpeed-Chat's versions (``act_loss`` / ``Actor Loss``)."""
    key = _key(name)
    return _TERMS.get(key, key)


def _ppo_loss(st: _State) -> None:
    """Which PPO term is the loss curve: none of the RL terms (the actor's and the critic's); the
    unsupervised LM loss when the run trains one (printed as 0.0 when the feature is off). A non-finite
    value of any term is a NaN loss all the same: a fault whatever the term means."""
    lm_key = "unsupervised_loss"
    lm = any(t.get(lm_key, 0.0) != 0.0 for _, t in st.ppo_terms)
    for point, terms in st.ppo_terms:
        if any(not math.isfinite(x) for x in terms.values()):
            point.loss = math.nan
        elif lm:
            point.loss = terms.get(lm_key)
    names = sorted({k for _, t in st.ppo_terms for k in t})
    left = {k: _RL_TERM for k in names if k != lm_key or not lm}
    if not lm and lm_key in left:
        left[lm_key] = "0.0 at every step: the unsupervised loss is off in this run"
    st.loss_series = {
        "how": "unsupervised LM loss" if lm else "none",
        "terms": [lm_key] if lm else [],
        "not_judged": left,
    }


def _pipe_line(m: re.Match[str], st: _State) -> None:
    """``steps: N loss: X ... iter time (s): T``: the pipeline engine's own line, printed after its
    ``log_dist`` line of the same N (whose LR, skip counter and scale it takes)."""
    step = int(m.group(1))
    lrs: list[float] | None = None
    skipped: int | None = None
    if st.dist_lines and st.dist_lines[-1][0] == step:
        _, skipped, lrs, _ = st.dist_lines[-1]
    point = TrainPoint(step=step, loss=float(m.group(2)), lr=lrs or None, time=st.stamp)
    dt = to_float(m.group(4))
    if dt is not None and dt >= 0:
        point.step_time = dt  # the mean over the steps since the previous line
    prev = st.last_logged
    if skipped is not None:
        if prev is not None and step > prev[0]:
            done = skipped - prev[1]
            point.skipped = True if done >= step - prev[0] else (False if done == 0 else None)
        st.last_logged = (step, skipped)
    point.loss_scale = st.scale.take()
    extra = {_key(k): float(v) for k, v in re.findall(r"([A-Za-z_][\w.]*):\s*(" + NUM + r")", m.group(3))}
    st.extra_losses.update(extra)
    st.items.append(point)
    st.last_point = point


def _rank_loss(epoch: int, step: int, loss: float, st: _State) -> None:
    """``Epoch: e, Step: s, Rank: r, loss = X``: one rank's loss of micro-batch ``s`` of epoch ``e``."""
    key = (epoch, step)
    m = st.micro_index.get(key)
    if m is None:
        m = epoch * st.per_epoch + step if st.per_epoch else len(st.micro_index)
        st.micro_index[key] = m
    i = m // (st.ga or 1)
    if st.open_update is not None and i != st.open_update:
        _close_update(st)
    st.open_update = i
    st.updates.setdefault(i, []).append(loss)
    st.update_time[i] = st.stamp


def _close_update(st: _State) -> None:
    """The scaler's messages for an update follow its loss lines: its scale is read when the next one starts."""
    if st.open_update is not None:
        st.update_scale[st.open_update] = st.scale.take()
    st.open_update = None


def _loss_points(st: _State) -> None:
    """One step point per optimizer update: the mean of its micro-batches' losses over every rank (the
    global batch's loss); the LR DeepSpeed printed after N updates is the one update N used; skipped when
    the skip counter grew by the whole interval around it, not skipped when it did not grow."""
    lr_at = {s: lrs for s, _, lrs, _ in st.dist_lines}
    skips = sorted((s, k) for s, k, _, _ in st.dist_lines)
    points = []
    for i in sorted(st.updates):
        losses = st.updates[i]
        loss = math.fsum(losses) / len(losses)
        point = TrainPoint(step=i, loss=loss, lr=lr_at.get(i) or None, time=st.update_time.get(i))
        point.loss_scale = st.update_scale.get(i)
        # the log_dist lines around update i (0-based): counters after `lo` and after `hi` updates
        lo = max(((s, k) for s, k in skips if s <= i), default=None)
        hi = min(((s, k) for s, k in skips if s > i), default=None)
        if hi is not None:
            base = lo if lo is not None else (0, 0)
            grew = hi[1] - base[1]
            point.skipped = True if grew >= hi[0] - base[0] else (False if grew == 0 else None)
        points.append(point)
    # evals and other items were appended as they came; the points go in step order before each later eval
    evals = [it for it in st.items if not isinstance(it, TrainPoint)]
    st.items = _merge(points, evals)
    st.last_point = points[-1] if points else None


def _merge(points: list[TrainPoint], evals: list[Item]) -> list[Item]:
    """Points and evals in step order (an eval after the points of its step)."""
    out: list[Item] = []
    k = 0
    for ev in evals:
        step = getattr(ev, "step", None)
        while k < len(points) and step is not None and points[k].step < step:
            out.append(points[k])
            k += 1
        out.append(ev)
    out.extend(points[k:])
    return out


def _dict_line(step: int, ppl: float, st: _State) -> None:
    """``'step':N, 'ppl':X, ...``: the script's batch counter, and an evaluation at it."""
    st.dict_lines = True
    lr = None
    ga = st.ga or 1
    engine_step = (step + 1) // ga
    for s, _, lrs, _ in reversed(st.dist_lines):
        if s == engine_step:
            lr = lrs or None
            break
        if s < engine_step:
            break
    point = TrainPoint(step=step, lr=lr, time=st.stamp)
    st.items.append(point)
    st.last_point = point
    st.items.append(_ppl_eval(step, ppl, st.stamp))


def _ppl_eval(step: int, ppl: float, t: float | None) -> EvalPoint:
    return EvalPoint(step, _ppl_loss(ppl), {"perplexity": ppl}, time=t)


def _ppl_loss(ppl: float) -> float:
    """The mean NLL a perplexity is the exponential of; ``inf`` stays infinite (the script's exp overflowed)."""
    return math.log(ppl) if ppl > 0 and not math.isnan(ppl) else math.nan


def _other(line: str, st: _State) -> None:
    if "cmd = " in line:  # the launcher's command line (any DeepSpeed script): its flags
        m = GA_CLI.search(line)
        if m is not None and st.ga is None:
            st.ga = int(m.group(1))
        if "--fp16" in line:
            st.fp16 = True
        return
    m = _EPOCH.search(line)
    if m is not None:
        st.chat = True
        st.epochs = int(m.group(2))
        st.per_epoch = int(m.group(4))
        st.batches_kind = m.group(3).lower()
        return
    m = _EVAL_HEAD.search(line)
    if m is not None:
        st.chat = True
        st.eval_kind = m.group(1)
        st.eval_epoch = int(m.group(2))
        return
    if st.eval_kind is not None and not line.startswith("["):
        # the result line is nothing but name: value pairs (not a closing remark that quotes a value)
        values = {_key(k): float(v) for k, _, v in _EVAL_KV.findall(line)}
        if values and not _EVAL_KV.sub("", line).replace(",", "").strip():
            _eval_result(values, st)
            st.eval_kind = None
            return
    m = _REWARD.match(line)
    if m is not None:
        step = st.last_point.step if st.last_point is not None else 0
        st.rewards.append((step, float(m.group(1))))
        return
    m = _E2E.search(line)
    if m is not None and st.ppo and st.last_point is not None:
        dt = to_float(m.group(1))
        if dt is not None and dt >= 0:
            st.last_point.step_time = dt
            st.ppo_clock += dt
            if st.first_stamp is not None:
                st.last_point.time = st.first_stamp + st.ppo_clock
        return
    m = _EPOCH_LOSS.match(line)
    if m is not None:
        st.epoch_losses.append(float(m.group(3)))
        return
    m = GA_DUMP.search(line)
    if m is not None:
        st.ga = int(m.group(1))
        return
    m = PRECISION_DUMP.search(line)
    if m is not None:
        if m.group(1) == "fp16":
            st.fp16 = m.group(2) == "True"
        else:
            st.bf16 = m.group(2) == "True"
        return
    m = _TOTAL.search(line)
    if m is not None:
        st.total_steps = int(m.group(1))
        return
    m = WORLD.search(line)
    if m is not None:
        st.world_size = int(m.group(1))
        return
    if line.lower().startswith("saving") and "model" in line.lower():
        st.saved = True
    elif EXIT_OK.search(line):
        st.exits_ok += 1
    elif EXIT_BAD.search(line):
        st.exits_bad += 1


def _key(name: str) -> str:
    return re.sub(r"\W+", "_", name.strip().lower()).strip("_")


def _eval_result(values: dict[str, float], st: _State) -> None:
    """The line after an ``Evaluating ...`` banner: an eval with its loss (printed, else ``ln ppl``), or,
    without either (a reward model's scores and accuracy), a record in the config."""
    step = _eval_step(st)
    ppl = values.pop("ppl", values.pop("perplexity", None))
    loss = values.pop("loss", None)
    if loss is None and ppl is not None:
        loss = _ppl_loss(ppl)
    if loss is None:
        st.reward_evals.append({"epoch": st.eval_epoch, "step": step, **values})
        return
    metrics = dict(values)
    if ppl is not None:
        metrics["perplexity"] = ppl
    st.items.append(EvalPoint(step, loss, metrics, time=st.stamp))


def _eval_step(st: _State) -> int:
    """The engine step an epoch's evaluation ran after: epochs done x batches per epoch / GA when the
    script printed them, else the last logged step (0 before the first)."""
    if st.per_epoch and st.batches_kind == "micro":
        done = st.eval_epoch * st.per_epoch // (st.ga or 1)
        # step base 1 (log_dist points) logs it under the updates done, step base 0 under the last one's index
        return done if not st.rank_losses else max(0, done - 1)
    return st.last_point.step if st.last_point is not None else 0


def _tenths(values: list[float]) -> tuple[float, float] | None:
    if len(values) < 2:
        return None
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _meta(st: _State) -> LogMeta:
    notes: list[str] = []
    config: dict[str, Any] = {}
    # DeepSpeed-Chat's format: its PPO, or its SFT/reward scripts' lines (not a script's own dict lines
    # or the pipeline engine's, which are DeepSpeed's whatever script runs them)
    chat = st.ppo or (st.chat and not (st.dict_lines or st.pipe))
    fmt, framework = ("deepspeed_chat_stdout", "deepspeed-chat") if chat else ("deepspeed_stdout", "deepspeed")
    if st.ppo:
        step_base = 0
        config["step_counter"] = "generation batch index (DeepSpeed-Chat PPO), counted over the epochs"
    elif st.dict_lines:
        step_base = 0
        config["step_counter"] = "the script's batch index ('step':N)"
    elif st.pipe:
        step_base = 1
        config["step_counter"] = "DeepSpeed's global_steps (pipeline engine 'steps: N', skipped steps included)"
        notes.append(
            "the pipeline engine prints, every steps_per_print steps, the loss of that step (its micro-batches "
            "aggregated) and the mean iteration time since its previous line"
        )
        if st.extra_losses:
            config["additional_losses_last"] = st.extra_losses
    elif st.rank_losses:
        step_base = 0
        config["step_counter"] = "optimizer update index (micro-batch index // gradient_accumulation_steps)"
        config["loss_reduction"] = "mean of every rank's printed micro-batch losses of the update"
    else:
        step_base = 1
        config["step_counter"] = "DeepSpeed's global_steps (log_dist step=N, skipped steps included)"
    planned = None
    if st.epochs and st.per_epoch:
        per_step = (st.ga or 1) if st.batches_kind == "micro" else 1
        planned = st.epochs * st.per_epoch // per_step
    elif st.total_steps:
        planned = st.total_steps
    last = max((it.step for it in st.items if isinstance(it, TrainPoint)), default=None)
    reached = planned is not None and last is not None and last + 1 - step_base >= planned
    status = None
    if st.exits_bad:
        status = "interrupted" if not reached else None
    elif st.exits_ok or (st.saved and reached):
        status = "finished"
    if st.ga:
        config["gradient_accumulation_steps"] = st.ga
    if st.fp16 or (st.fp16 is None and st.overflows):
        config["precision"] = "fp16"
    elif st.bf16:
        config["precision"] = "bf16"
    elif st.fp16 is False and st.bf16 is False:
        config["precision"] = "fp32"
    time_source = "the timestamps DeepSpeed prints on its log lines (read as UTC)"
    if st.ppo:
        time_source = "E2E latency per step summed from the first timestamp DeepSpeed prints (read as UTC)"
    elif st.dict_lines:
        time_source = "the last timestamp DeepSpeed printed before each line (read as UTC)"
    config["time_source"] = time_source
    if st.ppo and len(st.engines) == 2:
        names = ["actor", "critic"]
    else:
        names = [f"engine{k}" for k in range(len(st.engines))] if len(st.engines) > 1 else ["engine"]
    if st.engines:
        config["engines"] = [
            {
                "name": name,
                "param_groups": len(e.lr_first or []),
                "skipped_steps": e.skipped,
                "lr_peak": e.lr_peak,
                "step_lines": e.lines,
            }
            for name, e in zip(names, st.engines, strict=True)
        ]
        last = max((it.step for it in st.items if isinstance(it, TrainPoint)), default=0)
        done = last + 1 - step_base
        skipped = ", ".join(
            (f"{name} " if len(names) > 1 else "") + f"{e.skipped} of {done:,} steps ({e.skipped / max(1, done):.1%})"
            for name, e in zip(names, st.engines, strict=True)
        )
        config["lr_relation"] = (
            "DeepSpeed does not step the LR scheduler on an overflow-skipped step: the LR printed at step N "
            "is the schedule's value at N minus the skipped steps so far"
        )
        if any(e.skipped for e in st.engines):
            notes.append(
                f"fp16 overflow skips (DeepSpeed's skip counter at the end: {skipped}): the LR lags the step "
                "counter by the skipped count, as DeepSpeed's scheduler does not step on a skipped step"
            )
        if len(st.engines) > 1:
            notes.append(
                f"{len(st.engines)} DeepSpeed engines ({', '.join(names)}) print their step lines under the same step: "
                "kept apart by print order; "
                + (
                    "each step's lr lists every engine's param groups, engine by engine"
                    if st.ppo
                    else f"the step points carry {names[0]}'s LR and skips, each engine's skip total is in engines"
                )
            )
    sc = st.scale
    if sc.messages:
        config["loss_scale"] = {
            "messages": sc.messages,
            "copies_dropped": sc.copies,
            "changes": sc.changes,
            "lowest": sc.lowest,
            "lowest_after_step": sc.lowest_at,
            "increases_printed": sc.prints_increases,
        }
        if sc.lowest is not None and not (st.ppo and len(st.engines) > 1):
            where = f"after step {sc.lowest_at}" if sc.lowest_at is not None else "before the first logged step"
            notes.append(f"the fp16 loss scale's lowest value was {sc.lowest:g} ({where})")
        if sc.copies and sc.changes:
            ranks = round(sc.rank_lines / sc.changes) if sc.rank_lines else None
            copies = f"{ranks} copies of each change" if ranks and ranks > 1 else "repeated"
            notes.append(
                f"the loss scaler's messages are printed by every rank ({copies}): {sc.messages} lines, "
                f"read as {sc.changes} distinct scale changes"
            )
        if st.ppo and len(st.engines) > 1:
            notes.append(
                f"{st.overflows} fp16 overflow lines, not attributed to an engine (the lines do not say which): "
                "no loss scale is imported; a step is 'skipped' when an overflow was printed while it trained"
            )
        elif not sc.prints_increases:
            notes.append(
                "ZeRO's loss scaler prints its overflows but not its doublings after each clean window: the loss "
                "scale is imported only on the step point right after a message stated it"
            )
    if st.copies_of_step_lines:
        notes.append(f"{st.copies_of_step_lines} step lines printed twice: read once")
    if st.loss_series is not None:  # the import's statement of which series is the loss (as importers.structure)
        config["loss_series"] = st.loss_series
        for name, why in st.loss_series["not_judged"].items():
            notes.append(
                f"not a loss curve: {name} ({why}); not checked for spikes, divergence or the initial loss, "
                "only for non-finite values"
            )
        if not st.loss_series["terms"]:
            notes.append("no loss curve in this log: the loss rules had nothing to judge")
    elif st.rank_losses:
        config["loss_series"] = {"how": "printed loss (--print_loss)", "terms": ["loss"], "not_judged": {}}
    elif st.pipe:
        config["loss_series"] = {"how": "the pipeline engine's loss", "terms": ["loss"], "not_judged": {}}
    else:
        config["loss_series"] = {"how": "none", "terms": [], "not_judged": {}}
        notes.append(
            "no training loss is printed by this script: the log carries no loss curve, so the loss rules "
            "(spikes, divergence, the initial loss) had nothing to judge"
        )
    if st.epoch_losses:
        config["epoch_mean_losses"] = st.epoch_losses
        notes.append(
            "the script prints only each epoch's mean training loss ("
            + ", ".join(f"{x:.4g}" for x in st.epoch_losses)
            + "): recorded, not imported as a step's loss"
        )
    if st.reward_evals:
        config["reward_evals"] = st.reward_evals
        first, last = st.reward_evals[0], st.reward_evals[-1]
        names = [k for k in first if k not in ("epoch", "step") and k in last]
        shown = ", ".join(f"{k} {first[k]:.4g} -> {last[k]:.4g}" for k in names)
        notes.append(
            f"evaluations without an eval loss (a reward model's scores), recorded in reward_evals, not imported "
            f"as evals: {shown} (epoch {first['epoch']} -> {last['epoch']})"
        )
    if st.ppo:
        t = _tenths([r for _, r in st.rewards])
        if t is not None:
            config["reward"] = {
                "first_tenth_mean": round(t[0], 4),
                "last_tenth_mean": round(t[1], 4),
                "n": len(st.rewards),
            }
            notes.append(
                f"average reward score (the task metric, higher is better): {t[0]:.3g} over the first tenth of the "
                f"steps -> {t[1]:.3g} over the last"
            )
        c = _tenths(st.critic_losses)
        if c is not None:
            config["critic_loss"] = {"first_tenth_mean": round(c[0], 5), "last_tenth_mean": round(c[1], 5)}
    return LogMeta(
        format=fmt,
        framework=framework,
        planned_steps=planned,
        status=status,
        config=config,
        notes=notes,
        step_base=step_base,
        world_size=st.world_size,
    )
