"""Model FLOPs of one GPT training iteration, as Megatron-LM counts them.

TFLOP/s/GPU figures are only comparable with Megatron-LM's (and the Domino paper's) if the
FLOPs are counted the same way, so this is the dense-GPT case of ``num_floating_point_operations``
in Megatron-LM's ``megatron/training/training.py`` (no MoE, MTP, MLA or linear attention),
restated with explicit arguments instead of a global ``args``.

For a global batch of ``B`` sequences of length ``s``, ``L`` layers of hidden size ``h``, FFN
hidden size ``f``, ``n`` attention heads of width ``d`` (``kv_channels``), ``g`` query groups
(``g = n`` without grouped-query attention) and a padded vocabulary ``V``::

    FLOPs = 3 * 2 * B * s * [ L * (h * (n*d + 2*g*d) + n*d * h)     # QKV and output projections
                             + L * h * f * (3 if SwiGLU else 2)      # fc1 (x2 gate for SwiGLU), fc2
                             + h * V ]                               # logits
          + 3 * 2 * B * s**2 * L * n*d                               # QK^T and softmax(QK^T) V

* ``3``: every GEMM runs three times (forward, backward data gradient, backward weight gradient).
* ``2``: a multiply-add counts as two FLOPs.
* The core-attention term counts ``QK^T`` and ``softmax(QK^T) V`` (x2) under a causal mask
  that keeps half of the scores (/2), so the two factors cancel.

With ``f = 4h``, ``g = n``, ``d = h/n`` and no SwiGLU this reduces to the familiar
``72 B s L h^2 (1 + s/(12h) + V/(12 h L))``. Norms, softmax, activations and the embedding
lookup are not counted, exactly as in Megatron-LM.
"""

from __future__ import annotations


def gpt_training_flops(
    *,
    batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    padded_vocab_size: int,
    swiglu: bool,
) -> int:
    """FLOPs of one training iteration (forward + backward) over a global batch.

    Args:
        batch_size: sequences per iteration, summed over data-parallel ranks and micro-batches
            (the global batch size).
        num_query_groups: key/value heads; pass ``num_attention_heads`` for multi-head attention.
        kv_channels: width of one attention head (Megatron's default is ``hidden_size /
            num_attention_heads``).
        padded_vocab_size: the vocabulary size of the output layer, after padding.
    Returns:
        The FLOP count as an exact integer (see the module docstring for the formula).
    """
    query_width = kv_channels * num_attention_heads
    key_value_width = kv_channels * num_query_groups
    attention_projections = (
        hidden_size * (query_width + 2 * key_value_width) + query_width * hidden_size
    )
    mlp = hidden_size * ffn_hidden_size * (3 if swiglu else 2)
    logits = hidden_size * padded_vocab_size
    forward_backward_fma = 3 * 2
    tokens = batch_size * seq_length
    per_token = num_layers * (attention_projections + mlp) + logits
    core_attention = batch_size * seq_length**2 * num_layers * query_width
    return forward_backward_fma * (tokens * per_token + core_attention)


def tflops_per_gpu(
    flops_per_iteration: int, seconds_per_iteration: float, world_size: int
) -> float:
    """Achieved TFLOP/s per GPU, as Megatron-LM's ``--log-throughput`` reports it.

    Every rank (GPU) shares the iteration's FLOPs, whatever the TP/DP split.
    """
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
