"""One placeholder weight gradient per weight per engine call, as stock Megatron hands DDP.

With fused weight-gradient accumulation (``--gradient-accumulation-fusion``) a linear's
backward adds ``dW`` into ``weight.main_grad`` itself and returns a *placeholder* gradient, so
that Megatron DDP's hook (which only needs one defined gradient, and skips the add because
``grad_added_to_main_grad`` is set) runs on the main thread. Megatron-Core and Transformer
Engine take it from TE's ``get_dummy_wgrad``: one buffer per shape and dtype, shared by every
caller (TE ``module/base.py:110-124``). Stock calls each linear once per micro-batch, so the
weight gets one placeholder. Domino calls it once per chunk (and column piece).

* **One engine call for the whole backward** (autograd's order, ``--domino-backward-order
  autograd``): autograd would sum ``p`` placeholders, and because they share one storage it
  cannot do so in place (PyTorch's ``InputBuffer`` accumulates in place only when the storage
  has one user), so it would run ``p - 1`` weight-sized additions of values nobody reads. So
  every call but chunk 0's piece 0 drops its placeholder; the weight's ``AccumulateGrad``
  (and DDP's hook) runs once, after the last call's backward, on the kept one.
* **One engine call per leg** (:mod:`megatron_domino.engine.legs`): each chunk's leg runs its
  own backward, in which the weight's ``AccumulateGrad`` runs and DDP's hook asserts a gradient
  under ``overlap_grad_reduce``. So each chunk's piece 0 keeps a placeholder, a *fresh* one
  (``torch.empty``, zeros with ``zero_out_wgrad``): an empty ``.grad`` takes a fresh gradient
  over, where it would copy the shared buffer (torch ``functions/accumulate_grad.h``), ``p``
  weight-sized copies per micro-batch. Other pieces drop theirs.

:func:`one_placeholder_per_call` does both, with a post-hook on the call's autograd node: after
that node's backward, if the gradient it returned is a placeholder (the weight's
``grad_added_to_main_grad`` is set), its slot becomes ``None`` or a fresh placeholder. A real
``dW`` (fusion off) is never touched.
"""

from __future__ import annotations

import torch

__all__ = ["one_placeholder_per_call"]

#: How far from a call's output its autograd node with the weight's edge may sit (bias adds,
#: views, a weight slice of a column piece).
_SEARCH_DEPTH = 4


def _weight_edge(node, weight: torch.Tensor):
    """``(node, index)``: the autograd node within reach of ``node`` whose input ``index`` is
    ``weight``'s accumulator (directly, or through a slice of it), or ``(None, None)``."""
    frontier, seen = [node], set()
    for _ in range(_SEARCH_DEPTH):
        following = []
        for current in frontier:
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            for index, (child, _) in enumerate(current.next_functions):
                if child is not None and getattr(child, "variable", None) is weight:
                    return current, index
                following.append(child)
        frontier = following
    return None, None


def one_placeholder_per_call(
    output: torch.Tensor, weight: torch.Tensor, *, chunk: int, piece: int = 0, legs: bool
) -> None:
    """In backward, keep one placeholder gradient for ``weight`` per engine call (module
    docstring): from the call of chunk ``chunk``'s column piece ``piece`` that made ``output``.

    A no-op (no graph search on the host's per-chunk path) where this call keeps the shared
    placeholder (chunk 0's piece 0 without legs), nothing will flow to ``weight``, or it has no
    ``main_grad`` to accumulate into.

    Args:
        legs: whether each chunk's leg runs its own backward (the step has legs).
    Raises:
        RuntimeError: ``weight`` takes gradients but no autograd node near ``output`` leads to
            it (a module structure Domino does not know).
    """
    if not legs and chunk == 0 and piece == 0:
        return
    if output.grad_fn is None or not weight.requires_grad or not hasattr(weight, "main_grad"):
        return  # no main_grad, no fused accumulation: the call returns a real dW
    node, index = _weight_edge(output.grad_fn, weight)
    if node is None:
        raise RuntimeError(
            "Domino: cannot find the weight-gradient edge of a linear's output; this module "
            "structure is unsupported."
        )
    fresh = legs and piece == 0

    def settle(grad_inputs, _grad_outputs):
        if not getattr(weight, "grad_added_to_main_grad", False):
            return None  # a real weight gradient: autograd must sum it
        grads = list(grad_inputs)
        placeholder = grads[index]
        if fresh and placeholder is not None:
            make = (
                torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like
            )
            grads[index] = make(placeholder)
        else:
            grads[index] = None
        return tuple(grads)

    node.register_hook(settle)
