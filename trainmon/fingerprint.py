"""Resume and checkpoint fingerprints: how a trainer takes them and how two of them compare.

Send ``state_fingerprint(...)`` with ``TrainMonitor.checkpoint(..., fingerprint=...)`` when saving and
with ``TrainMonitor.resume(..., fingerprint=...)`` after restoring, so the collector can tell a faithful
resume from one that lost its optimizer, scheduler, RNG or data position; ``batch_fingerprint`` (a
``step_end`` field) spots replayed data.

:func:`compare_fingerprints` is shared by both sides (the collector's bad-resume check, a trainer's own
assertion), so it lives here, standard library only, beside the wire format; taking a fingerprint is
trainer-side (:mod:`trainmon.hooks.fingerprint`) and is loaded on first use, so the collector importing
this module never pulls the trainer side in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmon.hooks.fingerprint import batch_fingerprint, state_fingerprint

__all__ = ["batch_fingerprint", "compare_fingerprints", "flatten", "state_fingerprint"]


def __getattr__(name: str) -> Any:
    if name in ("batch_fingerprint", "state_fingerprint"):
        from trainmon.hooks import fingerprint

        return getattr(fingerprint, name)
    raise AttributeError(f"module 'trainmon.fingerprint' has no attribute {name!r}")


def flatten(d: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: nested records compared (or read as columns) key by key."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out


def _same(a: Any, b: Any, rel_tol: float) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, rel_tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        try:
            x, y = float(a), float(b)
        except (TypeError, ValueError):
            return bool(a == b)  # the caller tests it at once: same truth value
        if math.isnan(x) and math.isnan(y):
            return True
        return math.isclose(x, y, rel_tol=rel_tol, abs_tol=1e-12)
    return bool(a == b)


def compare_fingerprints(
    saved: Mapping[str, Any], restored: Mapping[str, Any], *, rel_tol: float = 1e-6, ignore: Iterable[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """Keys (dotted, e.g. ``optimizer.adam_step_max``) whose values differ: ``{key: (saved, restored)}``.

    Keys present on one side only are reported with ``None`` on the other. Floats compare with
    ``rel_tol``. Standard library only, for the collector's bad-resume check.
    """
    a, b = flatten(saved), flatten(restored)
    skip = set(ignore)
    diff = {}
    for key in sorted(set(a) | set(b)):
        if key in skip or any(key.startswith(s + ".") for s in skip):
            continue
        if not _same(a.get(key), b.get(key), rel_tol):
            diff[key] = (a.get(key), b.get(key))
    return diff
