"""Apply Domino to a Megatron-Core GPT or hybrid model, and take it off again.

``apply_domino(model, config)`` binds Domino's ``forward`` onto *instances* of the model's
layer stack (a ``GPTModel``'s ``TransformerBlock``, a ``HybridModel``'s ``HybridStack``) and of
the layer modules :data:`megatron_domino.plan.LAYER_PLAN` names for each layer's sub-layers
(tensor-parallel linears; core attentions under the sequence split), and onto the model's two
ends where they can take part (:data:`megatron_domino.plan.MODEL_ENDS`: the embedding's
all-reduce launched per chunk, the output layer's input gradient all-reduced per chunk). The classes stay
untouched, so an unpatched model in the same process (e.g. the baseline of an A/B test) is
unaffected. No parameter is created or replaced: the schedule calls the model's own
submodules. The returned :class:`DominoHandle` reverts exactly what was bound; applying twice
raises, as does reverting twice. Everything Domino cannot run with is refused first
(:mod:`megatron_domino.refusals`), before anything is bound; FSDP wrapping the layers after
``apply_domino`` is refused at the first forward.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_domino.base.config import DominoConfig, DominoUnsupportedError
from megatron_domino.base.recorder import NULL_RECORDER, NullRecorder
from megatron_domino.base.version import check_megatron_core_version
from megatron_domino.communication.te_fp8_inputs import casts_reduce_amax
from megatron_domino.engine.block import domino_block_forward
from megatron_domino.engine.output_head import chunk_logits
from megatron_domino.engine.state import DominoRuntime
from megatron_domino.plan import (
    LAYER_SUBLAYERS,
    block_layer_kinds,
    layer_forward,
    model_end_forwards,
    targets_of,
)
from megatron_domino.refusals import model_problems, raise_problems, sharded_problems
from megatron_domino.runtime.amax_group import amax_reduction_group

__all__ = ["DominoHandle", "apply_domino"]


def _block_forward(block: TransformerBlock, *args, runtime: DominoRuntime, **kwargs):
    """Domino's block forward, refusing layers FSDP wrapped after :func:`apply_domino` (a
    library user may apply Domino first; FSDP's hooks on the layers would never run)."""
    raise_problems(sharded_problems(block))
    return domino_block_forward(block, *args, runtime=runtime, **kwargs)


def _hybrid_stack_class() -> type:
    """Megatron-Core's ``HybridStack`` (imported when asked: its module imports the TE
    extension's classes)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    return HybridStack


def _hybrid_model_class() -> type:
    """Megatron-Core's ``HybridModel`` (imported when asked, as :func:`_hybrid_stack_class`)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return HybridModel


class DominoHandle:
    """What ``apply_domino`` bound, so it can be reverted; also a context manager.

    Attributes:
        runtime: the model's :class:`~megatron_domino.engine.state.DominoRuntime` (its ``last_step``
            and ``recorder`` are what tests and the overlap report read).
    """

    def __init__(self, runtime: DominoRuntime, patched: list[torch.nn.Module]) -> None:
        self.runtime = runtime
        self._patched = patched

    def revert(self) -> None:
        """Restore every patched module's stock ``forward``."""
        if not self._patched:
            raise RuntimeError("Domino was already reverted on this model.")
        for module in self._patched:
            del module.forward
        self._patched = []

    def __enter__(self) -> DominoHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def apply_domino(
    model: torch.nn.Module, config: DominoConfig, *, recorder: NullRecorder = NULL_RECORDER
) -> DominoHandle:
    """Make ``model``'s layer stack run the Domino schedule.

    Args:
        model: a Megatron-Core ``GPTModel`` (one pipeline stage or virtual-stage chunk of
            it) built from the local or the Transformer Engine layer spec, bare or wrapped
            (DDP, Float16Module): its single ``TransformerBlock`` is found by type; or a
            ``HybridModel`` whose pattern has ``*`` and ``-`` layers only (its ``HybridStack``).
        config: the Domino settings.
        recorder: an :class:`~megatron_domino.base.recorder.EventRecorder` to record the schedule.
    Raises:
        DominoUnsupportedError: for any model feature Domino cannot run with (see the message).
        UnsupportedMegatronVersion: outside the tested Megatron-Core releases.
    """
    check_megatron_core_version()
    stack_classes = (TransformerBlock, _hybrid_stack_class())
    blocks = [m for m in model.modules() if isinstance(m, stack_classes)]
    if len(blocks) != 1:
        raise DominoUnsupportedError(
            "Domino expects exactly one layer stack in the model (a GPTModel's TransformerBlock "
            f"or a HybridModel's HybridStack), found {len(blocks)}."
        )
    block = blocks[0]
    if "forward" in vars(block):
        raise RuntimeError(
            "Domino is already applied to this model; revert the first handle "
            "before applying again."
        )
    raise_problems(model_problems(block, config))

    tp_group = block.tp_group
    runtime = DominoRuntime(config, tp_group, recorder, block.config.sequence_parallel)
    runtime.layer_sublayers = tuple(LAYER_SUBLAYERS[kind] for kind in block_layer_kinds(block))
    if casts_reduce_amax(block.config):
        runtime.amax_group = amax_reduction_group(tp_group)
    block.forward = functools.partial(_block_forward, block, runtime=runtime)
    patched = [block]
    for layer, sublayers in zip(block.layers, runtime.layer_sublayers, strict=True):
        for target in targets_of(sublayers):
            module = target.find(layer)
            forward = layer_forward(target, module, config)
            if forward is not None:
                module.forward = functools.partial(forward, module, runtime=runtime)
                patched.append(module)
    language_models = (GPTModel, _hybrid_model_class())
    models = [m for m in model.modules() if isinstance(m, language_models)]
    for end, module in model_end_forwards(models[0], config) if len(models) == 1 else []:
        module.forward = functools.partial(end.forward, module, runtime=runtime)
        patched.append(module)
        if end.attribute == "output_layer":
            runtime.head_overlap = True
            runtime.chunk_logits = functools.partial(chunk_logits, models[0])
    return DominoHandle(runtime, patched)
