"""``pretrain_gpt_domino.py`` on Transformer Engine's own Python over the CPU backend of its
extension (:mod:`te_cpu`): what the Slurm tier's job runs to train as an H100 job does (TE
layers, sequence parallelism with the norms-apart spec, FP8), as far as a CPU can.

Two things a GPU has that the CPU backend does not, arranged before Megatron-Core is imported:
TE booted (:mod:`te_cpu.booted`, so Megatron's ``HAVE_TE`` is true here), and Megatron-Core's
optimizer as it runs without TE's GPU-only FusedAdam and multi-tensor kernels (torch's AdamW and
Megatron's own multi-tensor functions, :func:`te_models.megatron_optimizer_without_te_kernels`).
The recipes run it through their ``TRAIN_SCRIPT`` knob; the ``__main__`` guard matters, as in
``pretrain_gpt_domino.py`` (the checkpoint writer's helper process re-imports this file).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # te_cpu, te_models
    import te_cpu.booted  # noqa: F401 - before Megatron-Core
    from te_models import megatron_optimizer_without_te_kernels

    from megatron_domino.training.pretrain import main

    with megatron_optimizer_without_te_kernels():
        main()
