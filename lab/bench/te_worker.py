"""The bench worker (:mod:`lab.bench.worker`) with Transformer Engine's own Python booted on
the CPU backend of its extension first, for cases whose model needs TE: a ``HybridModel``
(``pattern``), whose final norm is TE's whatever the layers. ``te_cpu`` is the checkout's
(``tests/te_cpu``); run the bench from a checkout's root, as ``python -m lab.bench``."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # te_cpu
    import te_cpu.booted  # noqa: F401 - before Megatron-Core

    from lab.bench.worker import main

    main()
