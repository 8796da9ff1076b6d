"""A one-command GPU check of Domino: ``python -m lab.gpu_check``.

For a machine with one CUDA GPU (no Transformer Engine needed, no network), in under ten
minutes, printing progress and a Markdown summary table last:

0. :mod:`~lab.gpu_check.probe`: which collectives gloo runs on CUDA tensors (two
   ranks on one GPU cannot use NCCL);
1. :mod:`~lab.gpu_check.check_equivalence`: Domino against unpatched
   Megatron-Core at TP = 2 (two processes on the GPU), loss and every gradient: fp32
   element-wise, bf16 against an fp32 reference within 1.5 x stock's own error;
2. :mod:`~lab.gpu_check.check_overlap`: collective counts and overlap from the
   event recorder with CUDA events;
3. :mod:`~lab.gpu_check.gemm`: TFLOP/s of a layer's GEMMs split into ``p`` row
   chunks and ``k`` column pieces, for the paper's shapes.

``--device cpu --quick`` runs the same code on the CPU (gloo, fp32 and bf16, tiny shapes, wall
clock) so the test suite can check the script without a GPU. Every part runs on either device,
so the check passes (exit status 0) only when each part asked for ran and passed; a skipped
part or case makes it incomplete (exit status 3). The flags are in
:mod:`~lab.gpu_check.cli`; how to read the output is in ``docs/gpu_check.md``.
"""
