"""Builders of wire-format events for tests."""

from __future__ import annotations

import time
from typing import Any


def event(
    kind: str,
    fields: dict[str, Any],
    *,
    run: str = "r1",
    rank: int = 0,
    stream: str = "s0",
    seq: int = 0,
    t: float | None = None,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "run": run,
        "rank": rank,
        "host": "test-host",
        "stream": stream,
        "seq": seq,
        "time": time.time() if t is None else t,
        "fields": fields,
    }


def step_events(
    n: int, *, start_seq: int = 1, run: str = "r1", rank: int = 0, stream: str = "s0", loss: Any = None
) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        out.append(
            event(
                "step",
                {
                    "step": i,
                    "loss": 4.1 - 0.01 * i if loss is None else loss(i),
                    "grad_norm": 1.0,
                    "grad_norm_clipped": 1.0,
                    "clip_coef": 1.0,
                    "lr": [1e-3],
                    "tokens": 512,
                    "step_time": 0.05,
                    "phases": {"data": 0.01, "forward": 0.02, "backward": 0.015, "optimizer": 0.005},
                },
                run=run,
                rank=rank,
                stream=stream,
                seq=start_seq + i,
            )
        )
    return out


def batch(events: list[dict[str, Any]], version: int = 1) -> dict[str, Any]:
    return {"version": version, "events": events}
