"""What runs Megatron-Core for Domino's tests, tools and training script: not Domino itself.

* :mod:`.cpu_runtime` (with :mod:`.patch`): Megatron-Core's CUDA assumptions mapped to the CPU;
* :mod:`.distributed`: torch.distributed and Megatron's parallel state from any launcher;
* :mod:`.ranks`: one function on N gloo ranks, a process each (the tests, the GPU check);
* :mod:`.model_options`, :mod:`.gpt_model`: a ``GPTModel`` from a few options;
* :mod:`.norms`, :mod:`.cpu_specs`: sequence-parallel norms without Apex, and the layer spec
  for Megatron-LM's ``--spec`` that uses them;
* :mod:`.settings`: the named Domino settings (``p2``, ``p2-k2``, ``sp-s2``, ...) the tests,
  the benchmark and the GPU check run.
"""
