"""One placeholder weight gradient per weight per backward, as stock Megatron hands DDP.

With fused weight-gradient accumulation (``--gradient-accumulation-fusion``) a linear's
backward adds ``dW`` into ``weight.main_grad`` itself and returns a *placeholder* gradient, so
that Megatron DDP's hook (which only needs one defined gradient, and skips the add because
``grad_added_to_main_grad`` is set) runs on the main thread. Megatron-Core and Transformer
Engine take it from TE's ``get_dummy_wgrad``: one buffer per shape and dtype, shared by every
caller (TE ``module/base.py:110-124``). Stock calls each linear once per micro-batch, so the
weight gets one placeholder. Domino calls it once per chunk (and column piece): autograd would
sum ``p`` placeholders, and because they share one storage it cannot do so in place (PyTorch's
``InputBuffer`` accumulates in place only when the storage has one user), so it runs ``p - 1``
weight-sized additions of values nobody reads.

:func:`drop_placeholder_gradient` removes the weight's gradient from every call but the one
that keeps it (the schedule keeps chunk 0's, piece 0's), with a post-hook on the call's
autograd node: after that node's backward, if the gradient it returned is a placeholder (the
weight's ``grad_added_to_main_grad`` is set), its slot becomes ``None``. A real ``dW`` (fusion
off) is never touched. The autograd engine runs a weight's ``AccumulateGrad`` once, after the
last call's backward, so DDP's hook still runs once, on the kept placeholder.
"""

from __future__ import annotations

import torch

__all__ = ["drop_placeholder_gradient"]

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


def drop_placeholder_gradient(output: torch.Tensor, weight: torch.Tensor) -> None:
    """In backward, drop the placeholder gradient the call that made ``output`` returns for
    ``weight`` (see the module docstring); a no-op (no graph search on the host's per-chunk
    path) when nothing will flow to ``weight`` or it has no ``main_grad`` to accumulate into.

    Raises:
        RuntimeError: ``weight`` takes gradients but no autograd node near ``output`` leads to
            it (a module structure Domino does not know).
    """
    if output.grad_fn is None or not weight.requires_grad or not hasattr(weight, "main_grad"):
        return  # no main_grad, no fused accumulation: the call returns a real dW
    node, index = _weight_edge(output.grad_fn, weight)
    if node is None:
        raise RuntimeError(
            "Domino: cannot find the weight-gradient edge of a linear's output; this module "
            "structure is unsupported."
        )

    def keep_one(grad_inputs, _grad_outputs):
        if not getattr(weight, "grad_added_to_main_grad", False):
            return None  # a real weight gradient: autograd must sum it
        grads = list(grad_inputs)
        grads[index] = None
        return tuple(grads)

    node.register_hook(keep_one)
