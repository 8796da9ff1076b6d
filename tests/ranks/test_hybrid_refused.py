"""A ``HybridModel`` layer Domino does not run yet (MoE ``E``, Mamba-2 ``M``, GDN ``G``, DeepSeek
sparse attention ``D``, MLA ``+``) is refused by its pattern symbol with the reason and what to
run instead, before anything is bound. Their modules need packages this machine lacks (Mamba's
kernels) or a GPU, so the stack is Megatron-Core's own ``*-*-`` built from its hybrid stack spec
(TE layers, TE's Python on the CPU backend) with one layer's symbol changed as a MoE layer's
would read; the same ``*-*-`` unchanged is accepted (the control)."""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from te_models import te_options

pytestmark = pytest.mark.te


def _apply_with_symbols(symbols: list[str] | None) -> str:
    """What :func:`apply_domino` says of a ``*-*-`` HybridModel at TP = 2 whose stack reads
    ``symbols`` (``None``: as built); ``"applied"`` when it binds."""
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
    if symbols is not None:
        model.decoder.layer_type_list = symbols
    try:
        with apply_domino(model, DominoConfig(chunks=2, backward_overlap=False)):
            return "applied"
    except DominoUnsupportedError as error:
        return str(error)


def test_a_layer_domino_does_not_run_is_refused_by_its_symbol():
    refused = run_on_ranks(_apply_with_symbols, 2, args=(["*", "E", "*", "-"],), te=True)[0]
    assert "HybridModel layers 'E'" in refused, refused
    assert "a pattern of `*` and `-` layers" in refused, refused
    assert run_on_ranks(_apply_with_symbols, 2, args=(None,), te=True)[0] == "applied"
