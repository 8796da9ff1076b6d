"""Attention under the sequence split: each chunk's queries see the keys of earlier chunks.

With ``--domino-split sequence`` a layer's chunk ``c`` holds tokens ``[c*s/p, (c+1)*s/p)``. Its
queries must attend to every earlier token, whose keys and values the earlier chunks computed
in their own attention core op of the same layer (the wavefront runs chunk ``c`` after chunks
``0..c-1`` for each op). :func:`core_attention_forward`, bound onto each layer's
``core_attention`` (Megatron-Core's local ``DotProductAttention``), keeps each chunk's keys
and values ``[s/p, b, g/tp, d]`` (already rotated by the rotary embedding) in the step state
and calls the stock attention with the concatenation ``[(c+1)*s/p, b, g/tp, d]`` and the
chunk's mask rows (from :mod:`megatron_domino.chunking`). Autograd carries the later chunks'
gradients back into the earlier chunks' keys and values.

Only the attention arithmetic's order changes: a query's softmax runs over the same unmasked
keys as in the unsplit layer (the keys it drops are the masked future ones).
"""

from __future__ import annotations

import torch

from megatron_domino.state import DominoRuntime


def core_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    attn_mask_type=None,
    attention_bias: torch.Tensor | None = None,
    packed_seq_params=None,
    *,
    runtime: DominoRuntime,
):
    """Attention of one chunk's queries ``[s/p, b, n/tp, d]`` to the keys of chunks ``0..c``.

    Outside a Domino op, the stock forward runs unchanged.

    Returns:
        The context ``[s/p, b, n*d/tp]``, as the stock forward returns it.
    """
    step = runtime.step
    chunk = None if step is None else step.active
    if chunk is not None:
        earlier = step.key_values.setdefault(step.layer, [])
        if len(earlier) != chunk.index:
            raise RuntimeError(
                f"Domino bug: chunk {chunk.index} of layer {step.layer} reached attention after "
                f"{len(earlier)} chunks' keys (expected {chunk.index})."
            )
        earlier.append((key, value))
        if chunk.index:
            key = torch.cat([k for k, _ in earlier], dim=0)
            value = torch.cat([v for _, v in earlier], dim=0)
    return type(module).forward(
        module, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
    )
