"""megatron-domino: hide Megatron-Core tensor-parallel communication behind computation.

The package root is Domino's API (:mod:`.apply`, :mod:`.plan`, :mod:`.refusals`,
:mod:`.autotune`); its folders, each importing only those below it
(``tests/unit/test_import_layers.py``): ``tools`` (the user commands) > ``training`` (the body of ``pretrain_gpt_domino.py`` and
the patch's hooks) > ``analysis`` (``--domino-report``) > the API > ``specs`` (the ``--spec``
layers) > ``engine`` (the chunked schedule) > ``communication`` (collectives in flight) >
``data``, ``runtime`` (Megatron-Core on CPUs, launch) > ``base`` (config, setting names,
recorder, version). The measurement lab lives beside the package, in ``lab/`` of a checkout.

``import megatron_domino`` loads only the configuration (no torch); :func:`apply_domino` and
:class:`DominoHandle` are loaded when first used.
"""

from megatron_domino.base.config import (
    DominoConfig,
    DominoConfigError,
    DominoUnsupportedError,
    add_domino_args,
)

__all__ = [
    "DominoConfig",
    "DominoConfigError",
    "DominoHandle",
    "DominoUnsupportedError",
    "add_domino_args",
    "apply_domino",
]


def __getattr__(name: str):
    if name in ("apply_domino", "DominoHandle"):
        from megatron_domino import apply

        return getattr(apply, name)
    raise AttributeError(f"module 'megatron_domino' has no attribute {name!r}")
