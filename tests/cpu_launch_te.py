"""``patches/cpu_launch.py`` with Transformer Engine's own Python booted on the CPU backend
first (:mod:`te_cpu.booted`, before Megatron-Core is imported), and Megatron-Core's optimizer as
it runs without TE's GPU-only kernels: for a Megatron-LM script whose model needs TE, such as
the patched ``pretrain_hybrid.py`` (``HybridStack``'s final norm is TE's whatever the spec).

    PYTHONPATH=$MLM python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/cpu_launch_te.py $MLM/pretrain_hybrid.py <its flags>
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # te_cpu, te_models; the lab they import
    import te_cpu.booted  # noqa: F401 - before Megatron-Core
    from te_models import megatron_optimizer_without_te_kernels

    with megatron_optimizer_without_te_kernels():
        runpy.run_path(str(here.parent / "patches" / "cpu_launch.py"), run_name="__main__")
