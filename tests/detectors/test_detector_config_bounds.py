"""A detector setting that means nothing at 0 or below is refused, naming the field (``base.POSITIVE``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainmon.monitor.config import ConfigError, load_config
from trainmon.monitor.detectors import ALL_DETECTORS


@pytest.mark.parametrize("value", [0, -1.5])
@pytest.mark.parametrize("key", ["z", "tail_min_z"])
def test_a_loss_spike_bar_of_zero_or_less_is_refused(tmp_path: Path, key: str, value: float) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[detectors.loss_spike]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"detectors\.loss_spike\.{key}: must be greater than 0"):
        load_config(path)


def test_positive_bars_load_and_every_default_is_within_its_bounds(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[detectors.loss_spike]\nz = 4\ntail_min_z = 2.5\n")
    assert load_config(path).detectors.loss_spike.z == 4.0
    for cls in ALL_DETECTORS:
        for f in dataclasses.fields(cls.config_class):
            if f.metadata.get("positive"):
                assert getattr(cls.config_class(), f.name) > 0, (cls.kind, f.name)
