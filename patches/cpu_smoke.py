"""CPU smoke test of a patched Megatron-LM ``pretrain_gpt.py``: its functions, not a training run.

On two gloo ranks (TP = 2), using the patched script's own ``extra_args_provider`` and
``domino_model_provider``:

1. Megatron-LM's ``parse_args`` and ``validate_args`` accept the Domino flags next to its own;
2. the model built with ``--domino`` has Domino bound to its transformer block, and its loss and
   gradients match the model built without ``--domino`` from the same weights;
3. the patch refuses a micro-batch that ``--domino-chunks`` does not divide before building
   anything, and ``apply_domino`` (through the patch) refuses selective recompute of the MLP
   right after the model is built.

    MLM=/path/to/patched/Megatron-LM PYTHONPATH=$MLM python patches/cpu_smoke.py

Needs this repo's virtual environment plus what ``megatron.training`` imports and the
megatron-core wheel lacks (six, regex, pyyaml, pydantic, triton in our run). Megatron-LM's
``pretrain()`` is not called: it needs CUDA.
"""

import os
import pathlib
import sys

MLM = os.environ["MLM"]
sys.path[:0] = [MLM, str(pathlib.Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402
from multiproc import run_on_ranks  # noqa: E402

# fmt: off
COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "4",
    "--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--vocab-size", "256",
    "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
]
# fmt: on
SEQ, BATCH, VOCAB = 16, 4, 256


def _parse(extra):
    """Megatron-LM's own parsing and validation, with the patch's extra_args_provider."""
    import pretrain_gpt
    from megatron.training import arguments, global_vars

    sys.argv = ["pretrain_gpt.py", *COMMON, *extra]
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    arguments.get_device_arch_version = lambda: 9  # no GPU here: answer as a Hopper would
    args = arguments.parse_args(extra_args_provider=pretrain_gpt.extra_args_provider)
    arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = VOCAB  # set by the tokenizer build, which this test skips
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    return pretrain_gpt, args


def _build(extra):
    """The model as Megatron-LM's get_model() asks the patched provider for it."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pretrain_gpt, args = _parse(extra)
    torch.manual_seed(1234)
    model = pretrain_gpt.domino_model_provider(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    return args, model


def _loss(model):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().view(1, 1, SEQ, SEQ)
    out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), mask, labels=tokens)
    return out.float().mean()


def _flags(args):
    return (args.domino, args.chunks, args.column_chunks, args.inter_layer, args.backward_overlap)


def on_rank():
    import megatron.core
    import megatron.training
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_domino.config import DominoConfigError, DominoUnsupportedError

    report = {
        "megatron.core from": megatron.core.__file__,
        "megatron.training from": megatron.training.__file__,
    }
    args, stock = _build(["--transformer-impl", "local"])
    report["flags without --domino"] = _flags(args)
    args, domino = _build(
        [
            "--transformer-impl",
            "local",
            "--domino",
            "--domino-chunks",
            "2",
            "--domino-column-chunks",
            "2",
        ]
    )
    report["flags with --domino"] = _flags(args)
    block = next(m for m in domino.modules() if isinstance(m, TransformerBlock))
    report["Domino bound to the block"] = "forward" in vars(block)
    report["stock model untouched"] = not any("forward" in vars(m) for m in stock.modules())

    domino.load_state_dict(stock.state_dict())
    a, b = _loss(stock), _loss(domino)
    a.backward()
    b.backward()
    report["loss stock / domino"] = (a.item(), b.item())
    report["max |grad diff|"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(stock.parameters(), domino.parameters(), strict=True)
    )
    refusals = [
        (
            "MLP recompute refused",
            [
                "--transformer-impl",
                "local",
                "--recompute-granularity",
                "selective",
                "--recompute-modules",
                "mlp",
                "--domino",
            ],
            DominoUnsupportedError,
        ),
        (
            "mbs 4 / --domino-chunks 3 refused",
            ["--transformer-impl", "local", "--domino", "--domino-chunks", "3"],
            DominoConfigError,
        ),
    ]
    for name, extra, error in refusals:
        try:
            _build(extra)
            report[name] = "NOT REFUSED"
        except error as e:
            report[name] = str(e).splitlines()[0]
    return report


def main() -> int:
    reports = run_on_ranks(on_rank, 2, timeout_s=600)
    for rank, report in enumerate(reports):
        print(f"rank {rank}:")
        for key, value in report.items():
            print(f"  {key}: {value}")
    ok = all(
        r["Domino bound to the block"]
        and r["stock model untouched"]
        and abs(r["loss stock / domino"][0] - r["loss stock / domino"][1]) < 1e-5
        and r["max |grad diff|"] < 1e-5
        and "NOT REFUSED"
        not in (r["MLP recompute refused"], r["mbs 4 / --domino-chunks 3 refused"])
        for r in reports
    )
    print("SMOKE OK" if ok else "SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
