"""The module paths the house layout moved (2026-12-03) still import, for one release: each
old path is the new module, and importing it warns once, naming the new path
(:mod:`megatron_domino.base.moved`)."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from megatron_domino.base.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns_once(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        again = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new and again is new
    moved = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(moved) == 1 and f"{old} moved to {MOVED[old]}" in str(moved[0].message)


def test_the_old_spec_and_patch_names_resolve():
    """What old command lines and patched scripts name: ``--spec megatron_domino.te_spec
    te_norms_apart_block_spec``, ``megatron_domino.harness.cpu_specs``'s SP spec, and the
    patch's ``megatron_domino.megatron_lm``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert callable(
            importlib.import_module("megatron_domino.te_spec").te_norms_apart_block_spec
        )
        cpu_specs = importlib.import_module("megatron_domino.harness.cpu_specs")
        assert callable(cpu_specs.sequence_parallel_local_spec)
        assert hasattr(importlib.import_module("megatron_domino.megatron_lm"), "DominoModelHook")
