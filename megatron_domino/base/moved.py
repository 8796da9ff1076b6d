"""Module paths that moved in the house layout of 2026-12-03, kept importable for one release.

A script written against the old layout (a Megatron-LM ``pretrain_gpt.py`` patched before the
move imports ``megatron_domino.megatron_lm``; a command line passes ``--spec
megatron_domino.te_spec te_norms_apart_block_spec``) keeps working: the old module is a thin
alias that warns once, naming the new path, and puts the new module in its place, so that
every name of the new one is found under the old path. Docs: ``docs/log.md``.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["MOVED", "redirect"]

#: Old dotted module name -> where it lives now.
MOVED = {
    "megatron_domino.megatron_lm": "megatron_domino.training.megatron_lm",
    "megatron_domino.te_spec": "megatron_domino.specs.te_spec",
    "megatron_domino.harness.cpu_specs": "megatron_domino.specs.cpu_specs",
}


def redirect(old: str) -> None:
    """Called by the alias module ``old`` as it is imported: warn (a ``FutureWarning``, shown
    by default) and make ``old`` the module it moved to. Python then hands out that module
    for ``old``, so the alias runs, and warns, once per process."""
    new = MOVED[old]
    warnings.warn(
        f"{old} moved to {new} (2026-12-03); the old path goes in the next release: use {new}.",
        FutureWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
