"""Domino with Megatron-LM's sharded data parallelism and meta-device initialisation.

* **Fully sharded data parallelism is refused** (:func:`megatron_domino.refusals.fsdp_problems`):
  FSDP gathers each layer's parameters in hooks on the ``TransformerLayer`` module, which
  Domino never calls. Checked with PyTorch's own ``fully_shard`` (FSDP2, on a CPU mesh over the
  data-parallel group) applied after Domino (the first forward refuses; without the check it
  failed inside the first norm on a sharded DTensor) and before it (``apply_domino`` refuses,
  patching nothing), and with parameters marked as Megatron-FSDP marks those it manages
  (``__fsdp_param__``; Megatron-FSDP itself needs CUDA). The argument-time refusal is in
  ``tests/runs/test_pretrain_args.py``.
* **Meta-device initialisation is supported**: Megatron-LM builds the model on the meta device,
  runs the pre-wrap hooks (Domino) and materialises the parameters afterwards
  (``to_empty_if_meta_device``). Domino binds ``forward`` onto modules and holds no tensors,
  so the materialised model, loaded with the stock model's weights, computes what stock does.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE

from lab.analysis.equivalence import (
    TOLERANCES,
    forward_backward,
    max_abs_error,
    mismatches,
    token_batch,
)
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

OPTIONS = GPTOptions(num_layers=2, **LLAMA_STYLE)
CONFIG = DominoConfig(chunks=2)


def _fully_shard(model: torch.nn.Module) -> None:
    """FSDP2 as Megatron's ``TorchFullyShardedDataParallel`` applies it: each layer, then the
    root, over the data-parallel group (here on a CPU mesh)."""
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(parallel_state.get_data_parallel_group(), "cpu")
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_refusals() -> dict[str, str]:
    batch = token_batch(OPTIONS, 4)
    messages = {}

    model = build_gpt_model(OPTIONS)
    apply_domino(model, CONFIG)
    _fully_shard(model)  # a library user wrapping after applying Domino
    with pytest.raises(DominoUnsupportedError) as error:
        model(**batch)
    messages["FSDP2 after apply_domino"] = str(error.value)

    model = build_gpt_model(OPTIONS)
    _fully_shard(model)
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, CONFIG)
    messages["FSDP2 before apply_domino"] = str(error.value)
    assert not any("forward" in vars(m) for m in model.modules()), "a refusal patched something"

    model = build_gpt_model(OPTIONS)
    for param in model.parameters():  # what Megatron-FSDP's constructor sets on each parameter
        param.__fsdp_param__ = True
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, CONFIG)
    messages["Megatron-FSDP"] = str(error.value)
    return messages


def test_fully_sharded_data_parallelism_is_refused_before_or_after_apply():
    messages = run_on_ranks(_fsdp_refusals, 2)[0]
    for case, message in messages.items():
        flag = "--use-megatron-fsdp" if case == "Megatron-FSDP" else "--use-torch-fsdp2"
        assert f"{flag}: fully sharded data parallelism gathers" in message, (case, message)
        assert "never calls" in message, (case, message)


def _meta_device_model_matches_stock() -> tuple[list[str], int, bool]:
    from megatron.training.models.dist_utils import to_empty_if_meta_device

    stock = build_gpt_model(OPTIONS)
    with torch.device("meta"):
        model = build_gpt_model(OPTIONS)
    assert all(p.is_meta for p in model.parameters())
    model.config.init_model_with_meta_device = True
    handle = apply_domino(model, CONFIG)  # the pre-wrap hook's place: before materialising
    model = to_empty_if_meta_device(model, device=torch.device("cpu"))
    model.load_state_dict(stock.state_dict())  # in training: the checkpoint (--load)
    batch = token_batch(OPTIONS, 4)
    reference = forward_backward(stock, batch)
    wrong = mismatches(forward_backward(model, batch), reference, TOLERANCES[torch.float32])
    dgrad_slots = len(handle.runtime.last_step.dgrad_slots)
    handle.revert()
    same = max_abs_error(forward_backward(model, batch), reference) == 0.0
    return wrong, dgrad_slots, same


def test_domino_applied_before_meta_device_materialisation_matches_stock():
    for wrong, dgrad_slots, reverted_is_stock in run_on_ranks(_meta_device_model_matches_stock, 2):
        assert not wrong, wrong[:3]
        assert dgrad_slots == 2 * OPTIONS.num_layers * CONFIG.chunks  # Domino's backward ran
        assert reverted_is_stock
