"""GPT pretraining on Megatron-Core with Megatron-LM's flags (``pretrain_gpt_domino.py``).

One concern per module: ``arguments`` (flags and their validation), ``flops`` (Megatron-LM's
FLOP count), and the training loop, checkpointing and reporting modules it uses.
"""
