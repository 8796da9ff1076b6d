"""The tensor-parallel collectives as Megatron-Core and Domino look them up, and the one way to
swap them.

Megatron-Core and Domino look ``torch.distributed.<collective>`` up at call time, except
Megatron-Core's gather/scatter functions, which ``tensor_parallel.layers`` and ``.mappings``
bind at import: :data:`TP_COLLECTIVES` names both, so a swap reaches every TP collective.
:func:`swapped_tp_collectives` is the one place anything swaps them: ``--domino-ab``'s wait
clock (:mod:`megatron_domino.training.tp_wait`), and in a checkout the bench's no-op, logged
and emulated-link arms and the tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings as tp_mappings

from megatron_domino.runtime.patch import Patch

__all__ = ["COLLECTIVE_KINDS", "TP_COLLECTIVES", "swapped_tp_collectives"]

#: (module, attribute) of every collective Megatron-Core's tensor parallelism and Domino call.
#: ``layers.py`` and ``mappings.py`` bind the gather/scatter functions at import, so the
#: ``torch.distributed`` attributes alone would not reach them.
TP_COLLECTIVES = (
    (dist, "all_reduce"),
    (dist, "all_gather_into_tensor"),
    (dist, "reduce_scatter_tensor"),
    (tp_layers, "dist_all_gather_func"),
    (tp_layers, "dist_reduce_scatter_func"),
    (tp_mappings, "dist_all_gather_func"),
    (tp_mappings, "dist_reduce_scatter_func"),
)
#: What each attribute of :data:`TP_COLLECTIVES` does; the gather/scatter functions
#: Megatron-Core binds at import are ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
#: under another name.
COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "dist_all_gather_func": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "dist_reduce_scatter_func": "reduce_scatter",
}


@contextlib.contextmanager
def swapped_tp_collectives(
    replace: Callable[[str, Callable], Callable], why: str = "swap a TP collective"
) -> Iterator[None]:
    """Within the block, each attribute ``name`` of :data:`TP_COLLECTIVES` is
    ``replace(name, original)``; the originals come back on exit, also when the block raises.

    ``replace`` gets the attribute's name (its kind: :data:`COLLECTIVE_KINDS`) and the function
    it replaces, which a wrapper calls for what it does not handle; ``why`` is the patch's
    description (:class:`~megatron_domino.runtime.patch.Patch`).
    """
    with contextlib.ExitStack() as stack:
        for owner, name in TP_COLLECTIVES:
            replacement = replace(name, getattr(owner, name))
            stack.enter_context(Patch(owner, name, replacement, why).applied())
        yield
