"""``eval_regression``: the task metric getting worse, eval loss rising against the train loss, or jumping on resume.

Why the rule is what it is (DESIGN "The detections"; failure-modes.md R5-R7 and C2; trainmon issue 14):

* The number the user cares about is the task metric, not the eval loss. Every eval metric the log
  carries is read in its own direction (:func:`metric_direction`: WER/CER lower is better,
  accuracy/F1/BLEU/ROUGE/exact match higher), and the first of them in a fixed order (error rates,
  exact match, F1, accuracy, BLEU/ROUGE...; the trainer's ``metric_for_best_model`` first when it is
  known) is *the* task metric. It regresses when it is worse than its best at ``metric_evals``
  evals in a row, by more than ``metric_worse_rel`` of its best and ``metric_noise_k`` times its
  eval-to-eval noise (``metric_unmeasured_rel`` while too few evals came before to measure it), and
  the eval loss got worse with it (beyond ``above_best_rel`` and its own noise): a metric that dips
  while the eval loss holds or falls is eval-set noise (22_mt5-az-summ ROUGE, 05_bashkir WER), a
  real degradation drags the loss along (53_whisper-tr: WER 17.7 -> 29.6, eval loss doubled). A
  warning; critical when ``critical_rel`` worse for ``critical_evals`` evals in a row.
* The eval loss rising while the task metric improves or holds is not a regression: it is
  over-confidence (the model grows surer of the answers it still gets wrong), normal when
  fine-tuning for many epochs (01_whisper-large-v2-ja: eval loss 0.32 -> 0.42 while WER falls;
  60_cantillation: +35% while accuracy rises). It gets one info finding (the eval loss beyond its
  own noise for as many evals as it rose) that says to keep the checkpoint with the best task
  metric: rolling back to the best eval loss would make the model worse.
* With no task metric in the log the eval loss is the only judge. Overfitting or a train/eval
  mismatch shows as the held-out loss going up for several evals in a row while the train loss
  keeps falling: ``rising_evals`` consecutive increases, a total rise beyond ``min_rise_rel`` /
  ``min_rise_abs``, the latest eval ``above_best_rel`` above the best one, every rising eval above
  the best by the eval's own noise (``metric_noise_k`` times its eval-to-eval scatter measured on the
  evals before, and two quanta of a quantised loss: a tiny validation set's loss moves in steps of
  ~0.012 and single epochs swing, and the best is the luckiest of those swings, so the rising evals are
  measured from the best level the run held, the lowest median of three consecutive evals; before ``noise_evals``
  evals the scatter is not trusted and the latest eval must be ``metric_unmeasured_rel`` above the
  best), and the train level (median of the last ``train_window`` train losses) lower now than at
  the best eval. Leaky labels (C2) produce the same picture, far stronger. A warning whose advice
  asks for the task metric before going back to the best-loss checkpoint. A log with no training
  loss at all (a DeepSpeed script that prints only eval perplexity) has only its evals: the same
  rise beyond the eval's noise is a warning that says overfitting cannot be told from damage (109:
  ln perplexity 4.12 at step 0 -> 4.88 at 220, back at 320), resolved when the eval loss comes back.
* Several eval sets (the importers put the first set's loss and metrics in the eval itself, each
  other set's as ``SET/loss`` and ``SET/METRIC`` in its metrics): each set is judged on its own, by
  the same rules and its own noise, with the run's one train loss. A run whose held-out general set
  regresses while its own eval improves (forgetting) is flagged, naming the set; a set's regression
  clearing resolves the anomaly only when no other set's is still open.
* A resume that silently breaks the model (wrong weights, a different tokenizer or topology, R7)
  shows at the first eval after the resume as a jump against the last eval before it.
* Advice names a step only where the run was healthy: the best step of the task metric, and for an
  error rate that never got below ``unusable_error_rate`` it says no checkpoint is worth going back to.
* The trainer's own choice (``best_metric`` / ``best_global_step`` / ``best_model_checkpoint`` of an
  HF ``trainer_state.json``; ``metric_for_best_model`` / ``greater_is_better`` of its arguments) is
  named when it agrees with the evals, and gets a note when it does not: a best that a later eval
  beats in the metric's own direction means the trainer selected in the wrong direction
  (52_wav2vec2-bangla: ``greater_is_better`` left at HF's default True for WER), and so does a
  declared ``greater_is_better`` against the metric's direction.
* A metric exactly 0.0 at ``zero_metric_evals`` evals from the start is computed wrong, almost
  always (60_cantillation: F1/precision/recall 0.0 at all 100 evals): one note.

Notes (the broken metric, the trainer's wrong best) are findings opened and closed at once; they
wait while another finding of this kind is open, since the run has one anomaly of a kind at a time.
Regressions resolve when the metric (or eval loss) comes back within half its margin of the best; an
eval-loss regression that gets worse while open is restated at its worst eval (its extent).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
import statistics
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding, finite
from trainmon.monitor.detectors.batch import Reading
from trainmon.monitor.detectors.quiet import observe_quiet
from trainmon.monitor.detectors.rolling import LazyWindow
from trainmon.wire import Event

__all__ = ["EvalRegression", "EvalRegressionConfig", "metric_direction"]


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


# Name tokens (lowercased, split on anything but letters and digits) that say how to read a metric.
_ERROR_RATES = frozenset({"wer", "cer", "mer", "wil", "ter"})
_LOWER = frozenset({"error", "err", "mae", "mse", "rmse"})
_LOSS_LIKE = frozenset({"loss", "nll", "perplexity", "ppl", "bpb", "bpc"})
_HIGHER = {  # token -> rank among task metrics (lower rank: the one a person reads first)
    "exact": 1,
    "em": 1,
    "f1": 2,
    "accuracy": 3,
    "acc": 3,
    "bleu": 4,
    "sacrebleu": 4,
    "chrf": 4,
    "meteor": 4,
    "bertscore": 4,
    "precision": 5,
    "recall": 5,
    "auc": 5,
    "mrr": 5,
    "ndcg": 5,
    "spearman": 5,
    "pearson": 5,
    "matthews": 5,
    "mcc": 5,
    "correlation": 5,
}
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def _classify(name: str) -> tuple[int, bool, int, bool]:
    """(direction: +1 higher is better, -1 lower, 0 unknown; a task metric (not the loss by another
    name); rank among task metrics; an error rate)."""
    tokens = [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]
    lower = higher = loss_like = error_rate = False
    rank = 6
    for t in tokens:
        if t in _ERROR_RATES:
            lower = error_rate = True
            rank = min(rank, 0)
        elif t in _LOSS_LIKE:
            lower = loss_like = True
        elif t in _LOWER:
            lower = True
            rank = min(rank, 5)
        elif t in _HIGHER or t.startswith("rouge") or t.endswith("bleu") or t.startswith("f1"):
            higher = True
            rank = min(rank, _HIGHER.get(t, 2 if t.startswith("f1") else 4))
    if lower == higher:  # neither, or both (a name that says both ways is not read)
        return 0, False, rank, False
    if higher:
        return 1, True, rank, False
    return -1, not loss_like, rank, error_rate and not loss_like


def _noise(values: list[float]) -> float | None:
    """The eval-to-eval noise of a series (a standard deviation), None below five values: the median distance of
    each value from the mean of its two neighbours, which a steady trend (a loss still falling) does not inflate
    the way consecutive changes do; scaled so that it estimates sigma for independent noise."""
    off = [abs(b - (a + c) / 2) for a, b, c in zip(values, values[1:], values[2:], strict=False)]
    return statistics.median(off) / 0.826 if len(off) >= 3 else None


def _level(values: list[float], best: float) -> float:
    """The best level a noisy series reached: the lowest median of three consecutive values (the single lowest
    value is the luckiest draw of many, a level the run never held), never below ``best``."""
    medians = [sorted(values[i : i + 3])[1] for i in range(len(values) - 2)]
    return max(best, min(medians)) if medians else best


def _quantum(values: list[float]) -> float:
    """The resolution of a quantised series (a small eval set's loss moves in steps): the smallest nonzero
    difference between its distinct values, when the values repeat (half of them or more are repeats) and
    sit on a lattice of that step; else 0."""
    distinct = sorted(set(values))
    if len(distinct) < 4 or len(distinct) > len(values) // 2:
        return 0.0
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    q = min(gaps)
    if any(abs(g / q - round(g / q)) > 0.1 for g in gaps):
        return 0.0  # not on a lattice: repeats of a level, not a resolution
    return q


def metric_direction(name: str) -> tuple[int, bool]:
    """How to read an eval metric by its name: (+1 higher is better, -1 lower is better, 0 not a quality
    metric (throughput, runtime, counts)), and whether it is a task metric (WER, accuracy, BLEU...) rather than
    the eval loss by another name (perplexity, bits per byte)."""
    direction, task, _, _ = _classify(name)
    return direction, task


@dataclass(slots=True)
class _Metric:
    name: str
    sign: int  # +1: higher is better
    task: bool
    rank: int
    error_rate: bool
    order: int  # first seen
    recent: collections.deque[tuple[int, float, float, float | None]]  # (step, value, eval loss, train level)
    first: float
    varied: bool = False
    zeros: int = 0  # evals exactly 0.0 since the first one; -1 once it was not
    max_abs: float = 0.0
    best: tuple[float, int, float, float, float | None] | None = None  # (badness, step, value, eval loss, train)
    last_step: int = -1
    noted: bool = False

    def bad(self, value: float) -> float:
        return -value if self.sign > 0 else value

    @property
    def better(self) -> str:
        return "higher" if self.sign > 0 else "lower"


@dataclass(slots=True)
class _Trainer:
    """What the trainer says it kept as best (config of ``run_start``)."""

    value: float | None = None
    step: int | None = None
    checkpoint: str | None = None
    metric: str | None = None  # metric_for_best_model ("loss" for the eval loss)
    declared: bool = False  # metric came from the trainer's arguments, not matched by value
    greater: bool | None = None
    wrong: bool = False  # a note said the trainer's best is not the best
    noted: bool = False


class EvalRegression(Detector):
    """The task metric worsening; eval loss against a falling train loss; eval jump after resume."""

    kind = "eval_regression"
    config_class = EvalRegressionConfig
    order = 150
    priority = 40
    plots = ("loss",)
    localised = False
    consumes = frozenset(("run_start", "step", "eval"))

    def __init__(self, config: EvalRegressionConfig) -> None:
        self.config = config
        # the train level: added on every step, its median read only at evals (a few hundred in a long log)
        self._train = LazyWindow(config.train_window)
        # (step, eval loss, train level at that eval, attempt)
        self._evals: collections.deque[tuple[int, float, float | None, int]] = collections.deque(maxlen=config.history)
        # best eval loss: (step, loss, train level, task-metric values at that eval)
        self._best: tuple[int, float, float | None, dict[str, float]] | None = None
        self._open: dict[str, Any] | None = None
        self._metrics: dict[str, _Metric] = {}
        self._trainer = _Trainer()
        self._pending: list[list[Finding]] = []  # notes waiting for the open finding to close
        self._sets: dict[str, EvalRegression] = {}  # further eval sets, each judged by its own instance
        self._set_open: set[str] = set()  # sets ("" the run's own eval) whose finding is open

    # -- events ----------------------------------------------------------------------------------

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        """The run's own eval, and each further eval set (``SET/loss`` and ``SET/METRIC`` in the eval's metrics,
        as the importers write them) judged on its own by an instance of this detector per set."""
        kind = event.kind
        if kind != "eval":
            if kind == "run_start" and not event.fields.get("resumed", False):
                self._sets = {}
                self._set_open = set()
            if self._sets:  # the further eval sets read the run's steps (their train level) as the run does
                for child in self._sets.values():
                    child.observe(event, attempt)
            if kind == "step":  # nearly every event: only the train level, its median read at the next eval
                loss = event.fields.get("loss")
                if finite(loss):
                    self._train.add(loss)
                return []
            return self._observe_one(event, attempt)
        metrics = event.fields.get("metrics")
        if not isinstance(metrics, dict):
            return self._merge("", self._observe_one(event, attempt))
        by_set: dict[str, dict[str, Any]] = {}
        own: dict[str, Any] = {}
        for name, value in metrics.items():
            head, sep, tail = name.rpartition("/") if isinstance(name, str) else ("", "", "")
            if sep and head and f"{head}/loss" in metrics:
                by_set.setdefault(head, {})[tail] = value
            else:
                own[name] = value
        primary = dataclasses.replace(event, fields={**event.fields, "metrics": own})
        out = self._merge("", self._observe_one(primary, attempt))
        for name, values in by_set.items():
            loss = values.pop("loss")
            if name not in self._sets:
                if len(self._sets) >= self.config.max_sets:
                    continue
                child = self._sets[name] = EvalRegression(self.config)
                for v in self._train._order:  # the run's train loss so far (the steps reach it from now on)
                    child._train.add(v)
                child._trainer = _Trainer()  # the trainer's best is about the run's own eval
            fields = {"step": event.fields["step"], "loss": loss, "metrics": values}
            found = self._sets[name].observe(dataclasses.replace(event, fields=fields), attempt)
            out += self._merge(name, found)
        return out

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step is quiet (:mod:`.quiet`) while the run has no further eval set: it only adds its loss to the train
        level, a window of the last ``train_window`` finite losses."""
        observe_quiet(self.observe, events, attempts, out, self._quiet_until, self.config.train_window)

    def _quiet_until(self, batch: Reading, i: int) -> int:
        return i if self._sets else batch.quiet_end(i)

    def _merge(self, label: str, found: list[Finding]) -> list[Finding]:
        """One anomaly per run and kind: a set's findings say which set; a set's regression clearing resolves the
        anomaly only when no other set's is open, and a set's notes wait while another set's finding is open."""
        out: list[Finding] = []
        for f in found:
            if label:
                f = Finding(
                    f.kind,
                    f.severity,
                    f.step,
                    f"eval set {label}: {f.message}",
                    f.hint,
                    {**f.evidence, "eval_set": label},
                    f.resolved,
                    f.rank,
                )
            others = self._set_open - {label}
            if f.resolved:
                self._set_open.discard(label)
                if others:
                    continue
            elif f.severity == "info" and others and label:
                continue
            else:
                self._set_open.add(label)
            out.append(f)
        return out

    def _observe_one(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        kind = event.kind
        if kind == "run_start":
            if not f.get("resumed", False):
                sets, set_open = self._sets, self._set_open
                self.__init__(self.config)  # a fresh run: its evals are not comparable with the previous one's
                self._sets, self._set_open = sets, set_open
            self._read_config(f.get("config"))
            return []
        if kind != "eval":
            return []
        loss = f.get("loss")
        if not finite(loss):
            return []
        step = f["step"]
        train = self._train.median() if len(self._train) else None
        prev = self._evals[-1] if self._evals else None
        self._evals.append((step, loss, train, attempt))
        self._add_metrics(step, loss, train, f.get("metrics"))
        notes = self._zero_note(step) + self._trainer_note(step, loss)
        out: list[Finding] = []
        if self._open is not None:
            out.extend(self._follow(step, loss, train))
        elif prev is not None and attempt > prev[3]:
            out.extend(self._resume_jump(step, loss, prev, attempt))
        else:
            out.extend(self._detect(step, loss, train))
        self._pending.extend(notes)
        if self._open is None:
            for note in self._pending:
                out.extend(note)
            self._pending.clear()
        if self._best is None or loss < self._best[1]:
            self._best = (step, loss, train, {m.name: m.recent[-1][1] for m in self._current(step)})
        for m in self._current(step):
            value = m.recent[-1][1]
            if m.best is None or m.bad(value) < m.best[0]:
                m.best = (m.bad(value), step, value, loss, train)
        return out

    def _read_config(self, config: Any) -> None:
        if not isinstance(config, dict):
            return
        t = self._trainer
        if finite(config.get("best_metric")):
            t.value = float(config["best_metric"])
        step = config.get("best_global_step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            t.step = step
        ckpt = config.get("best_model_checkpoint")
        if isinstance(ckpt, str) and ckpt:
            t.checkpoint = re.split(r"[/\\]", ckpt.rstrip("/\\"))[-1][:120]
            m = _CHECKPOINT.search(t.checkpoint)
            if m and t.step is None:
                t.step = int(m.group(1))
        name = config.get("metric_for_best_model")
        if isinstance(name, str) and name:
            t.metric = name.removeprefix("eval_")[:120]
            t.declared = True
        greater = config.get("greater_is_better")
        if isinstance(greater, bool):
            t.greater = greater

    def _add_metrics(self, step: int, loss: float, train: float | None, metrics: Any) -> None:
        if not isinstance(metrics, dict):
            return
        for name, value in metrics.items():
            if not isinstance(name, str) or not finite(value):
                continue
            m = self._metrics.get(name)
            if m is None:
                if len(self._metrics) >= self.config.max_metrics:
                    continue
                sign, task, rank, error_rate = _classify(name)
                if sign == 0:
                    continue
                m = self._metrics[name] = _Metric(
                    name,
                    sign,
                    task,
                    rank,
                    error_rate,
                    len(self._metrics),
                    collections.deque(maxlen=self.config.history),
                    value,
                )
            value = float(value)
            m.recent.append((step, value, loss, train))
            m.last_step = step
            m.varied = m.varied or value != m.first
            m.max_abs = max(m.max_abs, abs(value))
            if m.zeros >= 0:
                m.zeros = m.zeros + 1 if value == 0.0 else -1

    def _current(self, step: int) -> list[_Metric]:
        return [m for m in self._metrics.values() if m.last_step == step]

    def _primary(self, step: int) -> _Metric | None:
        """The task metric of this eval: the trainer's ``metric_for_best_model`` if it is one, else the first
        (error rate, exact match, F1, accuracy, BLEU/ROUGE, ...) that has moved at all."""
        cands = [m for m in self._current(step) if m.task and m.varied]
        if not cands:
            return None
        chosen = [m for m in cands if m.name == self._trainer.metric]
        return chosen[0] if chosen else min(cands, key=lambda m: (m.rank, m.order))

    # -- margins -----------------------------------------------------------------------------------

    def _margin(self, ref: float, rel: float, abs_: float) -> float:
        return max(rel * abs(ref), abs_)

    def _metric_margin(self, m: _Metric) -> float:
        """How much worse than its best the metric must be to be beyond noise: a fraction of the best, and a
        multiple of the eval-to-eval noise (median absolute change between consecutive evals), measured on the
        evals before the ones being judged so that a steady worsening does not pass for noise."""
        assert m.best is not None
        cfg = self.config
        noise = _noise([r[1] for r in m.recent][: -cfg.metric_evals])
        if noise is None:
            return max(cfg.metric_worse_rel, cfg.metric_unmeasured_rel) * abs(m.best[2])
        return max(cfg.metric_worse_rel * abs(m.best[2]), cfg.metric_noise_k * noise)

    def _best_now(self, m: _Metric) -> tuple[int, float]:
        """(step, value) of the metric's best, this eval included."""
        step, value = m.recent[-1][0], m.recent[-1][1]
        if m.best is not None and m.best[0] <= m.bad(value):
            return m.best[1], m.best[2]
        return step, value

    def _unusable(self, m: _Metric, best: float) -> bool:
        """An error rate whose best is still most of the words wrong (percent when any value was above 1.5)."""
        if not m.error_rate:
            return False
        scale = 100.0 if m.max_abs > 1.5 else 1.0
        return best >= self.config.unusable_error_rate * scale

    # -- the trainer's best ------------------------------------------------------------------------

    def _trainer_note(self, step: int, loss: float) -> list[list[Finding]]:
        t = self._trainer
        if t.metric is None and t.value is not None and t.step is not None and abs(step - t.step) <= 1:
            # the value the trainer stored, as the log printed it (some loggers round to 4-6 digits)
            near = [(abs(loss - t.value), "loss")]
            near += [(abs(m.recent[-1][1] - t.value), m.name) for m in self._current(step)]
            gap, name = min(near)
            if gap <= 1e-4 * max(abs(t.value), 1e-12):
                t.metric = name
        if t.noted or t.metric is None:
            return []
        if t.metric == "loss":
            sign, name, value = -1, "eval loss", loss
        else:
            m = self._metrics.get(t.metric)
            if m is None or m.last_step != step:
                return []
            sign, name, value = m.sign, m.name, m.recent[-1][1]
        better = "lower" if sign < 0 else "higher"
        if t.declared:
            greater = t.greater if t.greater is not None else not t.metric.endswith("loss")
            if greater == (sign > 0):
                return []
            t.noted = t.wrong = True
            message = (
                f"metric_for_best_model {t.metric!r} with greater_is_better={greater}: the trainer keeps the "
                f"checkpoint with the {'highest' if greater else 'lowest'} {name}, the worst one ({better} is better)"
            )
        else:
            if t.value is None or t.step is None or step <= t.step + 1:
                return []
            gain = (value - t.value) * sign
            if gain <= self.config.metric_worse_rel * abs(t.value):
                return []
            t.noted = t.wrong = True
            message = (
                f"the trainer's best checkpoint (best_metric {t.value:.4g}, the {name} at step {t.step}) is not its "
                f"best {name}: {value:.4g} at step {step} is better ({better} is better)"
            )
        its = t.checkpoint or (f"step {t.step}" if t.step is not None else "the checkpoint it calls best")
        hint = (
            f"The trainer selects its best checkpoint in the wrong direction: set greater_is_better={sign > 0} for "
            f"{t.metric!r} (HF defaults it to True for every metric whose name does not end in 'loss'). As it is, "
            "load_best_model_at_end and early stopping act on the wrong checkpoint: do not go back to "
            f"{its}; judge checkpoints by {name} yourself."
        )
        evidence = {"best_metric": t.value, "best_step": t.step, "metric": t.metric, "value": value, "step": step}
        return [self._note(step, message, hint, evidence)]

    def _trainer_agrees(self, m: _Metric | None, step: int) -> str:
        """`` (the trainer's best_model_checkpoint, checkpoint-N)`` when the trainer kept that very step."""
        t = self._trainer
        name = "loss" if m is None else m.name
        if t.wrong or t.metric != name or t.step is None or abs(t.step - step) > 1:
            return ""
        return f"; the trainer's best_model_checkpoint {t.checkpoint}" if t.checkpoint else "; the trainer's best too"

    # -- notes ---------------------------------------------------------------------------------------

    def _note(self, step: int, message: str, hint: str, evidence: dict[str, Any]) -> list[Finding]:
        """A finding opened and closed at once: a fact about the run, not a condition that can clear."""
        return [
            Finding(self.kind, "info", step, message, hint, evidence),
            self.resolve(step, message, hint, evidence),
        ]

    def _zero_note(self, step: int) -> list[list[Finding]]:
        n = self.config.zero_metric_evals
        # higher is better: 0.0 is nothing right (a WER of 0.0 would be perfect, not suspicious)
        stuck = [m for m in self._current(step) if m.sign > 0 and m.zeros == n and not m.noted]
        if not stuck:
            return []
        for m in stuck:
            m.noted = True
        names = ", ".join(m.name for m in stuck)
        moving = self._primary(step)
        if moving is not None:
            other = f"{moving.name} moves ({moving.first:.4g} -> {moving.recent[-1][1]:.4g})"
        else:
            other = "the eval loss moves"
        first_step = min(m.recent[0][0] for m in stuck) if all(len(m.recent) >= n for m in stuck) else None
        since = f" (steps {first_step}-{step})" if first_step is not None else ""
        verb = "is" if len(stuck) == 1 else "are"
        message = f"eval {names} {verb} exactly 0.0 at all {n} evals so far{since} while {other}"
        hint = (
            "A metric that never leaves 0.0 is almost always computed wrong, not a model that never gets anything "
            "right: check compute_metrics (label ids against label names, the average= of precision/recall/F1, "
            "predictions argmaxed on the right axis, -100 padding labels dropped, a positive class that never "
            "occurs). Do not select checkpoints or early-stop on it."
        )
        return [self._note(step, message, hint, {"metrics": [m.name for m in stuck], "evals": n})]

    # -- detection ---------------------------------------------------------------------------------

    def _detect(self, step: int, loss: float, train: float | None) -> list[Finding]:
        m = self._primary(step)
        if m is not None:
            found = self._metric_regression(m, step, train)
            if found:
                return found
        rise = self._loss_rise(step, loss, train)
        if rise is None:
            return []
        if m is None:
            return self._loss_only(step, loss, rise)
        if m.best is None or m.bad(m.recent[-1][1]) > m.best[0] + self._metric_margin(m):
            return []  # the metric is off its best but not (yet) a regression: wait for the next eval
        cfg = self.config
        then = self._best[3].get(m.name) if self._best is not None else None
        if then is not None and m.bad(m.recent[-1][1]) - m.bad(then) > cfg.metric_worse_rel * abs(then):
            # Worse than when the eval loss was best, if within its noise: it did not hold (the note's claim that
            # the model is no worse at the task would be wrong), and it is no regression either.
            return []
        noise = _noise([e[1] for e in self._evals][: -cfg.rising_evals])
        above = rise["best_eval"] + max(
            cfg.above_best_rel * abs(rise["best_eval"]), cfg.metric_noise_k * (noise or 0.0)
        )
        if any(e[1] <= above for e in list(self._evals)[-cfg.rising_evals :]):
            return []  # a note is a claim too: the eval loss must stand beyond its noise for as many evals as it rose
        return [self._calibration(m, step, loss, rise)]

    def _loss_rise(self, step: int, loss: float, train: float | None) -> dict[str, Any] | None:
        cfg = self.config
        n = cfg.rising_evals + 1
        if len(self._evals) < n or self._best is None:
            return None
        tail = list(self._evals)[-n:]
        if any(b[1] <= a[1] for a, b in itertools.pairwise(tail)):
            return None
        if len({e[3] for e in tail}) > 1:
            return None  # a resume in between: the jump rule's business
        rise = loss - tail[0][1]
        if rise < self._margin(tail[0][1], cfg.min_rise_rel, cfg.min_rise_abs):
            return None
        best_step, best, best_train, _ = self._best
        if loss < best + self._margin(best, cfg.above_best_rel, cfg.min_rise_abs):
            return None
        # Beyond the eval's own noise, and persisting: every one of the rising evals above the best by a multiple of
        # the eval-to-eval scatter measured before them, and by two quanta of a quantised eval loss.
        values = [e[1] for e in self._evals]
        before = values[: -cfg.rising_evals]
        noise = _noise(before) or 0.0
        floor = max(cfg.metric_noise_k * noise, 2 * _quantum(values))
        if len(before) < cfg.noise_evals:  # too few evals to trust their scatter: the rule of an unmeasured metric
            if loss < best + max(floor, cfg.metric_unmeasured_rel * abs(best)):
                return None
        elif any(e[1] < _level(before, best) + floor for e in tail[1:]):
            return None
        blind = len(self._train) == 0  # the log carries no training loss at all: the evals are all there is
        if blind:
            return {
                "eval_losses": [round(e[1], 5) for e in tail],
                "eval_steps": [e[0] for e in tail],
                "best_eval": best,
                "best_step": best_step,
                "train_at_best": None,
                "train_now": None,
                "no_train_loss": True,
            }
        # an eval at step 0 with no train loss before it saw the model before training (HF's eval_on_start,
        # nanoGPT/llm.c's first val); a sparse train log's first logged step says nothing about earlier evals
        before_training = best_train is None and best_step == 0
        if (
            train is None
            or (best_train is None and not before_training)
            or (best_train is not None and train >= best_train)
        ):
            return None  # train loss did not fall: not the overfitting picture (an eval before training: the start)
        return {
            "eval_losses": [round(e[1], 5) for e in tail],
            "eval_steps": [e[0] for e in tail],
            "best_eval": best,
            "best_step": best_step,
            "train_at_best": round(best_train, 5) if best_train is not None else None,
            "train_now": round(train, 5),
        }

    def _loss_only(self, step: int, loss: float, rise: dict[str, Any]) -> list[Finding]:
        """No task metric in the log: the eval loss is the only judge of generalisation."""
        cfg = self.config
        best, best_step = rise["best_eval"], rise["best_step"]
        self._open = {"ref": best, "why": "rising"}
        if rise.get("no_train_loss"):
            return self._opened(
                Finding(
                    kind=self.kind,
                    severity="warning",
                    step=step,
                    message=(
                        f"eval loss rose {cfg.rising_evals} evals in a row to {loss:.4g} at step {step}, "
                        f"{loss - best:+.3g} above its best ({best:.4g} at step {best_step}), beyond its own noise; "
                        "this log has no training loss to compare with"
                    ),
                    hint=(
                        "The model is getting worse on held-out data. Without a training loss, overfitting cannot be "
                        "told from updates that damage the model; early in a fine-tune the usual causes are an LR "
                        "too high for the pretrained weights (check the warmup and the peak), a data or sequence-"
                        "length schedule that changes what the model sees, or a mismatch between the training and "
                        f"evaluation data. The eval loss was best at step {best_step}"
                        f"{self._trainer_agrees(None, best_step)}: keep that checkpoint until the eval loss is "
                        "back below it."
                    ),
                    evidence=rise,
                ),
                loss,
            )
        return self._opened(
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"eval loss rose {cfg.rising_evals} evals in a row to {loss:.4g} at step {step} "
                    f"(best {best:.4g} at step {best_step}) while the train loss fell "
                    + (
                        f"{rise['train_at_best']:.4g} -> {rise['train_now']:.4g}"
                        if rise["train_at_best"] is not None
                        else f"to {rise['train_now']:.4g} since training began (the best eval is the model before it)"
                    )
                ),
                hint=(
                    "Train and eval disagree: overfitting (too many epochs over a small dataset, data repeated), "
                    "or the train loss is flattered by leakage (labels not shifted, eval data in the train set); "
                    "check init_loss findings and the data pipeline. The eval loss was best at step "
                    f"{best_step}{self._trainer_agrees(None, best_step)}. Before going back to that checkpoint, "
                    "check the task metric (WER, accuracy, BLEU...) if the run has one: eval loss can rise while "
                    "the task metric still improves (over-confidence), and then the later checkpoint is the "
                    "better model. Log it with the evals (compute_metrics) and this finding judges by it."
                ),
                evidence=rise,
            ),
            loss,
        )

    def _opened(self, finding: Finding, loss: float) -> list[Finding]:
        """An eval-loss regression just opened: remembered, so that a worse eval while it lasts extends it."""
        assert self._open is not None
        self._open["finding"] = finding
        self._open["peak"] = loss
        return [finding]

    def _calibration(self, m: _Metric, step: int, loss: float, rise: dict[str, Any]) -> Finding:
        """Eval loss up, task metric up or holding: over-confidence, not a regression."""
        assert self._best is not None
        cfg = self.config
        best, best_step = rise["best_eval"], rise["best_step"]
        then = self._best[3].get(m.name)
        now = m.recent[-1][1]
        m_step, m_best = self._best_now(m)
        improved = then is not None and (now - then) * m.sign > cfg.metric_worse_rel * abs(then)
        verb = "improved" if improved else "held"
        was = f"{then:.4g} at step {best_step} -> " if then is not None else ""
        self._open = {"ref": best, "why": "calibration", "metric": m.name, "metric_best_step": m_step}
        return Finding(
            kind=self.kind,
            severity="info",
            step=step,
            message=(
                f"eval loss rose {cfg.rising_evals} evals in a row to {loss:.4g} at step {step} (best {best:.4g} at "
                f"step {best_step}) while {m.name} {verb} ({was}{now:.4g}; {m.better} is better): over-confidence, "
                "not a regression"
            ),
            hint=(
                f"The eval loss rising while {m.name} {verb} means the model grows surer of the answers it still gets "
                f"wrong (over-confidence), common when fine-tuning for many epochs; the model is not getting worse at "
                f"the task. Judge checkpoints by {m.name}: keep the checkpoint with the best {m.name} ({m_best:.4g} at "
                f"step {m_step}{self._trainer_agrees(m, m_step)}). Early stopping or load_best_model_at_end on "
                "eval_loss would pick a worse model; if calibrated probabilities matter, fewer epochs or label "
                "smoothing help."
            ),
            evidence={**rise, "metric": m.name, "metric_now": now, "metric_best": m_best, "metric_best_step": m_step},
        )

    def _metric_regression(self, m: _Metric, step: int, train: float | None) -> list[Finding]:
        cfg = self.config
        if m.best is None or len(m.recent) < cfg.metric_evals + 1:
            return []
        best_bad, best_step, _, best_loss, _ = m.best
        tail = list(m.recent)[-cfg.metric_evals :]
        margin = self._metric_margin(m)
        if any(s <= best_step or m.bad(v) <= best_bad + margin for s, v, _, _ in tail):
            return []
        loss_now = statistics.median(r[2] for r in tail)
        loss_noise = _noise([e[1] for e in self._evals][: -cfg.metric_evals]) or 0.0
        if loss_now <= best_loss + max(cfg.above_best_rel * abs(best_loss), cfg.metric_noise_k * loss_noise):
            # The eval loss did not get worse with it: a metric that dips alone is eval-set noise (ROUGE on 100
            # samples moves 10% between evals); a real degradation drags the loss along.
            return []
        severity = "critical" if self._critical(m, margin) else "warning"
        self._open = {"why": "metric", "metric": m.name, "severity": severity}
        return [self._regression_finding(m, step, train, severity, loss_now)]

    def _critical(self, m: _Metric, margin: float) -> bool:
        cfg = self.config
        assert m.best is not None
        best_bad, best_step, best_value = m.best[:3]
        tail = list(m.recent)[-cfg.critical_evals :]
        limit = max(margin, cfg.critical_rel * abs(best_value))
        return len(tail) == cfg.critical_evals and all(
            s > best_step and m.bad(v) > best_bad + limit for s, v, _, _ in tail
        )

    def _regression_finding(
        self, m: _Metric, step: int, train: float | None, severity: str, loss_now: float
    ) -> Finding:
        cfg = self.config
        assert m.best is not None
        _, best_step, best_value, best_loss, best_train = m.best
        n = cfg.critical_evals if severity == "critical" else cfg.metric_evals
        tail = list(m.recent)[-n:]
        now = tail[-1][1]
        worse = abs(now - best_value) / abs(best_value) if best_value else None
        pct = f" ({worse:.0%} worse)" if worse is not None else ""
        values = ", ".join(f"{v:.4g} (step {s})" for s, v, _, _ in tail)
        message = (
            f"{m.name} worse than its best at {n} evals in a row: {values} against {best_value:.4g} at step "
            f"{best_step}{pct}, {m.better} is better; the eval loss went {best_loss:.4g} -> {loss_now:.4g}"
        )
        if train is not None and best_train is not None and train > best_train * 1.05:
            cause = (
                f"The train loss rose too ({best_train:.4g} -> {train:.4g}): the updates are damaging the model, most "
                "likely an LR too high for this fine-tune (check the peak LR and the warmup), or a data change."
            )
            fix = "lower the peak LR or lengthen the warmup"
        elif train is not None and best_train is not None and train < best_train:
            cause = (
                f"The train loss kept falling ({best_train:.4g} -> {train:.4g}): the model is overfitting, memorising "
                "the training set (too many epochs over little data)."
            )
            fix = "stop earlier (early stopping on this metric), add data or regularisation"
        else:
            cause = "The model is getting worse at the task."
            fix = "find what changed around that step (LR, data, settings)"
        if self._unusable(m, best_value):
            target = (
                f"No checkpoint of this run is a good rollback target: its best {m.name} was {best_value:.4g} (step "
                f"{best_step}), most of the output still wrong. Unless {m.name} means little for this data "
                "(unsegmented CJK text inflates word error rates), fix the cause and restart instead of going back."
            )
        else:
            target = (
                f"The best checkpoint by {m.name} is step {best_step} ({best_value:.4g}"
                f"{self._trainer_agrees(m, best_step)}): keep it, or roll back to it, and {fix}."
            )
            t = self._trainer
            if t.wrong and t.metric == m.name and t.step is not None:
                target += f" Not the trainer's best (step {t.step}): see the note on it."
        return Finding(
            kind=self.kind,
            severity=severity,
            step=step,
            message=message,
            hint=f"{cause} {target}",
            evidence={
                "metric": m.name,
                "values": [round(v, 6) for _, v, _, _ in tail],
                "steps": [s for s, _, _, _ in tail],
                "best": best_value,
                "best_step": best_step,
                "eval_loss_at_best": round(best_loss, 5),
                "eval_loss_now": round(loss_now, 5),
            },
        )

    def _resume_jump(self, step: int, loss: float, prev: tuple[int, float, float | None, int], attempt: int) -> list:
        cfg = self.config
        jump = loss - prev[1]
        if jump <= self._margin(prev[1], cfg.resume_jump_rel, cfg.resume_jump_abs):
            return []
        self._open = {"ref": prev[1], "why": "resume"}
        return self._opened(
            Finding(
                kind=self.kind,
                severity="warning",
                step=step,
                message=(
                    f"eval loss {loss:.4g} at step {step}, the first eval after the resume (attempt {attempt}), "
                    f"is {jump:+.3g} above the last one before it ({prev[1]:.4g} at step {prev[0]})"
                ),
                hint=(
                    "The resumed model is worse than the one that was checkpointed: check that the right checkpoint "
                    "was loaded (path, step), that all weights and the optimizer state were restored, and that the "
                    "tokenizer, world size and batch are unchanged (see bad_resume findings around the resume)."
                ),
                evidence={"eval_loss": loss, "before_resume": prev[1], "before_step": prev[0], "attempt": attempt},
            ),
            loss,
        )

    # -- an open finding -----------------------------------------------------------------------------

    def _follow(self, step: int, loss: float, train: float | None) -> list[Finding]:
        assert self._open is not None
        why = self._open["why"]
        if why == "metric":
            return self._follow_metric(step, train)
        if why == "calibration":
            m = self._metrics.get(self._open["metric"])
            if m is not None and m.last_step == step:
                found = self._metric_regression(m, step, train)
                if found:
                    return found  # the task metric turned too: now it is a regression
        cfg = self.config
        ref = self._open["ref"]
        if loss <= ref + self._margin(ref, cfg.above_best_rel, cfg.min_rise_abs) / 2:
            self._open = None
            return [
                self.resolve(
                    step,
                    f"eval loss back to {loss:.4g} at step {step} (reference {ref:.4g})",
                    "The eval regression has cleared.",
                    {"eval_loss": loss, "reference": ref},
                )
            ]
        first = self._open.get("finding")
        if first is not None and loss > self._open["peak"]:
            # worse than at any eval since it opened: the regression goes on, and its extent with it
            self._open["peak"] = loss
            return [
                Finding(
                    self.kind,
                    first.severity,
                    step,
                    f"{first.message}; worse since: {loss:.4g} at step {step}",
                    first.hint,
                    {**first.evidence, "worst_eval": loss, "worst_step": step},
                )
            ]
        if why == "calibration":
            m = self._metrics.get(self._open["metric"])
            if m is not None and m.last_step == step and self._best_now(m)[0] != self._open["metric_best_step"]:
                rise = self._loss_rise(step, loss, train) or self._open_rise(loss, train)
                if rise is not None:
                    return [self._calibration(m, step, loss, rise)]  # the best checkpoint to keep moved
        return []

    def _open_rise(self, loss: float, train: float | None) -> dict[str, Any] | None:
        """The evidence of an eval loss still above its best (for an update of the open over-confidence note)."""
        if self._best is None:
            return None
        best_step, best, best_train, _ = self._best
        return {
            "eval_losses": [round(e[1], 5) for e in list(self._evals)[-self.config.rising_evals - 1 :]],
            "eval_steps": [e[0] for e in list(self._evals)[-self.config.rising_evals - 1 :]],
            "best_eval": best,
            "best_step": best_step,
            "train_at_best": round(best_train, 5) if best_train is not None else None,
            "train_now": round(train, 5) if train is not None else None,
        }

    def _follow_metric(self, step: int, train: float | None) -> list[Finding]:
        assert self._open is not None
        m = self._metrics.get(self._open["metric"])
        if m is None or m.last_step != step or m.best is None:
            return []
        now = m.recent[-1][1]
        margin = self._metric_margin(m)
        if m.bad(now) <= m.best[0] + margin / 2:
            self._open = None
            return [
                self.resolve(
                    step,
                    f"{m.name} back to {now:.4g} at step {step} (best {m.best[2]:.4g} at step {m.best[1]})",
                    "The eval regression has cleared.",
                    {"metric": m.name, "value": now, "best": m.best[2]},
                )
            ]
        if self._open.get("severity") != "critical" and self._critical(m, margin):
            self._open["severity"] = "critical"
            loss_now = statistics.median(r[2] for r in list(m.recent)[-self.config.critical_evals :])
            return [self._regression_finding(m, step, train, "critical", loss_now)]
        return []
