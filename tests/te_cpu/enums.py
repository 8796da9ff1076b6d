"""The enums Transformer Engine's extension exports, with the C values of TE 2.18's headers.

TE's Python reads these from ``transformer_engine_torch`` at import (``constants.py``,
``attention/dot_product_attention/utils.py``, ``router.py``, ``module/base.py``) and passes
them back to the extension's functions. The values are those of
``common/include/transformer_engine/{transformer_engine,fused_attn,comm_gemm_overlap,
fused_router}.h`` and ``pytorch/csrc/common.h`` at TE ``v2.18``: TE's ``DType`` (a Python
``IntEnum`` since 2.18) is built from ``int(tex.DType.x)``, so a wrong value here would tag
tensors wrongly in TE's own code.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "CommOverlapAlgo",
    "CommOverlapType",
    "DType",
    "FP8BwdTensors",
    "FP8FwdTensors",
    "FP8_MAX",
    "NVTEQBHistogramMode",
    "NVTERoutingMapFormat",
    "NVTE_Bias_Type",
    "NVTE_Fused_Attn_Backend",
    "NVTE_Mask_Type",
    "NVTE_QKV_Format",
    "NVTE_QKV_Layout",
    "NVTE_Softmax_Type",
    "NVTEScalingMode",
    "TORCH_DTYPE",
]


class DType(enum.IntEnum):
    """``NVTEDType`` (``transformer_engine.h``), the members TE's pybind module exports (TE's
    ``constants.py`` checks that its own ``DType`` has exactly these)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


#: The torch dtype of each TE dtype the backend computes with (FP8 as torch's float8 types).
TORCH_DTYPE = {
    DType.kByte: torch.uint8,
    DType.kInt32: torch.int32,
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
}

#: The largest finite value of each FP8 format (what a cast saturates to).
FP8_MAX = {
    DType.kFloat8E4M3: torch.finfo(torch.float8_e4m3fn).max,
    DType.kFloat8E5M2: torch.finfo(torch.float8_e5m2).max,
}


class FP8FwdTensors(enum.IntEnum):
    """Forward FP8 meta slots (``pytorch/csrc/common.h``)."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """Backward FP8 meta slots (``pytorch/csrc/common.h``)."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class CommOverlapType(enum.IntEnum):
    """``comm_gemm_overlap.h``: userbuffers overlap kinds (read at import, never run here)."""

    RS = 0
    AG = 1


class CommOverlapAlgo(enum.IntEnum):
    """``comm_gemm_overlap.h``."""

    BULK_OVERLAP_AG = 0
    BULK_OVERLAP_RS = 1
    SPLIT_PIPELINED_AG_P2P = 2
    SPLIT_PIPELINED_RS = 3
    SPLIT_PIPELINED_RS_P2P = 4
    ATOMIC_GEMM_RS = 5
    ATOMIC_GEMM_AG_P2P = 6
    ATOMIC_GEMM_RS_P2P = 7
    EXTERNAL_BULK_OVERLAP_AG = 8


class NVTEScalingMode(enum.IntEnum):
    """``transformer_engine.h`` (read at import by TE 2.20's attention)."""

    NVTE_DELAYED_TENSOR_SCALING = 0
    NVTE_MXFP8_1D_SCALING = 1
    NVTE_BLOCK_SCALING_1D = 2
    NVTE_BLOCK_SCALING_2D = 3
    NVTE_NVFP4_1D_SCALING = 4
    NVTE_INVALID_SCALING = 100


class NVTE_QKV_Layout(enum.IntEnum):  # noqa: N801 - the C name TE reads
    """``fused_attn.h``."""

    NVTE_SB3HD = 0
    NVTE_SBH3D = 1
    NVTE_SBHD_SB2HD = 2
    NVTE_SBHD_SBH2D = 3
    NVTE_SBHD_SBHD_SBHD = 4
    NVTE_BS3HD = 5
    NVTE_BSH3D = 6
    NVTE_BSHD_BS2HD = 7
    NVTE_BSHD_BSH2D = 8
    NVTE_BSHD_BSHD_BSHD = 9
    NVTE_T3HD = 10
    NVTE_TH3D = 11
    NVTE_THD_T2HD = 12
    NVTE_THD_TH2D = 13
    NVTE_THD_THD_THD = 14
    NVTE_SBHD_BSHD_BSHD = 15
    NVTE_BSHD_SBHD_SBHD = 16
    NVTE_THD_BSHD_BSHD = 17
    NVTE_THD_SBHD_SBHD = 18
    NVTE_Paged_KV_BSHD_BSHD_BSHD = 19
    NVTE_Paged_KV_BSHD_SBHD_SBHD = 20
    NVTE_Paged_KV_SBHD_BSHD_BSHD = 21
    NVTE_Paged_KV_SBHD_SBHD_SBHD = 22
    NVTE_Paged_KV_THD_BSHD_BSHD = 23
    NVTE_Paged_KV_THD_SBHD_SBHD = 24
    NVTE_BHSD_BHSD_BHSD = 25
    NVTE_QKV_Layout_NOT_SET = 26


class NVTE_QKV_Format(enum.IntEnum):  # noqa: N801
    """``fused_attn.h``."""

    NVTE_SBHD = 0
    NVTE_BSHD = 1
    NVTE_THD = 2
    NVTE_BSHD_2SBHD = 3
    NVTE_SBHD_2BSHD = 4
    NVTE_THD_2BSHD = 5
    NVTE_THD_2SBHD = 6
    NVTE_BHSD = 7
    NVTE_QKV_Format_NOT_SET = 8


class NVTE_Bias_Type(enum.IntEnum):  # noqa: N801
    """``fused_attn.h``."""

    NVTE_NO_BIAS = 0
    NVTE_PRE_SCALE_BIAS = 1
    NVTE_POST_SCALE_BIAS = 2
    NVTE_ALIBI = 3


class NVTE_Mask_Type(enum.IntEnum):  # noqa: N801
    """``fused_attn.h``."""

    NVTE_NO_MASK = 0
    NVTE_PADDING_MASK = 1
    NVTE_CAUSAL_MASK = 2
    NVTE_PADDING_CAUSAL_MASK = 3
    NVTE_CAUSAL_BOTTOM_RIGHT_MASK = 4
    NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5


class NVTE_Softmax_Type(enum.IntEnum):  # noqa: N801
    """``fused_attn.h``."""

    NVTE_VANILLA_SOFTMAX = 0
    NVTE_OFF_BY_ONE_SOFTMAX = 1
    NVTE_LEARNABLE_SOFTMAX = 2


class NVTE_Fused_Attn_Backend(enum.IntEnum):  # noqa: N801
    """``fused_attn.h``: the backend answers ``NVTE_No_Backend``, so TE picks its unfused
    attention, which is TE's own Python."""

    NVTE_No_Backend = -1
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


class NVTERoutingMapFormat(enum.IntEnum):
    """``fused_router.h`` (MoE routing; read at import)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


class NVTEQBHistogramMode(enum.IntEnum):
    """``fused_router.h`` (MoE quantile balancing; read at import by TE 2.20)."""

    TWO_KERNEL = 0
    FUSED_ATOMIC = 1
