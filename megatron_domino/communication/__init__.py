"""The collectives Domino keeps in flight: :mod:`.collectives` (launch, record, wait),
:mod:`.sequence_parallel` (sequence parallelism's gathers and scatters as launch/wait pairs),
:mod:`.saved_shards` (a column linear's input shard saved and re-gathered in backward) and
:mod:`.te_fp8_inputs` (FP8 casts before Transformer Engine's gathers). Imports only
:mod:`megatron_domino.base`.
"""
