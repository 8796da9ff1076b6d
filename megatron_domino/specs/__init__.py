"""The layer specs for Megatron-LM's ``--spec MODULE FUNCTION``:

* :mod:`.te_spec`: Transformer Engine's dense layer with its norms apart, the TE layer Domino
  runs under ``--sequence-parallel``;
* :mod:`.cpu_specs` (with :mod:`.norms`): the local spec with norms that run under sequence
  parallelism on the CPU;
* :mod:`.block_specs`: what both share.
"""
