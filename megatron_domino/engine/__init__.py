"""Domino's engine: the block forward that splits a batch into chunks (:mod:`.block`,
:mod:`.chunking`), the wavefront schedule over them (:mod:`.schedule`) with its state
(:mod:`.state`, :mod:`.row_output`, :mod:`.end_handoffs`), the tensor-parallel linears it runs
(:mod:`.linears`, :mod:`.te_linears`, :mod:`.column_pieces`, :mod:`.backward_overlap`,
:mod:`.placeholder_grads`), the model's two ends (:mod:`.embedding_overlap`,
:mod:`.output_head`) and the sequence split's attention (:mod:`.chunk_attention`).
It imports :mod:`megatron_domino.communication` and :mod:`megatron_domino.base` only.
"""
