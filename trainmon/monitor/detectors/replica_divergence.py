"""``replica_divergence``: data-parallel replicas whose weights part, or tensor-parallel shards that are alike.

Every few steps each rank sends a checksum of the weights the step starts from
(``trainmon.hooks.checksum``: an exact integer sum of the weights' bit patterns and their sum of
squares). The detector lines the ranks up at the same step and groups them by the run's declared
layout (``run_start.layout``, Megatron-LM's rank order; none declared: every rank is a replica):

- replicas (same tensor- and pipeline-parallel position) must agree. DDP replicas are bitwise
  identical, so the bits are compared exactly by default (``rtol`` allows a relative difference of
  the sums of squares instead). A group is checked only once it has agreed in the current attempt:
  DDP broadcasts rank 0's weights at construction, so replicas agree from the first step, and ranks
  that never agreed hold different layers or shards (a model-parallel job without a declared
  layout), not drifted replicas. With three or more replicas the minority is named against the
  majority, one anomaly per odd rank. Two replicas have no majority: the run-level anomaly names
  both, and one of them only when its weight norm jumped between two checks while the other's
  followed the group's usual change.
- shards of one tensor-parallel group must differ: at the first check of every attempt, ranks of
  one group holding identical weights were initialised from the same seed. Skipped when a rank
  left sharded (DTensor, FSDP, ZeRO-3) parameters out of its checksum: those are the TP shards.

FSDP/ZeRO-3 shards are never compared: the hooks leave sharded parameters out, so those ranks
compare only what they hold in full. An open finding follows the condition (its difference and
severity are updated as they grow) and resolves when the ranks agree again (e.g. after a restart
from a checkpoint).
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any

from trainmon.monitor.detectors.base import Detector, Finding
from trainmon.monitor.detectors.quiet import observe_quiet, steps_without
from trainmon.wire import Event

__all__ = ["ReplicaDivergence", "ReplicaDivergenceConfig"]

_QUIET_UNTIL = steps_without("weights_checksum")


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


_Checksum = tuple[float, float, float, float]  # bits 0-23, bits 24-47, sum of squares, parameters left out

_REPLICA_HINT = (
    "Data-parallel replicas must hold bitwise-identical weights. Look for: a rank-local write to the weights "
    "(code that runs on one rank only, a hook, a manual load), parameters updated outside the all-reduce "
    "(requires_grad toggled on one rank, parameters DDP does not see, a second optimizer), different kernels or "
    "library versions on one node (mixed GPU types: then set replica_divergence.rtol), or silent data corruption "
    "(ECC errors on that node's GPU). A checkpoint saved by an odd rank holds its weights: restart from one saved "
    "at or before step {agreed}, the last check where the replicas agreed."
)
_SHARD_HINT = (
    "Tensor-parallel ranks must initialise their shards from different random streams: offset the seed of the "
    "model-parallel RNG by the tensor-parallel rank (Megatron-LM: model_parallel_cuda_manual_seed(seed); plain "
    "torch: torch.manual_seed(seed + tp_rank) before building the sharded layers) or initialise the full weight "
    "once and shard it. With identical shards the layers compute correlated copies and the run trains a smaller "
    "model without any error. If these ranks are data-parallel replicas, the declared layout is wrong."
)


def _fmt(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _norm(c: _Checksum) -> float:
    return math.sqrt(max(c[2], 0.0))


class ReplicaDivergence(Detector):
    """Ranks' weight checksums at the same step, grouped into replicas and shards by the declared layout."""

    kind = "replica_divergence"
    config_class = ReplicaDivergenceConfig
    order = 160
    priority = None
    plots = ()
    localised = False
    consumes = frozenset(("run_start", "step"))
    scope = "run"

    def __init__(self, config: ReplicaDivergenceConfig) -> None:
        self.config = config
        self._world = 0
        self._layout: dict[str, int] | None = None
        self._attempt = -1  # the attempt whose checks are being judged
        self._first_check = True  # the attempt's first complete check is still to come (shards are checked there)
        self._pending: dict[tuple[int, int], dict[int, _Checksum]] = {}
        self._agreed: dict[tuple[int, ...], collections.deque[tuple[int, float]]] = {}  # group -> (step, sum sq)
        self._odd: dict[int, dict[str, Any]] = {}  # rank -> evidence of its open anomaly
        self._ties: dict[tuple[int, ...], dict[str, Any]] = {}  # replica groups without a majority
        self._alike: dict[tuple[int, ...], dict[str, Any]] = {}  # tensor-parallel groups with identical shards
        self._run_open: dict[str, Any] | None = None  # what the run-level anomaly last said

    def observe(self, event: Event, attempt: int) -> list[Finding]:
        f = event.fields
        kind = event.kind
        if kind == "step":
            return self._on_step(event, f, attempt) if "weights_checksum" in f else []
        if kind == "run_start":
            if attempt > self._attempt:
                self._new_attempt(attempt)
            self._world = max(self._world, int(f.get("world_size") or 0), event.rank + 1)
            layout = f.get("layout")
            if isinstance(layout, dict):
                self._layout = {k: v for k, v in layout.items() if isinstance(v, int) and v > 0}
        return []

    def observe_batch(self, events: list[Event], attempts: list[int], out: list[list[Finding]]) -> None:
        """A step without a weights checksum is quiet (:mod:`.quiet`)."""
        observe_quiet(self.observe, events, attempts, out, _QUIET_UNTIL)

    def _on_step(self, event: Event, f: dict[str, Any], attempt: int) -> list[Finding]:
        raw = f.get("weights_checksum")
        if (
            not isinstance(raw, list)
            or len(raw) != 4
            or not all(isinstance(v, float) and math.isfinite(v) for v in raw)
        ):
            return []  # none this step, or non-finite weights (nan_inf's business)
        self._world = max(self._world, event.rank + 1)
        key = (attempt, f["step"])
        row = self._pending.setdefault(key, {})
        row[event.rank] = (raw[0], raw[1], raw[2], raw[3])
        if len(self._pending) > self.config.max_pending:
            del self._pending[min(self._pending)]
        if len(row) < self._world:
            return []
        del self._pending[key]
        if attempt < self._attempt:
            return []  # a late row of an attempt already replaced
        if attempt > self._attempt:
            self._new_attempt(attempt)
        return self._judge(f["step"], row)

    def _new_attempt(self, attempt: int) -> None:
        """Replicas must agree afresh after a restart; tensor-parallel shards are checked again."""
        self._attempt = attempt
        self._agreed.clear()
        self._first_check = True

    # -- judging one step ------------------------------------------------------------------------

    def _groups(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(replica groups, tensor-parallel groups) of the world, by the declared layout when it fits."""
        world = self._world
        lay = self._layout or {}
        tp, pp = lay.get("tp", 1), lay.get("pp", 1)
        dp = lay.get("dp", world // (tp * pp) if world % (tp * pp) == 0 else 0)
        if tp * dp * pp != world:
            tp, dp, pp = 1, world, 1  # no usable layout: every rank is a replica of the others
        replicas: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        shards: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        for r in range(world):
            t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
            replicas[(t, p)].append(r)
            shards[(d, p)].append(r)
        return [tuple(g) for g in replicas.values()], [tuple(g) for g in shards.values()]

    def _judge(self, step: int, row: dict[int, _Checksum]) -> list[Finding]:
        replicas, shards = self._groups()
        out: list[Finding] = []
        for group in replicas:
            if len(group) > 1 and all(r in row for r in group):
                out += self._judge_replicas(group, step, row)
        if self._first_check:
            self._first_check = False
            self._alike.clear()
            for group in shards:
                if len(group) > 1 and all(r in row for r in group):
                    self._judge_shards(group, step, row)
        out += self._run_level(step)
        return out

    def _same(self, a: _Checksum, b: _Checksum) -> bool:
        if a[0] == b[0] and a[1] == b[1]:
            return True
        rtol = self.config.rtol
        return rtol > 0 and abs(a[2] - b[2]) <= rtol * max(abs(a[2]), abs(b[2]))

    def _clusters(self, group: tuple[int, ...], row: dict[int, _Checksum]) -> list[list[int]]:
        """Ranks with agreeing checksums, largest cluster first (ties: the one holding the lowest rank)."""
        clusters: list[list[int]] = []
        for r in group:
            for c in clusters:
                if self._same(row[c[0]], row[r]):
                    c.append(r)
                    break
            else:
                clusters.append([r])
        return sorted(clusters, key=lambda c: (-len(c), c[0]))

    def _judge_replicas(self, group: tuple[int, ...], step: int, row: dict[int, _Checksum]) -> list[Finding]:
        out: list[Finding] = []
        clusters = self._clusters(group, row)
        history = self._agreed.get(group)
        if len(clusters) == 1:
            history = self._agreed.setdefault(group, collections.deque(maxlen=self.config.history))
            history.append((step, row[group[0]][2]))
            self._ties.pop(group, None)
            for r in group:
                if self._odd.pop(r, None) is not None:
                    out.append(self._resolved(r, step, f"rank {r}'s weights agree with its replicas again"))
            return out
        if not history:
            return out  # never agreed in this attempt: not replicas of one another (an undeclared layout)
        agreed_step = history[-1][0]
        majority = clusters[0]
        if 2 * len(majority) > len(group):
            self._ties.pop(group, None)
            ref = _norm(row[majority[0]])
            for r in group:
                if r in majority:
                    if self._odd.pop(r, None) is not None:
                        out.append(self._resolved(r, step, f"rank {r}'s weights agree with the majority again"))
                    continue
                rel = abs(_norm(row[r]) - ref) / ref if ref > 0 else math.inf
                previous = self._odd.get(r)
                since = previous["first_step"] if previous else step
                evidence = {
                    "check": "replicas_differ",
                    "rank": r,
                    "replica_group": list(group),
                    "majority": majority,
                    "first_step": since,
                    "last_agreed_step": previous["last_agreed_step"] if previous else agreed_step,
                    "step": step,
                    "rel_norm_diff": rel,
                    "norm": _norm(row[r]),
                    "majority_norm": ref,
                }
                if previous is None or self._grew(previous, evidence):
                    self._odd[r] = evidence
                    out.append(self._rank_finding(r, step, evidence))
            return out
        for r in group:  # no majority: the run-level anomaly names the group
            if self._odd.pop(r, None) is not None:
                out.append(self._resolved(r, step, f"rank {r} is now part of a replica group without a majority"))
        norms = [_norm(row[r]) for r in group]
        top = max(norms)
        previous = self._ties.get(group)
        tie = {
            "check": "replicas_differ",
            "replica_group": list(group),
            "clusters": clusters,
            "first_step": previous["first_step"] if previous else step,
            "last_agreed_step": previous["last_agreed_step"] if previous else agreed_step,
            "step": step,
            "rel_norm_diff": (top - min(norms)) / top if top > 0 else math.inf,
            "likely_rank": previous["likely_rank"] if previous else self._jumped(group, step, row),
        }
        if previous is None or self._grew(previous, tie):
            self._ties[group] = tie
        return out

    def _jumped(self, group: tuple[int, ...], step: int, row: dict[int, _Checksum]) -> int | None:
        """With two replicas: the one whose norm jumped since the last agreement while the other's followed the
        group's usual change between checks; None when that is not clear."""
        history = self._agreed[group]
        if len(group) != 2 or len(history) < 3:
            return None
        points = list(history)
        usual = statistics.median(abs(b[1] - a[1]) / max(1, b[0] - a[0]) for a, b in itertools.pairwise(points))
        last_step, last = points[-1]
        moves = {r: abs(row[r][2] - last) / max(1, step - last_step) for r in group}
        jumped = [r for r in group if moves[r] > 0 and moves[r] > self.config.jump_factor * usual]
        calm = [r for r in group if moves[r] <= 3 * usual]
        return jumped[0] if len(jumped) == 1 and len(calm) == 1 else None

    def _judge_shards(self, group: tuple[int, ...], step: int, row: dict[int, _Checksum]) -> None:
        if any(row[r][3] > 0 for r in group):
            return  # sharded parameters left out: the checksums hold only what the shards share
        alike = [c for c in self._clusters_exact(group, row) if len(c) > 1]
        if alike:
            self._alike[group] = {
                "check": "shards_identical",
                "tp_group": list(group),
                "identical": alike,
                "step": step,
            }

    @staticmethod
    def _clusters_exact(group: tuple[int, ...], row: dict[int, _Checksum]) -> list[list[int]]:
        by_value: dict[tuple[float, float, float], list[int]] = collections.defaultdict(list)
        for r in group:
            by_value[row[r][:3]].append(r)
        return list(by_value.values())

    def _grew(self, previous: dict[str, Any], now: dict[str, Any]) -> bool:
        """Worth an update of the open anomaly: the difference doubled or crossed into critical."""
        return now["rel_norm_diff"] > 2 * previous["rel_norm_diff"] or (
            self._severity(now["rel_norm_diff"]) != self._severity(previous["rel_norm_diff"])
        )

    def _severity(self, rel: float) -> str:
        return "critical" if rel >= self.config.critical_rel_diff else "warning"

    # -- findings ----------------------------------------------------------------------------------

    def _rank_finding(self, rank: int, step: int, ev: dict[str, Any]) -> Finding:
        others = [r for r in ev["replica_group"] if r != rank]
        return Finding(
            kind=self.kind,
            severity=self._severity(ev["rel_norm_diff"]),
            step=step,
            message=(
                f"rank {rank}'s weights differ from its data-parallel replicas (ranks {_fmt(ev['majority'])} agree) "
                f"since step {ev['first_step']} (identical at step {ev['last_agreed_step']}); weight norm "
                f"{ev['norm']:.6g} vs {ev['majority_norm']:.6g}, {ev['rel_norm_diff']:.2g} relative"
                + (
                    f"; {len(others) - len(ev['majority'])} other replica(s) differ too"
                    if len(others) > len(ev["majority"])
                    else ""
                )
            ),
            hint=_REPLICA_HINT.format(agreed=ev["last_agreed_step"]) + f" Start with rank {rank}'s node.",
            evidence=ev,
            rank=rank,
        )

    def _resolved(self, rank: int, step: int, message: str) -> Finding:
        return self.resolve(step, message, "No action needed.", {"rank": rank}, rank=rank)

    def _run_level(self, step: int) -> list[Finding]:
        """One run-level anomaly for what names no single rank: replica groups without a majority, alike shards."""
        conditions = [*self._ties.values(), *self._alike.values()]
        if not conditions:
            if self._run_open is None:
                return []
            self._run_open = None
            return [
                self.resolve(
                    step, "the ranks' weights are as the layout expects again", "No action needed.", {}, rank=-1
                )
            ]
        severity = "warning"
        parts, hints = [], []
        for c in self._ties.values():
            severity = max(severity, self._severity(c["rel_norm_diff"]), key=("warning", "critical").index)
            text = (
                f"data-parallel replicas {_fmt(c['replica_group'])} hold different weights since step "
                f"{c['first_step']} (identical at step {c['last_agreed_step']}), with no majority to tell the odd "
                f"one; weight norms differ by {c['rel_norm_diff']:.2g} relative"
            )
            if c["likely_rank"] is not None:
                text += (
                    f"; rank {c['likely_rank']}'s norm jumped between two checks while the other followed the usual "
                    f"change: rank {c['likely_rank']} is the likely odd one"
                )
            parts.append(text)
            hints.append(_REPLICA_HINT.format(agreed=c["last_agreed_step"]))
        lay = self._layout or {}
        if self._alike:
            alike = [g for c in self._alike.values() for g in c["identical"]]
            where = "one tensor-parallel group" if len(alike) == 1 else "tensor-parallel groups"
            parts.append(
                f"ranks {'; '.join(map(_fmt, alike))} are declared shards of {where} (tp={lay.get('tp', 1)}) but "
                f"start from identical weights at step {min(c['step'] for c in self._alike.values())}: they were "
                "initialised from the same seed"
            )
            hints.append(_SHARD_HINT)
        message = "; ".join(parts)
        state = {"message": message, "severity": severity}
        if state == self._run_open:
            return []
        self._run_open = state
        return [
            Finding(
                kind=self.kind,
                severity=severity,
                step=step,
                message=message,
                hint=" ".join(dict.fromkeys(hints)),
                evidence={"conditions": conditions, "layout": dict(lay) or None},
                rank=-1,
            )
        ]
