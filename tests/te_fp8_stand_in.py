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

* **FP8 activations** (:class:`Float8Quantizer`, :class:`Float8ActivationTensor`,
  :func:`gather_along_first_dim`). ``module/linear.py:330-394``: a linear's input is cast by its
  input quantizer (``module._get_quantizers(...)[0]``, ``linear.py:2007-2037``, made
  ``internal``) unless it arrives already quantized, in which case it is used as it is. Under
  sequence parallelism the shard is cast row-wise only ("all-gather is not supported with FP8
  column-wise data") and the FP8 bits are all-gathered (``distributed.py:982-1073``:
  ``quantizer.make_empty``, the shard's ``_scale_inv``, ``all_gather_into_tensor`` of
  ``_data``). ``linear.py:556-616``: what is saved for backward is the row-wise FP8 *shard*
  when it is gathered again in backward (SP), only the column-wise data otherwise (an input
  the call cast itself), or the input object itself when it arrived quantized (the ``"inp"``
  alias); ``linear.py:928-955`` gathers the shard again, ``linear.py:1113-1115`` makes the
  column-wise data the weight-gradient GEMM reads. An *internal* quantizer makes a
  ``Float8TensorStorage``, saved as its plain parts; a non-internal one a ``Float8Tensor``, a
  tensor subclass of the high-precision dtype that autograd can carry. ``base.py:1462-1507``:
  ``init_fp8_metadata`` reads the autocast state into ``module.fp8`` and builds the
  quantizers. The scale is delayed scaling's initial one, 1 (no amax history is kept, so it
  never moves), the same for every rank, chunk and call, as a delayed-scaling scale is within a
  step.

Not modelled: amax histories and scale updates (weights scale by their own current amax,
activations by 1), the FP8 recompute phase, FP8 gradients, FP8 attention, block-scaled
recipes.
"""

from __future__ import annotations

import contextlib

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


class Float8ActivationStorage:
    """An internal FP8 activation (TE's ``Float8TensorStorage``, made by an ``internal``
    quantizer): not a tensor, saved as its plain parts (``quantized_tensor.py:137-155``)."""

    def __init__(self, data, transpose, scale_inv, dtype: torch.dtype) -> None:
        self._data, self._transpose, self._scale_inv, self.dtype = data, transpose, scale_inv, dtype

    def prepare_for_saving(self) -> list[torch.Tensor | None]:
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> None:
        self._data, self._transpose, self._scale_inv = tensors

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _dequantize_parts(self, dtype or self.dtype)


class Float8ActivationTensor(torch.Tensor):
    """A non-internal FP8 activation (TE's ``Float8Tensor``): a tensor of the high-precision
    ``dtype`` and shape ``[tokens, ..., h]`` to autograd, its bits in ``_data`` (``uint8``, the
    same shape; ``None`` once only column-wise data is kept) and ``_transpose`` (``uint8
    [h, tokens * ...]``, made on demand), scaled by ``_scale_inv`` (``fp32 [1]``). Any op but
    ``detach``/``alias`` runs on its dequantized values, as TE's ``__torch_dispatch__`` falls
    back to for ops it does not implement."""

    @staticmethod
    def __new__(cls, data, transpose, scale_inv, dtype: torch.dtype, shape=None):
        shape = data.shape if shape is None else shape
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=scale_inv.device
        )
        tensor._data, tensor._transpose, tensor._scale_inv = data, transpose, scale_inv
        return tensor

    def __repr__(self) -> str:  # the default repr would dequantize through dispatch
        return f"Float8ActivationTensor(shape={list(self.shape)}, dtype={self.dtype})"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _dequantize_parts(self, dtype or self.dtype)

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None):
        """``float8_tensor_storage.py``: make the transpose from the row-wise bits (Hopper), or
        drop either copy."""
        if columnwise_usage and self._transpose is None:
            self._transpose = self._data.reshape(-1, self._data.shape[-1]).t().contiguous()
        if rowwise_usage is False:
            self._data = None
        if columnwise_usage is False:
            self._transpose = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (source,) = args
            return cls(
                source._data, source._transpose, source._scale_inv, source.dtype, source.shape
            )

        def unwrap(value):
            return value.dequantize() if isinstance(value, Float8ActivationTensor) else value

        return func(
            *torch.utils._pytree.tree_map(unwrap, args),
            **torch.utils._pytree.tree_map(unwrap, kwargs),
        )


def _dequantize_parts(fp8, dtype: torch.dtype) -> torch.Tensor:
    if fp8._data is not None:
        return dequantize(fp8._data, fp8._scale_inv, dtype)
    columns = dequantize(fp8._transpose, fp8._scale_inv, dtype).t()
    return columns.reshape(*columns.shape[:-1], columns.shape[-1])


class Float8Quantizer:
    """TE's delayed-scaling ``Float8Quantizer`` for an activation: usage flags, ``internal``,
    the cast (``__call__``) and ``make_empty`` (``quantized_tensor.py:281-333``,
    ``tensor/float8_tensor.py``). Scale 1: delayed scaling's initial scale (module docstring)."""

    def __init__(self) -> None:
        self.scale = torch.ones(1)
        self.internal = False
        self.rowwise_usage, self.columnwise_usage = True, True
        self.casts = 0

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def __call__(self, tensor: torch.Tensor):
        """``tensor`` ``[tokens, ..., h]`` cast to FP8 with this quantizer's usage."""
        self.casts += 1
        data = (tensor.detach().float() * self.scale).to(FP8_DTYPE).view(torch.uint8)
        transpose = (
            data.reshape(-1, data.shape[-1]).t().contiguous() if self.columnwise_usage else None
        )
        return self._wrap(
            data if self.rowwise_usage else None, transpose, tensor.dtype, tensor.shape
        )

    def make_empty(
        self, shape, *, dtype: torch.dtype = torch.float32, device=None, requires_grad=False
    ):
        data = torch.empty(list(shape), dtype=torch.uint8, device=device)
        return self._wrap(data, None, dtype, torch.Size(shape))

    def _wrap(self, data, transpose, dtype: torch.dtype, shape):
        scale_inv = (1.0 / self.scale).reshape(1)
        if self.internal:
            return Float8ActivationStorage(data, transpose, scale_inv, dtype)
        return Float8ActivationTensor(data, transpose, scale_inv, dtype, shape)


def gather_along_first_dim(inp, process_group, async_op: bool = False, quantizer=None):
    """TE's ``gather_along_first_dim`` (``transformer_engine/pytorch/distributed.py``) for plain and FP8 tensors
    (``distributed.py:982-1073``, ``1640-1710``): ``(output [tp * tokens, ...], handle or None)``.

    FP8: a plain ``inp`` is cast row-wise first; the output comes from ``quantizer.make_empty``
    (or like ``inp`` without one), takes ``inp``'s ``_scale_inv`` (delayed scaling's scales are
    the same on every rank) and receives the gathered ``_data``.
    """
    if quantizer is not None and not _quantized(inp):
        with _usage(quantizer, rowwise=True, columnwise=False):
            inp = quantizer(inp)
    if not _quantized(inp):
        output = inp.new_empty((inp.shape[0] * process_group.size(), *inp.shape[1:]))
        handle = dist.all_gather_into_tensor(
            output, inp.contiguous(), group=process_group, async_op=async_op
        )
        return output, handle
    shape = [inp._data.shape[0] * process_group.size(), *inp._data.shape[1:]]
    if quantizer is not None:
        with _usage(quantizer, rowwise=True, columnwise=quantizer.columnwise_usage):
            output = quantizer.make_empty(shape, dtype=inp.dtype, device=inp._data.device)
    else:
        output = Float8ActivationTensor(
            torch.empty(shape, dtype=torch.uint8), None, inp._scale_inv, inp.dtype
        )
    output._scale_inv = inp._scale_inv
    handle = dist.all_gather_into_tensor(
        output._data, inp._data.contiguous(), group=process_group, async_op=async_op
    )
    return output, handle


def _quantized(value) -> bool:
    return isinstance(value, (Float8ActivationTensor, Float8ActivationStorage))


@contextlib.contextmanager
def _usage(quantizer: Float8Quantizer, *, rowwise: bool, columnwise: bool):
    """``quantizer`` with this usage inside, its own restored after (as TE's gather does)."""
    saved = quantizer.rowwise_usage, quantizer.columnwise_usage
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    try:
        yield
    finally:
        quantizer.set_usage(rowwise=saved[0], columnwise=saved[1])


class Fp8Linear(torch.autograd.Function):
    """TE's ``_Linear`` under FP8 for one call: ``Y = X W^T (+ b)`` with ``W`` from its FP8 copy
    and ``X`` cast by the module's input quantizer, as ``linear.py:330-394`` casts it.

    Shapes: ``X`` ``[s, b, in]`` (under sequence parallelism with ``gather``: this rank's
    ``[s/tp, b, in]``, cast row-wise and gathered in FP8 inside as TE does, the FP8 shard kept
    and gathered again in backward; already an FP8 tensor: used and saved as it is),
    ``W`` ``[out, in]``, ``Y`` ``[s, b, out]``. ``dX`` reads the saved ``_transpose``; with
    ``fuse_wgrad`` ``dW`` goes into ``W.main_grad`` (overwriting it when ``is_first_microbatch``
    is True) and the backward returns :func:`get_dummy_wgrad`. ``dX`` is all-reduced over
    ``allreduce_group`` (column linear without SP) or reduce-scattered over ``gather`` (SP).
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, fp8_weight, options: dict):
        storage = None if isinstance(fp8_weight, Float8WeightTensor) else fp8_weight
        group = options.get("gather")
        total, saved_input = _fp8_input(input_, options["input_quantizer"], group)
        parts = (
            fp8_weight.parts()
            if storage is None
            else (fp8_weight._data, None, fp8_weight._scale_inv)
        )
        w = dequantize(parts[0], parts[2], input_.dtype)
        output = torch.matmul(total.dequantize(), w.t())
        if bias is not None:
            output = output + bias
        # quantized_tensor.py:137-155: a storage is saved as its plain parts, a tensor as itself.
        input_parts = (
            saved_input.prepare_for_saving()
            if isinstance(saved_input, Float8ActivationStorage)
            else [saved_input]
        )
        ctx.save_for_backward(*input_parts, *_weight_parts(fp8_weight))
        # Only a storage's emptied shell rides on ctx: a tensor must go through the saved-
        # tensor hooks (Domino's keep only its shard), not stay referenced here.
        ctx.input_parts = len(input_parts)
        ctx.input_storage = (
            saved_input if isinstance(saved_input, Float8ActivationStorage) else None
        )
        ctx.storage, ctx.weight, ctx.options, ctx.has_bias = (
            storage,
            weight,
            options,
            bias is not None,
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        input_parts, saved = saved[: ctx.input_parts], saved[ctx.input_parts :]
        _data, transpose, scale_inv = _restore_parts(saved, ctx.storage)
        options, weight = ctx.options, ctx.weight
        group = options.get("gather")
        grad_input = torch.matmul(
            grad_output, dequantize(transpose, scale_inv, grad_output.dtype).t()
        )
        if group is not None:
            grad_input = _reduce_scatter(grad_input, group)
        elif options.get("allreduce_group") is not None:
            dist.all_reduce(grad_input, group=options["allreduce_group"])
        total = _saved_fp8_input(ctx.input_storage, input_parts, group)
        total.update_usage(columnwise_usage=True)  # linear.py:1113-1115: wgrad reads columns
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        total_2d = total.dequantize(grad_output.dtype).reshape(-1, total.shape[-1])
        wgrad = grad_2d.t().matmul(total_2d)
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


def _fp8_input(input_, quantizer: Float8Quantizer, group):
    """``(FP8 input the GEMM reads, what is saved of it)`` (``linear.py:342-394, 556-616``)."""
    if _quantized(input_):
        input_.update_usage(rowwise_usage=True)
        return input_, input_  # the "inp" alias: saved as the object it came as
    if group is not None:
        quantizer.set_usage(rowwise=True, columnwise=False)  # no FP8 column-wise all-gather
        shard = quantizer(input_)
        total, _ = gather_along_first_dim(shard, group, quantizer=quantizer)
        return total, shard  # the row-wise shard, gathered again in backward
    quantizer.set_usage(rowwise=True, columnwise=True)
    total = quantizer(input_)
    saved = Float8ActivationStorage(None, total._transpose, total._scale_inv, total.dtype)
    return total, saved  # row-wise data discarded: only the column-wise copy is kept


def _saved_fp8_input(storage, parts: list, group):
    """The FP8 input the weight-gradient GEMM reads, restored from what forward saved."""
    if isinstance(storage, Float8ActivationStorage):
        storage.restore_from_saved(parts)
        saved = storage
    else:
        (saved,) = parts
    if group is None:
        return saved if isinstance(saved, Float8ActivationTensor) else _as_tensor(saved)
    total, _ = gather_along_first_dim(saved, group)  # linear.py:928-955
    return total


def _as_tensor(storage: Float8ActivationStorage) -> Float8ActivationTensor:
    if storage._data is not None:
        return Float8ActivationTensor(
            storage._data, storage._transpose, storage._scale_inv, storage.dtype
        )
    rows = storage._transpose.shape[1]
    shape = torch.Size([rows, storage._transpose.shape[0]])
    return Float8ActivationTensor(
        None, storage._transpose, storage._scale_inv, storage.dtype, shape
    )


def _reduce_scatter(full: torch.Tensor, group) -> torch.Tensor:
    output = full.new_empty((full.shape[0] // group.size(), *full.shape[1:]))
    dist.reduce_scatter_tensor(output, full.contiguous(), group=group)
    return output
