"""The layers read one way, and no module imports itself back (issue 25).

The package's layers, lowest first. A module may import its own layer and any layer below it, never one
above, even inside a function: a lazy import is still a dependency, and it is where cycles hide. The
neutral modules (the wire format, the LR schedules, FLOPs formulas, fingerprint comparison) are shared
by the trainer and the collector, so they import neither side; the trainer side (``hooks``) never
imports the daemon (``monitor``) and the daemon never imports the trainer.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainmon"

# Lowest first; a group is a module or package prefix under trainmon.
NEUTRAL = ("trainmon.wire", "trainmon.schedules", "trainmon.flops", "trainmon.fingerprint", "trainmon.clock")
MONITOR_LAYERS: tuple[tuple[str, ...], ...] = (
    ("trainmon.monitor.store",),
    ("trainmon.monitor.core",),
    ("trainmon.monitor.detectors",),
    ("trainmon.monitor.config",),  # assembles the detectors' sections: above them
    ("trainmon.monitor.collector",),
    ("trainmon.monitor.notify",),
    ("trainmon.monitor.importers",),
    ("trainmon.monitor.analysis",),
    ("trainmon.monitor.web", "trainmon.monitor.grafana"),
    ("trainmon.monitor.demo", "trainmon.monitor.cli", "trainmon.monitor"),
)
LOWER_LAYER = ("trainmon.monitor.store", "trainmon.monitor.core")
# The one import across the trainer/daemon split: ``trainmon demo`` is the daemon command that launches the
# reference trainer (as a subprocess), and takes its command line from the trainer package's standard-library
# module that spells it, rather than a second copy of that contract.
TRAINER_LAUNCH = {("trainmon.monitor.demo", "trainmon.reference_trainer.command")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" not in path.parts:
            yield _module_name(path), path


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The trainmon modules ``path`` imports; with ``top_level_only``, those imported when it loads
    (not inside a function, not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST]
    if top_level_only:
        nodes = []
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            nodes.extend(ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.With)) else [node])
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("trainmon")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainmon"):
            found.add(node.module)
            # `from trainmon.monitor.core import goodput` imports the submodule
            found |= {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix decides
    for rank, group in enumerate(MONITOR_LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_monitor_module_has_a_layer() -> None:
    assert [m for m, _ in _modules() if m.startswith("trainmon.monitor") and _layer(m) is None] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, path in _modules():
        for target in _imports(path, top_level_only=False):
            here, there = _layer(module), _layer(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_lower_layer_imports_no_analysis_collector_or_importers() -> None:
    above = ("trainmon.monitor.analysis", "trainmon.monitor.collector", "trainmon.monitor.importers")
    bad = [
        f"{module} -> {target}"
        for module, path in _modules()
        if _within(module, LOWER_LAYER)
        for target in _imports(path, top_level_only=False)
        if _within(target, above)
    ]
    assert bad == []


def test_trainer_and_daemon_meet_only_in_the_neutral_modules() -> None:
    bad = []
    for module, path in _modules():
        targets = _imports(path, top_level_only=False)
        if _within(module, ("trainmon.monitor",)):
            trainer = [t for t in targets if _within(t, ("trainmon.hooks", "trainmon.reference_trainer"))]
            bad += [f"{module} -> {t}" for t in trainer if (module, t) not in TRAINER_LAUNCH]
        if _within(module, ("trainmon.hooks", "trainmon.reference_trainer")):
            bad += [f"{module} -> {t}" for t in targets if _within(t, ("trainmon.monitor",))]
        if module in NEUTRAL:
            # the fingerprint facade loads the trainer's functions on first use, never at import
            loaded = _imports(path, top_level_only=True)
            bad += [f"{module} -> {t}" for t in loaded if not _within(t, NEUTRAL)]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    """Between modules, counting every import (a function's too): a cycle is two modules that cannot be
    understood, tested or moved one without the other. A package's ``__init__`` re-exporting its own
    modules is not a cycle of modules, so a package's own submodules are not edges of its ``__init__``."""
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        targets = _imports(path, top_level_only=False) - {module}
        if path.name == "__init__.py":
            targets = {t for t in targets if not t.startswith(module + ".")}
        graph[module] = {t for t in targets if not (path.name != "__init__.py" and module.startswith(t + "."))}
    assert _cycles(graph) == []


def test_the_daemon_side_imports_without_torch() -> None:
    import subprocess

    code = (
        "import sys, trainmon.monitor.web.server, trainmon.monitor.cli, trainmon.monitor.analysis.postmortem; "
        "assert not {'torch', 'trainmon.hooks'} & set(sys.modules), sorted(m for m in sys.modules if 'trainmon' in m)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("module", NEUTRAL)
def test_the_neutral_modules_import_only_the_standard_library(module: str) -> None:
    path = PACKAGE / (module.split(".", 1)[1] + ".py")
    tree = ast.parse(path.read_text())
    roots = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) - {"trainmon"} == set()
