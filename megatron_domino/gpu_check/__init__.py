"""A one-command GPU check of Domino: ``python -m megatron_domino.gpu_check``.

For a machine with one CUDA GPU (no Transformer Engine needed, no network), in under ten
minutes, printing progress and a Markdown summary table last:

0. :mod:`~megatron_domino.gpu_check.probe`: which collectives gloo runs on CUDA tensors (two
   ranks on one GPU cannot use NCCL);
1. :mod:`~megatron_domino.gpu_check.check_equivalence`: Domino against unpatched
   Megatron-Core at TP = 2 (two processes on the GPU), bf16 and fp32, loss and every gradient;
2. :mod:`~megatron_domino.gpu_check.check_overlap`: collective counts and overlap from the
   event recorder with CUDA events;
3. :mod:`~megatron_domino.gpu_check.gemm`: TFLOP/s of a layer's GEMMs split into ``p`` row
   chunks and ``k`` column pieces, for the paper's shapes.

``--device cpu --quick`` runs the same code on the CPU (gloo, fp32, tiny shapes, wall clock)
so the test suite can check the script without a GPU. The flags are in
:mod:`~megatron_domino.gpu_check.cli`; how to read the output is in ``docs/gpu_check.md``.
"""
