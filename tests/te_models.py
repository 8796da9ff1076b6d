"""Real Transformer Engine models, and probes of what TE ran, for the TE tests' ranks.

Everything here runs in ranks with TE's own Python booted (``run_on_ranks(..., te=True)``,
:mod:`te_cpu`); the pytest process may import this module (it imports no TE at import time).

* :func:`te_options` and :func:`te_spec`: the tiny Llama-style model (:data:`tiny_models.LLAMA_STYLE`,
  2 layers) on TE layers: Megatron-Core's TE spec (``TELayerNormColumnParallelLinear``,
  ``TERowParallelLinear``, ``TEDotProductAttention``) without sequence parallelism, and under it
  the layer Domino runs there, its norms apart (``TENorm`` + ``TEColumnParallelLinear``,
  :mod:`megatron_domino.specs.te_spec`; the fused module is refused under SP).
* :class:`TECalls`: each TE linear and attention call as TE received it. Domino calls
  ``type(module).forward(module, x)``, so module hooks do not fire; instead, for the life of
  the context, the ``forward`` of TE's ``Linear``, ``LayerNormLinear`` and
  ``DotProductAttention`` (which Megatron's wrappers reach through ``super().forward``) is
  wrapped to log the module's ``parallel_mode`` and ``sequence_parallel``, the
  ``is_first_microbatch`` argument, the attention mask type and shapes, and which FP8 autocast
  the call ran in (TE's ``FP8GlobalStateManager``: its depth, and a serial number per
  ``autocast_enter``). It also counts TE's delayed-scaling updates (forward and backward).
* :func:`fp8_meta_state`, :func:`load_fp8_meta_state` and :func:`fp8_start_fixed`: every TE
  module's delayed-scaling state (``fp8_meta["scaling_fwd"|"scaling_bwd"]``' ``scale`` and
  ``amax_history``), copied out or in by module name, and a context in which every forward of
  a model starts from the same state, so two FP8 steps compare.
* :func:`main_grad_gemms`: the GEMMs of TE's extension that wrote a weight's ``main_grad``
  (fused weight-gradient accumulation), with their dtypes and whether they accumulated.
* :func:`megatron_optimizer_without_te_kernels`: Megatron-Core's optimizer as it runs without
  TE, where TE's fused Adam and multi-tensor kernels (GPU-only) would otherwise be taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

import torch
from tiny_models import LLAMA_STYLE

from lab.models.gpt_model import GPTOptions
from megatron_domino.specs.te_spec import te_norms_apart_layer_spec

LAYERS = 2
#: FP8 delayed scaling (``--fp8-format hybrid --fp8-recipe delayed``) with an amax history of
#: 4 steps (Megatron's default of 1 leaves the history zeroed after every update, so only the
#: scales would show what a step recorded).
FP8_DELAYED = dict(
    fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max"
)


def te_options(sequence_parallel: bool, **changes) -> GPTOptions:
    """:data:`tiny_models.LLAMA_STYLE` with :data:`LAYERS` layers on TE
    (``transformer_impl="transformer_engine"``), fp32 unless ``changes`` say otherwise."""
    return GPTOptions(
        **{
            **LLAMA_STYLE,
            "num_layers": LAYERS,
            "sequence_parallel": sequence_parallel,
            "transformer_impl": "transformer_engine",
            **changes,
        }
    )


def te_spec(sequence_parallel: bool, *, fused_norms: bool | None = None, **changes):
    """The TE layer Domino runs: Megatron-Core's TE spec (norms fused into the column
    linears) without SP, the norms-apart spec under it; ``fused_norms`` overrides the choice,
    ``changes`` go to the spec builder (e.g. ``use_te_activation_func``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    fused = not sequence_parallel if fused_norms is None else fused_norms
    if fused:
        return get_gpt_layer_with_transformer_engine_spec(**changes)
    return te_norms_apart_layer_spec(**changes)


def fused_twin(options: GPTOptions, model: torch.nn.Module) -> torch.nn.Module:
    """Stock's TE layer under SP (the norms fused into the column linears, as Megatron-LM builds
    it without ``--spec``) with ``model``'s weights: the norms-apart layer's ``state_dict`` is
    the fused layer's (TE's pickled FP8 state left out). Under FP8 Domino reproduces its one
    rounding of the norm output, where the norms-apart layer without Domino rounds twice."""
    from lab.models.gpt_model import build_gpt_model

    fused = build_gpt_model(options, spec=te_spec(True, fused_norms=True))
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    fused.load_state_dict(weights, strict=False)
    return fused


@dataclasses.dataclass(frozen=True)
class LinearCall:
    """One TE linear forward: the settings TE ran it with, and the FP8 autocast it was in
    (``autocast`` 0 and ``depth`` 0: none)."""

    parallel_mode: str | None
    sequence_parallel: bool
    is_first_microbatch: bool | None
    autocast: int
    depth: int


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One TE attention forward: the mask type TE got, query and key lengths, and whether a
    mask tensor came with it."""

    attn_mask_type: str
    sq: int
    sk: int
    mask_given: bool


class TECalls:
    """TE's forwards logged per module, and TE's delayed-scaling updates counted (see the
    module docstring). A context manager: the wrappers are installed on entry and removed on
    exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        import transformer_engine.pytorch as te

        self._classes = (te.Linear, te.LayerNormLinear, te.DotProductAttention)
        self.modules = [m for m in model.modules() if isinstance(m, self._classes)]
        self.calls: dict[int, list] = {id(m): [] for m in self.modules}
        #: ``autocast_enter`` calls with FP8 enabled (the serial of the latest one).
        self.autocasts = 0
        #: TE's amax reductions and scale updates: ``{"forward": n, "backward": n}``.
        self.scale_updates = {"forward": 0, "backward": 0}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TECalls:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        self._state = FP8GlobalStateManager.quantization_state
        for cls in self._classes:
            forward = cls.__dict__["forward"]
            describe = _attention_call if cls is te.DotProductAttention else self._linear_call
            self._replace(cls, "forward", self._logging(forward, describe))
        enter = FP8GlobalStateManager.autocast_enter
        update = FP8GlobalStateManager.reduce_and_update_fp8_tensors

        def autocast_enter(cls, enabled=False, *args, **kwargs):
            self.autocasts += bool(enabled)
            return enter(enabled, *args, **kwargs)

        def reduce_and_update(cls, forward=True):
            self.scale_updates["forward" if forward else "backward"] += 1
            return update(forward)

        self._replace(FP8GlobalStateManager, "autocast_enter", classmethod(autocast_enter))
        self._replace(
            FP8GlobalStateManager, "reduce_and_update_fp8_tensors", classmethod(reduce_and_update)
        )
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _replace(self, owner: type, name: str, replacement) -> None:
        saved = owner.__dict__[name]
        setattr(owner, name, replacement)
        self._stack.callback(setattr, owner, name, saved)

    def _logging(self, forward, describe):
        def logged(module, *args, **kwargs):
            if id(module) in self.calls:
                self.calls[id(module)].append(describe(module, *args, **kwargs))
            return forward(module, *args, **kwargs)

        return logged

    def _linear_call(self, module, inp, is_first_microbatch=None, *args, **kwargs) -> LinearCall:
        depth = self._state.autocast_depth if self._state.fp8_enabled else 0
        return LinearCall(
            module.parallel_mode,
            module.sequence_parallel,
            is_first_microbatch,
            self.autocasts if depth else 0,
            depth,
        )

    def take(self) -> list[list]:
        """Each module's calls since the last take (the log starts afresh), in model order:
        ``observe`` of :func:`~lab.analysis.equivalence.compare_with_stock`."""
        taken = [self.calls[id(m)][:] for m in self.modules]
        for calls in self.calls.values():
            calls.clear()
        return taken


def _attention_call(module, query, key, value, attention_mask=None, *args, **kwargs):
    mask_type = kwargs.get("attn_mask_type") or module.attn_mask_type
    return AttentionCall(mask_type, query.shape[0], key.shape[0], attention_mask is not None)


def fp8_meta_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every TE module's delayed-scaling state, copied: ``"<module>:<scaling_fwd|scaling_bwd>.
    <scale|amax_history>"`` -> tensor (modules that have not run in FP8 have none)."""
    return {
        f"{name}:{key}.{field}": getattr(meta[key], field).clone()
        for name, meta in _fp8_metas(model)
        for key in ("scaling_fwd", "scaling_bwd")
        if key in meta
        for field in ("scale", "amax_history")
    }


@contextlib.contextmanager
def fp8_start_fixed(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Every forward of ``model`` in this context starts from the FP8 state it had on entry
    (restored in place, so TE's global buffers keep pointing at it): delayed scaling
    updates scales and amax histories at every step, so without this two runs of the same
    step differ. Yields that state."""
    start = fp8_meta_state(model)
    handle = model.register_forward_pre_hook(lambda *_: load_fp8_meta_state(model, start))
    try:
        yield start
    finally:
        handle.remove()


def load_fp8_meta_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`fp8_meta_state`'s ``state`` into ``model``'s TE modules, in place (TE's
    global amax buffers hold views of these tensors)."""
    metas = dict(_fp8_metas(model))
    for key, value in state.items():
        name, field = key.split(":")
        scaling, attribute = field.split(".")
        getattr(metas[name][scaling], attribute).copy_(value)


def _fp8_metas(model: torch.nn.Module):
    return [
        (name, module.fp8_meta)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "fp8_meta", None), dict)
    ]


@dataclasses.dataclass(frozen=True)
class WeightGradientGemm:
    """One GEMM of TE's extension that wrote a weight's ``main_grad`` (fused weight-gradient
    accumulation): the weight, the operands' and ``main_grad``'s dtypes, and whether it added
    to ``main_grad`` (``accumulate``) or overwrote it."""

    weight: str
    operand_dtypes: tuple[torch.dtype, torch.dtype]
    main_grad_dtype: torch.dtype
    accumulate: bool


@contextlib.contextmanager
def gemms_into(targets: set[int], on_call) -> Iterator[None]:
    """While open, every GEMM of TE's extension (``generic_gemm``, which TE's ``general_gemm``
    calls) whose output ``D`` has a ``data_ptr`` in ``targets`` is first shown to
    ``on_call(call)`` (its arguments by name); a result other than ``None`` is returned in
    place of running the GEMM."""
    import transformer_engine_torch as tex

    generic_gemm = tex.generic_gemm
    signature = inspect.signature(generic_gemm)

    def wrapped(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        out = call["D"]
        if out is not None and out.data_ptr() in targets:
            replaced = on_call(call)
            if replaced is not None:
                return replaced
        return generic_gemm(*args, **kwargs)

    tex.generic_gemm = wrapped
    try:
        yield
    finally:
        tex.generic_gemm = generic_gemm


@contextlib.contextmanager
def main_grad_gemms(model: torch.nn.Module) -> Iterator[list[WeightGradientGemm]]:
    """The GEMMs TE runs into the ``main_grad`` of ``model``'s weights while the context is
    open (:func:`gemms_into`)."""
    names = {
        param.main_grad.data_ptr(): name.removeprefix("module.").removeprefix("module.")
        for name, param in model.named_parameters()
        if getattr(param, "main_grad", None) is not None
    }
    found: list[WeightGradientGemm] = []

    def record(call) -> None:
        out = call["D"]
        found.append(
            WeightGradientGemm(
                names[out.data_ptr()],
                (call["A"].dtype, call["B"].dtype),
                out.dtype,
                call["accumulate"],
            )  # fmt: skip
        )

    with gemms_into(set(names), record):
        yield found


@contextlib.contextmanager
def megatron_optimizer_without_te_kernels() -> Iterator[None]:
    """Megatron-Core's optimizer as it runs without TE or Apex, in a rank where TE is booted.

    With TE importable, Megatron-Core 0.19 takes TE's ``FusedAdam`` and TE's multi-tensor
    kernels (gradient norm, clipping, copies: ``megatron/core/optimizer/__init__.py``,
    ``optimizer.py``, ``clip_grads.py``), which run on a GPU only (:mod:`te_cpu` refuses
    them). For the context, those modules' names point at what they bind when neither TE nor
    Apex imports: torch's ``AdamW`` and Megatron's own ``local_multi_tensor_*`` functions."""
    from megatron.core import optimizer, utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    replacements = {
        optimizer: dict(Adam=torch.optim.AdamW, SGD=torch.optim.SGD, USING_PYTORCH_OPTIMIZER=True),
        clip_grads: dict(
            multi_tensor_applier=utils.local_multi_tensor_applier,
            l2_norm_impl=utils.local_multi_tensor_l2_norm,
            multi_tensor_scale_impl=utils.local_multi_tensor_scale,
            multi_tensor_scale_tensor_impl=None,
        ),
        megatron_optimizer: dict(
            multi_tensor_applier=utils.local_multi_tensor_applier,
            multi_tensor_scale_impl=utils.local_multi_tensor_scale,
        ),
    }
    saved = {
        module: {name: getattr(module, name) for name in names}
        for module, names in replacements.items()
    }
    for module, names in replacements.items():
        for name, value in names.items():
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, names in saved.items():
            for name, value in names.items():
                setattr(module, name, value)
