"""The small GPT models the GPU check's equivalence and overlap parts run.

The Domino settings they run are named as everywhere (:mod:`megatron_domino.base.settings`).

Two flavours cover what Domino patches differently: ``gpt`` (LayerNorm, GeLU, learned
positions, biases, multi-head attention) and ``llama`` (RMSNorm, SwiGLU, rotary positions,
grouped-query attention, no biases, untied output layer). ``--quick`` uses the test suite's
sizes (h = 64, s = 16); the full check uses h = 512, s = 256, still seconds on a GPU: the point
is numerics and ordering on the device, not speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lab.models.model_options import LLAMA_FLAVOUR

if TYPE_CHECKING:  # the parent process plans with this module and never imports Megatron-Core
    from lab.models.gpt_model import GPTOptions

__all__ = [
    "FLAVOURS",
    "MICRO_BATCH",
    "NEEDS",
    "build_on_device",
    "configure_cuda_numerics",
    "model_options",
]

MICRO_BATCH = 4

#: The collectives a model needs, by sequence parallelism (Domino's and Megatron-Core's own:
#: embedding, cross-entropy, and under SP the gathers and scatters around every TP region).
NEEDS: dict[bool, tuple[str, ...]] = {
    False: ("all_reduce",),
    True: ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"),
}

FLAVOURS = ("gpt", "llama")


def model_options(
    flavour: str, *, quick: bool, bf16: bool, sequence_parallel: bool, num_layers: int = 2
) -> GPTOptions:
    """The model of one flavour; dropout is off so Domino and stock draw nothing."""
    from lab.models.gpt_model import GPTOptions

    size = (
        dict(hidden_size=64, seq_length=16, vocab_size=300)
        if quick
        else dict(hidden_size=512, seq_length=256, vocab_size=1000)
    )
    common = dict(
        **size,
        num_layers=num_layers,
        num_attention_heads=8,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=bf16,
        sequence_parallel=sequence_parallel,
    )
    if flavour == "gpt":
        return GPTOptions(**common)
    if flavour == "llama":
        return GPTOptions(
            **{**common, **LLAMA_FLAVOUR},
            num_query_groups=4,
            ffn_hidden_size=96 if quick else 1024,
            untie_embeddings_and_output_weights=True,
        )
    raise ValueError(f"unknown flavour {flavour!r}; choose from {', '.join(FLAVOURS)}.")


def build_on_device(options: GPTOptions, device: str) -> torch.nn.Module:
    """This rank's GPTModel on ``device``, prepared as Megatron-LM's training script does.

    With CUDA, Megatron-Core initialises the TP-split weights on the GPU but leaves some
    modules (position embedding, torch norms) on the CPU until ``model.cuda()``. In bf16 the
    model is wrapped in Megatron-Core's ``Float16Module``, which casts every parameter to bf16
    (the torch norms and the learned position table are created in fp32, and a bare bf16
    ``GPTModel`` with learned positions fails on the dtype mismatch) and returns fp32 outputs.
    """
    from megatron.core.transformer.module import Float16Module

    from lab.models.gpt_model import build_gpt_model

    model = build_gpt_model(options)
    if device == "cuda":
        model = model.cuda(torch.cuda.current_device())
    return Float16Module(model.config, model) if options.bf16 else model


def configure_cuda_numerics() -> dict[str, object]:
    """Deterministic kernels and no TF32, so two stock runs agree bit for bit; returns what
    was set, for the report. ``warn_only``: an op without a deterministic kernel warns
    instead of failing the check."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {
        "deterministic_algorithms": "warn_only",
        "matmul_allow_tf32": False,
        "cudnn_allow_tf32": False,
        "bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
    }
