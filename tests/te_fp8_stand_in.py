"""Transformer Engine 2.x's FP8 weight contract, modelled on the CPU for the TE stand-ins.

Read from TransformerEngine ``v2.18`` (``transformer_engine/pytorch/``; facts and line numbers
also in ``../shared/docs/te-contract.md``). What a Domino schedule can break is not FP8 arithmetic
but what TE caches, saves and overwrites, so that is what this models, in plain torch:

* **The weight cast and its cache** (:func:`quantize_weight`). ``module/linear.py:1883`` (and
  ``layernorm_linear.py:1734``): the cached copy is looked up under ``"weight"`` unless
  ``is_first_microbatch is None``; ``linear.py:435-445``: ``update_ws = is_first_microbatch is
  None or is_first_microbatch``; ``module/base.py:803-855`` (``quantize_weight``): an already
  quantized parameter (``--fp8-param-gather``) is used as it is; a cached workspace is
  re-quantized in place only when ``update_ws``; on a miss a new copy is cast and, when it is to
  be cached, made a non-internal tensor. Every cast is counted in ``module.fp8_casts``.
* **What is saved** (``layernorm_linear.py:500-513``, ``linear.py`` likewise, and
  ``tensor/storage/float8_tensor_storage.py:145-151``): an *internal* (uncached) FP8 weight is
  saved as three plain tensors, ``_data`` ``uint8 [n/tp, h]``, ``_transpose`` ``uint8
  [h, n/tp]`` and ``_scale_inv`` ``fp32 [1]``: different on every TP rank. A cached copy is a
  tensor subclass (TE's ``Float8Tensor``) and is saved as one object.
* **Which copy each GEMM reads** (``common/gemm/cublaslt_gemm.cu:136-141``, Hopper): the forward
  GEMM reads ``_data``, the input-gradient (dgrad) GEMM reads ``_transpose``.
* **Weight-gradient accumulation** (``linear.py:1166-1171``): with ``fuse_wgrad_accumulation``
  the weight gradient goes into ``main_grad``, *overwriting* it when the call was flagged
  ``is_first_microbatch=True``; then (``linear.py:1287-1300``) the backward returns
  :func:`get_dummy_wgrad` (``module/base.py:110-124``): one shared buffer per shape and dtype,
  so autograd cannot sum two of them in place.

Not modelled: FP8 casts of the input and of the norm output (the stand-ins' activations stay in
the model's dtype), amax histories (each cast scales by the weight's current amax), FP8
attention, block-scaled recipes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max

#: ``get_dummy_wgrad``'s buffers by (shape, dtype): shared by every caller.
_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """TE's placeholder weight gradient (``module/base.py:110-124``): one buffer per shape and
    dtype, returned detached, so every caller's tensor shares that buffer's storage."""
    key = (*shape, dtype)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype)
    if zero:
        _DUMMY_WGRADS[key].fill_(0)
    return _DUMMY_WGRADS[key].detach()


def _cast(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data uint8 [n, h], transpose uint8 [h, n], scale_inv fp32 [1])`` of ``weight``."""
    amax = weight.detach().abs().amax().float().clamp(min=1e-12)
    scale = FP8_MAX / amax
    data = (weight.detach().float() * scale).to(FP8_DTYPE).view(torch.uint8)
    return data, data.t().contiguous(), (1.0 / scale).reshape(1)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` FP8 bits back to ``dtype``, same shape."""
    return (data.view(FP8_DTYPE).float() * scale_inv).to(dtype)


class Float8WeightStorage:
    """An internal FP8 weight (TE's ``Float8TensorStorage``): saved as its three tensors."""

    def __init__(self, data, transpose, scale_inv) -> None:
        self._data, self._transpose, self._scale_inv = data, transpose, scale_inv

    def prepare_for_saving(self) -> list[torch.Tensor]:
        """``float8_tensor_storage.py:145-151``: the plain tensors go to ``save_for_backward``."""
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors

    def restore_from_saved(self, tensors: list[torch.Tensor]) -> None:
        self._data, self._transpose, self._scale_inv = tensors

    def requantize_(self, weight: torch.Tensor) -> None:
        self._data, self._transpose, self._scale_inv = _cast(weight)


class Float8WeightTensor(torch.Tensor):
    """A cached FP8 weight (TE's ``Float8Tensor``, a tensor subclass): saved as one object.

    The subclass wraps ``_data`` (``uint8 [n, h]``); ``_transpose`` and ``_scale_inv`` ride along
    as attributes, which :meth:`requantize_` refreshes in place (a cache hit with an update).
    """

    @staticmethod
    def build(weight: torch.Tensor) -> Float8WeightTensor:
        data, transpose, scale_inv = _cast(weight)
        tensor = torch.Tensor._make_subclass(Float8WeightTensor, data)
        tensor._transpose, tensor._scale_inv = transpose, scale_inv
        return tensor

    def requantize_(self, weight: torch.Tensor) -> None:
        """A cache hit with an update: new bits into the same buffers, as TE's in-place cast."""
        with torch.no_grad():
            for old, new in zip(self.parts(), _cast(weight), strict=True):
                old.copy_(new)

    def detach(self) -> Float8WeightTensor:
        """A view of the same FP8 buffers (TE's ``Float8Tensor.detach`` keeps its parts)."""
        out = super().detach()
        out._transpose, out._scale_inv = self._transpose, self._scale_inv
        return out

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.as_subclass(torch.Tensor), self._transpose, self._scale_inv


def quantize_weight(module: torch.nn.Module, is_first_microbatch: bool | None):
    """The FP8 weight one call of ``module`` uses (see the module docstring), casts counted.

    ``module`` carries TE's per-module cache ``_fp8_workspaces`` and the counter ``fp8_casts``.
    Returns a :class:`Float8WeightStorage` (uncached) or a :class:`Float8WeightTensor` (cached,
    or the primary FP8 weight of a module with ``fp8_param``).
    """
    weight = module.weight
    if getattr(module, "fp8_param", False):
        # --fp8-param-gather: the parameter itself is FP8 (``base.py:803-813``: no cast, no
        # copy); the optimizer re-casts it after each step, which is not the module's work.
        if getattr(module, "_fp8_primary", None) is None:
            module._fp8_primary = Float8WeightTensor.build(weight)
        return module._fp8_primary
    cache_name = None if is_first_microbatch is None else "weight"
    workspace = module._fp8_workspaces.get(cache_name) if cache_name is not None else None
    update = is_first_microbatch is None or is_first_microbatch
    if workspace is not None:
        if update:
            workspace.requantize_(weight)
            module.fp8_casts += 1
        return workspace
    module.fp8_casts += 1
    if cache_name is None:
        return Float8WeightStorage(*_cast(weight))
    workspace = module._fp8_workspaces[cache_name] = Float8WeightTensor.build(weight)
    return workspace


def _weight_parts(fp8_weight) -> list[torch.Tensor]:
    if isinstance(fp8_weight, Float8WeightTensor):
        return [fp8_weight]
    return fp8_weight.prepare_for_saving()


def _restore_parts(saved: list[torch.Tensor], storage) -> tuple[torch.Tensor, ...]:
    if storage is None:
        return saved[0].parts()
    storage.restore_from_saved(saved)
    return storage._data, storage._transpose, storage._scale_inv


class Fp8Linear(torch.autograd.Function):
    """TE's ``_Linear`` under FP8 for one call: ``Y = X W^T (+ b)`` with ``W`` from its FP8 copy.

    Shapes: ``X`` ``[s, b, in]`` (under sequence parallelism with ``gather``: this rank's
    ``[s/tp, b, in]``, gathered inside as TE does, the shard kept and gathered again in backward),
    ``W`` ``[out, in]``, ``Y`` ``[s, b, out]``. ``dX`` reads the saved ``_transpose``; with
    ``fuse_wgrad`` ``dW`` goes into ``W.main_grad`` (overwriting it when ``is_first_microbatch``
    is True) and the backward returns :func:`get_dummy_wgrad`. ``dX`` is all-reduced over
    ``allreduce_group`` (column linear without SP) or reduce-scattered over ``gather`` (SP).
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, fp8_weight, options: dict):
        storage = None if isinstance(fp8_weight, Float8WeightTensor) else fp8_weight
        group = options.get("gather")
        total = _all_gather(input_, group) if group is not None else input_
        parts = (
            fp8_weight.parts()
            if storage is None
            else (fp8_weight._data, None, fp8_weight._scale_inv)
        )
        w = dequantize(parts[0], parts[2], input_.dtype)
        output = torch.matmul(total, w.t())
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input_, *_weight_parts(fp8_weight))
        ctx.storage, ctx.weight, ctx.options, ctx.has_bias = (
            storage,
            weight,
            options,
            bias is not None,
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, *saved = ctx.saved_tensors
        _data, transpose, scale_inv = _restore_parts(list(saved), ctx.storage)
        options, weight = ctx.options, ctx.weight
        group = options.get("gather")
        total = _all_gather(input_, group) if group is not None else input_
        grad_input = torch.matmul(
            grad_output, dequantize(transpose, scale_inv, grad_output.dtype).t()
        )
        if group is not None:
            grad_input = _reduce_scatter(grad_input, group)
        elif options.get("allreduce_group") is not None:
            dist.all_reduce(grad_input, group=options["allreduce_group"])
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        wgrad = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_weight = None
        if options["fuse_wgrad"] and hasattr(weight, "main_grad"):
            if options["is_first_microbatch"]:
                weight.main_grad.copy_(wgrad)
            else:
                weight.main_grad.add_(wgrad)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                zero = getattr(weight, "zero_out_wgrad", False)
                grad_weight = get_dummy_wgrad(list(weight.main_grad.shape), weight.dtype, zero=zero)
        else:
            grad_weight = wgrad.to(weight.dtype)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None


def _all_gather(shard: torch.Tensor, group) -> torch.Tensor:
    output = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
    dist.all_gather_into_tensor(output, shard.contiguous(), group=group)
    return output


def _reduce_scatter(full: torch.Tensor, group) -> torch.Tensor:
    output = full.new_empty((full.shape[0] // group.size(), *full.shape[1:]))
    dist.reduce_scatter_tensor(output, full.contiguous(), group=group)
    return output
