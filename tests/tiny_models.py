"""Tiny GPT shapes shared by the multi-rank Domino tests (fp32 by default, dropout off, so two
runs of the same arithmetic compare to rounding).

* :data:`TINY`: hidden 64, sequence 16, vocabulary 300; with GPTOptions' defaults (LayerNorm,
  GeLU, learned positions, biases) the GPT-3 flavour.
* :data:`LLAMA_STYLE`: :data:`TINY` in the Llama flavour the tools use
  (:data:`lab.models.model_options.LLAMA_FLAVOUR`: RMSNorm, SwiGLU, rotary
  positions), FFN 96 and grouped-query attention (8 heads, 4 key/value groups), its linear
  biases kept (GPTOptions' default: the bias paths run too; a test that wants Llama's own
  passes ``add_bias_linear=False``).
* :data:`PRODUCTION_DEFAULTS`: :data:`LLAMA_STYLE` with Megatron-LM's defaults turned back on
  as far as the CPU runs them (``tests/ranks/test_production_defaults.py``): bf16, sequence
  parallelism, the bias-activation and bias-dropout-add fusions, the masked-softmax flag (at
  16 tokens Megatron takes torch's softmax on any device) and gradient-accumulation fusion
  (the fused weight-gradient GEMM is a CPU stand-in, ``tests/fused_wgrad_stand_in.py``, and
  the model must be wrapped in Megatron DDP). Dropout stays off, as in every shape here.
"""

from lab.models.model_options import LLAMA_FLAVOUR

TINY = dict(
    hidden_size=64, seq_length=16, vocab_size=300, attention_dropout=0.0, hidden_dropout=0.0
)
LLAMA_STYLE = dict(
    TINY,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=96,
    **{name: value for name, value in LLAMA_FLAVOUR.items() if name != "add_bias_linear"},
)
PRODUCTION_DEFAULTS = dict(
    LLAMA_STYLE,
    bf16=True,
    sequence_parallel=True,
    bias_activation_fusion=True,
    bias_dropout_fusion=True,
    masked_softmax_fusion=True,
    gradient_accumulation_fusion=True,
)
