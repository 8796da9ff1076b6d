"""The measurement lab beside the package: run from a checkout (``make bench``,
``make gpu-check``, the test suite), not installed by ``pip install .``.

* :mod:`.bench`: the A/B benchmark (``python -m lab.bench``), its emulated link, the
  DeepSpeed-Domino arm and the host-time row;
* :mod:`.gpu_check`: the one-command GPU check (``python -m lab.gpu_check``);
* :mod:`.activation_memory`, :mod:`.loss_parity`: saved-activation bytes, baseline against
  ``--domino`` loss curves;
* :mod:`.analysis`: Domino against stock (equivalence, errors), host time, capture safety,
  collective bytes;
* :mod:`.models`: a ``GPTModel`` from a few options, and the GPU check's small models;
* :mod:`.launch`: one function on N gloo ranks, a training script on ranks forked from a
  preloaded server (the test suite's launchers).
"""
