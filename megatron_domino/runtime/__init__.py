"""Megatron-Core where its CUDA assumptions do not hold, for the training entry point and the
lab: :mod:`.patch` (a reversible attribute patch), :mod:`.cpu_runtime` (Megatron-Core's CUDA
assumptions mapped to the CPU) and :mod:`.distributed` (torch.distributed and Megatron's
parallel state from any launcher). Imports nothing else of the package.
"""
