"""Attention under the sequence split: each chunk's queries see the keys of earlier chunks.

With ``--domino-split sequence`` a layer's chunk ``c`` holds tokens ``[c*s/p, (c+1)*s/p)``. Its
queries must attend to every earlier token, whose keys and values the earlier chunks computed
in their own attention core op of the same layer (the wavefront runs chunk ``c`` after chunks
``0..c-1`` for each op). :func:`core_attention_forward`, bound onto each layer's
``core_attention``, keeps each chunk's keys and values ``[s/p, b, g/tp, d]`` (already rotated
by the rotary embedding) in the step state and calls the stock attention with the
concatenation ``[(c+1)*s/p, b, g/tp, d]``: ``sq = s/p`` queries against ``sk = (c+1)*s/p``
keys, the queries being the *last* ``sq`` positions. Autograd carries the later chunks'
gradients back into the earlier chunks' keys and values. How the causal mask reaches the
attention for ``sq != sk`` depends on the implementation:

* **Megatron-Core's local** ``DotProductAttention``: its ``FusedScaleMaskSoftmax`` was built
  for ``AttnMaskType.causal``. With ``--masked-softmax-fusion`` (Megatron-LM's default) in
  bf16/fp16 it then runs the fused *upper-triangular* kernel, which ignores the mask, asserts
  ``sq == sk`` and (under ``python -O``, without the assert) would silently apply a wrong
  mask. So every chunk's softmax runs as ``AttnMaskType.arbitrary`` for its call
  (:func:`_explicit_mask_softmax`): the fused *masked* kernel ``ScaledMaskedSoftmax`` when
  Megatron's ``is_kernel_available`` allows it for ``[b, np, sq, sk]`` (else the torch
  softmax), with the chunk's explicit mask rows ``[*, 1, sq, sk]`` (contiguous: the kernel
  reads them as a dense array). Which rows: where the stock layer would have run the
  upper-triangular kernel on ``[s, s]`` (so ignored any mask passed), or where no mask was
  passed (Megatron then means causal), the causal rows (:func:`causal_rows`, built once per
  shape and device, never the dense ``[s, s]`` mask), else the given mask's rows
  (:func:`_chunk_mask`); either way what stock computes for those queries.
* **Transformer Engine's** ``DotProductAttention`` (Megatron's ``TEDotProductAttention``):
  TE aligns ``"causal"`` to the *top-left* corner of the ``[sq, sk]`` score matrix (query
  ``i`` sees keys ``j <= i``), and ``"causal_bottom_right"`` to the bottom-right (``j <= i +
  sk - sq``), which is the causal mask of the last ``sq`` positions. Chunk 0 (``sq == sk``,
  where both agree) keeps the stock ``causal``; later chunks pass ``causal_bottom_right`` and
  no mask tensor (TE's documented contract for causal types; chunk 0 gets the caller's mask
  rows, ``None`` when it passed none: no mask is built for TE). TE's flash, cuDNN and unfused
  backends implement the bottom-right type; TE picks one per call from the shapes and mask
  type (the chunks' differing shapes can make it redo that selection on every call: host
  time). Run on TE's own Python with its unfused backend on the CPU
  (``tests/ranks/test_te_sequence_split.py``); TE's flash and cuDNN backends need a GPU
  (``tests/gpu/test_transformer_engine_gpu.py`` has the case).

Only the attention arithmetic's order changes: a query's softmax runs over the same unmasked
keys as in the unsplit layer (the keys it drops are the masked future ones).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from megatron.core.transformer.enums import AttnMaskType

if TYPE_CHECKING:
    from megatron_domino.engine.state import DominoRuntime

__all__ = ["causal_rows", "core_attention_forward", "local_attend", "te_attend"]


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
    attend,
):
    """Attention of one chunk's queries ``[s/p, b, n/tp, d]`` to the keys of chunks ``0..c``.

    Outside a Domino op, the stock forward runs unchanged. ``attend`` is :func:`local_attend`
    or :func:`te_attend` (bound by :mod:`megatron_domino.plan`).

    Returns:
        The context ``[s/p, b, n*d/tp]``, as the stock forward returns it.
    """
    step = runtime.step
    chunk = None if step is None else step.active
    if chunk is None:
        return type(module).forward(
            module, query, key, value, attention_mask, attn_mask_type, attention_bias,
            packed_seq_params,
        )  # fmt: skip
    earlier = step.key_values.setdefault(step.layer, [])
    if len(earlier) != chunk.index:
        raise RuntimeError(
            f"Domino bug: chunk {chunk.index} of layer {step.layer} reached attention after "
            f"{len(earlier)} chunks' keys (expected {chunk.index})."
        )
    legs, tokens = step.legs, None
    if legs is not None and chunk.index < len(step.chunks) - 1:
        tokens = (legs.share(chunk.index, key), legs.share(chunk.index, value))
    earlier.append((key, value, tokens))
    if chunk.index:
        key = torch.cat([_in_leg(step, chunk, owner, 0) for owner in range(chunk.index + 1)])
        value = torch.cat([_in_leg(step, chunk, owner, 1) for owner in range(chunk.index + 1)])
    return attend(
        module, chunk.index, runtime.config.chunks, query, key, value, attention_mask,
        attn_mask_type, attention_bias, packed_seq_params,
    )  # fmt: skip


def _in_leg(step, chunk, owner: int, which: int) -> torch.Tensor:
    """Chunk ``owner``'s keys (``which`` 0) or values (1) ``[s/p, b, g/tp, d]`` as a tensor of
    ``chunk``'s leg: another chunk's borrowed from the leg that made them
    (:meth:`~megatron_domino.engine.legs.LegBook.borrow`), so that each leg keeps a graph of its
    own and their gradients reach that leg; the chunk's own, or any without legs, as they are."""
    entry = step.key_values[step.layer][owner]
    tensor, token = entry[which], None if entry[2] is None else entry[2][which]
    if owner == chunk.index or token is None:
        return tensor
    return step.legs.borrow(chunk.index, token, tensor)


def local_attend(
    module, index, chunks, query, key, value, mask, mask_type, bias, packed_seq_params
):
    """Megatron-Core's ``DotProductAttention`` on chunk ``index``'s queries and keys: an
    explicit-mask softmax with the chunk's mask rows (:func:`_chunk_mask`)."""
    mask = _chunk_mask(module, query, key, mask, chunks)
    with _explicit_mask_softmax(module.scale_mask_softmax):
        return type(module).forward(
            module, query, key, value, mask, mask_type, bias, packed_seq_params
        )


def te_attend(module, index, chunks, query, key, value, mask, mask_type, bias, packed_seq_params):
    """Transformer Engine's attention on chunk ``index``'s queries and keys: chunks after the
    first get ``causal_bottom_right`` and no mask tensor."""
    if index:
        mask_type, mask = AttnMaskType.causal_bottom_right, None
    return type(module).forward(module, query, key, value, mask, mask_type, bias, packed_seq_params)


def _chunk_mask(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor,
    chunks: int,
) -> torch.Tensor:
    """The mask rows ``[*, 1, sq, sk]`` that make the chunk's softmax equal to stock's rows.

    The stock layer, on ``[b, np, s, s]`` with ``s = p * sq``, runs the fused upper-triangular
    kernel when Megatron's ``is_kernel_available`` allows it (and there is no softmax
    offset), which applies the causal mask whatever mask was passed; otherwise the torch
    softmax applies the passed mask, or with none Megatron's default causal one.
    ``attention_mask`` is the chunk's rows of the passed mask, or ``None``.
    """
    sq, b, heads = query.shape[:3]
    sk = key.shape[0]
    softmax = module.scale_mask_softmax
    stock_fused = getattr(module, "softmax_offset", None) is None and softmax.is_kernel_available(
        None, b, heads, sq * chunks, sq * chunks
    )
    if attention_mask is not None and not stock_fused:
        return attention_mask
    return causal_rows(sq, sk, query.device)


@functools.lru_cache(maxsize=64)
def causal_rows(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """The causal mask's rows for the last ``sq`` of ``sk`` positions: ``[1, 1, sq, sk]`` bool,
    True where key ``j > i + sk - sq`` is masked for query ``i``.

    Chunk ``c`` of ``p`` has ``sq = s/p`` and ``sk = (c+1)s/p``: the rows
    ``[c*s/p, (c+1)*s/p)``, key columns ``[0, (c+1)*s/p)``, of the ``[s, s]`` causal mask,
    which is never built. Every layer and every forward reads the same rows, so they are built
    once per ``(sq, sk, device)`` and shared (read only: the softmax and autograd never write
    a mask). Built outside inference mode, so that a training forward after an inference one
    may save it for backward.
    """
    with torch.inference_mode(False):
        ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
        return torch.triu(ones, diagonal=sk - sq + 1).view(1, 1, sq, sk)


@contextlib.contextmanager
def _explicit_mask_softmax(softmax: torch.nn.Module) -> Iterator[None]:
    """Megatron's ``FusedScaleMaskSoftmax`` applying the mask it is given, for one call.

    Its ``attn_mask_type`` (set at construction) selects the kernel: ``causal`` the
    upper-triangular one for ``sq == sk`` only; any other type the masked kernel (or the torch
    softmax) with the explicit mask. Restored on exit, also when the call raises.
    """
    saved = softmax.attn_mask_type
    softmax.attn_mask_type = AttnMaskType.arbitrary
    try:
        yield
    finally:
        softmax.attn_mask_type = saved
