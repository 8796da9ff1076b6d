"""megatron-domino: hide Megatron-Core tensor-parallel communication behind computation."""

from megatron_domino.config import DominoConfig, DominoConfigError, add_domino_args

__all__ = ["DominoConfig", "DominoConfigError", "add_domino_args"]
