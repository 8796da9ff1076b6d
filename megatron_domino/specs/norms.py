"""A torch LayerNorm/RMSNorm that runs under sequence parallelism, for the local layer spec.

Megatron-Core's ``WrappedTorchNorm`` (the local spec's norm without Apex) refuses sequence
parallelism, and its Apex/TE norms need CUDA. Under sequence parallelism each tensor-parallel
rank normalises its own ``s/tp`` tokens, so a norm's weight gradient is a partial sum; marking
the parameters ``sequence_parallel`` makes Megatron-Core's ``finalize_model_grads`` all-reduce
them over the tensor-parallel group, exactly as it does for its fused norms.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Build ``config.normalization`` over ``hidden_size`` (``[*, h]`` in, same shape out).

    Has the constructor signature Megatron-Core's layer specs call norms with.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization not in _NORMS:
            raise ValueError(
                f"normalization {config.normalization!r} is not one of {sorted(_NORMS)}"
            )
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError(
                "this torch norm has no zero-centred gamma (--apply-layernorm-1p) and no "
                "memory-efficient variant (--memory-efficient-layer-norm); those need Apex's "
                "or Transformer Engine's norms (on a GPU)"
            )
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
