"""The reference trainer's command line and environment, built in one place.

``python -m trainmon.reference_trainer --run NAME --steps N --out DIR [--collector URL]
[--inject KIND@STEP[:params]]... [options]`` is a DESIGN contract; the demo, the detection
benchmark and the tests all start the trainer as a separate process this way, so the contract has
one spelling. Standard library only: the daemon side (``trainmon demo``) imports this module, and
the daemon never imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["trainer_command", "trainer_env"]

MODULE = "trainmon.reference_trainer"
# The folder holding the trainmon package (a source checkout or site-packages): the trainer
# process imports this same trainmon, whatever its working directory.
_IMPORT_ROOT = Path(__file__).resolve().parents[2]


def trainer_command(
    run: str,
    steps: int,
    out: str | os.PathLike[str],
    *,
    collector: str | None = None,
    inject: Iterable[str] = (),
    extra: Iterable[str] = (),
    ranks: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The argv of one training run: ``inject`` holds ``KIND@STEP[:params]`` specs, ``extra`` any
    further options. With ``ranks``, the run is ``ranks`` processes under ``torchrun --standalone``,
    which takes ``--run`` for its own ``--run-path``: the run id goes as ``--run-id``."""
    if ranks is None:
        cmd = [python, "-m", MODULE, "--run", run]
    else:
        launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        cmd = [*launcher, "-m", MODULE, "--run-id", run]
    cmd += ["--steps", str(steps), "--out", str(out)]
    if collector is not None:
        cmd += ["--collector", collector]
    for spec in inject:
        cmd += ["--inject", spec]
    return [*cmd, *extra]


def trainer_env(*, threads: int | None = None) -> dict[str, str]:
    """This process's environment for a trainer it starts: this trainmon first on the import path,
    and no ``RANK`` / ``WORLD_SIZE`` (inherited from an enclosing torchrun, they would make the
    trainer take itself for one rank of a larger run). ``threads`` caps OpenMP
    (``OMP_NUM_THREADS``) for runs that share the machine with others (tests, benchmarks)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_IMPORT_ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
