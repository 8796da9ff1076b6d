"""Pretrain a GPT model with Megatron-LM's own training loop, optionally with Domino.

    torchrun --nproc-per-node 8 pretrain_gpt_domino.py --tensor-model-parallel-size 8 \
        <Megatron-LM's pretrain_gpt.py flags> --domino [--domino-chunks 2 ...]
    srun --ntasks-per-node 8 python pretrain_gpt_domino.py ...        # SLURM, a task per GPU

Every flag of Megatron-LM's ``pretrain_gpt.py`` is parsed by Megatron itself, with its
meaning; ``--help`` lists them, Domino's included. See ``megatron_domino/training/pretrain.py``;
installed, the same runs as ``pretrain-gpt-domino`` or ``python -m megatron_domino.training``.
The ``__main__`` guard is required, not a formality: ``megatron.core.dist_checkpointing``
saves through a helper process started with the spawn method, which re-imports this file;
without the guard that import would start training again.
"""

if __name__ == "__main__":
    from megatron_domino.training.pretrain import main

    main()
