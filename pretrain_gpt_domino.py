"""Pretrain a GPT model on Megatron-Core with Megatron-LM's flags, optionally with Domino.

    python pretrain_gpt_domino.py --num-layers 4 --hidden-size 256 ...       # one process
    torchrun --nproc-per-node 2 pretrain_gpt_domino.py --tensor-model-parallel-size 2 ...
    srun --ntasks-per-node 8 python pretrain_gpt_domino.py ...               # SLURM

``--help`` lists the flags. The ``__main__`` guard is required, not a formality:
``megatron.core.dist_checkpointing`` saves through a helper process started with the spawn
method, which re-imports this file; without the guard that import would start training again.
"""

import sys

from megatron_domino.training.pretrain import pretrain

if __name__ == "__main__":
    pretrain(sys.argv[1:])
