"""The instability precursors on ``/metrics``: one bounded series per rank (never one per layer), kept
between the sampled steps that send them (issue 28)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainmon.monitor.collector.exporter import MAX_PRECURSOR_GROUPS, TrainingCollector
from trainmon.monitor.collector.live import LiveState
from trainmon.wire import Event

SAMPLED = {
    "attn_logit_max": {"blocks.0.attn": 3.0, "blocks.1.attn": 41.5, "blocks.2.attn": "NaN"},
    "attn_entropy": {"blocks.0.attn": 2.5, "blocks.1.attn": 0.25},
    "linear_out_rms": {"blocks.0.attn.c_attn": 0.5, "blocks.0.mlp.c_proj": 7.0},
    "output_logz": 9.25,
    "output_logit_max": 31.0,
    "group_update_ratio": {"0": 1e-3, "1": 2e-4},
    "adam_eps_frac": {"0": 0.0, "1": 0.75},
}


def _scrape(live: LiveState) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(TrainingCollector(live, clock=lambda: 1000.0))
    text = generate_latest(registry).decode()
    return {
        fam.name: [(s.labels, s.value) for s in fam.samples]
        for fam in text_string_to_metric_families(text)
        if fam.samples
    }


def _step(rank: int, step: int, fields: dict) -> tuple[Event, int]:
    return Event("step", "run", rank, "node", f"s{rank}", step + 1, 990.0 + step, {"step": step, **fields}), 0


def test_a_sampled_step_exports_each_precursor_folded_per_rank_and_keeps_it_until_the_next() -> None:
    live = LiveState()
    live.apply([_step(0, 0, {"loss": 2.0, **SAMPLED}), _step(0, 1, {"loss": 1.9})])  # then an unsampled step
    m = _scrape(live)
    rank0 = {"run": "run", "rank": "0"}
    assert m["trainmon_attention_logit_bound_max"] == [(rank0, 41.5)]  # the largest finite one
    assert m["trainmon_attention_entropy_min_nats"] == [(rank0, 0.25)]
    assert m["trainmon_linear_output_rms_max"] == [(rank0, 7.0)]
    assert m["trainmon_output_logz"] == [(rank0, 9.25)] and m["trainmon_output_logit_max"] == [(rank0, 31.0)]
    assert m["trainmon_update_ratio"] == [(rank0 | {"group": "0"}, 1e-3), (rank0 | {"group": "1"}, 2e-4)]
    assert m["trainmon_adam_second_moment_below_eps_ratio"] == [
        (rank0 | {"group": "0"}, 0.0),
        (rank0 | {"group": "1"}, 0.75),
    ]
    assert m["trainmon_loss"] == [(rank0, 1.9)]  # the step gauges follow the latest step meanwhile


def test_a_run_that_sends_no_precursors_exports_none() -> None:
    live = LiveState()
    live.apply([_step(0, 0, {"loss": 2.0})])
    m = _scrape(live)
    assert "trainmon_loss" in m
    assert not [name for name in m if "attention" in name or "output_log" in name or "adam" in name]


def test_non_finite_values_are_left_to_nan_inf_and_groups_are_bounded() -> None:
    live = LiveState()
    many = {str(i): 0.5 for i in range(1000)}
    sampled = {"attn_logit_max": {"a": "NaN", "b": "Infinity"}, "group_update_ratio": many, "output_logz": math.inf}
    live.apply([_step(0, 0, sampled)])
    m = _scrape(live)
    assert "trainmon_attention_logit_bound_max" not in m
    assert len(m["trainmon_update_ratio"]) == MAX_PRECURSOR_GROUPS
    assert m["trainmon_output_logz"][0][1] == math.inf  # a scalar as sent, like the loss


def test_a_wide_run_folds_the_precursors_across_ranks() -> None:
    live = LiveState()
    live.apply([_step(r, 0, {"attn_logit_max": {"blocks.0.attn": float(r)}}) for r in range(100)])
    m = _scrape(live)
    by_rank = {labels["rank"]: v for labels, v in m["trainmon_attention_logit_bound_max"]}
    assert by_rank == {"min": 0.0, "median": 49.0, "max": 99.0}
