"""Entry point: ``python -m lab.gpu_check --help``."""

import sys

from lab.gpu_check.cli import main

# The guard matters: the ranks are spawned processes, which re-import this module.
if __name__ == "__main__":
    sys.exit(main())
