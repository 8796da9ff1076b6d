"""What Domino refuses, as records: the rows of the README's support table.

Each :class:`Refusal` says what is refused, why, whether that is by design (Domino cannot do
it without ceasing to be Domino, or something else already does the same job) or not yet
(possible, not built or not validated), and what to run instead. :data:`REFUSALS` is the
complete list; the README's support table is :func:`support_table` verbatim
(``tests/unit/test_support_table.py`` keeps them equal, and prints the table to paste when
they differ).

Where a refusal is a ``TransformerConfig`` attribute (``attribute`` and ``applies`` set), the
check itself reads the record: :func:`megatron_domino.refusals.config_problems` reports
``message`` for every record whose ``applies`` holds for the attribute's value. The other
records are decided by the functions of :mod:`megatron_domino.refusals`, the shape checks of
:mod:`megatron_domino.base.config` and the version guard (:mod:`megatron_domino.base.version`), which
word their messages for the case at hand (the flags involved, the layer, the version found);
the record is the row a user reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["HYBRID_LAYERS", "REFUSALS", "Refusal", "config_refusals", "support_table"]

BY_DESIGN, NOT_YET = "by design", "not yet"


@dataclass(frozen=True)
class Refusal:
    """One thing Domino refuses.

    Attributes:
        refused: what is refused, as a user names it (flags, settings).
        why: the reason.
        kind: ``by design`` or ``not yet`` (module docstring).
        instead: what to run instead.
        attribute: the ``TransformerConfig`` attribute the check reads, or ``None`` where a
            function of :mod:`megatron_domino.refusals` decides.
        applies: with ``attribute``: whether the attribute's value is refused.
    """

    refused: str
    why: str
    kind: Literal["by design", "not yet"]
    instead: str
    attribute: str | None = None
    applies: Callable[[object], bool] | None = None

    @property
    def message(self) -> str:
        """The refusal as the error lists it: ``why; instead``."""
        return f"{self.why}; {self.instead}"


def _not_none(value) -> bool:
    return value is not None


def _above_one(value) -> bool:
    return (value or 1) > 1


_CUDA_GRAPHS = "CUDA graphs bypass forward()"

#: HybridModel's layers other than attention (``*``) and dense MLP (``-``), refused by
#: :func:`megatron_domino.refusals.model_problems` (the layers Domino runs:
#: :data:`megatron_domino.plan.LAYER_SUBLAYERS`).
HYBRID_LAYERS = Refusal(
    "`HybridModel` layers other than `*` and `-` (`E` MoE, `M` Mamba-2, `G` GDN, `D` DeepSeek "
    "sparse attention, `+` MLA) and MTP",
    "Domino's schedule runs attention and dense-MLP sub-layers only",
    NOT_YET,
    "a pattern of `*` and `-` layers, or train without `--domino`",
)

#: Every refusal, in the order of the support table.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("TP = 1", "no tensor-parallel communication to hide", BY_DESIGN, "drop `--domino`"),
    Refusal(
        "a micro-batch (batch split) or sequence length (sequence split; x TP under SP) not "
        "divisible by `--domino-chunks`; a hidden size not divisible by "
        "`--domino-column-chunks`; P = 1 with K = 1",
        "chunks and pieces are equal slices, and one of each overlaps nothing",
        BY_DESIGN,
        "a P (K) that divides, or the other split",
    ),
    Refusal(
        "`--no-domino-backward-overlap` with `--sequence-parallel`",
        "the sequence-parallel collectives always overlap in backward",
        BY_DESIGN,
        "drop one of them",
    ),
    Refusal(
        "TE layers with `--domino-column-chunks` > 1",
        "a TE linear multiplies by its whole weight",
        BY_DESIGN,
        "`--domino-column-chunks 1`, or Megatron's local layers",
    ),
    Refusal(
        "TE layers: backward overlap without `--sequence-parallel`",
        "TE's fused norm + column linear keeps its input-gradient all-reduce inside its own "
        "backward",
        BY_DESIGN,
        "`--sequence-parallel`, or `--no-domino-backward-overlap`",
    ),
    Refusal(
        "TE's fused norm + column linear (`TELayerNormColumnParallelLinear`) under SP",
        "Domino could only gather the pre-norm residual: the norm would run `tp` times and keep "
        "the whole sequence for backward",
        BY_DESIGN,
        "`--spec megatron_domino.specs.te_spec te_norms_apart_block_spec` (same parameters and "
        "checkpoints), or no SP",
    ),
    Refusal(
        "FP8 recipes `mxfp8` and `custom`",
        "MXFP8 needs Blackwell; neither is validated with chunks",
        NOT_YET,
        "`--fp8-recipe delayed`, `tensorwise` or `blockwise`",
    ),
    Refusal(
        "`--disable-parameter-transpose-cache` under FP8",
        "every chunk's call would cast every weight again (P casts per micro-batch, stock one)",
        BY_DESIGN,
        "drop the flag",
    ),
    Refusal(
        "TE's op-fused MLP (`use_transformer_engine_op_fuser`)",
        "fc1, activation and fc2 run as one fused op sequence",
        NOT_YET,
        "the op fuser off",
    ),
    Refusal(
        "FP8 with Megatron's local layers",
        "FP8 runs only in TE's linears",
        BY_DESIGN,
        "`--transformer-impl transformer_engine`",
    ),
    Refusal(
        "selective recompute of anything but `core_attn`; full recompute with FP8",
        "Domino calls the norms and the MLP itself; TE's checkpoint is not used",
        NOT_YET,
        "`--recompute-modules core_attn`, or full recompute in bf16",
    ),
    Refusal(
        "sequence split with selective `core_attn` recompute",
        "a replayed attention's keys come from other chunks",
        BY_DESIGN,
        "the batch split, or no selective recompute",
    ),
    Refusal(
        "sequence split with non-causal attention, packed sequences, TE < 0.12 or a core "
        "attention other than Megatron's or TE's",
        "a chunk's queries need a bottom-right causal mask per call",
        NOT_YET,
        "the batch split",
    ),
    Refusal(
        "a (virtual) pipeline stage without transformer layers",
        "nothing to chunk on that stage",
        BY_DESIGN,
        "a layout with a layer on every stage",
    ),
    Refusal(
        "Megatron-FSDP, torch FSDP2",
        "they gather each layer's parameters in hooks on the layer module, which Domino never "
        "calls",
        NOT_YET,
        "Megatron DDP with `--use-distributed-optimizer`",
    ),
    Refusal(
        "a non-stock layer, attention, MLP or linear (custom classes, TE's fused MLP, "
        "`gather_output`), cross-attention",
        "the schedule calls Megatron-Core's own submodules",
        BY_DESIGN,
        "the standard layer spec",
    ),
    Refusal(
        "megatron-core outside 0.19.x; Transformer Engine outside the tested range",
        "Domino re-sequences those releases' internals",
        BY_DESIGN,
        "megatron-core 0.19.x (`constraints.txt`), Transformer Engine `>=2.18.0,<2.21`; a newer "
        "one at your own risk with `MEGATRON_DOMINO_ALLOW_UNTESTED_MEGATRON=1` or "
        "`MEGATRON_DOMINO_ALLOW_UNTESTED_TE=1` (one warning)",
    ),
    Refusal(
        "`--domino-chunks auto` through the patched `pretrain_gpt.py`",
        "it needs the loop that times iterations",
        BY_DESIGN,
        "`pretrain_gpt_domino.py`",
    ),
    Refusal(
        "`tp_comm_overlap` (TE userbuffers)",
        "TE userbuffer overlap (tp_comm_overlap) takes over the same collectives",
        BY_DESIGN,
        "use one or the other",
        "tp_comm_overlap",
        bool,
    ),
    Refusal(
        "`enable_cuda_graph`",
        _CUDA_GRAPHS,
        BY_DESIGN,
        "disable CUDA graphs",
        "enable_cuda_graph",
        bool,
    ),
    Refusal(
        "`external_cuda_graph`",
        _CUDA_GRAPHS,
        BY_DESIGN,
        "disable CUDA graphs",
        "external_cuda_graph",
        bool,
    ),
    Refusal(
        "`--cuda-graph-impl local` / `transformer_engine`",
        f"{_CUDA_GRAPHS}: per-layer graphs replay each layer's own forward, not Domino's block "
        "schedule (by design)",
        BY_DESIGN,
        "set --cuda-graph-impl none",
        "cuda_graph_impl",
        lambda value: value not in (None, "none", "full_iteration"),
    ),
    Refusal(
        "`--cuda-graph-impl full_iteration`",
        "--cuda-graph-impl full_iteration waits for a GPU to capture and replay a Domino step "
        "(from a checkout: scripts/gpu_check.sh --parts capture; the CPU-side checks pass, "
        "tests/ranks/test_capture_safety.py)",
        NOT_YET,
        "set --cuda-graph-impl none until then",
        "cuda_graph_impl",
        lambda value: value == "full_iteration",
    ),
    Refusal(
        "MoE layers (`--num-experts`)",
        "MoE layers are not supported",
        NOT_YET,
        "use a dense model",
        "num_moe_experts",
        _not_none,
    ),
    Refusal(
        "MoE combined-1F1B overlap",
        "MoE combined-1F1B overlap takes over the same layers",
        BY_DESIGN,
        "disable it",
        "overlap_moe_expert_parallel_comm",
        bool,
    ),
    Refusal(
        "FP4",
        "FP4 is not supported",
        NOT_YET,
        "use FP8 (--fp8-format) or bf16",
        "fp4",
        _not_none,
    ),
    Refusal(
        "`--first-last-layers-bf16`",
        "bf16 first/last layers enter an FP8 context per layer, which the chunked schedule "
        "interleaves across layers",
        NOT_YET,
        "drop --first-last-layers-bf16",
        "first_last_layers_bf16",
        bool,
    ),
    Refusal(
        "`--symmetric-ar-type`",
        "symmetric all-reduce replaces the collective Domino launches itself",
        BY_DESIGN,
        "drop --symmetric-ar-type",
        "symmetric_ar_type",
        _not_none,
    ),
    Refusal(
        "activation CPU offloading",
        "activation CPU offloading is not supported",
        NOT_YET,
        "disable it",
        "cpu_offloading",
        bool,
    ),
    Refusal(
        "fine-grained activation offloading",
        "activation offloading is not supported",
        NOT_YET,
        "disable it",
        "fine_grained_activation_offloading",
        bool,
    ),
    Refusal(
        "context parallelism (CP > 1)",
        "context parallelism is not supported",
        NOT_YET,
        "use size 1",
        "context_parallel_size",
        _above_one,
    ),
    Refusal(
        "`--delay-wgrad-compute`",
        "delayed weight-gradient compute is not supported",
        NOT_YET,
        "disable it",
        "delay_wgrad_compute",
        bool,
    ),
    Refusal(
        "multi-latent attention",
        "multi-latent attention is not supported",
        NOT_YET,
        "use standard attention",
        "multi_latent_attention",
        bool,
    ),
    Refusal(
        "experimental attention variants",
        "experimental attention variants are not supported",
        NOT_YET,
        "use standard attention",
        "experimental_attention_variant",
        _not_none,
    ),
    Refusal(
        "fused inference TP communication",
        "fused inference TP communication is not supported (Domino schedules training)",
        BY_DESIGN,
        "drop it",
        "inference_fuse_tp_communication",
        bool,
    ),
    Refusal(
        "GTP weight sharding (`--tensor-parallel-num-weight-shards` > TP)",
        "GTP weight sharding (--tensor-parallel-num-weight-shards above the TP size) gathers "
        "each weight inside Megatron-Core's GEMM path, which Domino's chunked GEMMs replace",
        NOT_YET,
        "drop --tensor-parallel-num-weight-shards",
        "gtp_weight_remat_size",
        _above_one,
    ),
    Refusal(
        "per-module quantization recipes (`quant_recipe`, Kitchen)",
        "per-module quantization recipes (--te-precision-config-file, Kitchen) enter a "
        "quantization context in every linear call, i.e. once per chunk",
        NOT_YET,
        "drop them",
        "quant_recipe",
        _not_none,
    ),
    Refusal(
        "mHC residual streams (`enable_mhc_connections`)",
        "mHC residual streams (enable_mhc_connections, Megatron-Core 0.20) replace the layer's "
        "residual adds with hyper-connections that Domino's schedule does not run",
        NOT_YET,
        "drop them",
        "enable_mhc_connections",
        bool,
    ),
    HYBRID_LAYERS,
    Refusal(
        "`mlp_chunks_for_training` > 1",
        "mlp_chunks_for_training splits the MLP inside the stock layer forward, which the "
        "Domino schedule replaces",
        BY_DESIGN,
        "leave it at 1",
        "mlp_chunks_for_training",
        _above_one,
    ),
)


def config_refusals(model_config) -> list[str]:
    """The messages of the attribute records whose attribute ``model_config`` (a
    ``TransformerConfig``) sets to a refused value."""
    return [
        refusal.message
        for refusal in REFUSALS
        if refusal.attribute is not None
        and refusal.applies(getattr(model_config, refusal.attribute, None))
    ]


def support_table() -> str:
    """The README's table of refusals: one row per record, Markdown."""
    rows = ["| refused | why | kind | run instead |", "|---|---|---|---|"]
    for refusal in REFUSALS:
        cells = (refusal.refused, refusal.why, refusal.kind, refusal.instead)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"
