"""``python -m trainmon`` is the ``trainmon`` command."""

import sys

from trainmon.monitor.cli import main

sys.exit(main())
