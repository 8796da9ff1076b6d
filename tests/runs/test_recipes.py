"""The SLURM recipes in examples/: what they print is what pretrain_gpt_domino.py accepts.

Every model config x launch style is run with DRY_RUN=1 (no srun, no SLURM needed); the
printed launcher is checked, and the printed pretrain_gpt_domino.py flags go through what the
script runs before it initialises anything: Megatron-LM's own parser (``parse_args`` with the
script's ``extra_args_provider``, so an unknown flag fails) and validation (``validate_args``,
for the printed world size), then Domino's checks (``check_args``: chunk shapes, Transformer
Engine rules) and the flags the script's GPT path refuses. Validation opens no file and needs
no GPU (the GPU's architecture is answered as a Hopper's), so it runs in full for mock and
real data alike. Not checked here: that a model fits in GPU memory, and what a real SLURM
does with the jobs: ``tests/slurm/`` submits them with sbatch to a real one-node Slurm
(``make test-slurm``), trains, signals, requeues and resumes them, and reads their real logs
with the A/B report (``megatron_domino.tools.ab_report``). The report's unit tests here write
their JSON records through the script's own ``--log-json`` hook.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from megatron.core.models.common.embeddings import rope_utils
from megatron.training import arguments as megatron_arguments

from megatron_domino.refusals import _FP8_RECIPES_RUN
from megatron_domino.training import loop_hooks
from megatron_domino.training import pretrain as entry
from megatron_domino.training.gpt_steps import unsupported_flags
from megatron_domino.training.megatron_lm import check_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = {"srun": "pretrain_gpt_srun.sh", "torchrun": "pretrain_gpt_torchrun.sh"}
MODELS = sorted(path.stem for path in (EXAMPLES / "models").glob("*.env"))

#: Published shapes: layers, hidden, heads, key/value heads, FFN, sequence, vocabulary.
SHAPES = {
    "gpt3-2.7b": (32, 2560, 32, 32, 10240, 2048, 50257),
    "gpt3-6.7b": (32, 4096, 32, 32, 16384, 2048, 50257),
    "gpt3-13b": (40, 5120, 40, 40, 20480, 2048, 50257),
    "gpt3-30b": (48, 7168, 56, 56, 28672, 2048, 50257),
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 32000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 8192, 128256),
}


def run_script(
    script: str, *, check: bool = True, timeout: float = 30, **env: str
) -> subprocess.CompletedProcess:
    """Run an examples/ script in a clean environment (no SLURM_*, no knobs), DRY_RUN=1 unless
    ``env`` says otherwise."""
    environment = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    environment.update({"DRY_RUN": "1", **env})
    done = subprocess.run(
        ["bash", str(EXAMPLES / script)],
        env=environment,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def launches(output: str) -> list[tuple[list[str], list[str]]]:
    """(launcher words up to the script, pretrain_gpt_domino.py flags) of each printed command."""
    found = []
    for line in output.splitlines():
        if line.startswith("#") or "pretrain_gpt_domino.py" not in line:
            continue
        words = shlex.split(line)
        end = next(i for i, w in enumerate(words) if w.endswith("/pretrain_gpt_domino.py"))
        found.append((words[: end + 1], words[end + 1 :]))
    return found


def exports(output: str) -> dict[str, str]:
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in output.splitlines()
        if line.startswith("export ")
    )


def read_model(name: str) -> dict[str, str]:
    """examples/models/<name>.env as a dict (KEY=VALUE lines, '#' comments)."""
    config = {}
    for line in (EXAMPLES / "models" / f"{name}.env").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = line.split("=", 1)
            config[key] = value
    return config


def parsed(flags: list[str], *, world_size: int, monkeypatch):
    """Megatron-LM's parse of pretrain_gpt_domino.py's command line (``SystemExit`` on an
    unknown flag), for rank 0 of ``world_size`` ranks; nothing is initialised."""
    monkeypatch.setattr(sys, "argv", [str(REPO / "pretrain_gpt_domino.py"), *flags])
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return megatron_arguments.parse_args(extra_args_provider=entry.add_flags)


def accepted(flags: list[str], *, world_size: int, monkeypatch):
    """Parse, validate and check like pretrain_gpt_domino.py does before it initialises
    anything; raises on any rejected flag. (Its check that NCCL has a GPU is left out: the
    recipes' runs are GPU runs.)"""
    args = parsed(flags, world_size=world_size, monkeypatch=monkeypatch)
    # validate_args asks the GPU's architecture; answered as a Hopper, as the CPU runtime does.
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    # The GPU nodes have Transformer Engine, this machine may not: its fused RoPE (Megatron-LM's
    # default with RoPE) is stood in for, so that Domino's check can build the model config.
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", rope_utils.apply_rotary_pos_emb)
    megatron_arguments.validate_args(args, dict(entry.ARGS_DEFAULTS))
    assert unsupported_flags(args) == []
    check_args(args)
    return args


def option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


@pytest.mark.parametrize("style", sorted(SCRIPTS))
@pytest.mark.parametrize("model", MODELS)
def test_every_model_and_launch_style_prints_a_command_megatron_accepts(model, style, monkeypatch):
    done = run_script(SCRIPTS[style], MODEL=model, MOCK="1", DOMINO="1", NNODES="2")
    [(launcher, flags)] = launches(done.stdout)
    assert exports(done.stdout)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert launcher[0] == "srun" and "--nodes=2" in launcher
    assert launcher[-1] == str(REPO / "pretrain_gpt_domino.py")
    if style == "srun":
        assert "--ntasks-per-node=8" in launcher and launcher[-2] == "python"
    else:
        assert "--ntasks-per-node=1" in launcher and "torchrun" in launcher
        assert option(launcher, "--nnodes") == "2"
        assert option(launcher, "--nproc-per-node") == "8"
        assert option(launcher, "--rdzv-backend") == "c10d"
        assert option(launcher, "--rdzv-endpoint") == "localhost:29500"

    args = accepted(flags, world_size=16, monkeypatch=monkeypatch)
    config = read_model(model)
    assert args.num_layers == int(config["NUM_LAYERS"])
    assert args.hidden_size == int(config["HIDDEN_SIZE"])
    assert args.ffn_hidden_size == int(config["FFN_HIDDEN_SIZE"])
    assert args.num_attention_heads == int(config["NUM_ATTENTION_HEADS"])
    groups = int(config["NUM_QUERY_GROUPS"])
    assert args.group_query_attention == (groups != args.num_attention_heads)
    if args.group_query_attention:
        assert args.num_query_groups == groups
    assert args.seq_length == int(config["SEQ_LENGTH"])
    assert args.vocab_size == int(config["VOCAB_SIZE"])
    assert args.normalization == config["NORMALIZATION"]
    assert args.position_embedding_type == config["POSITION_EMBEDDING_TYPE"]
    assert args.swiglu == (config["SWIGLU"] == "1")
    assert args.add_bias_linear == (config["DISABLE_BIAS_LINEAR"] == "0")
    assert args.untie_embeddings_and_output_weights == (
        config["UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS"] == "1"
    )
    assert args.max_position_embeddings == int(config["MAX_POSITION_EMBEDDINGS"])
    assert args.rotary_base == int(config.get("ROTARY_BASE", 10000))
    assert args.tensor_model_parallel_size == 8 and args.micro_batch_size == 2
    assert args.global_batch_size == 4  # micro-batch 2 x data-parallel 2 (16 ranks / TP 8)
    assert args.domino and args.domino_chunks == 2 and args.bf16 and args.mock_data
    assert args.use_distributed_optimizer and args.overlap_grad_reduce
    assert args.log_throughput and args.log_json.endswith("/log.jsonl")
    # Megatron-LM's GPU defaults stay: TE layers (then sequence parallelism, for Domino's
    # backward overlap), NCCL, its fusions; 0.19 needs an evaluation interval.
    assert args.transformer_impl == "transformer_engine" and args.sequence_parallel
    assert args.distributed_backend == "nccl" and args.gradient_accumulation_fusion
    assert (args.eval_interval, args.eval_iters) == (1000, 10)


def test_fp8_and_local_layer_knobs_reach_the_flags(monkeypatch):
    done = run_script(SCRIPTS["srun"], MODEL="llama3-8b", MOCK="1", DOMINO="1", FP8_FORMAT="hybrid")
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert args.transformer_impl == "transformer_engine" and args.sequence_parallel
    assert args.fp8 == "hybrid" and args.fp8_recipe == "delayed" and args.domino
    for recipe in sorted(_FP8_RECIPES_RUN):  # FP8_RECIPE: every recipe Domino runs
        done = run_script(
            SCRIPTS["srun"], MODEL="llama3-8b", MOCK="1", DOMINO="1", FP8_FORMAT="hybrid",
            FP8_RECIPE=recipe,
        )  # fmt: skip
        [(_, flags)] = launches(done.stdout)
        assert accepted(flags, world_size=8, monkeypatch=monkeypatch).fp8_recipe == recipe
    refused = run_script(
        SCRIPTS["srun"], check=False, MOCK="1", DOMINO="1", FP8_FORMAT="hybrid", FP8_RECIPE="mxfp8"
    )
    assert refused.returncode == 1 and "FP8_RECIPE=mxfp8 must be delayed" in refused.stderr
    # Megatron-Core's own layers on request: then no sequence parallelism unless asked.
    done = run_script(SCRIPTS["srun"], MOCK="1", DOMINO="1", TRANSFORMER_IMPL="local")
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert args.transformer_impl == "local" and not args.sequence_parallel


def test_model_class_hybrid_builds_the_hybrid_model_of_the_same_layers(monkeypatch):
    """MODEL_CLASS=hybrid: Megatron-Core's HybridModel of MODEL's layers, '*-' per layer and
    '|' between PP segments, with Domino's hybrid spec (TE's norms apart under SP); refused
    before launch with VP > 1, and on the CPU without a TE-running TRAIN_SCRIPT."""
    done = run_script(
        SCRIPTS["srun"], MODEL="llama3-8b", MOCK="1", DOMINO="1", MODEL_CLASS="hybrid", PP="2",
        NNODES="2",
    )  # fmt: skip
    [(_, flags)] = launches(done.stdout)
    assert option(flags, "--hybrid-layer-pattern") == "|".join(["*-" * 16] * 2)
    assert flags[flags.index("--spec") + 1 :][:2] == [
        "megatron_domino.specs.te_hybrid_spec", "te_norms_apart_hybrid_stack_spec",
    ]  # fmt: skip
    args = accepted(flags, world_size=16, monkeypatch=monkeypatch)
    assert args.num_layers == 64 and args.sequence_parallel and args.domino
    for knobs, message in (
        ({"VP": "2"}, "MODEL_CLASS=hybrid with VP=2"),
        ({"CPU": "1"}, "TRAIN_SCRIPT=tests/pretrain_te_cpu.py"),
        ({"MODEL_CLASS": "mamba"}, "MODEL_CLASS=mamba must be gpt or hybrid"),
    ):
        refused = run_script(
            SCRIPTS["srun"],
            check=False,
            MOCK="1",
            NNODES="2",
            PP="2",
            **{"MODEL_CLASS": "hybrid", **knobs},
        )
        assert refused.returncode == 1 and message in refused.stderr, (knobs, refused.stderr)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"DOMINO_BACKWARD_OVERLAP": "0"}, "add SEQUENCE_PARALLEL=0"),
        ({"SEQUENCE_PARALLEL": "0"}, "DOMINO_BACKWARD_OVERLAP=0"),
        ({"DOMINO_COLUMN_CHUNKS": "2"}, "needs Megatron-Core's local layers"),
        ({"TRANSFORMER_IMPL": "te"}, "must be transformer_engine or local"),
    ],
)
def test_domino_settings_transformer_engine_refuses_are_refused_before_launch(
    knobs, message, monkeypatch
):
    refused = run_script(SCRIPTS["srun"], check=False, MOCK="1", DOMINO="1", **knobs)
    assert refused.returncode == 1 and message in refused.stderr, refused.stderr
    assert refused.stdout == ""
    # The way out each message gives is a command Domino accepts.
    fixed = {
        "DOMINO_BACKWARD_OVERLAP": {"SEQUENCE_PARALLEL": "0"},
        "SEQUENCE_PARALLEL": {"DOMINO_BACKWARD_OVERLAP": "0"},
        "DOMINO_COLUMN_CHUNKS": {"TRANSFORMER_IMPL": "local"},
        "TRANSFORMER_IMPL": {"TRANSFORMER_IMPL": "local"},
    }[next(iter(knobs))]
    done = run_script(SCRIPTS["srun"], MOCK="1", DOMINO="1", **{**knobs, **fixed})
    [(_, flags)] = launches(done.stdout)
    assert accepted(flags, world_size=8, monkeypatch=monkeypatch).domino


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_model_configs_have_the_published_shapes(model):
    config = read_model(model)
    keys = ("NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "NUM_QUERY_GROUPS")
    keys += ("FFN_HIDDEN_SIZE", "SEQ_LENGTH", "VOCAB_SIZE")
    assert tuple(int(config[key]) for key in keys) == SHAPES[model]
    assert config["MAX_POSITION_EMBEDDINGS"] == config["SEQ_LENGTH"]
    assert config.get("ROTARY_BASE") == ("500000" if model.startswith("llama3") else None)
    llama = model.startswith("llama")
    assert config["NORMALIZATION"] == ("RMSNorm" if llama else "LayerNorm")
    assert config["POSITION_EMBEDDING_TYPE"] == ("rope" if llama else "learned_absolute")
    for key in ("SWIGLU", "DISABLE_BIAS_LINEAR", "UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS"):
        assert config[key] == ("1" if llama else "0")


def test_inside_a_slurm_job_the_first_node_job_id_and_cpus_are_used(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\nprintf "gpu-node-7\\ngpu-node-8\\n"\n')
    scontrol.chmod(0o755)
    slurm = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-node-[7-8]",
        "SLURM_CPUS_ON_NODE": "224",
        "SLURM_GPUS_ON_NODE": "8",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    torchrun = run_script(SCRIPTS["torchrun"], MOCK="1", **slurm)
    [(launcher, flags)] = launches(torchrun.stdout)
    assert option(launcher, "--rdzv-endpoint") == "gpu-node-7:24242"
    assert option(launcher, "--rdzv-id") == "4242" and option(launcher, "--nnodes") == "2"
    assert "--cpus-per-task=224" in launcher  # the whole node for the one torchrun task
    assert "# inherited: NCCL_SOCKET_IFNAME=ib0" in torchrun.stdout
    assert "/runs/gpt3-6.7b-tp8-2n-4242/" in option(flags, "--log-json")
    srun = run_script(SCRIPTS["srun"], MOCK="1", **slurm)
    [(launcher, _)] = launches(srun.stdout)
    assert "--cpus-per-task=28" in launcher and "--nodes=2" in launcher
    assert exports(srun.stdout)["MASTER_ADDR"] == "gpu-node-7"
    assert exports(srun.stdout)["MASTER_PORT"] == "24242"


def test_gpus_per_node_in_the_forms_the_slurm_tier_does_not_submit():
    """tests/slurm/ submits the recipes with --gpus-per-node=2 to a real 8-GPU node (one rank
    per GPU asked for, in both styles and ab_compare.sh; more ranks than the node's GPUs
    refused). Left to SLURM's variables stood in for here: a typed request, a job whose tasks
    per node are fewer than the GPUs it asked for, and a job that shows no GPU count."""
    typed = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "8"}
    typed["SLURM_GPUS_PER_NODE"] = "h100:4"  # --gpus-per-node=h100:4; no SLURM_GPUS_ON_NODE
    done = run_script(SCRIPTS["srun"], MOCK="1", TP="4", **typed)
    assert "--ntasks-per-node=4" in launches(done.stdout)[0][0]
    job = {**typed, "SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "4"}
    refused = run_script(SCRIPTS["srun"], check=False, MOCK="1", **job)
    assert refused.returncode == 1 and "--ntasks-per-node=8" in refused.stderr
    # A job without GPUs in SLURM's variables: srun's tasks per node, torchrun must be told.
    job = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2"}
    done = run_script(SCRIPTS["srun"], MOCK="1", TP="2", **job)
    assert "--ntasks-per-node=2" in launches(done.stdout)[0][0]
    refused = run_script(SCRIPTS["torchrun"], check=False, MOCK="1", **job)
    assert refused.returncode == 1 and "GPUS_PER_NODE" in refused.stderr
    done = run_script(SCRIPTS["torchrun"], MOCK="1", TP="2", GPUS_PER_NODE="2", **job)
    assert option(launches(done.stdout)[0][0], "--nproc-per-node") == "2"


def test_baseline_omits_domino_and_environment_overrides_reach_the_flags(monkeypatch):
    done = run_script(
        SCRIPTS["srun"],
        MODEL="llama2-7b",
        MOCK="1",
        TP="4",
        NNODES="2",
        MICRO_BATCH_SIZE="4",
        GLOBAL_BATCH_SIZE="64",
        TRAIN_ITERS="50",
        BF16="0",
        MODEL_OVERRIDES="NUM_LAYERS=4",
        EXTRA_ARGS="--eval-interval 25 --split 98,2,0",
        RUN_DIR="/scratch/run1",
    )
    [(launcher, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=16, monkeypatch=monkeypatch)
    assert not args.domino and not args.bf16
    assert (args.tensor_model_parallel_size, args.micro_batch_size) == (4, 4)
    assert (args.global_batch_size, args.train_iters, args.num_layers) == (64, 50, 4)
    assert args.lr_warmup_iters == 5 and args.eval_interval == 25
    assert args.log_json == "/scratch/run1/log.jsonl"


def test_micro_batch_one_splits_the_sequence_or_needs_local_layers_for_columns(monkeypatch):
    refused = run_script(SCRIPTS["srun"], check=False, MOCK="1", DOMINO="1", MICRO_BATCH_SIZE="1")
    assert refused.returncode == 1 and "DOMINO_SPLIT=sequence" in refused.stderr
    # The way out it gives runs with the defaults: Transformer Engine layers and SP.
    sequence_split = {"MICRO_BATCH_SIZE": "1", "DOMINO_SPLIT": "sequence"}
    done = run_script(SCRIPTS["srun"], MOCK="1", DOMINO="1", **sequence_split)
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert args.transformer_impl == "transformer_engine" and args.sequence_parallel
    assert (args.micro_batch_size, args.domino_split_along) == (1, "sequence")
    column_split = {"MICRO_BATCH_SIZE": "1", "DOMINO_CHUNKS": "1", "DOMINO_COLUMN_CHUNKS": "4"}
    refused = run_script(SCRIPTS["srun"], check=False, MOCK="1", DOMINO="1", **column_split)
    assert refused.returncode == 1 and "add TRANSFORMER_IMPL=local" in refused.stderr
    done = run_script(
        SCRIPTS["srun"],
        MOCK="1",
        DOMINO="1",
        TRANSFORMER_IMPL="local",
        DOMINO_INTER_LAYER="0",
        **column_split,
    )
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert (args.domino_chunks, args.domino_column_chunks, args.domino_inter_layer) == (1, 4, False)


def test_real_data_flags_pass_and_missing_data_is_a_clear_error(monkeypatch):
    done = run_script(
        SCRIPTS["torchrun"],
        MODEL="llama2-13b",
        DATA_PATH="0.7 /data/web_text_document 0.3 /data/code_text_document",
        TOKENIZER_MODEL="/data/tokenizer.model",
    )
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert args.data_path == ["0.7", "/data/web_text_document", "0.3", "/data/code_text_document"]
    assert args.tokenizer_type == "SentencePieceTokenizer" and not args.mock_data
    assert args.tokenizer_model == "/data/tokenizer.model" and args.split == "969,30,1"

    missing = run_script(SCRIPTS["torchrun"], check=False, DATA_PATH="/data/x")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "TOKENIZER_MODEL" in missing.stderr and "MOCK=1" in missing.stderr

    # GPT-3's own tokenizer, one of Megatron-LM's others.
    gpt2 = {"MODEL": "gpt3-2.7b", "DATA_PATH": "/data/x", "TOKENIZER_TYPE": "GPT2BPETokenizer"}
    missing = run_script(SCRIPTS["srun"], check=False, **gpt2)
    assert missing.returncode == 1 and "VOCAB_FILE and MERGE_FILE" in missing.stderr
    done = run_script(SCRIPTS["srun"], VOCAB_FILE="/v.json", MERGE_FILE="/m.txt", **gpt2)
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == (
        "GPT2BPETokenizer",
        "/v.json",
        "/m.txt",
    ) and args.tokenizer_model is None


def test_model_config_typos_and_unknown_models_are_errors(tmp_path):
    config = (EXAMPLES / "models" / "gpt3-2.7b.env").read_text()
    typo = tmp_path / "typo.env"
    typo.write_text(config.replace("NUM_LAYERS=", "NUM_LAYER="))
    done = run_script(SCRIPTS["srun"], check=False, MOCK="1", MODEL=str(typo))
    assert done.returncode == 1 and "unknown model key NUM_LAYER" in done.stderr
    done = run_script(SCRIPTS["srun"], check=False, MOCK="1", MODEL="gpt5")
    assert done.returncode == 1 and "Known models:" in done.stderr and "llama3-8b" in done.stderr


def test_sbatch_headers_match_the_launch_style():
    for style, tasks in (("srun", 8), ("torchrun", 1)):
        text = (EXAMPLES / SCRIPTS[style]).read_text()
        assert f"#SBATCH --ntasks-per-node={tasks}\n" in text
        assert "#SBATCH --gpus-per-node=8\n" in text and "set -euo pipefail" in text
        # Restarts and resumes on its own, and says so (tests/runs/test_faults.py runs the faults).
        assert "# Restarts on its own:" in text and "requeues itself" in text
        assert "#SBATCH --requeue\n" in text and "#SBATCH --signal=TERM@300\n" in text
        assert ("MAX_RESTARTS=3" in text) == (style == "torchrun")


@pytest.mark.parametrize("style", sorted(SCRIPTS))
def test_recipes_checkpoint_and_resume_by_default(style, monkeypatch):
    done = run_script(SCRIPTS[style], MOCK="1", DOMINO="1", RUN_DIR="/scratch/run")
    [(launcher, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8, monkeypatch=monkeypatch)
    assert args.save == args.load == "/scratch/run/checkpoints" and args.exit_signal_handler
    assert ("--max-restarts" in launcher) == (style == "torchrun")
    if style == "torchrun":
        assert option(launcher, "--max-restarts") == "3"
    assert exports(done.stdout)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    [(_, flags)] = launches(run_script(SCRIPTS[style], MOCK="1", CHECKPOINT_DIR="").stdout)
    assert "--save" not in flags and "--exit-signal-handler" not in flags


def test_cpu_runs_keep_the_gpu_recipes_distributed_optimizer(monkeypatch):
    """CPU=1 runs the distributed optimizer as the GPU recipes do (its resume works on the CPU
    through the runtime's patches: tests/runs/test_faults.py, tests/slurm/); asked off it is
    off."""
    cpu = {"MOCK": "1", "CPU": "1", "MODEL": "tiny", "TP": "2", "GPUS_PER_NODE": "2"}
    [(_, flags)] = launches(run_script(SCRIPTS["srun"], **cpu).stdout)
    args = accepted(flags, world_size=2, monkeypatch=monkeypatch)
    assert args.use_distributed_optimizer and args.distributed_backend == "gloo"
    [(_, flags)] = launches(run_script(SCRIPTS["srun"], DISTRIBUTED_OPTIMIZER="0", **cpu).stdout)
    assert "--use-distributed-optimizer" not in flags
    [(_, flags)] = launches(run_script(SCRIPTS["srun"], MOCK="1").stdout)  # GPU runs keep it
    assert "--use-distributed-optimizer" in flags


#: What an attempt printed, by name: nothing of note, the entry point's refusal as rank 0
#: prints it (exit status 2), and the refusal followed by a long output (torchrun's restarts
#: print megabytes after it: a reader that stops at the match must not fail the search).
REFUSAL = "pretrain_gpt_domino.py: error: There is no CUDA device here and NCCL needs one\n"
OUTPUTS = {"": "", "refusal": REFUSAL, "refusal, long": REFUSAL + "[rank0]: args ...\n" * 50_000}


@pytest.mark.parametrize(
    ("tracker", "launched_at", "restarts", "status", "output", "requeued", "returned"),
    [
        ("100", "0", "0", "0", "", False, 0),  # finished: nothing to do
        ("40", "0", "0", "0", "", True, 0),  # SIGTERM before the time limit: saved at 40, requeue
        ("40", "20", "1", "1", "", True, 0),  # a rank died after saving 40, requeued once: again
        ("40", "20", "0", "137", "", True, 0),  # a rank killed after saving 40: again
        ("40", "0", "3", "1", "", False, 1),  # MAX_REQUEUES reached: the failure stands
        (None, "0", "0", "0", "", True, 0),  # stopped before the first checkpoint: start over
        # Retries that cannot succeed (issue 29: four runs before FAILED):
        ("40", "40", "0", "2", "refusal", False, 2),  # a refused command line: its status kept
        (None, "0", "0", "2", "refusal", False, 2),
        # ... also when srun reports a rank it killed after another refused (--kill-on-bad-exit),
        # or torchrun its ranks' failure as 1: the refusal in this attempt's output counts.
        ("40", "40", "0", "143", "refusal", False, 2),
        ("40", "40", "0", "1", "refusal, long", False, 2),
        ("40", "40", "0", "1", "", False, 1),  # failed again where it started: would repeat
        ("40", "40", "0", "137", "", False, 137),  # killed there again (OOM): would repeat
    ],
)
def test_an_unfinished_job_requeues_itself(
    tmp_path, tracker, launched_at, restarts, status, output, requeued, returned
):
    """recipe_requeue_unfinished against a stand-in scontrol, after runs that stopped early
    (the real SLURM tier, tests/slurm/, requeues real jobs). The log starts with an earlier
    attempt's refusal, which must not count for this one."""
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n')
    scontrol.chmod(0o755)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    if tracker is not None:
        (checkpoints / "latest_checkpointed_iteration.txt").write_text(tracker)
    earlier = f"# pretrain: an earlier attempt\n{REFUSAL}"
    train_log = tmp_path / "run" / "train.log"
    train_log.write_text(f"{earlier}# pretrain: this attempt\n{OUTPUTS[output]}")
    script = f'source {EXAMPLES}/lib/common.sh; recipe_requeue_unfinished "$STATUS"'
    done = subprocess.run(
        ["bash", "-c", script],
        env={
            "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "DRY_RUN": "0", "STATUS": status,
            "TRAIN_ITERS": "100", "MAX_REQUEUES": "3", "SLURM_JOB_ID": "4242",
            "SLURM_RESTART_COUNT": restarts, "RUN_DIR": str(tmp_path / "run"),
            "CHECKPOINT_DIR": str(checkpoints), "RECIPE_LAUNCHED_AT": launched_at,
            "RECIPE_LOG": str(train_log), "RECIPE_LOG_START": str(len(earlier)),
        },
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == returned, done.stderr
    calls = tmp_path / "scontrol.calls"
    assert (calls.read_text() if calls.exists() else "") == ("requeue 4242\n" if requeued else "")
    if tracker != "100":
        log = train_log.read_text()
        assert "# training stopped at iteration" in log
        assert ("requeueing job 4242" in log) == requeued
        refused = "not requeued: the command line or an input was refused"
        assert (refused in log) == (returned == 2)


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "local"])
def test_ab_compare_runs_identical_arms_but_for_domino(launcher, monkeypatch):
    done = run_script("ab_compare.sh", LAUNCHER=launcher, MOCK="1", AB_DIR="/tmp/ab")
    (base_launcher, base), (dom_launcher, dom) = launches(done.stdout)
    world = 2 if launcher == "local" else 8
    base_args = accepted(base, world_size=world, monkeypatch=monkeypatch)
    dom_args = accepted(dom, world_size=world, monkeypatch=monkeypatch)
    assert not base_args.domino and dom_args.domino
    assert base_args.log_json == "/tmp/ab/baseline/log.jsonl"
    assert dom_args.log_json == "/tmp/ab/domino/log.jsonl"
    differing = {"domino", "log_json"}
    for name, value in vars(base_args).items():
        if name not in differing:
            assert getattr(dom_args, name) == value, name
    if launcher == "local":
        assert base_launcher[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
        assert base_args.num_layers == 2 and not base_args.bf16  # the tiny CPU model
        assert base_args.distributed_backend == "gloo" and base_args.transformer_impl == "local"
    else:
        assert base_launcher[0] == "srun" and base_args.transformer_impl == "transformer_engine"
    report = next(
        line for line in done.stdout.splitlines() if "megatron_domino.tools.ab_report" in line
    )
    words = shlex.split(report)
    assert option(words, "--out-dir") == "/tmp/ab" and option(words, "--gpus") == str(world)
    tokens = base_args.global_batch_size * base_args.seq_length
    assert option(words, "--tokens-per-iteration") == str(tokens)
    assert "pp=1" in words and "tp=" + str(base_args.tensor_model_parallel_size) in words


def test_ab_compare_reports_the_pipeline_parallel_size_it_ran(monkeypatch):
    """The report used to say pp=1 whatever PP was."""
    done = run_script("ab_compare.sh", MOCK="1", MODEL="llama3-70b", PP="2", NNODES="2")
    report = shlex.split(
        next(line for line in done.stdout.splitlines() if "megatron_domino.tools.ab_report" in line)
    )
    assert "pp=2" in report and "pp=1" not in report
    (_, base), _ = launches(done.stdout)
    assert accepted(base, world_size=16, monkeypatch=monkeypatch).pipeline_model_parallel_size == 2


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean():
    scripts = [*(EXAMPLES / s for s in (*SCRIPTS.values(), "ab_compare.sh", "llama3_70b_h100.sh"))]
    done = subprocess.run(
        ["shellcheck", "-x", *map(str, scripts), str(EXAMPLES / "lib" / "common.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


# --- ab_report -----------------------------------------------------------------------------


def load_ab_report():
    """The A/B report command's module (``megatron_domino.tools.ab_report``)."""
    from megatron_domino.tools import ab_report

    return ab_report


def megatron_line(iteration: int, total: int, ms: float, tflops: float, loss: float) -> str:
    """An iteration line as Megatron-LM's ``training_log`` writes it with --log-throughput
    (``megatron/training/training.py``; the slow test above reads real ones)."""
    return (
        f" [2026-11-30 12:00:00.000000] iteration {iteration:8d}/{total:8d} |"
        f" consumed samples: {iteration * 8:12d} |"
        f" elapsed time per iteration (ms): {ms:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        f" learning rate: {1e-4:.6E} | global batch size: {8:5d} | lm loss: {loss:.6E} |"
        f" loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations: {0:3d} |"
        f" number of nan iterations: {0:3d} |"
    )


def write_run(directory: Path, seconds: list[float], losses: list[float], monkeypatch) -> Path:
    """A run's --log-json, written by the script's own hook around Megatron's train_step, and
    its train.log: the header examples/lib/common.sh prints, then Megatron-LM's lines."""
    directory.mkdir()
    monkeypatch.setattr(loop_hooks, "_is_last_rank", lambda: True)
    hooks = loop_hooks.LoopHooks(str(directory / "log.jsonl"))
    optimizer = SimpleNamespace(param_groups=[{"lr": 1e-4}])
    flops_per_gpu = 10**15 / 4  # 1 PFLOP per iteration over 4 GPUs
    lines = ["# baseline: tiny", "export CUDA_DEVICE_MAX_CONNECTIONS=1"]
    lines.append("srun --nodes=1 python /repo/pretrain_gpt_domino.py --num-layers 2")
    for iteration, (step_s, loss) in enumerate(zip(seconds, losses, strict=True), 1):
        hooks._train_step = lambda *args, loss=loss, step_s=step_s, **kwargs: (
            {"lm loss": loss},
            False,
            False,
            0,
            None,
            1.0,
            None,
            None,
        )
        hooks.train_step(None, None, None, optimizer, None, iteration=iteration - 1)
        lines.append(
            megatron_line(
                iteration, len(seconds), step_s * 1e3, flops_per_gpu / step_s / 1e12, loss
            )
        )
    # The hook times the (instant) fake step; the recorded seconds are the run's.
    records = [json.loads(r) for r in (directory / "log.jsonl").read_text().splitlines()]
    for record, step_s in zip(records, seconds, strict=True):
        assert set(record) == {
            "kind", "iteration", "loss", "grad_norm", "learning_rate", "skipped", "seconds"
        }  # fmt: skip
        record["seconds"] = step_s
    (directory / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "train.log").write_text("\n".join(lines) + "\n")
    return directory


@pytest.mark.parametrize("log_name", ["log.jsonl", "train.log"])
def test_ab_report_writes_table_json_and_plot(tmp_path, monkeypatch, log_name):
    ab_report = load_ab_report()
    losses = [5.0, 4.0, 3.5, 3.2, 3.0, 2.9]
    base = write_run(tmp_path / "baseline", [9.0, 1.0, 1.2, 1.1, 0.9, 1.0], losses, monkeypatch)
    dom = write_run(
        tmp_path / "domino", [9.0, 0.8, 0.9, 0.8, 0.7, 0.8], [x + 1e-3 for x in losses], monkeypatch
    )
    out = tmp_path / "ab_results"
    status = ab_report.main(
        [
            "--baseline", str(base / log_name), "--domino", str(dom / log_name),
            "--gpus", "4", "--out-dir", str(out), "--warmup", "1",
            "--tokens-per-iteration", str(8 * 2048),
            "--meta", "model=gpt3-2.7b", "--meta", "system=8xH100", "--meta", "tp=4",
            "--meta", "domino=p=2 k=1", "--meta", "precision=bf16",
        ]
    )  # fmt: skip
    assert status == 0
    result = json.loads((out / "ab.json").read_text())
    baseline, domino = result["arms"]["baseline"], result["arms"]["domino"]
    assert result["warmup_iterations"] == 1 and baseline["iterations"] == [2, 6]
    assert baseline["ms_per_iteration"] == pytest.approx({"median": 1000, "min": 900, "max": 1200})
    assert domino["ms_per_iteration"]["median"] == pytest.approx(800)
    assert result["speedup"] == pytest.approx(1.25)
    # 8 x 2048 tokens per iteration over 4 GPUs; 1 PFLOP per iteration over 4 GPUs, from
    # Megatron's lines (TFLOP/s/GPU with one decimal) in train.log, also beside log.jsonl.
    assert baseline["tokens_per_s_per_gpu"] == pytest.approx(8 * 2048 / 1.0 / 4, rel=1e-3)
    assert domino["tflops_per_gpu"] == pytest.approx(1000 / 0.8 / 4, rel=1e-3)
    assert result["loss_parity"]["common_iterations"] == 6
    assert result["loss_parity"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert baseline["command"].startswith("srun --nodes=1 python /repo/pretrain_gpt_domino.py")
    assert set(result["provenance"]) >= {"commit", "host", "torch", "megatron-core", "date"}

    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| arm | system | GPUs | precision | model |")
    assert "speedup" in table[0] and "TFLOP/s/GPU" in table[0] and "tokens/s/GPU" in table[0]
    assert table[2].startswith("| baseline | 8xH100 | 4 | bf16 | gpt3-2.7b |")
    assert table[2].endswith("| 1.000 |") and table[3].endswith("| 1.250 |")
    assert "| p=2 k=1 |" in table[3] and "| 1000.0 (900.0-1200.0) |" in table[2]
    if importlib.util.find_spec("matplotlib"):
        assert (out / "ab.png").stat().st_size > 0


def test_ab_report_refuses_logs_without_measured_iterations(tmp_path, capsys, monkeypatch):
    ab_report = load_ab_report()
    run = write_run(tmp_path / "run", [1.0, 1.0], [3.0, 2.0], monkeypatch)
    log = str(run / "log.jsonl")
    argv = ["--baseline", log, "--domino", log, "--gpus", "1", "--out-dir", str(tmp_path / "o")]
    assert ab_report.main([*argv, "--warmup", "2"]) == 1
    assert "warm-up" in capsys.readouterr().err
    assert ab_report.main([*argv[:1], str(tmp_path / "missing.jsonl"), *argv[2:]]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_llama3_70b_h100_recipe_is_nvidias_layout_where_domino_applies(monkeypatch):
    done = run_script("llama3_70b_h100.sh", MOCK="1", NNODES="8")
    [(launcher, flags)] = launches(done.stdout)
    assert launcher[0] == "srun" and "--nodes=8" in launcher and "--ntasks-per-node=8" in launcher
    args = accepted(flags, world_size=64, monkeypatch=monkeypatch)
    assert (args.num_layers, args.hidden_size, args.num_query_groups) == (80, 8192, 8)
    layout = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    assert layout == (4, 4) and args.virtual_pipeline_model_parallel_size == 5
    assert args.sequence_parallel and args.micro_batch_size == 1 and args.bf16
    assert args.transformer_impl == "transformer_engine" and args.context_parallel_size == 1
    assert args.domino and args.domino_split_along == "sequence" and args.domino_chunks == 2
    assert not args.tp_comm_overlap and args.cuda_graph_impl == "none"
    header = (EXAMPLES / "llama3_70b_h100.sh").read_text()
    for given_up in ("context parallelism (CP 2)", "TE userbuffer overlap", "CUDA graphs"):
        assert given_up in header
    assert "#SBATCH --requeue\n" in header and "#SBATCH --gpus-per-node=8\n" in header


#: A stand-in for srun on one machine: starts --ntasks-per-node copies of the command with
#: SLURM's rank variables, as srun does on each node (the real Slurm tier, tests/slurm/, runs
#: the recipes under a real srun; this keeps one real training run of a recipe in make test).
FAKE_SRUN = """#!/bin/bash
tasks=1
while [[ $1 == --* ]]; do
    case $1 in --ntasks-per-node=*) tasks=${1#*=} ;; esac
    shift
done
pids=()
for ((rank = 0; rank < tasks; rank++)); do
    SLURM_PROCID=$rank SLURM_NTASKS=$tasks SLURM_LOCALID=$rank "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


@pytest.mark.slow
def test_the_srun_recipe_trains_with_ranks_from_slurm_variables(tmp_path):
    """The real (not dry) path of a recipe, in make test: exports, run directory, tee'd log,
    ranks from SLURM_PROCID, the CPU=1 defaults (the distributed optimizer included), Domino's
    banner and three iterations logged."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    done = run_script(
        SCRIPTS["srun"], timeout=240, DRY_RUN="0",
        PATH=f"{srun.parent}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHON=sys.executable, CPU="1", MODEL="tiny", TP="2", GPUS_PER_NODE="2", BF16="0",
        MOCK="1", DOMINO="1", TRAIN_ITERS="3", LOG_INTERVAL="1", EVAL_ITERS="0",
        RUN_DIR=str(tmp_path / "run"), DATA_CACHE_PATH=str(tmp_path / "cache"),
    )  # fmt: skip
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.startswith("# pretrain: tiny, 1 node(s) x 2 ranks, TP=2, PP=1, DP=1 (srun)")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in log
    assert "--use-distributed-optimizer" in log and "> Domino: DominoConfig(chunks=2" in log
    assert (
        " iteration        3/       3 | " in log
        and " iteration        3/       3 | " in done.stdout
    )
    records = [json.loads(r) for r in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["kind"] == "train"] == [1, 2, 3]
