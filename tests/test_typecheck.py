"""The type hints hold (issue 25): mypy, with the configuration in ``pyproject.toml``, finds no error.

Its scope is the trainer side (``trainmon.hooks``), the modules both sides share (the wire format,
schedules, FLOPs and fingerprint arithmetic) and the public API. CI runs only ``make test``, so this
test is what keeps ``make lint``'s type check green there. mypy's cache stays in ``.mypy_cache``: a
first run reads torch's annotations (tens of seconds), later ones only what changed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (it is in the dev extra)")
def test_mypy_finds_no_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0, "\n".join(errors) or result.stdout + result.stderr
