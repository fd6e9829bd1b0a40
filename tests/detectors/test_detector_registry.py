"""A detector owns every fact about itself (issue 25): adding one is adding its module.

The contract test writes a toy detector as one module in a temporary folder on the detectors package's
path, in a fresh interpreter (the registry is read when the package loads), and follows it through the
configuration, the engine, the post-mortem's ordering and the plots. The other tests hold every real
detector to the same declarations, and the derived orders to the ones the daemon had before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import trainmon.monitor.detectors as detectors_package
from trainmon.monitor.analysis import plots, verdict
from trainmon.monitor.config import DetectorsConfig
from trainmon.monitor.detectors import ALL_DETECTORS, PLOTS, localised_kinds

ROOT = Path(__file__).resolve().parents[2]

# The orders as they were hard-coded before the detectors declared them: the regression reference.
PRIORITY_BEFORE = (
    "nan_inf",
    "loss_spike",
    "divergence",
    "eval_regression",
    "degenerate",
    "bad_resume",
    "init_loss",
    "hang",
    "throughput_collapse",
    "straggler",
    "lr_schedule_drift",
    "loss_scale_collapse",
    "memory_leak",
    "grad_explosion",
    "instability_precursor",
    "node_health",
)
ENGINE_ORDER_BEFORE = (
    "nan_inf",
    "lr_schedule_drift",
    "bad_resume",
    "throughput_collapse",
    "straggler",
    "hang",
    "node_health",
    "memory_leak",
    "loss_spike",
    "grad_explosion",
    "instability_precursor",
    "divergence",
    "init_loss",
    "loss_scale_collapse",
    "eval_regression",
    "replica_divergence",
    "loss_noise",
    "degenerate",
)
PLOTS_BEFORE = {
    "loss": {
        "nan_inf",
        "loss_spike",
        "divergence",
        "eval_regression",
        "degenerate",
        "bad_resume",
        "init_loss",
        "loss_scale_collapse",
        "instability_precursor",
    },
    "grad": {"grad_explosion", "loss_spike", "nan_inf", "divergence"},
    "lr": {"lr_schedule_drift", "bad_resume"},
    "throughput": {"throughput_collapse", "straggler", "hang"},
}
LOCALISED_BEFORE = {"loss_spike", "grad_explosion", "nan_inf", "divergence"}
HELPERS = {"base", "rolling", "intermittent", "anchors", "batch", "quiet"}
FACTS = ("kind", "config_class", "order", "priority", "plots", "localised")

TOY = '''
"""A toy detector: a non-finite loss, or one above its threshold."""

from dataclasses import dataclass

from trainmon.monitor.detectors.base import Detector, Finding, finite


@dataclass
class ToyConfig:
    threshold: float = 100.0


class Toy(Detector):
    kind = "toy"
    config_class = ToyConfig
    order = 1000
    priority = 5  # ahead of nan_inf (10): it heads an incident they share
    plots = ("throughput",)
    localised = False

    def __init__(self, config: ToyConfig) -> None:
        self.config = config

    def observe(self, event, attempt):
        loss = event.fields.get("loss") if event.kind == "step" else None
        if loss is None or (finite(loss) and loss <= self.config.threshold):
            return []
        return [Finding(self.kind, "warning", event.fields["step"], "toy fired", "toy hint", {"loss": loss})]
'''

SCRIPT = """
import importlib.util, json, sys

# The detectors package, loaded with the toy's folder on its path before its discovery runs.
spec = importlib.util.find_spec("trainmon.monitor.detectors")
spec.submodule_search_locations.append(sys.argv[1])
package = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = package
spec.loader.exec_module(package)

from trainmon.monitor.analysis import plots, verdict
from trainmon.monitor.analysis.postmortem import analyse
from trainmon.monitor.collector.engine import Engine
from trainmon.monitor.collector.ingest import Ingestor
from trainmon.monitor.collector.live import LiveState
from trainmon.monitor.config import ConfigError, load_config
from trainmon.monitor.store.storage import Storage
from trainmon.wire import validate_batch
from tests.events import batch, step_events

out = {"discovered": [cls.kind for cls in package.ALL_DETECTORS]}
config = load_config(sys.argv[2])
out["threshold"] = config.detectors.toy.threshold
try:
    load_config(sys.argv[3])
except ConfigError as exc:
    out["bad_field"] = str(exc)

storage = Storage(sys.argv[4])
ingestor = Ingestor(storage, Engine(storage, config.detectors), LiveState())
# Losses fall from 4.1; at step 30 they turn NaN: nan_inf and the toy both fire there.
ingestor.ingest(validate_batch(batch(step_events(40, loss=lambda i: 4.1 - 0.01 * i if i < 30 else "NaN"))))
analysis = analyse(storage, "r1")
out["anomalies"] = [[a["kind"], a["first_step"], a["level"]] for a in analysis.summary["anomalies"]]
out["priority"] = list(verdict.PRIORITY)
labels = {}
for name, draw in (("loss", plots.plot_loss), ("throughput", plots.plot_throughput)):
    figure = draw(analysis)
    labels[name] = [t.get_text() for t in figure.axes[0].texts]
out["labels"] = labels
storage.close()
print(json.dumps(out))
"""


def test_a_new_detector_module_is_discovered_configured_run_ordered_and_plotted(tmp_path: Path) -> None:
    toy_dir = tmp_path / "more_detectors"
    toy_dir.mkdir()
    (toy_dir / "toy.py").write_text(textwrap.dedent(TOY))
    good = tmp_path / "good.toml"
    good.write_text("[detectors.toy]\nthreshold = 50\n")
    bad = tmp_path / "bad.toml"
    bad.write_text('[detectors.toy]\nthreshold = "high"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(toy_dir), str(good), str(bad), str(tmp_path / "db.sqlite")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])

    assert out["discovered"] == [*ENGINE_ORDER_BEFORE, "toy"]  # its order (1000) puts it last
    assert out["threshold"] == 50.0  # the [detectors.toy] section, an int read as the float field
    assert out["bad_field"] == "detectors.toy.threshold: expected float, got 'high'"
    # The engine ran it and stored its finding; the post-mortem lists it first in the incident it shares
    # with nan_inf (its priority 5 is ahead of nan_inf's), nan_inf under it.
    assert out["anomalies"][:2] == [["toy", 30, 1], ["nan_inf", 30, 2]]
    assert out["priority"] == ["toy", *PRIORITY_BEFORE]
    # It is marked (and, heading the verdict, labelled) on the plot it declared, not on the others.
    assert any("toy" in label for label in out["labels"]["throughput"])
    assert not any("toy" in label for label in out["labels"]["loss"])


def test_every_detector_declares_its_facts_on_its_own_class() -> None:
    fields = {f.name: f for f in dataclasses.fields(DetectorsConfig)}
    for cls in ALL_DETECTORS:
        missing = [fact for fact in FACTS if fact not in vars(cls)]
        assert not missing, f"{cls.__name__} does not declare {missing}"
        assert dataclasses.is_dataclass(cls.config_class) and cls.config_class.__module__ == cls.__module__
        assert fields[cls.kind].type is cls.config_class
        assert isinstance(cls.order, int) and (cls.priority is None or isinstance(cls.priority, int))
        assert set(cls.plots) <= set(PLOTS) and isinstance(cls.localised, bool)
    assert len({cls.order for cls in ALL_DETECTORS}) == len(ALL_DETECTORS)
    ranked = [cls.priority for cls in ALL_DETECTORS if cls.priority is not None]
    assert len(set(ranked)) == len(ranked)


def test_every_module_but_the_helpers_is_a_detector() -> None:
    modules = {info.name for info in pkgutil.iter_modules(detectors_package.__path__)}
    assert {cls.__module__.rsplit(".", 1)[1] for cls in ALL_DETECTORS} == modules - HELPERS


def test_derived_orders_are_the_ones_hard_coded_before() -> None:
    assert tuple(cls.kind for cls in ALL_DETECTORS) == ENGINE_ORDER_BEFORE
    assert verdict.PRIORITY == PRIORITY_BEFORE
    derived = {
        "loss": plots.LOSS_KINDS,
        "grad": plots.GRAD_KINDS,
        "lr": plots.LR_KINDS,
        "throughput": plots.THROUGHPUT_KINDS,
    }
    assert {name: set(kinds) for name, kinds in derived.items()} == PLOTS_BEFORE
    assert set(localised_kinds()) == LOCALISED_BEFORE


def test_kinds_without_a_priority_sort_after_the_ranked_ones_as_before() -> None:
    """loss_noise and replica_divergence had no place in the list: they tie after every listed kind."""
    unranked = {cls.kind for cls in ALL_DETECTORS if cls.priority is None}
    assert unranked == set(ENGINE_ORDER_BEFORE) - set(PRIORITY_BEFORE) == {"loss_noise", "replica_divergence"}
    found = [
        {"kind": "loss_noise", "rank": 0, "first_step": 5, "last_step": 5, "id": 1},
        {"kind": "node_health", "rank": 0, "first_step": 5, "last_step": 5, "id": 2},
        {"kind": "replica_divergence", "rank": 0, "first_step": 5, "last_step": 5, "id": 3},
    ]
    assert [a["kind"] for a in verdict.clusters(found)[0]] == ["node_health", "loss_noise", "replica_divergence"]
