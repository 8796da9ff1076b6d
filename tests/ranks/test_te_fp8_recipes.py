"""The FP8 recipes Hopper users run, on Transformer Engine's own modules: delayed, tensorwise and
blockwise.

Under ``--fp8-recipe tensorwise`` (current scaling) every cast takes the amax of what it casts.
Stock casts a whole micro-batch with one scale; Domino casts each chunk with the amax of that
chunk, reduced over the TP group where stock reduces it (the SP gathers), so every rank casts a
gathered chunk with one scale (:mod:`megatron_domino.communication.te_fp8_inputs`). The chunks' scales
differ from stock's, so Domino is not stock bit for bit; it is held to stock's own FP8 error:
over a short training run (Adam, 6 steps, fixed batches, TP 2), Domino's per-step loss error
against the bf16 run stays within 1.5x stock's FP8 error against it, or within one bf16
rounding of the loss, whichever is larger (the existing bf16 rule of
:mod:`lab.analysis.equivalence`). Delayed scaling runs the same way. The other
recipes are refused with the reason (MXFP8 needs Blackwell; custom recipes are not validated).
Under ``--fp8-recipe blockwise`` (1 x 128 activation tiles, 128 x 128 weight blocks) the
forward is stock's bit for bit (the tiles run along ``h``) and the training loss is held the
same way.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_on_ranks
from te_models import te_spec
from tiny_models import LLAMA_STYLE

pytestmark = pytest.mark.te

STEPS = 6


def _losses(recipe: str, sequence_parallel: bool) -> dict[str, list[float]]:
    """Per-step mean losses of three runs from the same initial weights: bf16, FP8 stock, FP8
    with Domino (p = 2)."""

    from lab.analysis.equivalence import token_batch
    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.settings import setting

    name = "sp-p2" if sequence_parallel else "p2-no-backward-overlap"
    runs = {}
    for arm, fp8, domino in (
        ("bf16", None, False),
        ("stock", "hybrid", False),
        ("domino", "hybrid", True),
    ):
        options = GPTOptions(
            **{**LLAMA_STYLE, "num_layers": 2}, sequence_parallel=sequence_parallel,
            transformer_impl="transformer_engine", bf16=True, fp8_format=fp8, fp8_recipe=recipe,
        )  # fmt: skip
        torch.manual_seed(0)
        model = build_gpt_model(options, spec=te_spec(sequence_parallel))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        with apply_domino(model, setting(name).config) if domino else _nothing():
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                loss = model(**token_batch(options, 4, seed=step)).float().mean()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        runs[arm] = losses
    return runs


class _nothing:  # noqa: N801 - a null context, named for what it applies
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel", "no-sp"])
def test_fp8_training_loss_within_stocks_own_fp8_error(recipe, sequence_parallel):
    runs = run_on_ranks(_losses, 2, args=(recipe, sequence_parallel), te=True)[0]
    bf16, stock, domino = runs["bf16"], runs["stock"], runs["domino"]
    print(runs)
    for step, (exact, theirs, ours) in enumerate(zip(bf16, stock, domino, strict=True)):
        bound = max(1.5 * abs(theirs - exact), 2**-9 * abs(exact))
        assert abs(ours - exact) <= bound, (step, exact, theirs, ours)
    assert stock != bf16, "FP8 must change the losses for the comparison to mean something"


def _gathered_chunk_scales() -> list[float]:
    """Tensorwise + SP, one Domino forward: the scale each norm-output shard was cast with
    before its gather, in order (2 layers x 2 norms x 2 chunks)."""
    import megatron_domino.engine.schedule
    from lab.analysis.equivalence import token_batch
    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig

    options = GPTOptions(
        **{**LLAMA_STYLE, "num_layers": 2}, sequence_parallel=True,
        transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid",
        fp8_recipe="tensorwise",
    )  # fmt: skip
    model = build_gpt_model(options, spec=te_spec(True))
    scales, cast = [], megatron_domino.engine.schedule.quantized_norm_output

    def recording(*args):
        quantized = cast(*args)
        scales.append(quantized._scale_inv.item())
        return quantized

    megatron_domino.engine.schedule.quantized_norm_output = recording
    with torch.no_grad(), apply_domino(model, DominoConfig(chunks=2)):
        model(**token_batch(options, 4))
    return scales


def test_tensorwise_casts_each_gathered_chunk_with_one_scale_on_every_rank():
    """Each rank casts its shard of a chunk with the chunk's amax over all ranks (stock's SP
    gather reduces the amax over the TP group the same way), so the gathered FP8 chunk has one
    scale; the chunks' scales differ from each other (per chunk, not per micro-batch)."""
    first, second = run_on_ranks(_gathered_chunk_scales, 2, te=True)
    assert len(first) == 8 and first == second, (first, second)
    assert len(set(first)) > 1, first


def _refusal(recipe: str) -> str:

    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

    options = GPTOptions(**{**LLAMA_STYLE, "num_layers": 1}, transformer_impl="transformer_engine")
    model = build_gpt_model(options, spec=te_spec(True, fused_norms=True))
    model.config.fp8, model.config.fp8_recipe = "hybrid", recipe
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(chunks=2, backward_overlap=False))
    return str(error.value)


@pytest.mark.parametrize(
    "recipe, expected",
    [("mxfp8", "Blackwell GPUs only"), ("custom", "has not been validated")],
)
def test_other_recipes_are_refused_with_the_reason(recipe, expected):
    message = run_on_ranks(_refusal, 2, args=(recipe,), te=True)[0]
    assert expected in message and "delayed, tensorwise or blockwise" in message, message


def _blockwise_step(seq_length: int = 64) -> dict:
    """Blockwise FP8 + SP, h = 256 (two 1 x 128 tiles per token), stock's fused layer and Domino
    (p = 2) from the same weights: the largest per-token loss difference, and each arm's TP
    bytes per direction. At ``seq_length`` 64, 32 tokens per chunk and rank: TE gathers in bf16
    and casts the gathered tensor (its fallback for shapes not divisible by 128, synchronous).
    At 512, 256: TE's FP8 block gather (its NCCL-coalesced data and scale gathers; on gloo run
    one by one, :mod:`te_cpu.coalescing`)."""

    from lab.analysis.collective_bytes import CollectiveBytes
    from lab.analysis.equivalence import token_batch
    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from lab.models.model_options import LLAMA_FLAVOUR
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig

    options = GPTOptions(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=512, seq_length=seq_length, vocab_size=512, **LLAMA_FLAVOUR,
        sequence_parallel=True, transformer_impl="transformer_engine", bf16=True,
        fp8_format="hybrid", fp8_recipe="blockwise",
    )  # fmt: skip
    stock = build_gpt_model(options, spec=te_spec(True, fused_norms=True))
    apart = build_gpt_model(options, spec=te_spec(True))
    apart.load_state_dict(stock.state_dict())
    batch = token_batch(options, 2)

    def step(model) -> tuple:
        with CollectiveBytes() as forward:
            loss = model(**batch)
        with CollectiveBytes() as backward:
            loss.float().mean().backward()
        return loss.detach(), forward.total, backward.total

    import warnings

    from megatron_domino.communication.te_fp8_inputs import SynchronousGatherWarning

    reference, *stock_bytes = step(stock)
    with apply_domino(apart, DominoConfig(chunks=2)), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss, *domino_bytes = step(apart)
        step(apart)  # a second step: the warning is said once per process
    said = [str(w.message) for w in seen if issubclass(w.category, SynchronousGatherWarning)]
    return dict(
        error=(reference - loss).abs().max().item(), stock=stock_bytes, domino=domino_bytes,
        synchronous=said,
    )  # fmt: skip


def test_blockwise_forward_is_stocks_bit_for_bit_and_tp_bytes_are_stocks():
    """Block scaling's activation tiles are 1 x 128 along ``h``: each token's scales depend on
    that token alone, so chunking the tokens leaves every forward cast as stock's (checked with
    two tiles per token). Its weight-gradient inputs are tiled 128 x 1 along the tokens, so
    there a chunk boundary changes the tiles: the backward is held to stock's FP8 error by the
    training test above. The TP bytes of each direction are stock's (before: each chunk's kept
    input was gathered twice in backward when TE's gather ran synchronously, 1.4x stock's)."""
    found = run_on_ranks(_blockwise_step, 2, te=True)[0]
    assert found["error"] == 0.0, found
    assert found["domino"] == found["stock"], found
    # 32 tokens per chunk and rank: TE's gather is synchronous, and Domino says so, once.
    (said,) = found["synchronous"]
    assert "32 tokens synchronously" in said and "multiple of 128" in said, said


@pytest.fixture(scope="module")
def block_gathered() -> dict:
    """:func:`_blockwise_step` at 256 tokens per chunk and rank, where TE's FP8 block
    all-gather runs (the FP8 bits and the 1 x 128 tiles' scales, gathered and put in order by
    TE's own code; on gloo one collective at a time, :mod:`te_cpu.coalescing`), in stock's fused
    layer and in Domino's gathers. Before the shim this shape failed on the CPU (gloo refuses
    TE's coalesced gather)."""
    return run_on_ranks(_blockwise_step, 2, args=(512,), te=True)[0]


def test_blockwise_fp8_block_gather_forward_is_stocks_bit_for_bit(block_gathered):
    """Domino's forward through TE's FP8 block gather is stock's bit for bit, and nothing was
    gathered synchronously (no warning)."""
    assert block_gathered["error"] == 0.0, block_gathered
    assert block_gathered["synchronous"] == [], block_gathered


def test_blockwise_fp8_block_gather_moves_stocks_tp_bytes(block_gathered):
    """Through TE's FP8 block gather Domino moves stock's TP bytes in each direction: its
    forward gathers the shard's row-wise buffers only and its backward re-gather the
    column-wise ones (``GatherUse``), as stock's SP gathers do. Before (2026-12-06) the
    forward gathered both: 5,320,704 / 7,995,392 bytes against stock's 4,239,360 / 6,914,048
    (+26 % / +16 %)."""
    assert block_gathered["domino"] == block_gathered["stock"], block_gathered


def _reordered_quantizers() -> str:
    """Domino's SP forward under FP8 on a TE whose ``_get_quantizers`` puts the weight's
    quantizer first (as a TE outside the tested range might): the error Domino raises."""
    from lab.analysis.equivalence import token_batch
    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

    options = GPTOptions(
        **{**LLAMA_STYLE, "num_layers": 2}, sequence_parallel=True,
        transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid",
    )  # fmt: skip
    model = build_gpt_model(options, spec=te_spec(True))
    linear = type(model.decoder.layers[0].self_attention.linear_qkv)
    original, own = linear._get_quantizers, "_get_quantizers" in vars(linear)

    def reordered(self, *args, **kwargs):
        quantizers = list(original(self, *args, **kwargs))
        quantizers[0], quantizers[1] = quantizers[1], quantizers[0]
        return quantizers

    linear._get_quantizers = reordered
    try:
        try:
            handle = apply_domino(model, DominoConfig(chunks=2))
        except DominoUnsupportedError as error:
            return f"refused at apply: {error}"
        with handle:
            model(**token_batch(options, 4))
    except DominoUnsupportedError as error:
        return f"refused at the call: {error}"
    finally:
        if own:
            linear._get_quantizers = original
        else:
            del linear._get_quantizers
    return "nothing raised"


def test_a_te_that_reorders_its_quantizers_is_refused_at_apply():
    """Domino reads TE's private quantizer tuple by position; when it is applied, before any FP8
    call (TE makes a module's quantizers in its first), it checks each slot's role on a probe
    of the linear's class and refuses a TE that keeps another quantizer there."""
    message = run_on_ranks(_reordered_quantizers, 2, te=True)[0]
    assert message.startswith("refused at apply"), message
    assert "input quantizer" in message and "scaling_fwd[GEMM1_INPUT]" in message, message
