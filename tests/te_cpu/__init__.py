"""Transformer Engine's own Python on the CPU: a backend for its compiled extension, and the boot.

``pip install --no-deps transformer-engine==2.18.0`` installs all of TE's PyTorch code; what
is missing on a machine without CUDA is the compiled extension ``transformer_engine_torch``
(and ``libtransformer_engine.so`` behind it). :func:`boot` makes TE importable and runnable
here, using TE's own switches and nothing of its code:

0. TE's directory on ``sys.path``: ``make install`` puts TE in a folder of its own
   (``.venv/transformer-engine-<version>``, :data:`SUITE_TE_VERSION` unless
   ``MEGATRON_DOMINO_TE_HOME`` names another), not in the virtual environment, because an
   importable ``transformer_engine`` without its compiled parts makes Megatron-Core's import
   fail in every other process (TE raises ``RuntimeError``, not ``ImportError``);
1. ``NVTE_PROJECT_BUILDING=1`` (TE ``common/__init__.py``: skip loading cuDNN, NVRTC, cuRAND
   and the core library) and ``NVTE_TORCH_COMPILE=0`` (``pytorch/jit.py``: no
   ``torch.compile`` around TE's fusions);
2. the backend module below registered as ``transformer_engine_torch``, and TE's
   ``load_framework_extension`` (which would load the ``.so``) made a no-op;
3. TE's CUDA questions answered for TE's callers only (:mod:`te_cpu.cuda_answers`);
4. gloo given a coalescing manager that runs each collective as issued
   (:mod:`te_cpu.coalescing`), for TE's FP8 block all-gather.

The backend is the extension's functions that a step of TE's ``Linear``,
``LayerNormLinear``, norms and unfused attention calls (:mod:`te_cpu.gemm`,
:mod:`te_cpu.fp8`, :mod:`te_cpu.norms`, :mod:`te_cpu.softmax`, :mod:`te_cpu.activations`),
its enums (:mod:`te_cpu.enums`) and a few version
queries. Every other name TE binds at import is a placeholder class that raises, naming the
function, when TE calls it: what a GPU alone runs (fused attention, userbuffers, MXFP8/NVFP4,
the multi-tensor optimizer kernels) is never modelled silently. TE is booted only in the
processes of TE tests (``multiproc.run_on_ranks(..., te=True)``), so Megatron-Core elsewhere
runs as it does for a user without TE.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

__all__ = ["SUITE_TE_VERSION", "boot", "installed_te_version", "te_home", "te_version_line"]

_MODULE = "transformer_engine_torch"
#: The TE release the suite runs (``make install``; ``make test-te TE=x.y.z`` runs another).
SUITE_TE_VERSION = "2.18.0"
_CHECKOUT = Path(__file__).resolve().parents[2]


def te_home() -> Path:
    """The folder holding the ``transformer_engine`` package the TE tests run:
    ``MEGATRON_DOMINO_TE_HOME`` (a relative one, as the Makefile passes it, is the checkout's,
    whatever folder a test's subprocess runs in), else the suite's release in ``.venv``."""
    home = os.environ.get("MEGATRON_DOMINO_TE_HOME")
    if home:
        return Path(home) if Path(home).is_absolute() else _CHECKOUT / home
    return _CHECKOUT / ".venv" / f"transformer-engine-{SUITE_TE_VERSION}"


class _Unavailable:
    """A name of TE's extension that the CPU backend does not provide: calling it (or
    constructing it) raises; it can still stand in a type hint or an ``isinstance``."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"transformer_engine_torch.{cls.__name__} is not provided by the CPU backend "
            "(tests/te_cpu): it runs on a GPU only"
        )


def _extension() -> types.ModuleType:
    from te_cpu import activations, enums, fp8, gemm, norms, softmax

    module = types.ModuleType(_MODULE, __doc__)
    for source in (activations, enums, fp8, gemm, norms, softmax):
        for name in source.__all__:
            setattr(module, name, getattr(source, name))
    module.get_cudnn_version = lambda: 91000
    module.get_cublasLt_version = lambda: 130000
    module.get_num_cublas_streams = lambda: 4
    module.get_fused_attn_backend = _no_fused_attention
    module.__getattr__ = lambda name: (
        _unavailable(name) if not name.startswith("__") else _no_attribute(name)
    )
    return module


def _no_fused_attention(*args, **kwargs):
    """No cuDNN attention here, so TE picks its unfused attention (its own Python). TE 2.18 passes
    the attention's parameters one by one and takes the backend; TE 2.20 passes one
    ``FusedAttentionParams`` and takes ``(backend, why not)``."""
    from te_cpu.enums import NVTE_Fused_Attn_Backend

    if len(args) == 1 and not kwargs:
        return NVTE_Fused_Attn_Backend.NVTE_No_Backend, "the CPU backend has no fused attention"
    return NVTE_Fused_Attn_Backend.NVTE_No_Backend


def _unavailable(name: str) -> type:
    return type(name, (_Unavailable,), {"__module__": _MODULE})


def _no_attribute(name: str):
    raise AttributeError(name)


def boot() -> types.ModuleType:
    """Make ``import transformer_engine.pytorch`` work on this CPU (module docstring); returns
    ``transformer_engine.pytorch``. Call it before anything imports Megatron-Core, whose
    ``HAVE_TE`` is decided at import."""
    if _MODULE in sys.modules:
        return importlib.import_module("transformer_engine.pytorch")
    home = te_home()
    if not (home / "transformer_engine").is_dir():
        raise ImportError(
            f"Transformer Engine is not installed in {home}: run `make install` (or "
            "`make test-te TE=x.y.z` for another release)"
        )
    sys.path.insert(0, str(home))
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    os.environ["NVTE_TORCH_COMPILE"] = "0"
    from te_cpu.coalescing import coalesce_on_gloo
    from te_cpu.cuda_answers import answer_te_cuda_questions

    answer_te_cuda_questions()
    coalesce_on_gloo()
    sys.modules[_MODULE] = _extension()
    import transformer_engine.common

    transformer_engine.common.load_framework_extension = lambda framework: None
    return importlib.import_module("transformer_engine.pytorch")


def installed_te_version() -> str | None:
    """The version of the TE in :func:`te_home`, or ``None`` where there is none."""
    from importlib.metadata import PathDistribution

    found = sorted(te_home().glob("transformer_engine-*.dist-info"))
    return PathDistribution(found[0]).version if found else None


def te_version_line() -> str:
    """What the pytest header prints: the TE the suite runs, and on what."""
    found = installed_te_version()
    if found is None:
        return f"transformer-engine: none in {te_home()} (run make install)"
    return f"transformer-engine {found} (TE's Python, CPU backend), from {te_home()}"
