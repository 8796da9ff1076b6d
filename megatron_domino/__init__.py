"""megatron-domino: hide Megatron-Core tensor-parallel communication behind computation.

The package root is the Domino library (see README's "Layout" for the walk through it); the
subpackages are what runs it: ``harness`` (Megatron-Core on CPUs, launch, model building),
``analysis`` (what a recorded schedule or a comparison means), ``training`` (the body of
``pretrain_gpt_domino.py``), ``data`` (data preparation) and ``tools`` (the commands). Imports
point down only: the library imports none of them.

``import megatron_domino`` loads only the configuration (no torch); :func:`apply_domino` and
:class:`DominoHandle` are loaded when first used.
"""

from megatron_domino.config import (
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
