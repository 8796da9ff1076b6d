"""GPT pretraining with Megatron-LM's own loop, optionally with Domino (``pretrain_gpt_domino.py``).

Megatron-LM's ``pretrain()`` (from the ``megatron-core`` wheel's ``megatron.training``) runs
everything: flags, initialisation, model, optimizer, DDP, schedules, checkpoints, logging.
These modules only connect it: ``pretrain`` (the entry point), ``gpt_steps`` (the GPT
callbacks Megatron-LM keeps in its repository's ``pretrain_gpt.py``), ``loop_runtime`` (what
the loop needs from the wheel and without CUDA), ``loop_hooks`` and ``domino_report``
(per-iteration records and the overlap report around the loop), ``flags`` and ``parser_help``
(every flag of the project, for both entry points), ``megatron_lm`` (Domino inside Megatron-LM's
loop: what the script and the patch of ``pretrain_gpt.py`` call).
"""
