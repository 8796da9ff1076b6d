"""The row-parallel output of one chunk: how its partial sum is computed, and the output in flight.

State the schedule keeps per chunk (:class:`~megatron_domino.engine.state.ChunkState` holds a
:class:`DeferredRow` and a :class:`PendingReduce`), below :mod:`megatron_domino.engine.state` and
:mod:`megatron_domino.engine.linears` in the import order, so that both can use it without importing
each other.

* :class:`RowGemm`: how one implementation's row-parallel linear computes this rank's partial
  sum without a collective (:data:`LOCAL_ROW` for Megatron-Core's, ``te_linears.TE_ROW`` for
  Transformer Engine's).
* :class:`DeferredRow`: a row-parallel call captured during a core op, run one op later.
* :class:`PendingReduce`: the partial sums with their all-reduces (or, under sequence
  parallelism, reduce-scatters) in flight; the output is reachable only through ``wait()``.

Chunk shapes are written for the batch split, ``[s, b/p, h]``; under the sequence split
read ``[s/p, b, h]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import RowParallelLinear

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.communication.collectives import ForwardAllReduce, SequenceCollective
from megatron_domino.communication.sequence_parallel import launch_scatter, wait_scatter
from megatron_domino.engine.column_pieces import column_piece_into_main_grad

__all__ = ["LOCAL_ROW", "DeferredRow", "PendingReduce", "RowGemm", "output_dtype_option"]


@dataclass(frozen=True)
class RowGemm:
    """How one implementation's row-parallel linear computes this rank's partial sum.

    Attributes:
        partial: ``(module, input_, piece, pieces) -> (partial [s, b/p, h/pieces], bias the
            linear returns or None)``, with no collective.
        bias_after_reduce: ``module -> bias or None``: the bias added once to the reduced
            output (a linear that does not return its bias separately, ``skip_bias_add=False``).
    """

    partial: Callable
    bias_after_reduce: Callable[[torch.nn.Module], torch.Tensor | None]


def output_dtype_option(module: torch.nn.Module) -> dict:
    """``_forward_impl``'s ``output_dtype`` keyword for ``module``, where it has one.

    Megatron-Core 0.20 (Megatron-LM ``main``) gave the local linears an ``output_dtype`` (a GEMM
    output dtype other than the input's) that their ``forward`` passes to ``_forward_impl``;
    0.19's have neither. Passing the module's own value keeps Domino's GEMM output the stock
    one's on both.
    """
    return {"output_dtype": module.output_dtype} if hasattr(module, "output_dtype") else {}


def _local_row_partial(
    module: RowParallelLinear, input_: torch.Tensor, piece: int, pieces: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Piece ``piece`` of ``pieces`` of this rank's partial sum ``[s, b/p, h/pieces]``.

    Megatron-Core's own GEMM path (frozen weights, main_grad accumulation), called by keyword:
    the positional order changed between releases. A column piece (``pieces > 1``) of a
    trained weight under gradient-accumulation fusion accumulates into its rows of main_grad
    (:mod:`megatron_domino.engine.column_pieces`); without fusion a weight slice's gradient flows
    through autograd.
    """
    if pieces > 1 and module.gradient_accumulation_fusion and module.weight.requires_grad:
        partial = column_piece_into_main_grad(input_, module.weight, piece, pieces)
        return partial, module.bias if module.skip_bias_add else None
    weight = module.weight.chunk(pieces, dim=0)[piece] if pieces > 1 else module.weight
    partial = module._forward_impl(
        input=input_,
        weight=weight,
        bias=None,
        gradient_accumulation_fusion=module.gradient_accumulation_fusion and pieces == 1,
        allreduce_dgrad=False,
        sequence_parallel=False,
        tp_group=None,
        grad_output_buffer=None,
        **output_dtype_option(module),
    )
    return partial, module.bias if module.skip_bias_add else None


#: Megatron-Core's ``RowParallelLinear``.
LOCAL_ROW = RowGemm(
    partial=_local_row_partial,
    bias_after_reduce=lambda module: None if module.skip_bias_add else module.bias,
)


@dataclass(frozen=True)
class DeferredRow:
    """A row-parallel linear call captured in a core op, run by the next projection op."""

    module: torch.nn.Module
    input_: torch.Tensor
    """``[s, b/p, n/tp]``, this rank's slice of the attention context or MLP activation."""
    gemm: RowGemm

    def with_input(self, input_: torch.Tensor) -> DeferredRow:
        """The same call on ``input_`` (the captured input as the next leg's tensor)."""
        return dataclasses.replace(self, input_=input_)


@dataclass(eq=False)
class PendingReduce:
    """The row-parallel output of one chunk whose collective(s) are in flight.

    Holds ``k`` partial sums (one per column piece, each ``[s, b/p, h/k]``) and the means to
    wait for them. Without sequence parallelism each piece is all-reduced in place; with it,
    reduce-scattered along ``s`` to ``[s/tp, b/p, h/k]``. Reading a piece before :meth:`wait`
    would read an unreduced partial sum, so pieces are only reachable through :meth:`wait`.

    Attributes:
        group: the tensor-parallel process group.
        label: recorder label (collective name, layer, chunk).
        bias: added after the reduction when the linear does not return its bias separately
            (``skip_bias_add=False``), as Megatron-Core does.
        scatter: reduce-scatter along the sequence instead of all-reducing.
        grad_quantizer: under ``scatter``, the FP8 quantizer of a Transformer Engine row
            linear's output gradient: the backward all-gather of that gradient then moves FP8
            bits, as stock TE gathers it (:mod:`megatron_domino.communication.te_fp8_inputs`).
        amax_group: where that cast reduces its amax under current scaling
            (:mod:`megatron_domino.runtime.amax_group`).
    """

    group: dist.ProcessGroup
    label: CollectiveLabel
    bias: torch.Tensor | None = None
    scatter: bool = False
    grad_quantizer: object = None
    amax_group: dist.ProcessGroup | None = None
    _pieces: list[tuple[ForwardAllReduce | SequenceCollective, torch.Tensor]] = field(
        default_factory=list, init=False, repr=False
    )

    def launch(self, partial: torch.Tensor) -> None:
        """Start the collective of the next column piece ``partial`` (``[s, b/p, h/k]``)."""
        piece = len(self._pieces)
        if self.scatter:
            slot = SequenceCollective(self.group, self.label, piece)
            self._pieces.append((slot, launch_scatter(partial, slot)))
        else:
            slot = ForwardAllReduce(self.group, self.label, piece)
            self._pieces.append((slot, slot.launch(partial.contiguous())))

    @property
    def in_flight(self) -> bool:
        return bool(self._pieces)

    def hand_on(self, move: Callable[..., tuple | torch.Tensor]) -> None:
        """Replace the pieces' outputs in flight by ``move(*outputs)`` (one tensor per piece, or
        a tuple): under sequence parallelism the next leg waits for them
        (:mod:`megatron_domino.engine.legs`). The outputs are moved, never read."""
        moved = move(*(output for _, output in self._pieces))
        moved = moved if isinstance(moved, tuple) else (moved,)
        self._pieces = [
            (slot, output) for (slot, _), output in zip(self._pieces, moved, strict=True)
        ]

    def wait(self, then_in_backward: Callable[[], None] | None = None) -> torch.Tensor:
        """Wait for every piece; the reduced output ``[s or s/tp, b/p, h]`` (pieces joined on h).

        Under sequence parallelism, ``then_in_backward`` runs in backward right after the
        reduce-scatters' twins have launched their output-gradient all-gathers (the schedule
        passes the launch of the chunk's column-linear input re-gather).
        """
        if not self._pieces:
            raise RuntimeError(
                f"{self.label.name} of layer {self.label.layer} chunk "
                f"{self.label.chunk} was waited twice or never launched."
            )
        if then_in_backward is not None and not self.scatter:
            raise RuntimeError("then_in_backward applies to reduce-scatters only.")
        outputs = []
        for index, (slot, in_flight) in enumerate(self._pieces):
            if self.scatter:
                # Piece 0's twin is the last of the pieces' to run in backward.
                then = then_in_backward if index == 0 else None
                outputs.append(
                    wait_scatter(in_flight, slot, then, self.grad_quantizer, self.amax_group)
                )
            else:
                slot.finish()
                outputs.append(in_flight)
        self._pieces.clear()
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return output if self.bias is None else output + self.bias
