"""The SLURM recipes in examples/: what they print is what pretrain_gpt_domino.py accepts.

Every model config x launch style is run with DRY_RUN=1 (no srun, no SLURM needed); the
printed launcher is checked, and the printed pretrain_gpt_domino.py flags go through the
script's own parser (``build_parser``) and validation (``validate_args``) for the printed world
size. With MOCK=1 validation reads no file and touches no GPU, so it runs in full: model
shapes, TP divisibility, batch layout, Domino settings. With DATA_PATH/TOKENIZER_MODEL the
flags are only parsed (validation would open the dataset and the SentencePiece model). Not
checked here: that a model fits in GPU memory, and that a real srun accepts its options.
One slow test runs the srun recipe for real on CPU, with a stand-in for srun that starts the
ranks with SLURM's variables. ab_report.py is tested on logs written by the trainer's own
Reporter, so a change of the log format shows up here.
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

import pytest

from megatron_domino.training.arguments import ArgumentsError, build_parser, validate_args
from megatron_domino.training.reporting import Reporter

REPO = Path(__file__).resolve().parent.parent
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
    """examples/models/NAME.env as a dict (KEY=VALUE lines, '#' comments)."""
    config = {}
    for line in (EXAMPLES / "models" / f"{name}.env").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = line.split("=", 1)
            config[key] = value
    return config


def accepted(flags: list[str], *, world_size: int):
    """Parse and validate like pretrain_gpt_domino.py does; raises on any rejected flag."""
    args = build_parser().parse_args(flags)
    validate_args(args, world_size=world_size)
    return args


def option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


@pytest.mark.parametrize("style", sorted(SCRIPTS))
@pytest.mark.parametrize("model", MODELS)
def test_every_model_and_launch_style_prints_a_command_the_trainer_accepts(model, style):
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

    args = accepted(flags, world_size=16)
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
    assert args.disable_bias_linear == (config["DISABLE_BIAS_LINEAR"] == "1")
    assert args.untie_embeddings_and_output_weights == (
        config["UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS"] == "1"
    )
    assert args.max_position_embeddings == (
        int(config["MAX_POSITION_EMBEDDINGS"]) if "MAX_POSITION_EMBEDDINGS" in config else None
    )
    assert args.tensor_model_parallel_size == 8 and args.micro_batch_size == 2
    assert args.global_batch_size == 4  # micro-batch 2 x data-parallel 2 (16 ranks / TP 8)
    assert args.domino and args.chunks == 2 and args.bf16 and args.mock_data
    assert args.use_distributed_optimizer and args.overlap_grad_reduce
    assert args.log_throughput and args.log_json.endswith("/log.jsonl")


def test_transformer_engine_fp8_and_sequence_parallel_knobs_reach_the_flags():
    """TE + FP8 + SP with Domino: flags the trainer accepts; on this machine validation stops
    only at the missing GPU/Transformer Engine, which is checked last."""
    done = run_script(
        SCRIPTS["srun"],
        MODEL="llama3-8b",
        MOCK="1",
        DOMINO="1",
        TRANSFORMER_IMPL="transformer_engine",
        SEQUENCE_PARALLEL="1",
        FP8_FORMAT="hybrid",
    )
    [(_, flags)] = launches(done.stdout)
    args = build_parser().parse_args(flags)
    assert args.transformer_impl == "transformer_engine" and args.sequence_parallel
    assert args.fp8_format == "hybrid" and args.fp8_recipe == "delayed" and args.domino
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ArgumentsError, match="needs a CUDA GPU and Transformer Engine"):
            validate_args(args, world_size=8)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_model_configs_have_the_published_shapes(model):
    config = read_model(model)
    keys = ("NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "NUM_QUERY_GROUPS")
    keys += ("FFN_HIDDEN_SIZE", "SEQ_LENGTH", "VOCAB_SIZE")
    assert tuple(int(config[key]) for key in keys) == SHAPES[model]
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


def test_baseline_omits_domino_and_environment_overrides_reach_the_flags():
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
    args = accepted(flags, world_size=16)
    assert not args.domino and not args.bf16
    assert (args.tensor_model_parallel_size, args.micro_batch_size) == (4, 4)
    assert (args.global_batch_size, args.train_iters, args.num_layers) == (64, 50, 4)
    assert args.lr_warmup_iters == 5 and args.eval_interval == 25
    assert args.log_json == "/scratch/run1/log.jsonl"


def test_micro_batch_one_needs_column_chunks():
    refused = run_script(SCRIPTS["srun"], check=False, MOCK="1", DOMINO="1", MICRO_BATCH_SIZE="1")
    assert refused.returncode == 1 and "DOMINO_COLUMN_CHUNKS" in refused.stderr
    done = run_script(
        SCRIPTS["srun"],
        MOCK="1",
        DOMINO="1",
        MICRO_BATCH_SIZE="1",
        DOMINO_CHUNKS="1",
        DOMINO_COLUMN_CHUNKS="4",
        DOMINO_INTER_LAYER="0",
    )
    [(_, flags)] = launches(done.stdout)
    args = accepted(flags, world_size=8)
    assert (args.chunks, args.column_chunks, args.inter_layer) == (1, 4, False)


def test_real_data_flags_parse_and_missing_data_is_a_clear_error():
    done = run_script(
        SCRIPTS["torchrun"],
        MODEL="llama2-13b",
        DATA_PATH="0.7 /data/web_text_document 0.3 /data/code_text_document",
        TOKENIZER_MODEL="/data/tokenizer.model",
    )
    [(_, flags)] = launches(done.stdout)
    # Parse only: validation would open the .bin/.idx files and the SentencePiece model.
    args = build_parser().parse_args(flags)
    assert args.data_path == ["0.7", "/data/web_text_document", "0.3", "/data/code_text_document"]
    assert args.tokenizer_type == "SentencePieceTokenizer" and not args.mock_data
    assert args.tokenizer_model == "/data/tokenizer.model" and args.split == "969,30,1"

    missing = run_script(SCRIPTS["torchrun"], check=False, DATA_PATH="/data/x")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "TOKENIZER_MODEL" in missing.stderr and "MOCK=1" in missing.stderr


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


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "local"])
def test_ab_compare_runs_identical_arms_but_for_domino(launcher):
    done = run_script("ab_compare.sh", LAUNCHER=launcher, MOCK="1", AB_DIR="/tmp/ab")
    (base_launcher, base), (dom_launcher, dom) = launches(done.stdout)
    world = 2 if launcher == "local" else 8
    base_args, dom_args = accepted(base, world_size=world), accepted(dom, world_size=world)
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
    else:
        assert base_launcher[0] == "srun"
    report = next(line for line in done.stdout.splitlines() if "ab_report.py" in line)
    words = shlex.split(report)
    assert option(words, "--out-dir") == "/tmp/ab" and option(words, "--gpus") == str(world)


#: A stand-in for srun on one machine: starts --ntasks-per-node copies of the command with
#: SLURM's rank variables, as srun does on each node.
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
def test_srun_recipe_trains_with_ranks_from_slurm_variables(tmp_path):
    """The real (not dry) path: exports, run directory, tee'd log, SLURM_PROCID ranks."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    python_dir = Path(sys.executable).parent
    done = run_script(
        SCRIPTS["srun"],
        timeout=240,
        DRY_RUN="0",
        PATH=f"{srun.parent}:{python_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        MODEL="tiny",
        TP="2",
        GPUS_PER_NODE="2",
        BF16="0",
        MOCK="1",
        DOMINO="1",
        TRAIN_ITERS="3",
        LOG_INTERVAL="1",
        RUN_DIR=str(tmp_path / "run"),
        DATA_CACHE_PATH=str(tmp_path / "cache"),
    )
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.startswith("# pretrain: tiny, 1 node(s) x 2 ranks, TP=2, PP=1, DP=1 (srun)")
    assert "iteration        3/       3" in log and "Summary" in log
    records = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert [json.loads(r)["iteration"] for r in records] == [1, 2, 3]
    assert "iteration        3/       3" in done.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean():
    scripts = [*(EXAMPLES / s for s in (*SCRIPTS.values(), "ab_compare.sh"))]
    done = subprocess.run(
        ["shellcheck", "-x", *map(str, scripts), str(EXAMPLES / "lib" / "common.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


# --- ab_report.py -------------------------------------------------------------------------


def load_ab_report():
    """examples/ab_report.py as a module (registered first: its dataclass needs that)."""
    if "ab_report" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ab_report", EXAMPLES / "ab_report.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["ab_report"]


def write_run(directory: Path, seconds: list[float], losses: list[float], capsys) -> Path:
    """A run's --log-json and text output, written by the trainer's Reporter itself."""
    directory.mkdir()
    reporter = Reporter(
        tokens_per_iteration=8 * 2048,
        flops_per_iteration=10**15,
        world_size=4,
        train_iters=len(seconds),
        log_interval=1,
        log_throughput=True,
        log_json=str(directory / "log.jsonl"),
        resumed=False,
        tensorboard_dir=None,
        enabled=True,
    )
    capsys.readouterr()
    for iteration, (step_s, loss) in enumerate(zip(seconds, losses, strict=True), 1):
        reporter.step(
            iteration, loss=loss, learning_rate=1e-4, grad_norm=1.0, seconds=step_s, skipped=False
        )
    reporter.finish()
    # The header examples/lib/common.sh prints before the run's output.
    header = "# baseline: tiny\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    header += "srun --nodes=1 python /repo/pretrain_gpt_domino.py --num-layers 2\n"
    (directory / "train.log").write_text(header + capsys.readouterr().out)
    return directory


@pytest.mark.parametrize("log_name", ["log.jsonl", "train.log"])
def test_ab_report_writes_table_json_and_plot(tmp_path, capsys, log_name):
    ab_report = load_ab_report()
    losses = [5.0, 4.0, 3.5, 3.2, 3.0, 2.9]
    base = write_run(tmp_path / "baseline", [9.0, 1.0, 1.2, 1.1, 0.9, 1.0], losses, capsys)
    dom = write_run(
        tmp_path / "domino", [9.0, 0.8, 0.9, 0.8, 0.7, 0.8], [x + 1e-3 for x in losses], capsys
    )
    out = tmp_path / "ab_results"
    status = ab_report.main(
        [
            "--baseline", str(base / log_name), "--domino", str(dom / log_name),
            "--gpus", "4", "--out-dir", str(out), "--warmup", "1",
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
    # 8 x 2048 tokens per iteration over 4 GPUs; 1 PFLOP per iteration over 4 GPUs.
    assert baseline["tokens_per_s_per_gpu"] == pytest.approx(8 * 2048 / 1.0 / 4, rel=1e-3)
    # Text lines print TFLOP/s with 3 significant digits.
    assert domino["tflops_per_gpu"] == pytest.approx(1000 / 0.8 / 4, rel=5e-3)
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


def test_ab_report_refuses_logs_without_measured_iterations(tmp_path, capsys):
    ab_report = load_ab_report()
    run = write_run(tmp_path / "run", [1.0, 1.0], [3.0, 2.0], capsys)
    log = str(run / "log.jsonl")
    argv = ["--baseline", log, "--domino", log, "--gpus", "1", "--out-dir", str(tmp_path / "o")]
    assert ab_report.main([*argv, "--warmup", "2"]) == 1
    assert "warm-up" in capsys.readouterr().err
    assert ab_report.main([*argv[:1], str(tmp_path / "missing.jsonl"), *argv[2:]]) == 1
    assert "cannot read" in capsys.readouterr().err
