"""``python -m lab.bench``: ``make bench``'s command."""

import sys

from lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
