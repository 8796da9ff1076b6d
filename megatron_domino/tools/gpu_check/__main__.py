"""Entry point: ``python -m megatron_domino.tools.gpu_check --help``."""

import sys

from megatron_domino.tools.gpu_check.cli import main

# The guard matters: the ranks are spawned processes, which re-import this module.
if __name__ == "__main__":
    sys.exit(main())
