"""The runtime under Megatron-LM's loop: every patch applies, and all are undone on exit.

An upgrade of Megatron-LM that renames or moves a patched attribute must fail here (and at the
start of every run), not train something else: two of the CPU patches would otherwise fail
silently (no TP groups, no TP RNG seeding).
"""

import pytest
import torch
from megatron.core.datasets import utils as datasets_utils
from megatron.training import training as megatron_training

from megatron_domino.runtime.cpu_runtime import cpu_runtime_active
from megatron_domino.runtime.patch import Patch, PatchError
from megatron_domino.training.loop_runtime import (
    CPU_LOOP_PATCHES,
    WHEEL_PATCHES,
    megatron_loop_runtime,
)


def _current(patch: Patch):
    return vars(patch.owner)[patch.name]


def test_every_patch_applies_and_is_undone():
    patches = (*WHEEL_PATCHES, *CPU_LOOP_PATCHES)
    originals = [_current(p) for p in patches]
    with megatron_loop_runtime():
        assert cpu_runtime_active()
        assert all(_current(p) is p.replacement for p in patches)
        assert torch.cuda.device_count() == 1  # Megatron then builds TP groups and seeds
        datasets_utils.compile_helpers()  # the wheel's prebuilt helpers import
    assert not cpu_runtime_active()
    assert [_current(p) for p in patches] == originals


def test_a_missing_attribute_fails_loudly():
    renamed = Patch(megatron_training, "initialize_megatron_v2", None, "a renamed function")
    with pytest.raises(PatchError, match="initialize_megatron_v2"), renamed.applied():
        pass
