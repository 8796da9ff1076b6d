"""Megatron-LM's GPT FLOP count, checked against sums worked out by hand."""

from megatron_domino.training.flops import gpt_training_flops, tflops_per_gpu


def test_swiglu_gqa_case_counted_gemm_by_gemm():
    # B=4 sequences of s=32 tokens, L=2 layers, h=64, n=4 heads of d=16, g=2 groups,
    # f=96 (SwiGLU), V=256. FLOPs of one GEMM [m, k] x [k, n] = 2mkn; training = 3x forward.
    tokens = 4 * 32
    qkv = 2 * tokens * 64 * (64 + 2 * 32)  # q: 4*16 = 64 wide, k and v: 2*16 = 32 wide each
    proj = 2 * tokens * 64 * 64
    fc1 = 2 * tokens * 64 * (2 * 96)  # SwiGLU: gate and up projections
    fc2 = 2 * tokens * 96 * 64
    # Causal attention, 4 sequences: QK^T and PV, each over half of the 32x32 scores.
    core = 4 * 2 * (2 * 32 * 32 * 64) // 2
    logits = 2 * tokens * 64 * 256
    forward = 2 * (qkv + proj + fc1 + fc2 + core) + logits  # two layers, one output layer
    assert forward == 20_971_520
    assert 3 * forward == gpt_training_flops(
        batch_size=4,
        seq_length=32,
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        padded_vocab_size=256,
        swiglu=True,
    )


def test_classic_gpt_matches_the_closed_form():
    # f = 4h, multi-head attention, GeLU: 72 B s L h^2 (1 + s/(12h) + V/(12 h L)).
    b, s, n_layers, h, v = 8, 2048, 24, 2048, 51200
    closed_form = 72 * b * s * n_layers * h**2 * (1 + s / (12 * h) + v / (12 * h * n_layers))
    flops = gpt_training_flops(
        batch_size=b,
        seq_length=s,
        num_layers=n_layers,
        hidden_size=h,
        ffn_hidden_size=4 * h,
        num_attention_heads=16,
        num_query_groups=16,
        kv_channels=h // 16,
        padded_vocab_size=v,
        swiglu=False,
    )
    assert flops == round(closed_form)


def test_tflops_per_gpu_shares_the_iteration_over_every_rank():
    assert tflops_per_gpu(8 * 10**12, seconds_per_iteration=0.5, world_size=4) == 4.0
