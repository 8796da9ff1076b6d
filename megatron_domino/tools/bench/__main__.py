"""``python -m megatron_domino.tools.bench``, the same as ``megatron-domino-bench``."""

import sys

from megatron_domino.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
