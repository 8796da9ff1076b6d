"""What Megatron-LM ``main`` (megatron-core 0.20.0) changed under Domino, handled on either release.

Checked here on the pinned 0.19.2 wheel by giving its objects the 0.20 attributes; the Domino
suite itself ran on ``main`` with its ``megatron/`` first on ``PYTHONPATH`` (``patches/README.md``
records the commit and the result):

* the local linears' ``_forward_impl`` takes an ``output_dtype`` (0.20): Domino's GEMM calls
  pass the linear's own value where it has one, and nothing on 0.19;
* the mHC layer type (``enable_mhc_connections``, 0.20) is refused by name at flag time, not
  only later by the layer-type check;
* ``TransformerLayer._forward_post_mlp`` became ``_apply_mlp_bda_step`` (0.20): Domino calls
  neither (its schedule runs the layer's ``mlp_bda`` itself, as both do), and a layer class
  that overrides either is refused as not the stock ``TransformerLayer``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from tiny_models import TINY

from lab.models.gpt_model import GPTOptions, transformer_config
from megatron_domino.base.config import DominoConfig
from megatron_domino.engine.row_output import LOCAL_ROW
from megatron_domino.refusals import config_problems, layer_problems


class _RecordingRowLinear(SimpleNamespace):
    """What :data:`LOCAL_ROW` reads of a ``RowParallelLinear``; records ``_forward_impl``'s
    keywords instead of running the GEMM."""

    def _forward_impl(self, **kwargs):
        self.kwargs = kwargs
        return kwargs["input"] @ kwargs["weight"].t()


def _row_linear(**extra) -> _RecordingRowLinear:
    return _RecordingRowLinear(
        weight=torch.ones(4, 8),
        bias=None,
        skip_bias_add=True,
        gradient_accumulation_fusion=False,
        **extra,
    )


@pytest.mark.parametrize("output_dtype", [None, torch.float32])
def test_the_gemm_gets_the_linears_output_dtype_on_0_20(output_dtype):
    module = _row_linear(output_dtype=output_dtype)
    LOCAL_ROW.partial(module, torch.ones(3, 2, 8), 0, 1)
    assert module.kwargs["output_dtype"] is output_dtype


def test_the_gemm_gets_no_output_dtype_on_0_19():
    module = _row_linear()
    LOCAL_ROW.partial(module, torch.ones(3, 2, 8), 0, 1)
    assert "output_dtype" not in module.kwargs


def test_mhc_connections_are_refused_by_name():
    config = transformer_config(
        GPTOptions(num_layers=2, **TINY, num_attention_heads=4), tensor_model_parallel_size=2
    )
    assert config_problems(config, DominoConfig(), tp_size=2, te_layers=False) == []
    config.enable_mhc_connections = True  # a 0.20 TransformerConfig field
    (reason,) = config_problems(config, DominoConfig(), tp_size=2, te_layers=False)
    assert "enable_mhc_connections" in reason and "drop them" in reason


@pytest.mark.parametrize("hook", ["_forward_post_mlp", "_apply_mlp_bda_step"])
def test_a_layer_overriding_the_mlp_bda_step_is_refused(hook):
    subclass = type("CustomLayer", (TransformerLayer,), {hook: lambda self, *args: None})
    layer = object.__new__(subclass)
    assert layer_problems(layer) == ["CustomLayer is not a dense Megatron-Core TransformerLayer"]
