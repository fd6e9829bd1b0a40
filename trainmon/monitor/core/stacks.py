"""Where the ranks of a hung run wait: their stacks grouped by signature, the odd ones named.

In a collective hang most ranks wait in the same collective and one or a few are elsewhere (a
rank that skipped the collective, is in a dataloader, a lock, a sleep): the answer to "where is
it stuck" is the odd ones out, not a wall of 64 identical tracebacks. Ranks are grouped by the
signature of their innermost frames (file name, line, function: paths differ between nodes, so
only the file's name counts), and each group is described by the innermost frame of the
program's own code and the call it made there: "ranks 0-6 wait in all_reduce (train.py:212),
rank 7 is in before_step (faults.py:269, time.sleep)".

The odd ones are the smaller groups when one group is largest; with groups of equal size (two
ranks that differ), the ranks that are not waiting in torch's communication or autograd code
(they are where the others wait for them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["group_stacks", "hang_stacks", "rank_ranges"]

_SIGNATURE_FRAMES = 4  # innermost frames that make a signature
_SHOWN_FRAMES = 12  # innermost frames kept per group in the evidence
_SHOWN_GROUPS = 8
# Frameworks a program calls into: a frame there is where the program waits, not the program itself
# (a training package installed in site-packages is the program, so only these count).
_FRAMEWORKS = frozenset(
    ("torch", "numpy", "transformers", "accelerate", "lightning", "pytorch_lightning", "deepspeed", "megatron")
)
_WAITING = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/", "torch/cuda/streams", "torch/futures")
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; one rank -> ``"rank 5"``."""
    ranks = sorted(ranks)
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _base(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _library(frame: Mapping[str, Any]) -> bool:
    """A frame of the standard library or of a framework, not of the training program."""
    path = str(frame.get("file", "")).replace("\\", "/")
    if path.startswith("<frozen"):
        return True
    for packages in ("/site-packages/", "/dist-packages/"):
        if packages in path:
            return path.split(packages, 1)[1].split("/", 1)[0] in _FRAMEWORKS
    return "/lib/python3" in path


def _signature(frames: list[Mapping[str, Any]]) -> str:
    inner = frames[-_SIGNATURE_FRAMES:][::-1]
    return " < ".join(f"{_base(str(f.get('file', '?')))}:{f.get('line', 0)}:{f.get('function', '?')}" for f in inner)


def _describe(frames: list[Mapping[str, Any]]) -> tuple[str, bool]:
    """(where the thread is, whether it waits in communication/autograd code) for one stack."""
    if not frames:
        return "no Python frame", False
    own = next((i for i in range(len(frames) - 1, -1, -1) if not _library(frames[i])), len(frames) - 1)
    user = frames[own]
    inner = frames[own + 1 :]  # library frames the program's own code called into
    waiting = any(mark in str(f.get("file", "")).replace("\\", "/") for f in inner for mark in _WAITING)
    code = str(user.get("code") or "")
    callee = next((str(f.get("function")) for f in inner[::-1] if f"{f.get('function')}(" in code), None)
    if callee is None:
        match = _CALL.search(code)
        callee = match.group(1) if match else (str(inner[-1].get("function")) if inner else None)
    at = f"{_base(str(user.get('file', '?')))}:{user.get('line', 0)}"
    if waiting:
        return f"in {callee or user.get('function')} ({at})", True
    return f"in {user.get('function')} ({at}" + (f", {callee})" if callee else ")"), False


def group_stacks(stacks: Mapping[int, list[Mapping[str, Any]]]) -> dict[str, Any]:
    """Group ranks by stack signature. ``stacks``: rank -> frames (outermost first, as captured).

    Returns ``summary`` (one line), ``odd_ranks`` (possibly empty) and ``groups`` (largest
    first: ranks, where, whether they wait in communication, the innermost frames)."""
    by_sig: dict[str, list[int]] = {}
    for rank, frames in sorted(stacks.items()):
        by_sig.setdefault(_signature(list(frames)), []).append(rank)
    groups = []
    for sig, ranks in by_sig.items():
        frames = list(stacks[ranks[0]])
        where, waiting = _describe(frames)
        shown = [
            f"{f.get('file')}:{f.get('line')} in {f.get('function')}" + (f": {f.get('code')}" if f.get("code") else "")
            for f in frames[-_SHOWN_FRAMES:][::-1]
        ]
        groups.append({"ranks": ranks, "where": where, "waiting": waiting, "signature": sig, "frames": shown})
    groups.sort(key=lambda g: (-len(g["ranks"]), g["ranks"][0]))
    odd: list[int] = []
    if len(groups) > 1:
        if len(groups[0]["ranks"]) > len(groups[1]["ranks"]):
            odd = sorted(r for g in groups[1:] for r in g["ranks"])
        elif any(g["waiting"] for g in groups) and not all(g["waiting"] for g in groups):
            odd = sorted(r for g in groups if not g["waiting"] for r in g["ranks"])
    parts = []
    for g in groups[:_SHOWN_GROUPS]:
        many = len(g["ranks"]) > 1
        verb = ("wait" if many else "waits") if g["waiting"] else ("are" if many else "is")
        parts.append(f"{rank_ranges(g['ranks'])} {verb} {g['where']}")
    if len(groups) > _SHOWN_GROUPS:
        parts.append(f"{len(groups) - _SHOWN_GROUPS} more groups")
    summary = ", ".join(parts)
    if odd:
        summary += f"; the odd one{'s' if len(odd) > 1 else ''} out: {rank_ranges(odd)}"
    return {"summary": summary, "odd_ranks": odd, "groups": groups[:_SHOWN_GROUPS]}


def hang_stacks(anomalies: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The distinct stack groupings carried by hang anomalies, for the post-mortem and live views:
    every rank's hang of one episode carries the same grouping, so it is shown once."""
    seen: set[str] = set()
    out = []
    for a in anomalies:
        stacks = (a.get("evidence") or {}).get("stacks") if a.get("kind") == "hang" else None
        if not isinstance(stacks, dict) or not stacks.get("summary") or stacks["summary"] in seen:
            continue
        seen.add(stacks["summary"])
        out.append({"first_step": a.get("first_step"), **stacks})
    return out
