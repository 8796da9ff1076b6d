"""The CPU backend of Transformer Engine's extension (``tests/te_cpu``) against plain torch.

Each check runs in a rank with TE booted (``run_on_ranks(..., te=True)``), so the pytest
process keeps seeing Megatron-Core without TE. What is checked: the GEMM's three layouts with
``out``, ``accumulate`` and the bias (forward add, backward column sums); FP8 operands read
from the buffer an H100 reads (and a missing one refused); the FP8 cast's rounding,
saturation and amax bookkeeping (delayed: running maximum; current: per call, reduced over
the group); the delayed-scaling update against TE's own unfused Python update; the fused norms
and their backward against torch's autograd; and TE's CUDA questions answered for TE's modules
only.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_on_ranks

pytestmark = pytest.mark.te


def _gemm_layouts() -> dict:
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    x, w, dy = torch.randn(6, 4), torch.randn(5, 4), torch.randn(6, 5)
    bias = torch.randn(5)
    f32 = tex.DType.kFloat32
    common = dict(
        quantizer=None, out_dtype=f32, bias_type=f32, gelu=False, gelu_in=None,
        workspace=None, workspace_size=0, use_split_accumulator=False,
    )  # fmt: skip
    fwd, *_ = tex.generic_gemm(
        w, True, x, False, None, bias=bias, grad=False, accumulate=False, **common
    )
    dgrad, *_ = tex.generic_gemm(
        w, False, dy, False, None, bias=None, grad=False, accumulate=False, **common
    )
    main_grad = torch.ones(5, 4)
    wgrad, bias_grad, *_ = tex.generic_gemm(
        x, False, dy, True, main_grad, bias=bias, grad=True, accumulate=True, **common
    )
    return {
        "fwd": (fwd - (x @ w.t() + bias)).abs().max().item(),
        "dgrad": (dgrad - dy @ w).abs().max().item(),
        "wgrad_accumulated": (wgrad - (1 + dy.t() @ x)).abs().max().item(),
        "wgrad_in_place": wgrad.data_ptr() == main_grad.data_ptr(),
        "bias_grad": (bias_grad - dy.sum(0)).abs().max().item(),
        "fwd_shape_3d": list(
            tex.generic_gemm(w, True, x.reshape(3, 2, 4), False, None, bias=None, grad=False,
                             accumulate=False, **common)[0].shape
        ),
    }  # fmt: skip


def test_gemm_layouts_accumulate_and_bias_match_torch():
    found = run_on_ranks(_gemm_layouts, 1, te=True)[0]
    assert found.pop("wgrad_in_place") is True
    assert found.pop("fwd_shape_3d") == [3, 2, 5]
    assert all(error < 1e-5 for error in found.values()), found


def _fp8_quantizer(**usage):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    return Float8Quantizer(torch.ones(1), torch.zeros(1), tex.DType.kFloat8E4M3, **usage)


def _fp8_casts() -> dict:
    import transformer_engine_torch as tex

    quantizer = _fp8_quantizer(rowwise=True, columnwise=True)
    exact = torch.tensor([[0.5, -1.5, 448.0], [2.0, 0.0, -3.0]])
    cast = quantizer(exact)
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    round_trip = quantizer(x).dequantize()
    relative = ((round_trip - x).abs() / x.abs().clamp(min=2**-6)).max().item()
    saturated = quantizer(torch.tensor([1e4, -1e4, 500.0])).dequantize()
    amax_after_two = quantizer.amax.clone()
    quantizer.amax.zero_()
    quantizer(torch.tensor([3.0])), quantizer(torch.tensor([-7.0])), quantizer(torch.tensor([5.0]))
    transpose_matches = torch.equal(cast._transpose, cast._data.t().contiguous())
    return {
        "exact": torch.equal(cast.dequantize(), exact),
        "transpose": transpose_matches,
        "relative": relative,
        "saturated": saturated.tolist(),
        "amax_running": quantizer.amax.item(),
        "amax_after_two": amax_after_two.item(),
        "storage_uint8": cast._data.dtype == torch.uint8 and tex.DType.kFloat8E4M3 == 7,
    }


def test_fp8_casts_round_to_nearest_saturate_and_keep_a_running_amax():
    """E4M3 keeps 3 mantissa bits: a round trip is within 2^-4 relative (half an ulp);
    exactly representable values survive; out-of-range values saturate to +-448 (not NaN);
    delayed scaling's amax slot holds the maximum over every cast since it was reset."""
    found = run_on_ranks(_fp8_casts, 1, te=True)[0]
    assert found["exact"] and found["transpose"] and found["storage_uint8"]
    assert found["relative"] <= 2**-4, found["relative"]
    assert found["saturated"] == [448.0, -448.0, 448.0]
    assert found["amax_after_two"] == 1e4
    assert found["amax_running"] == 7.0


def _fp8_gemm_reads_the_hopper_buffers() -> dict:
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    x, w, dy = torch.randn(8, 16), torch.randn(4, 16), torch.randn(8, 4)
    both = _fp8_quantizer(rowwise=True, columnwise=True)
    fx, fw, fdy = both(x), both(w), both(dy)
    common = dict(
        quantizer=None, out_dtype=tex.DType.kFloat32, bias=None, bias_type=tex.DType.kFloat32,
        gelu=False, gelu_in=None, grad=False, workspace=None, workspace_size=0,
        accumulate=False, use_split_accumulator=False,
    )  # fmt: skip
    fwd = tex.generic_gemm(fw, True, fx, False, None, **common)[0]
    wgrad = tex.generic_gemm(fx, False, fdy, True, None, **common)[0]
    rowwise_only = _fp8_quantizer(rowwise=True, columnwise=False)(w)
    try:
        tex.generic_gemm(rowwise_only, False, fdy, False, None, **common)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return {
        "fwd": (fwd - fx.dequantize() @ fw.dequantize().t()).abs().max().item(),
        "wgrad": (wgrad - fdy.dequantize().t() @ fx.dequantize()).abs().max().item(),
        "refused": refused,
    }


def test_fp8_gemm_reads_the_buffers_an_h100_reads():
    """Row-wise bits for "T" operands, the transpose otherwise (sm_90 multiplies "TN" FP8 only):
    a dgrad ("NN") on a weight cast without its transpose fails, as on an H100."""
    found = run_on_ranks(_fp8_gemm_reads_the_hopper_buffers, 1, te=True)[0]
    assert found["fwd"] < 1e-4 and found["wgrad"] < 1e-4, found
    assert found["refused"] and "column-wise" in found["refused"]


def _scale_update() -> list:
    """The backend's fused update against TE's own unfused Python update, same inputs."""
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.quantization import _amax_and_scale_update

    torch.manual_seed(0)
    found = []
    for algo, length in (("max", 4), ("most_recent", 4), ("max", 1)):
        recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=1)
        histories = [torch.rand(length, 3) * 10, torch.rand(length, 2)]
        histories[1][:, 0] = 0.0  # amax 0 keeps the old scale
        scales = [torch.rand(3) + 0.5, torch.rand(2) + 0.5]
        reduced = torch.cat([h[0] for h in histories]) * 2
        ours = ([h.clone() for h in histories], [s.clone() for s in scales])
        tex.fused_amax_and_scale_update_after_reduction(
            reduced, ours[0], ours[1], algo, tex.DType.kFloat8E4M3, recipe.margin
        )
        for history, scale, new_amax in zip(histories, scales, reduced.split([3, 2]), strict=True):
            history[0].copy_(new_amax)
            _amax_and_scale_update(history, scale, 448.0, recipe)
        found.append(
            max(
                max((a - b).abs().max().item() for a, b in zip(ours[0], histories, strict=True)),
                max((a - b).abs().max().item() for a, b in zip(ours[1], scales, strict=True)),
            )
        )
    return found


def test_delayed_scaling_update_matches_tes_own_python_update():
    assert run_on_ranks(_scale_update, 1, te=True)[0] == [0.0, 0.0, 0.0]


def _current_scaling_amax_is_reduced(group_reduced: bool) -> float:
    import transformer_engine_torch as tex
    from megatron.core import parallel_state
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    quantizer = Float8CurrentScalingQuantizer(
        tex.DType.kFloat8E4M3,
        device=torch.device("cpu"),
        with_amax_reduction=group_reduced,
        amax_reduction_group=parallel_state.get_tensor_model_parallel_group(),
    )
    rank = torch.distributed.get_rank()
    return quantizer(torch.full((4,), 2.0 + 2.0 * rank))._scale_inv.item()


@pytest.mark.parametrize("group_reduced", [True, False], ids=["amax-reduced", "per-rank"])
def test_current_scaling_takes_the_amax_of_the_call_reduced_over_the_group(group_reduced):
    """``scale = 448 / amax`` per call; with the amax reduction group every rank casts with
    the group's largest amax (4.0 here), else each with its own (2.0, 4.0)."""
    scale_invs = run_on_ranks(_current_scaling_amax_is_reduced, 2, args=(group_reduced,), te=True)
    expected = [4.0 / 448, 4.0 / 448] if group_reduced else [2.0 / 448, 4.0 / 448]
    assert scale_invs == pytest.approx(expected, rel=1e-6)


def _norms(quantized: bool) -> dict:
    import torch.nn.functional as F
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    gamma, beta = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    dz = torch.randn(6, 8)
    quantizer = _fp8_quantizer(rowwise=True, columnwise=False) if quantized else None
    f32 = tex.DType.kFloat32
    ln, mu, rsigma = tex.layernorm_fwd(
        x.detach(), gamma.detach(), beta.detach(), 1e-5, None, quantizer, f32, 0, False
    )
    rms, _, rms_rsigma = tex.rmsnorm_fwd(
        x.detach(), gamma.detach(), 1e-5, None, quantizer, f32, 0, False
    )
    ln_ref = F.layer_norm(x, (8,), gamma, beta, 1e-5)
    rms_ref = F.rms_norm(x, (8,), gamma, 1e-5)
    if quantized:  # one rounding: the fp32 result cast straight to FP8
        return {
            "layernorm": torch.equal(ln.dequantize(), quantizer(ln_ref.detach()).dequantize()),
            "rmsnorm": torch.equal(rms.dequantize(), quantizer(rms_ref.detach()).dequantize()),
        }
    grads = torch.autograd.grad(ln_ref, (x, gamma, beta), dz)
    dx, dgamma, dbeta = tex.layernorm_bwd(dz, x.detach(), mu, rsigma, gamma.detach(), 0, False)
    rms_grads = torch.autograd.grad(rms_ref, (x, gamma), dz)
    rms_dx, rms_dgamma = tex.rmsnorm_bwd(dz, x.detach(), rms_rsigma, gamma.detach(), 0, False)
    pairs = {
        "layernorm": (ln, ln_ref), "dx": (dx, grads[0]), "dgamma": (dgamma, grads[1]),
        "dbeta": (dbeta, grads[2]), "rmsnorm": (rms, rms_ref), "rms_dx": (rms_dx, rms_grads[0]),
        "rms_dgamma": (rms_dgamma, rms_grads[1]),
    }  # fmt: skip
    return {name: (ours - ref).abs().max().item() for name, (ours, ref) in pairs.items()}


def test_fused_norms_and_their_backward_match_torch():
    found = run_on_ranks(_norms, 1, args=(False,), te=True)[0]
    assert all(error < 1e-5 for error in found.values()), found


def test_fused_norm_with_a_delayed_scaling_quantizer_casts_the_fp32_result_once():
    assert run_on_ranks(_norms, 1, args=(True,), te=True)[0] == {"layernorm": True, "rmsnorm": True}


def _cuda_seen() -> dict:
    from transformer_engine.pytorch.utils import get_device_compute_capability

    return {
        "torch": torch.cuda.is_available(),
        "te_capability": get_device_compute_capability(),
        "megatron_have_te": __import__("megatron.core.extensions.transformer_engine", fromlist=["x"]).HAVE_TE,
    }  # fmt: skip


def test_cuda_is_answered_for_te_only():
    """TE's modules see an H100 (sm_90); torch and Megatron-Core, asked themselves, see no
    CUDA; Megatron-Core sees TE in these ranks."""
    found = run_on_ranks(_cuda_seen, 1, te=True)[0]
    assert found == {"torch": False, "te_capability": (9, 0), "megatron_have_te": True}


def _megatron_sees_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def test_other_ranks_run_megatron_core_without_te():
    """The ranks of every other test run Megatron-Core as a user without TE does."""
    assert run_on_ranks(_megatron_sees_te, 1) == [False]


def _block_casts() -> dict:
    """Block scaling: a [256, 384] tensor whose 128 x 128 blocks span six decades (values within
    a factor 2 inside each), cast with 1 x 128 tiles (activations) and 128 x 128 blocks
    (weights); read back by TE's own Python."""
    import transformer_engine_torch as tex
    from te_cpu.blockwise import values
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    torch.manual_seed(0)
    decades = torch.tensor([[-3.0, -1.0, 1.0], [-2.0, 0.0, 2.0]])  # per 128 x 128 block
    magnitude = (10**decades).repeat_interleave(128, 0).repeat_interleave(128, 1)
    sign = torch.randint(0, 2, (256, 384)) * 2 - 1
    x = sign * (1 + torch.rand(256, 384)) * magnitude
    found = {}
    for dim in (1, 2):
        quantizer = Float8BlockQuantizer(
            tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim
        )
        cast = quantizer(x)
        rowwise = cast.dequantize(dtype=torch.float32)
        columnwise = values(cast, columnwise=True)
        found[dim] = dict(
            relative=((rowwise - x).abs() / x.abs()).max().item(),
            columnwise=((columnwise - x).abs() / x.abs()).max().item(),
            scale_shape=tuple(cast._rowwise_scale_inv.shape),
        )
    return found


def test_block_scaled_casts_scale_each_tile_and_read_back_through_tes_python():
    """Each 1 x 128 tile (or 128 x 128 block) gets its own power-of-2 scale, so values spread
    over six decades still come back within E4M3's half-ulp (2^-4) from either buffer; the
    scales are laid out as TE's GEMM reads them (transposed, padded to 4)."""
    found = run_on_ranks(_block_casts, 1, te=True)[0]
    for dim, result in found.items():
        assert result["relative"] <= 2**-4 and result["columnwise"] <= 2**-4, (dim, result)
    assert found[1]["scale_shape"] == (3, 256)  # [ceil(K/128), roundup(M, 4)]
    assert found[2]["scale_shape"] == (2, 4)  # [ceil(M/128), roundup(ceil(K/128), 4)]
