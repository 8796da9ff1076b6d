"""Importing this boots Transformer Engine on the CPU (:func:`te_cpu.boot`): the first module of
the TE ranks' fork server (``multiproc.TE_PRELOAD``), ahead of Megatron-Core."""

from te_cpu import boot

boot()
