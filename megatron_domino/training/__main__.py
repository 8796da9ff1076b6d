"""``python -m megatron_domino.training``: the same as ``pretrain_gpt_domino.py``.

The ``__main__`` guard is required, not a formality: ``megatron.core.dist_checkpointing``
saves through a helper process started with the spawn method, which re-imports the main
module; without the guard that import would start training again.
"""

if __name__ == "__main__":
    from megatron_domino.training.pretrain import main

    main()
