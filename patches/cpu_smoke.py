"""CPU smoke test of Megatron-LM's ``pretrain_gpt.py`` with the Domino patch applied.

    MLM=/path/to/patched/Megatron-LM PYTHONPATH=$MLM python patches/cpu_smoke.py

The checkout's ``megatron.core`` and ``megatron.training`` must come first on ``sys.path``
(``PYTHONPATH``); the megatron-core wheel beside them lends only its prebuilt dataset helpers
(see ``cpu_launch.py``). Three parts, TP = 2 on two gloo ranks where ranks are needed:

1. **imports**, in a fresh interpreter: Megatron-LM's ``parse_args`` with the patch's
   ``extra_args_provider``. Without ``--domino`` nothing of ``megatron_domino`` is imported
   and a ``--domino-*`` flag is an unknown argument; with it, the flags are registered.
2. **build**, on two ranks: the patched script's ``__main__`` runs as written
   (``parse_and_validate_args``, ``gpt_config_from_args``, the patch's ``attach``) up to
   ``pretrain()``, which is replaced by what ``setup_model_and_optimizer`` does with the
   config container: the ``GPTModelConfig``'s builder, ``build_distributed_models``, pre-wrap
   hooks included (DDP wrapping left out, so the gradients stay in ``.grad``). Once without
   and once with ``--domino --domino-chunks 2 --domino-column-chunks 2``: Domino is bound to
   the second model's transformer block only, both start from the same weights, and the loss
   and every gradient agree to 1e-6. Then ``--micro-batch-size 4 --domino-chunks 3`` and
   selective recompute of the MLP must be refused: exit status 2, Domino's message on rank 0
   only.
3. **train**: Megatron-LM's real ``pretrain()`` through the patched script, under torchrun
   (``cpu_launch.py``), three iterations on ``--mock-data``, without and with ``--domino``:
   Domino bound only in the second run, the same per-iteration losses (to 1e-6, relative) and
   gradient norms; the run without ``--domino`` gives bit for bit the iterations of upstream's
   unpatched script (the checkout's committed ``pretrain_gpt.py``), and the run with
   ``--domino-chunks 3`` fails with Domino's message in one line, without a traceback.

On a checkout whose Megatron-Core megatron-domino refuses (``main``: 0.20), parts 2 and 3
check instead that the build and the training run without ``--domino`` work and that
``--domino`` is refused with :class:`~megatron_domino.base.version.UnsupportedMegatronVersion`'s
message. Exit status 0 and ``SMOKE OK`` when every check passes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import runpy
import subprocess
import sys
import tempfile
import warnings

HERE = pathlib.Path(__file__).resolve().parent
MLM = pathlib.Path(os.environ.get("MLM", ".")).resolve()
SCRIPT = MLM / "pretrain_gpt.py"

#: What Megatron-LM defaults to on a GPU and this machine cannot run, each replaced by the
#: flag that says so: their one list, ``megatron_domino/training/runs.py``'s ``CPU_FLAGS``
#: (with the reasons; docs/cpu.md), read as a file so that the imports check of part 1 starts
#: with nothing of ``megatron_domino`` imported.
CPU_FLAGS = runpy.run_path(str(HERE.parent / "megatron_domino/training/runs.py"))["cpu_flags"]()
#: A two-layer GPT, fp32, no dropout (Domino's chunks draw other dropout masks).
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--vocab-size", "256",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "3", "--lr", "1e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1",
    "--eval-interval", "1000", "--eval-iters", "1", "--use-cpu-initialization",
    "--seed", "1234",
]  # fmt: skip
COMMON = CPU_FLAGS + TINY_GPT
DOMINO = ["--domino", "--domino-chunks", "2", "--domino-column-chunks", "2"]
BAD_CHUNKS = ["--domino", "--domino-chunks", "3"]
MLP_RECOMPUTE = ["--domino", "--recompute-granularity", "selective", "--recompute-modules", "mlp"]
SEQ, BATCH, VOCAB = 32, 4, 256
TOLERANCE = 1e-6
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}

_results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    _results.append((name, bool(ok), str(detail)))
    print(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail != "" else ""))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a))


def first_line(err: BaseException) -> str:
    """The error's type and the start of its message (a list of reasons: the first one)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {' '.join(lines[:2])}"


# ---------------------------------------------------------------- part 1: imports
def _imports_child() -> None:
    """In a fresh interpreter: parse with the patch's provider, report imports as JSON."""
    import pretrain_gpt
    from megatron.training.arguments import parse_args

    report = {}
    for name, extra in (
        ("plain", []),
        ("domino", DOMINO),
        ("chunks only", ["--domino-chunks", "2"]),
    ):
        sys.argv = [str(SCRIPT), *COMMON, *extra]
        try:
            args = parse_args(extra_args_provider=pretrain_gpt.extra_args_provider)
            parsed = [
                getattr(args, k, None) for k in ("domino", "domino_chunks", "domino_column_chunks")
            ]
        except SystemExit as stop:
            parsed = f"SystemExit({stop.code})"
        modules = sorted(m for m in sys.modules if m.split(".")[0] == "megatron_domino")
        report[name] = {"parsed": parsed, "modules": modules}
    print(json.dumps(report))


def part_imports() -> None:
    print("1. imports (fresh interpreter, Megatron-LM's parse_args)")
    done = subprocess.run(
        [sys.executable, __file__, "--imports-child"],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=300,
    )
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        check("parse in a fresh interpreter", False, done.stdout[-2000:] + done.stderr[-2000:])
        return
    plain, domino, chunks = report["plain"], report["domino"], report["chunks only"]
    check("without --domino: no Domino flags", plain["parsed"] == [None, None, None])
    check("without --domino: nothing of megatron_domino imported", not plain["modules"])
    check(
        "with --domino: --domino-chunks 2 --domino-column-chunks 2 parsed",
        domino["parsed"] == [True, 2, 2],
        domino["parsed"],
    )
    check(
        "with --domino: megatron_domino.training.megatron_lm imported",
        "megatron_domino.training.megatron_lm" in domino["modules"],
    )
    check(
        "--domino-chunks without --domino: rejected by Megatron's parser",
        chunks["parsed"] == "SystemExit(2)",
        chunks["parsed"],
    )


# ---------------------------------------------------------------- part 2: build on two ranks
def _build(extra: list[str]):
    """The patched ``__main__`` up to ``pretrain()``, then the model as pretrain builds it."""
    import megatron.training
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training import get_args, global_vars

    from megatron_domino.runtime.patch import Patch

    captured = {}

    def pretrain(cfg_container, *args, **kwargs):
        captured["cfg"] = cfg_container

    global_vars.unset_global_variables()
    sys.argv = [str(SCRIPT), *COMMON, *extra]
    with Patch(megatron.training, "pretrain", pretrain, "stop before training").applied():
        runpy.run_path(str(SCRIPT), run_name="__main__")
    cfg = captured["cfg"]
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    # setup_model_and_optimizer's builder call (megatron/training/training.py), without DDP
    (model,) = cfg.model.get_builder_cls()(cfg.model).build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        ddp_config=cfg.ddp,
        wrap_with_ddp=False,
        data_parallel_random_init=cfg.rng.data_parallel_random_init,
    )
    return get_args(), model


def _loss(model):
    import torch

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().view(1, 1, SEQ, SEQ)
    out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), mask, labels=tokens)
    return out.float().mean()


def _refused(extra: list[str]) -> str:
    """``SystemExit(2): <rank 0's message>`` (the patch's refusal), or what else happened."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _build(extra)
    except SystemExit as stop:
        said = stderr.getvalue()  # Megatron's warnings first, if any
        start = said.find("pretrain_gpt.py: error: ")
        return f"SystemExit({stop.code}): {said[start:].strip() if start >= 0 else ''}"
    except Exception as err:  # the check reads the type and the message
        return first_line(err)
    return "NOT REFUSED"


def build_on_rank(domino_runs: bool) -> dict:
    import megatron.core
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_domino.training.loop_runtime import CPU_LOOP_PATCHES

    arch = next(p for p in CPU_LOOP_PATCHES if p.name == "get_device_arch_version")
    report = {"megatron.core from": megatron.core.__file__}
    # Megatron prints every argument on every rank; the report below says what matters.
    with arch.applied(), contextlib.redirect_stdout(io.StringIO()):
        _, stock = _build([])
        report["stock model untouched"] = not any("forward" in vars(m) for m in stock.modules())
        if not domino_runs:
            report["--domino"] = _refused(DOMINO)
            return report
        args, domino = _build(DOMINO)
        report["flags"] = [args.domino, args.domino_chunks, args.domino_column_chunks]
        block = next(m for m in domino.modules() if isinstance(m, TransformerBlock))
        report["Domino bound to the block"] = "forward" in vars(block)
        stock_state, domino_state = stock.state_dict(), domino.state_dict()
        report["same initial weights"] = all(
            torch.equal(v, domino_state[k])
            for k, v in stock_state.items()
            if isinstance(v, torch.Tensor)
        )
        domino.load_state_dict(stock_state)
        a, b = _loss(stock), _loss(domino)
        a.backward()
        b.backward()
        report["loss stock / domino"] = [a.item(), b.item()]
        report["max |grad diff|"] = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(stock.parameters(), domino.parameters(), strict=True)
        )
        report["mbs 4, --domino-chunks 3"] = _refused(BAD_CHUNKS)
        report["selective MLP recompute"] = _refused(MLP_RECOMPUTE)
    return report


def part_build(domino_runs: bool) -> None:
    print("2. build: the patched __main__ up to pretrain(), GPTModelBuilder, two gloo ranks")
    from lab.launch.ranks import run_ranks

    reports = run_ranks(
        "__main__:build_on_rank", 2, device="cpu", args=(domino_runs,), timeout_s=600
    )
    for rank, report in enumerate(reports):
        print(f"  rank {rank}: {json.dumps(report)}")
    from_checkout = all(r["megatron.core from"].startswith(str(MLM)) for r in reports)
    check("megatron.core imported from the checkout", from_checkout)
    check("model without --domino: nothing bound", all(r["stock model untouched"] for r in reports))
    if not domino_runs:
        check(
            "--domino refused (megatron-core version)",
            reports[0]["--domino"].startswith("SystemExit(2): pretrain_gpt.py: error: ")
            and "is not a release megatron-domino is tested with" in reports[0]["--domino"],
            reports[0]["--domino"],
        )
        return
    check("--domino flags parsed", all(r["flags"] == [True, 2, 2] for r in reports))
    check(
        "--domino: Domino bound to the transformer block",
        all(r["Domino bound to the block"] for r in reports),
    )
    check(
        "both models built with the same weights", all(r["same initial weights"] for r in reports)
    )
    check(
        "same loss",
        all(close(*r["loss stock / domino"]) for r in reports),
        [r["loss stock / domino"] for r in reports],
    )
    check(
        f"same gradients (max |diff| <= {TOLERANCE})",
        all(r["max |grad diff|"] <= TOLERANCE for r in reports),
        [r["max |grad diff|"] for r in reports],
    )
    for name, error in (
        ("mbs 4, --domino-chunks 3", "is not divisible by --domino-chunks 3"),
        ("selective MLP recompute", "recompute"),
    ):
        said = [r[name] for r in reports]
        check(
            f"{name}: refused, exit 2, the message on rank 0 only",
            said[0].startswith("SystemExit(2): pretrain_gpt.py: error: ")
            and error in said[0]
            and said[1] == "SystemExit(2): ",
            said,
        )


# ---------------------------------------------------------------- part 3: pretrain()
def _pretrain(
    extra: list[str], record: pathlib.Path, script: pathlib.Path = SCRIPT
) -> tuple[int, str, list[dict]]:
    """``script`` on two torchrun ranks; its exit status, output and rank records."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(HERE / "cpu_launch.py"), str(script), *COMMON, *extra,
    ]  # fmt: skip
    env = {**os.environ, **ENV, "CPU_LAUNCH_RECORD": str(record)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    records = []
    for rank in range(2):
        path = record.with_name(f"{record.name}.rank{rank}.json")
        records.append(json.loads(path.read_text()) if path.exists() else {})
    return done.returncode, done.stdout + done.stderr, records


def _upstream_script(tmp: pathlib.Path) -> pathlib.Path | None:
    """Upstream's ``pretrain_gpt.py`` (the checkout's committed one), if it is unpatched."""
    done = subprocess.run(
        ["git", "-C", str(MLM), "show", "HEAD:pretrain_gpt.py"], capture_output=True, text=True
    )
    if done.returncode != 0 or "megatron_domino" in done.stdout:
        return None
    path = tmp / "upstream" / "pretrain_gpt.py"  # imports gpt_builders etc. via PYTHONPATH
    path.parent.mkdir()
    path.write_text(done.stdout)
    return path


def _error_line(output: str, error: str) -> str:
    return next((line for line in output.splitlines() if error in line), "")


def part_train(domino_runs: bool) -> None:
    print("3. train: Megatron-LM's pretrain() via the patched script, torchrun, two ranks")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        rc, out, stock = _pretrain([], tmp / "stock")
        ok = rc == 0 and all(r.get("finished") for r in stock)
        check("without --domino: 3 iterations trained", ok, "" if ok else out[-3000:])
        if not ok:
            return
        check(
            "without --domino: TP = 2, nothing bound",
            all(r["tp_size"] == 2 and r["domino_bound"] is False for r in stock),
        )
        check(
            "without --domino: neither megatron_domino.training.megatron_lm nor .apply imported",
            not any(
                {"megatron_domino.training.megatron_lm", "megatron_domino.apply"}
                & set(r["megatron_domino_modules"])
                for r in stock
            ),
        )
        stock_losses = [i["loss"] for i in stock[-1]["iterations"]]
        print(f"        losses without --domino: {stock_losses}")
        upstream = _upstream_script(tmp)
        if upstream is None:
            print("        (no unpatched pretrain_gpt.py at the checkout's HEAD: upstream not run)")
        else:
            rc, out, plain = _pretrain([], tmp / "upstream", upstream)
            check(
                "upstream's unpatched script: the same iterations, bit for bit",
                rc == 0 and plain[-1].get("iterations") == stock[-1]["iterations"],
                "" if rc == 0 else out[-3000:],
            )
        if not domino_runs:
            rc, out, _ = _pretrain(["--domino"], tmp / "domino")
            line = _error_line(out, "is not a release megatron-domino is tested with")
            check("--domino refused (megatron-core version)", rc != 0 and line, line.strip())
            return
        rc, out, domino = _pretrain(DOMINO, tmp / "domino")
        ok = rc == 0 and all(r.get("finished") for r in domino)
        check("with --domino: 3 iterations trained", ok, "" if ok else out[-3000:])
        if not ok:
            return
        check(
            "with --domino: TP = 2, Domino bound",
            all(r["tp_size"] == 2 and r["domino_bound"] is True for r in domino),
        )
        losses = [i["loss"] for i in domino[-1]["iterations"]]
        print(f"        losses with --domino:    {losses}")
        check(
            "same loss every iteration",
            len(losses) == len(stock_losses) == 3 and all(map(close, stock_losses, losses)),
            max(abs(a - b) for a, b in zip(stock_losses, losses, strict=True)),
        )
        pairs = zip(stock[-1]["iterations"], domino[-1]["iterations"], strict=True)
        norms = [(a["grad_norm"], b["grad_norm"]) for a, b in pairs]
        check("same gradient norm every iteration", all(close(a, b) for a, b in norms), norms)
        rc, out, _ = _pretrain(BAD_CHUNKS, tmp / "bad")
        lines = [line for line in out.splitlines() if "pretrain_gpt.py: error: " in line]
        tracebacks = out.split("Traceback (most recent call last):")[1:]
        check(
            "mbs 4, --domino-chunks 3: refused in one line, no traceback from a rank",
            rc != 0
            and len(lines) == 1
            and all("torch/distributed/run.py" in t[:400] for t in tracebacks),  # torchrun's
            lines,
        )


def main() -> int:
    if not SCRIPT.is_file() or "MLM" not in os.environ:
        sys.exit("usage: MLM=/path/to/patched/Megatron-LM PYTHONPATH=$MLM python cpu_smoke.py")
    if "from megatron_domino.training.megatron_lm import attach" not in SCRIPT.read_text():
        sys.exit(f"{SCRIPT} is not patched: git apply {HERE}/megatron-lm-*.patch in {MLM}")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron_domino.base.version import (
        UnsupportedMegatronVersion,
        check_megatron_core_version,
        imported_megatron_core_version,
    )

    version = imported_megatron_core_version()
    try:
        check_megatron_core_version()
        domino_runs = True
    except UnsupportedMegatronVersion:
        domino_runs = False
    commit = subprocess.run(
        ["git", "-C", str(MLM), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"Megatron-LM {MLM} at {commit or '?'}: megatron-core {version}; "
        f"Domino {'runs' if domino_runs else 'is refused'} here"
    )
    part_imports()
    part_build(domino_runs)
    part_train(domino_runs)
    failed = [name for name, ok, _ in _results if not ok]
    print("SMOKE OK" if not failed else f"SMOKE FAILED: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--imports-child"]:
        _imports_child()
    else:
        sys.exit(main())
