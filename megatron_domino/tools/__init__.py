"""The commands (``[project.scripts]`` in ``pyproject.toml``; each also runs as
``python -m megatron_domino.tools.<name>``):

* ``megatron-domino-demo`` (:mod:`.demo`): ``make demo``;
* ``megatron-domino-loss-parity`` (:mod:`.loss_parity`): baseline and ``--domino`` loss curves;
* ``megatron-domino-ab-report`` (:mod:`.ab_report`): compare two runs' logs (``examples/``);
* ``megatron-domino-bench`` (:mod:`.bench`): ``make bench``;
* ``megatron-domino-gpu-check`` (:mod:`.gpu_check`): ``make gpu-check``;
* ``megatron-domino-activation-memory`` (:mod:`.activation_memory`): saved-activation bytes.

:mod:`.provenance` records commit, versions and machine beside their numbers; :mod:`.plots`
draws with matplotlib where it is installed; :mod:`.ab_logs` reads a run's logs for
:mod:`.ab_report`.
"""
