"""Megatron-Core's GPTModel at TP = 2 and TP = 4 on the CPU computes what TP = 1 computes.

A TP = 1 model is built once per configuration; its weights are cut into each TP rank's
shards (:func:`sharding.shard_state_dict`) and every rank runs the same batch.
Logits (this rank's vocabulary shard ``[b, s, V_pad / TP]``), the per-token loss ``[b, s]``
and every parameter's gradient (this rank's shard) must match the TP = 1 run. Dropout is off,
so the only difference is the order of floating-point sums: the row-parallel all-reduce adds
TP partial products, and TP-split GEMMs accumulate over fewer terms.

Tolerances (fp32): ``atol = 1e-6, rtol = 1e-5``. Reordered fp32 sums differ by a few ulp; the
largest differences measured are 4e-7 on logits (|x| <= ~1), 5e-7 on the loss (~6.6) and
1e-7 on gradients (|g| <= 0.25). A sharding mistake (a wrong block, a swapped gate/up half)
gives differences of the order of the values themselves (0.1 on the logits).
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_on_ranks
from sharding import shard_like, shard_state_dict

from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from lab.models.model_options import LLAMA_FLAVOUR

ATOL = 1e-6
RTOL = 1e-5
BATCH = 2

_TINY = dict(
    num_layers=2,
    hidden_size=64,
    seq_length=32,
    # Padded to 512 at TP 1, 2 and 4 alike (multiples of 128, 256, 512), so shapes agree.
    vocab_size=500,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

CONFIGS = {
    "layernorm-gelu-learned": GPTOptions(**_TINY, num_attention_heads=4),
    "rmsnorm-swiglu-rope-gqa-nobias": GPTOptions(
        **{**_TINY, **LLAMA_FLAVOUR},
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=128,
        untie_embeddings_and_output_weights=True,
    ),
}


def _batch(options: GPTOptions) -> dict[str, torch.Tensor]:
    """The same fixed batch on every rank: tokens and labels ``[b, s]``, mask ``[1, 1, s, s]``."""
    s = options.seq_length
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, options.vocab_size, (BATCH, s), generator=generator),
        "position_ids": torch.arange(s).expand(BATCH, s),
        "attention_mask": causal_attention_mask(s, "cpu"),
        "labels": torch.randint(0, options.vocab_size, (BATCH, s), generator=generator),
    }


def _forward_backward(model: torch.nn.Module, options: GPTOptions):
    """Logits ``[b, s, V_pad / TP]`` and loss ``[b, s]`` of one batch; gradients of the mean loss."""
    batch = _batch(options)
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch)
    loss = model(**batch, labels=labels)
    loss.mean().backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    return logits, loss.detach(), grads


def _reference(options: GPTOptions):
    """On one rank (TP = 1): the full weights and what they compute."""
    model = build_gpt_model(options)
    return (model.state_dict(), *_forward_backward(model, options))


def _check_tensor_parallel_rank(options: GPTOptions, reference) -> int:
    """On every TP rank: load the shards of the reference weights and compare against it."""
    from megatron.core import parallel_state

    full_state, full_logits, full_loss, full_grads = reference
    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model = build_gpt_model(options)
    model.load_state_dict(shard_state_dict(full_state, model, rank=rank, world_size=tp))
    logits, loss, grads = _forward_backward(model, options)

    vocab_shard = full_logits.shape[-1] // tp
    expected_logits = full_logits[..., rank * vocab_shard : (rank + 1) * vocab_shard]
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=RTOL, msg=_msg("logits"))
    torch.testing.assert_close(loss, full_loss, atol=ATOL, rtol=RTOL, msg=_msg("loss"))
    assert grads.keys() == full_grads.keys()
    for name, param in model.named_parameters():
        expected = shard_like(full_grads[name], param, rank=rank, world_size=tp)
        torch.testing.assert_close(grads[name], expected, atol=ATOL, rtol=RTOL, msg=_msg(name))
    return len(grads)


def _msg(what: str):
    return lambda default: f"{what} differs from TP = 1:\n{default}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config(request):
    """A configuration and its TP = 1 reference, computed once for all TP sizes."""
    options = CONFIGS[request.param]
    (reference,) = run_on_ranks(_reference, 1, args=(options,))
    return options, reference


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_tp1(config, tp):
    options, reference = config
    checked = run_on_ranks(_check_tensor_parallel_rank, tp, args=(options, reference))
    assert checked == [len(reference[3])] * tp
