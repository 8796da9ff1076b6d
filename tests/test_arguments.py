"""Flag parsing and validation of pretrain_gpt_domino.py: pure Python, no process group."""

import importlib.util

import pytest

from megatron_domino.training.arguments import (
    ArgumentsError,
    Layout,
    build_parser,
    lr_decay_iters,
    model_options,
    parse_args,
    tokenizer_from_args,
    validate_args,
)

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 100"
).split()


TP2_DOMINO = "--domino --tensor-model-parallel-size 2".split()
FULL_RECOMPUTE = [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1",
]  # fmt: skip
#: Domino on Transformer Engine layers at TP = 2.
TE_DOMINO = "--domino --transformer-impl transformer_engine --tensor-model-parallel-size 2".split()


def parsed(*extra: str, world_size: int = 2):
    args = build_parser().parse_args([*BASE, *extra])
    validate_args(args, world_size=world_size)
    return args


def invalid(*extra: str, world_size: int = 2) -> str:
    with pytest.raises(ArgumentsError) as err:
        parsed(*extra, world_size=world_size)
    return str(err.value)


def test_megatron_defaults_are_derived_without_touching_the_namespace():
    args = parsed("--swiglu")
    assert args.ffn_hidden_size is None and args.max_position_embeddings is None
    vocab = tokenizer_from_args(args).vocab_size
    assert vocab == 101  # NullTokenizer: --vocab-size ids plus end-of-document
    options = model_options(args, vocab_size=vocab)
    assert options.resolved_ffn_hidden_size == 128  # int(4 * 64 * 2/3 / 64) * 64
    assert options.resolved_max_position_embeddings == 32
    assert options.resolved_num_query_groups == 4  # multi-head without --group-query-attention
    gqa = parsed("--group-query-attention", "--num-query-groups", "2")
    assert model_options(gqa, vocab_size=vocab).resolved_num_query_groups == 2
    assert model_options(parsed(), vocab_size=vocab).resolved_ffn_hidden_size == 256
    assert lr_decay_iters(args) == 10
    assert args.transformer_impl == "local" and args.seed == 1234 and args.clip_grad == 1.0


def test_layout_gives_data_parallel_size_and_gradient_accumulation():
    args = parsed("--tensor-model-parallel-size", "2", "--global-batch-size", "8", world_size=4)
    layout = Layout.from_args(args, world_size=4)
    assert (layout.data_parallel_size, layout.num_microbatches) == (2, 2)
    assert Layout.from_args(parsed(), world_size=2).global_batch_size == 4  # micro x dp


@pytest.mark.parametrize(
    ("extra", "world_size", "expected"),
    [
        (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible"),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
        (["--sequence-parallel"], 2, "--sequence-parallel shards the sequence"),
        (
            [
                "--sequence-parallel",
                "--tensor-model-parallel-size",
                "2",
                "--seq-length",
                "31",
                "--max-position-embeddings",
                "32",
            ],
            2,
            "--seq-length 31 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible"),
        (
            ["--tensor-model-parallel-size", "2", "--group-query-attention"],
            2,
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            2,
            "--num-attention-heads 4 is not divisible by --num-query-groups 3",
        ),
        (["--hidden-size", "66"], 2, "--hidden-size 66 is not divisible"),
        (["--max-position-embeddings", "16"], 2, "--max-position-embeddings 16 is smaller"),
        (["--lr-warmup-iters", "10"], 2, "--lr-warmup-iters 10 must be smaller"),
        (["--save-interval", "5"], 2, "--save-interval needs --save"),
        (["--micro-batch-size", "0"], 2, "--micro-batch-size must be >= 1"),
        (["--hidden-dropout", "1.5"], 2, "--hidden-dropout must be in [0, 1)"),
        (["--domino"], 2, "--tensor-model-parallel-size 1 has none"),
        (
            ["--domino", "--domino-chunks", "4", "--tensor-model-parallel-size", "2"],
            2,
            "--micro-batch-size 2 is not divisible by --domino-chunks 4",
        ),
        (["--fp8-format", "hybrid"], 2, "add --transformer-impl transformer_engine"),
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            6,
            "launch a multiple of 4 processes",
        ),
        (["--pipeline-model-parallel-size", "4"], 4, "--num-layers 2 is not divisible"),
        (["--recompute-granularity", "full"], 2, "needs --recompute-method (uniform or block)"),
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "3",
            ],
            2,
            "--recompute-num-layers 3 does not divide the 2 layers",
        ),
        (
            [*TE_DOMINO, "--sequence-parallel", "--fp8-format", "hybrid", *FULL_RECOMPUTE],
            2,
            "full activation recompute with FP8 needs",
        ),
        (
            [*TP2_DOMINO, "--recompute-granularity", "selective", "--recompute-modules", "mlp"],
            2,
            "selective recompute of mlp is not supported",
        ),
        (
            [*TE_DOMINO, "--domino-column-chunks", "2", "--sequence-parallel"],
            2,
            "--domino-column-chunks > 1 needs",
        ),
        (TE_DOMINO, 2, "add --no-domino-backward-overlap, or --sequence-parallel"),
        (
            [*TE_DOMINO, "--sequence-parallel", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
            2,
            "--fp8-recipe mxfp8 computes scales",
        ),
    ],
)
def test_invalid_combinations_name_the_problem(extra, world_size, expected):
    assert expected in invalid(*extra, world_size=world_size)


def test_recompute_flags_reach_the_model_options():
    args = parsed("--recompute-activations", *TP2_DOMINO)
    options = model_options(args, vocab_size=101)
    assert options.recompute_granularity == "selective"
    assert options.recompute_modules == ("core_attn",)
    full = model_options(parsed(*FULL_RECOMPUTE, *TP2_DOMINO), vocab_size=101)
    assert (full.recompute_granularity, full.recompute_method) == ("full", "uniform")
    assert full.recompute_num_layers == 1


def test_data_source_and_tokenizer_are_checked(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    assert "exactly one data source" in invalid("--data-path", str(prefix))
    base = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ArgumentsError, match=r"corpus_text_document\.bin does not exist"):
        validate_args(build_parser().parse_args([*base, "--data-path", str(prefix)]), world_size=1)
    prefix.with_suffix(".bin").write_bytes(b"")
    prefix.with_suffix(".idx").write_bytes(b"")
    data = [*base, "--data-path", str(prefix)]
    validate_args(build_parser().parse_args(data), world_size=1)
    with pytest.raises(ArgumentsError, match="gives it no share"):
        args = build_parser().parse_args([*data, "--split", "100,0,0", "--eval-interval", "5"])
        validate_args(args, world_size=1)
    sp = "--tokenizer-type SentencePieceTokenizer".split()
    assert "needs --tokenizer-model" in invalid(*sp)
    assert "x.model does not exist" in invalid(*sp, "--tokenizer-model", str(tmp_path / "x.model"))


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed"
)
def test_transformer_engine_without_te_says_how_to_fix():
    message = invalid("--transformer-impl", "transformer_engine")
    assert "Transformer Engine" in message and "--transformer-impl local" in message
    # Domino's supported TE settings pass the flag checks and fail only for the missing TE.
    supported = [*TE_DOMINO, "--sequence-parallel", "--fp8-format", "hybrid"]
    assert "needs a CUDA GPU and Transformer Engine" in invalid(*supported)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="installed")
def test_tensorboard_dir_without_tensorboard_is_an_error(tmp_path):
    assert "pip install tensorboard" in invalid("--tensorboard-dir", str(tmp_path / "tb"))


def test_parse_args_exits_with_the_reason_and_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--global-batch-size", "3"], world_size=2)
    assert exit_info.value.code == 2
    assert "--global-batch-size 3 is not divisible" in capsys.readouterr().err


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_an_invalid_run_writes_nothing(tmp_path, capsys):
    from megatron_domino.training.pretrain import pretrain

    outputs = ["--save", str(tmp_path / "ckpt"), "--log-json", str(tmp_path / "log.jsonl")]
    outputs += ["--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(SystemExit):
        pretrain([*BASE, *outputs, "--global-batch-size", "3"])
    assert "--global-batch-size 3 is not divisible" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
