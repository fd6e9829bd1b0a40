"""One import package: everything installs under ``trainmon``, nothing generic at the top level.

A user's project with its own ``hooks/`` (a very common name) used to shadow ours:
``ImportError: cannot import name 'TrainMonitor' from 'hooks'``. These tests run the README's
imports from a directory that holds its own ``hooks``, ``monitor`` and ``reference_trainer``, and
install a real (non-editable) wheel into a fresh virtual environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
BIN = Path(sys.executable).parent

# What a user's project may well have: each of them fails loudly if anything imports it.
_SHADOWS = {
    "hooks/__init__.py": "raise ImportError('the user project hooks package was imported')\n",
    "monitor/__init__.py": "raise ImportError('the user project monitor package was imported')\n",
    "reference_trainer.py": "raise ImportError('the user project reference_trainer module was imported')\n",
}


def _shadowed_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    for rel, text in _SHADOWS.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    return project


def _readme_imports() -> list[str]:
    """Every import line of the README's Python examples."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    lines = [ln.split("#")[0].strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln.startswith(("from trainmon", "import trainmon"))]


def _env() -> dict[str, str]:
    # Nothing from the repository on the path: only what the installation provides.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_every_source_folder_is_a_package_and_the_top_level_names_lead_into_it() -> None:
    """setuptools finds packages by their ``__init__.py``: a folder of modules without one would be left out."""
    assert PYPROJECT["packages"]["find"]["include"] == ["trainmon*"]
    missing = [
        str(folder.relative_to(ROOT))
        for folder in (ROOT / "trainmon").rglob("*")
        if folder.is_dir()
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
        and "migrations" not in folder.parts  # alembic's env and revision scripts: package data, not a package
    ]
    assert not missing
    for name in ("hooks", "monitor", "reference_trainer", "dashboards", "alerts"):
        top = ROOT / name
        assert top.is_symlink() and top.resolve() == (ROOT / "trainmon" / name).resolve(), name


def test_readme_imports_use_the_trainmon_package() -> None:
    readme = (ROOT / "README.md").read_text()
    assert _readme_imports(), "the README shows no imports"
    stale = re.findall(r"^\s*(?:from|import) (?:hooks|monitor|reference_trainer)\b.*$", readme, re.M)
    assert not stale
    assert "python -m reference_trainer" not in readme


def test_a_project_with_its_own_hooks_and_monitor_is_not_shadowed(tmp_path: Path) -> None:
    project = _shadowed_project(tmp_path)
    code = "\n".join(
        [
            *_readme_imports(),
            "from trainmon import TrainMonitor, Schedule",
            "from trainmon.hf import TrainmonCallback",
            "from trainmon.lightning import TrainmonCallback",
            "from trainmon.fingerprint import state_fingerprint",
            "import sys",
            "assert not {'hooks', 'monitor', 'reference_trainer'} & set(sys.modules), sorted(sys.modules)",
            "print('ok')",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=project, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    cli = subprocess.run([BIN / "trainmon", "--help"], cwd=project, env=_env(), capture_output=True, text=True)
    assert cli.returncode == 0 and "postmortem" in cli.stdout, cli.stderr
    trainer = subprocess.run(
        [sys.executable, "-m", "trainmon.reference_trainer", "--help"],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert trainer.returncode == 0 and "--inject" in trainer.stdout, trainer.stderr


@pytest.mark.slow
def test_the_wheel_installs_trainmon_alone_and_works(tmp_path: Path) -> None:
    dist, source = tmp_path / "dist", tmp_path / "source"
    # A copy: setuptools builds in the source tree, and a build/ folder left in the checkout would go stale.
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache"),
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("trainmon-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"trainmon", next(n for n in names if ".dist-info/" in n).split("/")[0]}
    assert "trainmon/monitor/store/migrations/versions/0001_initial_schema.py" in names
    assert "trainmon/dashboards/trainmon-run.json" in names
    assert "trainmon/alerts/trainmon.rules.yml" in names

    # A fresh environment that sees the already installed dependencies (torch included) after its own packages.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "deps.pth").write_text(deps + "\n")
    install = subprocess.run(
        [venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    top = {p.name for p in site.iterdir()} - {"deps.pth"}
    assert {"hooks", "monitor", "reference_trainer"}.isdisjoint(top)

    project = _shadowed_project(tmp_path)
    code = "\n".join(
        [
            "import sys, trainmon",
            f"assert trainmon.__file__.startswith({str(site)!r}), trainmon.__file__",
            "from trainmon import TrainMonitor, Schedule",
            "from trainmon.hf import TrainmonCallback",
            "from trainmon.lightning import TrainmonCallback",
            "from trainmon.fingerprint import state_fingerprint",
            "from trainmon.monitor.store.storage import Storage",
            "from sqlalchemy import text",
            "s = Storage('w.sqlite')",  # runs the Alembic migrations shipped as package data
            "with s.connect() as c: print(c.execute(text('SELECT version_num FROM alembic_version')).scalar_one())",
            "from trainmon.monitor.grafana import load_dashboards",
            "print(len(load_dashboards()))",
        ]
    )
    out = subprocess.run([venv / "bin/python", "-c", code], cwd=project, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    version, dashboards = out.stdout.split()
    assert version and int(dashboards) == 2
    cli = subprocess.run([venv / "bin/trainmon", "--help"], cwd=project, env=_env(), capture_output=True, text=True)
    assert cli.returncode == 0 and "postmortem" in cli.stdout, cli.stderr
    for name in ("hooks", "monitor"):  # nothing generic was installed: the user's own package is what imports
        probe = subprocess.run(
            [venv / "bin/python", "-c", f"import {name}"], cwd=tmp_path, env=_env(), capture_output=True
        )
        assert probe.returncode != 0
