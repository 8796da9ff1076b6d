"""pretrain_gpt_domino.py's flags: Megatron-LM's parser and validation plus Domino's checks.

Megatron's own ``parse_args`` and ``validate_args`` run in-process on a faked command line
(no process group), with the script's ``extra_args_provider``; then the checks the script adds
after Megatron's validation (:func:`megatron_domino.training.pretrain._script_checks`). The
spec check builds the parsed ``--spec``'s layer in a rank with Transformer Engine's own Python
booted (``run_on_ranks(..., te=True)``; this process runs Megatron-Core without TE). Last, a
real launch with a refused flag combination: it fails before writing anything.
"""

import os
import re
import subprocess
import sys

import pytest
from launch import TINY_GPT, run_pretrain
from megatron.core import utils as megatron_utils
from megatron.core.extensions import transformer_engine as megatron_te
from megatron.training import arguments as megatron_arguments
from megatron.training.argument_utils import gpt_config_from_args
from multiproc import run_on_ranks
from packaging.version import Version

from megatron_domino.autotune import AutoTuner, NoCandidateError
from megatron_domino.base.config import DominoConfigError, DominoUnsupportedError
from megatron_domino.training import pretrain as entry

DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 100".split()
BASE = [*TINY_GPT, "--lr", "1e-3", "--train-iters", "10", *DATA]
TP2_DOMINO = "--domino --tensor-model-parallel-size 2".split()
#: Transformer Engine layers (Megatron-LM's default) with Domino, at TP = 2.
TE_DOMINO = [*TP2_DOMINO, "--transformer-impl", "transformer_engine"]
SEQUENCE_SPLIT_MB1 = "--domino-split sequence --micro-batch-size 1".split()


def checked(
    monkeypatch,
    *extra: str,
    world_size: int = 2,
    base: list[str] = BASE,
    max_connections: str | None = "1",
):
    """Megatron's parse and validation of ``base + extra``, then the script's checks.

    ``max_connections``: ``CUDA_DEVICE_MAX_CONNECTIONS`` (``None``: unset, as Megatron-FSDP
    asserts).
    """
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", *base, *extra])
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    if max_connections is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", max_connections)
    # validate_args asks the GPU's architecture; answered as a Hopper, as the CPU runtime does.
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = megatron_arguments.parse_args(extra_args_provider=entry.add_flags)
    megatron_arguments.validate_args(args, dict(entry.ARGS_DEFAULTS))
    entry._script_checks(args)
    return args


@pytest.mark.parametrize(
    ("extra", "error", "expected"),
    [
        (["--domino"], DominoUnsupportedError, "tensor-model-parallel size is 1"),
        (
            [*TP2_DOMINO, "--domino-chunks", "4"],
            DominoConfigError,
            "--micro-batch-size 2 is not divisible by --domino-chunks 4",
        ),
        (
            [*TP2_DOMINO, "--domino-chunks", "1"],
            DominoConfigError,
            "leaves nothing to overlap",
        ),
        (
            [*TP2_DOMINO, "--domino-chunks", "1", "--domino-column-chunks", "3"],
            DominoConfigError,
            "--hidden-size 64 is not divisible by --domino-column-chunks 3",
        ),
        (
            [*TP2_DOMINO, "--domino-split", "sequence", "--domino-chunks", "3"],
            DominoConfigError,
            "--seq-length 32 is not divisible by --domino-chunks 3",
        ),
        (
            [*TP2_DOMINO, "--recompute-granularity", "selective", "--recompute-modules", "mlp"],
            DominoUnsupportedError,
            "selective recompute of mlp is not supported",
        ),
        (
            [*TE_DOMINO, "--sequence-parallel", "--domino-column-chunks", "2"],
            DominoUnsupportedError,
            "--domino-column-chunks > 1 needs",
        ),
        (TE_DOMINO, DominoUnsupportedError, "add --no-domino-backward-overlap"),
        (
            [*TE_DOMINO, "--sequence-parallel", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
            DominoUnsupportedError,
            "--fp8-recipe mxfp8 runs on Blackwell GPUs only",
        ),
        (
            [*TP2_DOMINO, "--fp8-format", "hybrid"],
            DominoUnsupportedError,
            "FP8 runs only in Transformer Engine layers",
        ),
        (
            # s = 32 splits into 32 chunks, but not under SP into 32 pieces per TP rank.
            [*TP2_DOMINO, "--sequence-parallel", "--domino-split", "sequence"]
            + ["--domino-chunks", "32"],
            DominoConfigError,
            "--seq-length 32 is not divisible by --domino-chunks 32 x "
            "--tensor-model-parallel-size 2",
        ),
        (
            [*TP2_DOMINO, "--cuda-graph-impl", "local"],
            DominoUnsupportedError,
            "CUDA graphs bypass forward()",
        ),
        (
            # 5 candidates at micro-batch 2 (p4 refused), 1 warm-up + 3 measured iterations each.
            [*TP2_DOMINO, "--domino-chunks", "auto"],
            entry.StartupError,
            "--domino-chunks auto needs 20 iterations to time its candidates",
        ),
        (
            [*TP2_DOMINO, "--domino-chunks", "auto", "--domino-split", "sequence"],
            DominoConfigError,
            "--domino-chunks auto chooses --domino-split too",
        ),
        (
            [*TP2_DOMINO, "--domino-chunks", "auto", "--cuda-graph-impl", "local"],
            NoCandidateError,
            "- p2, p2-k2, p4, p4-k2, p1-k2, s2, s4: CUDA graphs bypass forward()",
        ),
        (["--sft"], entry.StartupError, "does not implement --sft"),
        (["--domino-report"], entry.StartupError, "--domino-report reports Domino's overlap"),
        (
            ["--distributed-backend", "nccl"],
            entry.StartupError,
            "add --distributed-backend gloo",
        ),
    ],
)
def test_refused_combinations_name_the_problem_and_the_fix(monkeypatch, extra, error, expected):
    with pytest.raises(error) as err:
        checked(monkeypatch, *extra)
    assert expected in str(err.value)


#: Fully sharded data parallelism gathers each layer's parameters in hooks on the layer
#: module, which Domino never calls (``refusals.fsdp_problems``).
FSDP_REFUSED = "never calls (it runs the layer's submodules itself"


@pytest.mark.parametrize(
    "fsdp",
    [
        # Each as Megatron-LM's validation accepts it: FSDP2 with untied output weights,
        # Megatron-FSDP with its checkpoint format, alone and with meta-device initialisation.
        ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
        ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
        ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--init-model-with-meta-device"],
    ],
)
def test_fully_sharded_data_parallelism_is_refused_at_argument_time(monkeypatch, fsdp):
    # Both FSDPs assert CUDA_DEVICE_MAX_CONNECTIONS != 1 (Megatron's TP overlap wants 1).
    assert checked(monkeypatch, *fsdp, max_connections=None)  # Megatron-LM without --domino
    with pytest.raises(DominoUnsupportedError) as error:
        checked(monkeypatch, *TP2_DOMINO, *fsdp, max_connections=None)
    message = str(error.value)
    assert f"{fsdp[0]}: fully sharded data parallelism gathers" in message
    assert FSDP_REFUSED in message and "use Megatron's DDP" in message


def test_supported_combinations_pass(monkeypatch):
    for extra in (
        # Domino holds no tensors: meta-device parameters materialised after the pre-wrap
        # hook are the ones it runs (tests/ranks/test_domino_fsdp_meta.py).
        [*TP2_DOMINO, "--init-model-with-meta-device"],
        [*TP2_DOMINO, "--domino-chunks", "2", "--domino-column-chunks", "2"],
        [*TP2_DOMINO, "--domino-split", "sequence", "--micro-batch-size", "1"],
        [*TP2_DOMINO, *SEQUENCE_SPLIT_MB1, "--sequence-parallel"],
        # Megatron-LM's defaults for its largest models: TE layers, SP, micro-batch 1.
        [*TE_DOMINO, *SEQUENCE_SPLIT_MB1, "--sequence-parallel", *TE_NORMS_APART],
        [*TE_DOMINO, "--sequence-parallel", "--fp8-format", "hybrid", *TE_NORMS_APART],
        # Current scaling, as H100 recipes run it (tests/ranks/test_te_fp8_recipes.py).
        [
            *TE_DOMINO,
            "--sequence-parallel",
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "tensorwise",
            *TE_NORMS_APART,
        ],
        [*TP2_DOMINO, "--recompute-activations", "--domino-report"],
    ):
        args = checked(monkeypatch, *extra)
        assert args.domino


def test_auto_tunes_over_the_settings_the_model_allows(monkeypatch):
    args = checked(monkeypatch, *TP2_DOMINO, "--domino-chunks", "auto", "--domino-auto-iters", "1")
    tuner = entry._script_checks(args)
    assert isinstance(tuner, AutoTuner) and tuner.iterations == 10
    assert repr(tuner).startswith("AutoTuner(candidates=[p2, p2-k2, p1-k2, s2, s4], 1 warm-up")


#: Parses and checks BASE (no --domino) in a fresh interpreter; prints the megatron_domino
#: modules that imported.
_BASELINE_IMPORTS = f"""
import sys
from megatron.training import arguments
from megatron_domino.training import pretrain
arguments.get_device_arch_version = lambda: 9
sys.argv = ["pretrain_gpt_domino.py", *{BASE!r}]
args = arguments.parse_args(extra_args_provider=pretrain.add_flags)
arguments.validate_args(args, dict(pretrain.ARGS_DEFAULTS))
pretrain._script_checks(args)
print(" ".join(sorted(m for m in sys.modules if m.startswith("megatron_domino"))))
"""


def test_megatron_parses_every_megatron_lm_flag_with_its_meaning(monkeypatch):
    base = [*TINY_GPT, "--lr", "1e-3", *DATA]
    args = checked(monkeypatch, "--rotary-base", "500000", "--train-samples", "64", base=base)
    assert args.rotary_base == 500000
    assert args.train_samples == 64 and args.train_iters is None
    # Megatron-LM's own default, not a CPU one: the CPU flags in TINY_GPT set it to local.
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", "--num-layers", "2"])
    assert megatron_arguments.parse_args(entry.add_flags).transformer_impl == "transformer_engine"
    # Without --domino, of Domino's library only its flags (base/config.py, autotune.py with
    # the setting names of base/settings.py) and the version check import: nothing of the
    # engine, the communication or the API that binds them.
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _BASELINE_IMPORTS], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    modules = done.stdout.strip().splitlines()[-1].split()
    outside = tuple(f"megatron_domino.{name}" for name in ("data", "runtime", "training"))
    packages = {f"megatron_domino.{name}" for name in ("base", "engine", "communication", "specs")}
    library = {
        name
        for name in modules
        if "." in name and not name.startswith(outside) and name not in packages
    }
    expected = {
        "megatron_domino.autotune",
        "megatron_domino.base.config",
        "megatron_domino.base.settings",
        "megatron_domino.base.version",
    }
    assert library == expected, library


def test_a_refused_run_writes_nothing(tmp_path):
    outputs = [
        "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
        "--tensorboard-dir", str(tmp_path / "tb"),
        "--log-json", str(tmp_path / "log.jsonl"), "--data-cache-path", str(tmp_path / "cache"),
    ]  # fmt: skip
    output = run_pretrain(
        [*BASE, *TP2_DOMINO, *outputs, "--domino-chunks", "4"],
        cwd=tmp_path,
        expect_success=False,
    )
    assert "pretrain_gpt_domino.py: error: --micro-batch-size 2 is not divisible" in output
    assert list(tmp_path.iterdir()) == []


#: TP = 2 x PP = 2 on four ranks, with four layers to place.
PP2_DOMINO = [*TP2_DOMINO, "--pipeline-model-parallel-size", "2", "--num-layers", "4"]


@pytest.mark.parametrize(
    "virtual",
    [
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--num-virtual-stages-per-pipeline-rank", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-layout", "Et|t|t|tL"],
    ],
)
def test_interleaved_pipeline_layouts_with_a_layer_on_every_stage_pass(monkeypatch, virtual):
    args = checked(monkeypatch, *PP2_DOMINO, *virtual, world_size=4)
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    ("virtual", "empty"),
    [
        (["--pipeline-model-parallel-layout", "E|tt|tt|L"], "rank 0 virtual stage 0, "
         "pipeline rank 1 virtual stage 1"),
        (["--num-layers", "3", "--account-for-embedding-in-pipeline-split",
          "--num-layers-per-virtual-pipeline-stage", "1"], "rank 0 virtual stage 0 ("),
    ],
)  # fmt: skip
def test_a_virtual_stage_without_layers_is_refused_at_argument_time(monkeypatch, virtual, empty):
    checked(monkeypatch, *PP2_DOMINO[1:], *virtual, world_size=4)  # Megatron-LM runs it
    with pytest.raises(DominoUnsupportedError) as error:
        checked(monkeypatch, *PP2_DOMINO, *virtual, world_size=4)
    message = str(error.value)
    assert f"no transformer layer on pipeline {empty}" in message
    assert "give every virtual stage at least one layer" in message


def _installed_te(monkeypatch, version: str) -> None:
    """Megatron-Core's view of an installed Transformer Engine of ``version``."""
    monkeypatch.setattr(megatron_te, "HAVE_TE", True)
    monkeypatch.setattr(megatron_utils, "get_te_version", lambda: Version(version))


def test_an_older_transformer_engine_is_refused_at_argument_time(monkeypatch):
    """TE layers with a TE older than the release whose contract Domino models: refused when
    the flags are checked, naming the version found and the fix; local layers do not ask."""
    _installed_te(monkeypatch, "2.17.0")
    with pytest.raises(DominoUnsupportedError) as error:
        checked(monkeypatch, *TE_DOMINO, "--sequence-parallel")
    message = str(error.value)
    assert "Domino needs Transformer Engine >= 2.18.0" in message and "found 2.17.0" in message
    assert "pip install 'transformer-engine[pytorch]>=2.18.0'" in message
    assert "--transformer-impl local" in message
    checked(monkeypatch, *TP2_DOMINO)
    _installed_te(monkeypatch, "2.18.0")
    checked(monkeypatch, *TE_DOMINO, "--sequence-parallel", *TE_NORMS_APART)


#: The spec Domino needs for Transformer Engine layers under sequence parallelism.
TE_NORMS_APART = ["--spec", "megatron_domino.specs.te_spec", "te_norms_apart_block_spec"]


def test_fused_te_norms_are_refused_under_sequence_parallelism_at_argument_time(monkeypatch):
    """Without --spec Megatron-LM builds TE's fused norm + column linear, on which Domino under
    SP could only gather the pre-norm residual: refused when the flags are checked, naming
    the spec; without SP (no gather) or with the spec, accepted."""
    _installed_te(monkeypatch, "2.18.0")
    with pytest.raises(DominoUnsupportedError) as error:
        checked(monkeypatch, *TE_DOMINO, "--sequence-parallel")
    assert "--spec megatron_domino.specs.te_spec te_norms_apart_block_spec" in str(error.value)
    checked(monkeypatch, *TE_DOMINO, "--sequence-parallel", *TE_NORMS_APART)
    checked(monkeypatch, *TE_DOMINO, "--no-domino-backward-overlap")


def _layer_built_from(args) -> dict:
    """In a rank with Transformer Engine booted: Megatron-LM's model config from ``args`` and
    the first layer of the block its spec gives when called as ``GPTModelBuilder`` calls it
    (one pipeline stage), by qualified name."""
    model_config = gpt_config_from_args(args)
    spec = model_config.transformer_layer_spec
    block = spec(model_config, vp_stage=None)
    layer = block.layer_specs[0].submodules

    def name(obj) -> str:
        return f"{obj.__module__}.{obj.__qualname__}"

    return dict(
        spec=name(spec),
        layers=len(block.layer_specs),
        norms=[name(layer.input_layernorm), name(layer.pre_mlp_layernorm)],
        linear_qkv=name(layer.self_attention.submodules.linear_qkv),
    )


@pytest.mark.te
def test_the_norms_apart_spec_builds_through_megatron_lm_model_config(monkeypatch):
    """Both entry points build the model from ``gpt_config_from_args`` (Megatron-LM
    ``core_r0.19``'s ``pretrain_gpt.py`` line 521, where the patch hooks in, and this script):
    ``--spec`` is imported as given, and ``GPTModelBuilder.build_model`` calls a callable spec
    with the config and ``vp_stage`` (``megatron/training/models/gpt.py:273-281``). So the
    spec Domino needs under SP on TE works through the patched ``pretrain_gpt.py`` too: the
    flags are parsed here, and in a rank with Transformer Engine's own Python booted (where
    Megatron-Core builds TE's layers) the parsed spec is the builder function, and called as
    the builder calls it (one stage, so the layer count is the config's) it gives TE's layer
    with its norms apart: Megatron-Core's ``TENorm`` and ``TEColumnParallelLinear``."""
    _installed_te(monkeypatch, "2.18.0")
    args = checked(monkeypatch, *TE_DOMINO, "--sequence-parallel", *TE_NORMS_APART)
    built = run_on_ranks(_layer_built_from, 1, args=(args,), te=True)[0]
    te = "megatron.core.extensions.transformer_engine"
    assert built == dict(
        spec="megatron_domino.specs.te_spec.te_norms_apart_block_spec",
        layers=args.num_layers,
        norms=[f"{te}.TENorm"] * 2,
        linear_qkv=f"{te}.TEColumnParallelLinear",
    )


@pytest.mark.parametrize(
    ("extra", "error", "expected"),
    [
        # Domino's own reason, not a pointer to the patch (which refuses the same).
        ([*TP2_DOMINO, "--context-parallel-size", "2"], DominoUnsupportedError,
         "context parallelism is not supported"),
        ([*TP2_DOMINO, "--num-experts", "2", "--expert-tensor-parallel-size", "1"], DominoUnsupportedError, "MoE layers are not supported"),
        # Without --domino: upstream's script runs it, no patch needed.
        (["--context-parallel-size", "2"], entry.StartupError,
         "does not implement --context-parallel-size > 1; Megatron-LM's own pretrain_gpt.py runs it"),
        # A flag only this script lacks, with Domino's checks passed: the patch runs it.
        ([*TP2_DOMINO, "--sft"], entry.StartupError,
         "Domino's own checks accept this command line, so Megatron-LM's pretrain_gpt.py"),
    ],
)  # fmt: skip
def test_context_parallel_and_moe_are_refused_with_what_is_true(
    monkeypatch, extra, error, expected
):
    with pytest.raises(error, match=re.escape(expected)):
        checked(monkeypatch, *extra, world_size=4)


@pytest.mark.parametrize(
    ("impl", "expected"),
    [
        ("local", "per-layer graphs replay each layer's own forward"),
        ("transformer_engine", "per-layer graphs replay each layer's own forward"),
        ("full_iteration", "full_iteration waits for a GPU to capture and replay a Domino step"),
    ],
)
def test_cuda_graphs_are_refused_with_what_each_waits_for(monkeypatch, impl, expected):
    # Megatron-LM asserts the host-side NaN check off for whole-iteration graphs.
    extra = ["--no-check-for-nan-in-loss-and-grad"] if impl == "full_iteration" else []
    with pytest.raises(DominoUnsupportedError) as error:
        checked(monkeypatch, *TP2_DOMINO, "--cuda-graph-impl", impl, *extra)
    assert expected in str(error.value) and "set --cuda-graph-impl none" in str(error.value)


def test_no_auto_candidate_is_refused_in_one_message(monkeypatch, capsys):
    """``main()`` as a rank runs it, up to the checks: exit 2, the reasons on rank 0."""
    argv = [*BASE, *TP2_DOMINO, "--domino-chunks", "auto", "--cuda-graph-impl", "local"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", *argv])
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "pretrain_gpt_domino.py: error: --domino-chunks auto found no Domino setting" in err
