"""The bench's model shapes (cases) and the Domino settings it runs on them.

Apart from :mod:`lab.bench.cli` so that the host-time row
(:mod:`lab.bench.host_time`) can name the same settings without importing
the command line.
"""

from __future__ import annotations

from lab.models.model_options import LLAMA_FLAVOUR

__all__ = ["ABLATIONS", "CASES", "SETTINGS"]

#: Shapes where each chunk keeps 512 tokens (s * b / p at p = 2): smaller chunks lose CPU GEMM
#: efficiency and pay for accumulating each weight gradient once per chunk, which is not the
#: regime of real training (thousands of tokens per chunk). h = 1024 keeps gloo's CPU cost per
#: byte small next to the wire time at a 25-45 % communication share.
_MODEL = dict(
    num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=256, vocab_size=1024,
    attention_dropout=0.0, hidden_dropout=0.0,
)  # fmt: skip
_LLAMA = dict(_MODEL, **LLAMA_FLAVOUR, num_query_groups=4, ffn_hidden_size=2816)
#: The shape of the DeepSpeed comparison in ../shared/docs/deepspeed-domino.md (h = 512, ffn
#: 2048, 8 heads): 256 tokens per chunk at p = 2, where per-chunk costs weigh more than at
#: h = 1024.
_MODEL_H512 = dict(_MODEL, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048)
#: The Domino settings the benchmark runs (names: :mod:`megatron_domino.base.settings`).
SETTINGS = ("p2", "p4", "p2-k2", "p1-k2", "s2", "s4")
#: Run only when asked for (``--settings``): the backward order autograd derives from the
#: forward (the order before Domino chose its own, an ablation) and each chunk's backward
#: back to back (a negative control: its backward waits must come back).
ABLATIONS = ("p2-autograd-order", "p2-serial-order", "s2-autograd-order")
_BATCH_SETTINGS = ("p2", "p4", "p2-k2", "p1-k2", "p2-autograd-order", "p2-serial-order")
#: Each case runs the settings it lists that were asked for. ``gpt-h1024-l8`` is ``gpt-h1024``
#: twice as deep, so that a result is not carried by the model's two ends (the first chunk's
#: embedding all-reduce and the last chunk's final one, which no schedule can hide: each
#: weighs half as much there). ``llama-h1024-mb1`` has the
#: other cases' 1024 tokens per micro-batch in one sample, where only the column split and the
#: sequence split have something to split. ``hybrid-h1024`` is ``gpt-h1024`` as Megatron-Core's
#: ``HybridModel`` (``pattern``: each layer an attention ``*`` and an MLP ``-`` layer), the same
#: computation and collectives: its overlap should be ``gpt-h1024``'s (its ranks run TE's
#: Python on the CPU backend for ``HybridStack``'s final norm, :mod:`lab.bench.te_worker`).
CASES = {
    "gpt-h1024": dict(model=_MODEL, micro_batch_size=4, settings=_BATCH_SETTINGS),
    "gpt-h1024-l8": dict(
        model=dict(_MODEL, num_layers=8), micro_batch_size=4, settings=_BATCH_SETTINGS
    ),
    "gpt-h512": dict(model=_MODEL_H512, micro_batch_size=4, settings=_BATCH_SETTINGS),
    "llama-h1024": dict(model=_LLAMA, micro_batch_size=4, settings=_BATCH_SETTINGS),
    "gpt-h1024-sp": dict(
        model=dict(_MODEL, sequence_parallel=True), micro_batch_size=4, settings=_BATCH_SETTINGS
    ),
    "hybrid-h1024": dict(
        model=_MODEL, pattern="*-" * 4, micro_batch_size=4, settings=_BATCH_SETTINGS
    ),
    "llama-h1024-mb1": dict(
        model=dict(_LLAMA, seq_length=1024),
        micro_batch_size=1,
        settings=("p1-k2", "s2", "s4", "s2-autograd-order"),
    ),
}
