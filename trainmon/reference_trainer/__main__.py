"""``python -m trainmon.reference_trainer --run NAME --steps N --out DIR [...]`` (see ``--help``)."""

from __future__ import annotations

import sys

from trainmon.hooks.policy import TrainingStopped
from trainmon.reference_trainer.config import ConfigError, config_from_args
from trainmon.reference_trainer.faults import FaultError


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
    except ConfigError as exc:
        print(f"python -m trainmon.reference_trainer: error: {exc}", file=sys.stderr)
        return 2
    from trainmon.reference_trainer.train import train  # torch is imported only once the config is valid

    try:
        status = train(cfg)
    except (ConfigError, FaultError, FileNotFoundError) as exc:
        print(f"python -m trainmon.reference_trainer: error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:  # --stop-on: the collector's finding stopped the run
        print(f"python -m trainmon.reference_trainer: {exc}", file=sys.stderr)
        return 3
    return 0 if status in ("finished", "interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
