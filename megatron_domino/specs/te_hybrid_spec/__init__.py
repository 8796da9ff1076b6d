"""``--spec megatron_domino.specs.te_hybrid_spec te_norms_apart_hybrid_stack_spec``: a
``HybridModel`` of Transformer Engine's layers with their norms apart, the stack Domino runs
under ``--sequence-parallel`` on TE (:mod:`megatron_domino.specs.hybrid_spec`,
:mod:`megatron_domino.specs.te_spec`).

Built when first asked for, so that importing this imports no Transformer Engine. Megatron-LM
reads a ``--spec`` from the module's namespace (``vars(module)[name]`` after
``__import__(module, fromlist=[name])``, ``megatron/core/transformer/spec_utils.py``); for a
package, that import asks for the name first (``hasattr``), which builds the spec into the
namespace: hence a package, not a module.
"""

from __future__ import annotations

__all__ = ["te_norms_apart_hybrid_stack_spec"]


def __getattr__(name: str):
    """Build ``te_norms_apart_hybrid_stack_spec`` (the ``HybridStack`` spec of TE norms-apart
    ``*`` and ``-`` layers) when first asked for; raises ``ImportError`` without TE."""
    if name != "te_norms_apart_hybrid_stack_spec":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron_domino.specs.hybrid_spec import hybrid_stack_spec
    from megatron_domino.specs.te_spec import te_norms_apart_layer_spec

    spec = globals()[name] = hybrid_stack_spec(te_norms_apart_layer_spec())
    return spec
