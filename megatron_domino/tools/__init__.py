"""The commands (``[project.scripts]`` in ``pyproject.toml``; each also runs as
``python -m megatron_domino.tools.<name>``):

* ``megatron-domino-demo`` (:mod:`.demo`): ``make demo``;
* ``megatron-domino-ab-report`` (:mod:`.ab_report`): compare two runs' logs (``examples/``).

:mod:`.provenance` records commit, versions and machine beside their numbers; :mod:`.plots`
draws with matplotlib where it is installed; :mod:`.ab_logs` reads a run's logs for
:mod:`.ab_report`. The lab's commands (bench, GPU check, loss parity, activation memory) are
in ``lab/`` beside the package.
"""
