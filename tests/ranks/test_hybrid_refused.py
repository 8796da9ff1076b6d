"""Megatron-Core 0.19's ``HybridModel`` (``--hybrid-layer-pattern``), which Domino does not run
yet (issue 38), is refused by name with what to run instead, not with a count of transformer
blocks. Built as Megatron-LM's ``pretrain_hybrid.py`` builds it, from Megatron-Core's own hybrid
stack spec (TE layers; its final norm is TE's whatever the spec), on two ranks with TE's Python
on the CPU backend. The same model class's absence is what the script's own check refuses
earlier (``tests/runs/test_pretrain_args.py``)."""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from te_models import te_options

pytestmark = pytest.mark.te


def _apply_to_a_hybrid_model() -> str:
    """The error :func:`apply_domino` raises on a ``*-*-`` HybridModel at TP = 2."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from lab.models.gpt_model import padded_vocab_size, transformer_config
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

    options = te_options(False)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(options, tensor_model_parallel_size=tp)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec,
        vocab_size=padded_vocab_size(options.vocab_size, tp),
        max_sequence_length=options.seq_length,
        hybrid_layer_pattern="*-*-",
        position_embedding_type="rope",
    )
    try:
        apply_domino(model, DominoConfig(chunks=2, backward_overlap=False))
    except DominoUnsupportedError as error:
        return str(error)
    return "applied"


def test_a_hybrid_model_is_refused_by_name_with_what_to_run_instead():
    message = run_on_ranks(_apply_to_a_hybrid_model, 2, te=True)[0]
    assert "does not run Megatron-Core's HybridModel yet" in message, message
    assert "GPTModel with the same layers" in message.replace("`", ""), message
