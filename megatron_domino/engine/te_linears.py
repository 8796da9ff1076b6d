"""Domino on Transformer Engine linears (``--transformer-impl transformer_engine``).

Under Megatron-Core's TE layer spec the tensor-parallel collectives run inside TE's modules
(``TELayerNormColumnParallelLinear`` for ``linear_qkv``/``linear_fc1``, with the norm fused in;
``TERowParallelLinear`` for ``linear_proj``/``linear_fc2``), so patching Megatron's own
linears does nothing there. A TE linear picks its collectives *per call* from two attributes,
``parallel_mode`` (``"row"``/``"column"``) and ``sequence_parallel``: its forward passes them
into its autograd function, which saves them for backward. For the calls the schedule makes,
Domino sets them to ``None``/``False`` (:func:`_domino_call_settings`), which keeps everything
else TE does (FP8 casts, the fused norm, fused weight-gradient accumulation into
``main_grad``) and drops only the collective, and then runs that collective itself,
asynchronously, as it does for Megatron's linears:

* **Row-parallel** (``linear_proj``, ``linear_fc2``): the output's all-reduce (reduce-scatter
  under sequence parallelism) becomes a :class:`~megatron_domino.engine.row_output.PendingReduce`,
  waited after another chunk's work (:data:`TE_ROW`, run by
  :func:`~megatron_domino.engine.linears.row_projection`). The row linear's backward has
  no collective of its own once the all-gather of its output gradient (under SP) is done by
  the reduce-scatter's backward twin.
* **Column-parallel** (``linear_qkv``, ``linear_fc1``), under sequence parallelism: on the
  layer with its norms apart (:mod:`megatron_domino.specs.te_spec`; the fused
  ``TELayerNormColumnParallelLinear`` is refused under SP, :mod:`megatron_domino.refusals`),
  the schedule's norm op runs ``TENorm`` on this rank's shard ``[s/tp, b/p, h]`` and
  launches the all-gather of its output, as stock TE gathers its norm output (under FP8 the
  shard cast to FP8 first and the FP8 bits gathered, :mod:`megatron_domino.communication.te_fp8_inputs`); the
  ``TEColumnParallelLinear`` then runs on the gathered ``[s, b/p, h]`` without collectives
  (:func:`te_column_parallel_forward`), under
  :func:`~megatron_domino.communication.saved_shards.keeping_input_shards`, which keeps this rank's rows of
  its input for backward and gathers them again there. In backward TE returns this rank's
  partial input gradient over the full sequence, and the gather's backward twin
  reduce-scatters it: the same sum the stock path forms.
* **Column-parallel without sequence parallelism**: the forward has no collective, and the
  backward's dX all-reduce stays TE's own, overlapped with TE's weight-gradient GEMM as in
  stock Megatron (Domino's forward is still bound, for the weight-gradient accumulation
  described in :func:`_domino_call_settings`). Domino's cross-chunk backward overlap cannot apply here: the fused norm's
  backward runs inside the same TE function right after the all-reduce, and moving the
  all-reduce behind it would leave the norm weights with partial gradients that nothing sums.
  So this combination needs ``--no-domino-backward-overlap``
  (:func:`megatron_domino.refusals.te_problems`).

Known risks, from reading TE's source (not observed): the backward FP8 scale update runs in
the backward of the step's first FP8 call (chunk 0's first linear), normally the last
backward; a chunk whose backward ran after it would add its amax to the next step's window.
TE 2.x leaves ``optimize_for_gemm`` set on a module's quantizers after a call without
collectives; it matters for block-scaled recipes (refused) in later stock calls (after
``revert``).

What has run where: on TE's own Python (2.18 and 2.20) over the test suite's CPU backend of
its compiled extension (``tests/te_cpu``), against stock on the same weights; TE's kernels,
cuDNN attention and NCCL only on a GPU (``tests/gpu/test_transformer_engine_gpu.py``, not yet
run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from megatron_domino.base.recorder import time_backward
from megatron_domino.communication.saved_shards import keeping_input_shards
from megatron_domino.engine.placeholder_grads import one_placeholder_per_call
from megatron_domino.engine.row_output import RowGemm

if TYPE_CHECKING:
    from megatron_domino.engine.state import DominoRuntime

__all__ = ["TE_ROW", "te_column_parallel_forward", "te_row_partial"]


@contextlib.contextmanager
def _domino_call_settings(module: torch.nn.Module, *, own_collectives: bool) -> Iterator[None]:
    """Settings of ``module`` for one call made by the schedule, restored on exit (also when
    the call raises).

    Unless ``own_collectives``, the call runs its GEMM (and fused norm) without collectives:
    ``parallel_mode = None`` and ``sequence_parallel = False`` (TE saves the values it ran
    with for its backward).

    In every case the call is never flagged ``is_first_microbatch=True``, whose two meanings
    in TE 2.x a chunked schedule must pull apart (TE ``module/linear.py:435-445``,
    ``1166-1171``, ``1883``):

    * *forward*: ``True`` re-casts the weight to FP8 into the module's cached copy, ``False``
      reuses that copy, ``None`` casts a fresh, uncached copy on every call (and saves it);
    * *backward*, with fused weight-gradient accumulation: ``True`` *overwrites* ``main_grad``,
      anything else accumulates into it. Autograd runs the chunks' backwards latest chunk
      first, so a first chunk flagged ``True`` would erase the other chunks' weight gradients.

    So when Megatron's wrapper would pass ``True`` (its ``is_first_microbatch``, set by
    ``set_is_first_microbatch`` at a global batch's first micro-batch), Domino drops the
    module's cached FP8 weight (TE's ``_fp8_workspaces["weight"]``; TE itself clears that
    cache when the recipe changes, ``module/base.py:1519``) and passes ``False``: the call misses
    the cache, casts once and caches the copy, which every later chunk and micro-batch of the
    global batch reuses, and every backward accumulates (DDP zeroes ``main_grad`` before each
    step, as Megatron's own ``disable_parameter_transpose_cache`` path relies on). One cast per
    weight per global batch, one cached copy, as stock. With
    ``disable_parameter_transpose_cache`` (``None`` on every call) each chunk's call would cast
    afresh, p casts per micro-batch: refused under FP8
    (:func:`megatron_domino.refusals.te_problems`), and without FP8 there is nothing to cast.
    With FP8 parameters (``--fp8-param-gather``) TE uses the parameter as it is.
    """
    saved = module.parallel_mode, module.sequence_parallel
    if not own_collectives:
        module.parallel_mode, module.sequence_parallel = None, False
    if module.is_first_microbatch and not module.disable_parameter_transpose_cache:
        module._fp8_workspaces.pop("weight", None)
        module.is_first_microbatch = False
    try:
        yield
    finally:
        module.parallel_mode, module.sequence_parallel = saved


def te_row_partial(module: torch.nn.Module, input_: torch.Tensor, piece: int, pieces: int):
    """This rank's partial sum of a TE row-parallel linear, before any collective.

    A TE linear multiplies by its whole weight, so there is one piece (``--domino-column-chunks
    > 1`` is refused with TE layers).

    Args:
        input_: ``[s, b/p, n/tp]``, this rank's slice of the attention context or MLP activation.
    Returns:
        ``(partial [s, b/p, h], bias-or-None)``: the bias is returned, not added (Domino
        refuses TE row linears that would add it before the reduction).
    """
    with _domino_call_settings(module, own_collectives=False):
        return type(module).forward(module, input_)


#: Transformer Engine's row-parallel linear (``TERowParallelLinear``): its bias is returned.
TE_ROW = RowGemm(partial=te_row_partial, bias_after_reduce=lambda module: None)


def te_column_parallel_forward(
    module: torch.nn.Module, input_: torch.Tensor, *, runtime: DominoRuntime
):
    """A TE column-parallel linear (fused norm included) on the input the schedule prepared.

    Under sequence parallelism the schedule gathered the input and the call runs without
    TE's collectives; without it the call keeps TE's (its backward input-gradient
    all-reduce). Either way weight gradients keep accumulating over the chunks (see
    :func:`_domino_call_settings`). Outside a Domino op, the stock forward runs.

    Args:
        input_: ``[s, b/p, h]``, one chunk's residual stream, full sequence (all-gathered by
            the schedule under sequence parallelism).
    Returns:
        ``(output [s, b/p, n/tp], bias-or-None)`` as Megatron's TE wrapper returns it.
    """
    step = runtime.step
    chunk = None if step is None else step.active
    if chunk is None:
        return type(module).forward(module, input_)
    if input_ is not chunk.linear_input:
        raise RuntimeError(
            "Domino: a Transformer Engine column-parallel linear received something other "
            "than the input the schedule prepared for it; this module structure is "
            "unsupported."
        )
    own_collectives = not runtime.sequence_parallel
    with (
        _domino_call_settings(module, own_collectives=own_collectives),
        keeping_input_shards(None if own_collectives else chunk.input_regather, input_, module),
    ):
        output, bias = type(module).forward(module, input_)
    one_placeholder_per_call(output, module.weight, chunk=chunk.index, legs=step.legs is not None)
    time_backward(output, runtime.recorder, f"{step.sublayer}_column_gemm", step.layer, chunk.index)
    return output, bias
