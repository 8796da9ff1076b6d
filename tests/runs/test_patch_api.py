"""What the patch of Megatron-LM's ``pretrain_gpt.py`` calls (``megatron_domino.training.megatron_lm``:
``help_lists_domino``, ``add_args``, ``attach``), and ``--help`` of both entry points.

CI has no Megatron-LM checkout, so the first tests call those functions as the patched script
does, on the megatron-core wheel's ``megatron.training``. The last test runs the patched
script itself on two CPU ranks when ``MEGATRON_LM`` names a Megatron-LM checkout
(``core_r0.19.0``) with ``patches/megatron-lm-core_r0.19-pretrain_gpt-domino.patch`` applied;
it is skipped, saying so, otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from megatron.core import parallel_state
from megatron.training import arguments as megatron_arguments
from megatron.training import training as megatron_training

from megatron_domino.base.config import DominoConfig
from megatron_domino.training import megatron_lm
from megatron_domino.training import pretrain as entry
from megatron_domino.training.runs import read_records

REPO = Path(__file__).resolve().parents[2]
MOCK = "--mock-data --tokenizer-type NullTokenizer --vocab-size 128".split()
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
    "--tensor-model-parallel-size 2 --lr 1e-3 --train-iters 8 --transformer-impl local"
).split()


def _parse(monkeypatch, *flags: str):
    """Megatron-LM's parse and validation with the patch's provider part (``add_args``), as
    the patched script has them when it calls ``attach``."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, *MOCK, *flags])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # validate_args asks the GPU's architecture; answered as a Hopper, as the CPU runtime does.
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = megatron_arguments.parse_args(extra_args_provider=megatron_lm.add_args)
    return megatron_arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_through_the_patch_exits_0_and_lists_domino(flag, monkeypatch, capsys):
    """The patched script's first parse (in-process restart's) prints the help."""
    monkeypatch.setattr(
        megatron_arguments, "add_megatron_arguments", megatron_arguments.add_megatron_arguments
    )  # restored after the test
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", flag])
    megatron_lm.help_lists_domino()
    with pytest.raises(SystemExit) as stop:
        megatron_arguments.parse_args(ignore_unknown_args=True)
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for listed in ("--moe-paged-stash-buffer-size-factor-cuda", "--domino-chunks", "--domino-ab"):
        assert listed in out
    assert "(e.g. 1.10 = 10%)" in out  # escaped, printed as written


def test_help_of_pretrain_gpt_domino_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        megatron_arguments.parse_args(extra_args_provider=entry.add_flags)
    assert stop.value.code == 0
    assert "--domino-ab N" in capsys.readouterr().out


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refusal_through_the_patch_is_one_message_on_rank_0(rank, monkeypatch, capsys):
    args = _parse(monkeypatch, "--domino", "--domino-chunks", "3", "--domino-ab", "2")
    monkeypatch.setenv("RANK", rank)
    model_config = SimpleNamespace(pre_wrap_hooks=[])
    capsys.readouterr()  # Megatron's argument dump
    with pytest.raises(SystemExit) as stop:
        megatron_lm.attach(model_config, args)
    assert stop.value.code == 2 and model_config.pre_wrap_hooks == []
    err = capsys.readouterr().err
    if rank == "1":
        assert err == ""
        return
    assert err.startswith("pretrain_gpt.py: error: --micro-batch-size 2 is not divisible by ")
    assert err.count("pretrain_gpt.py: error:") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--domino-chunks", "auto"], "this patch does not: run pretrain_gpt_domino.py"),
    (["--domino-ab", "4"], "--domino-ab 4 needs 10 training iterations"),
])  # fmt: skip
def test_loop_flags_are_checked_through_the_patch(flags, message, monkeypatch, capsys):
    args = _parse(monkeypatch, "--domino", *flags)
    with pytest.raises(SystemExit):
        megatron_lm.attach(SimpleNamespace(pre_wrap_hooks=[]), args)
    assert message in capsys.readouterr().err


def test_attach_adds_the_hook_and_the_loop_hooks(monkeypatch):
    args = _parse(monkeypatch, "--domino", "--domino-ab", "2", "--log-json", "x.jsonl",
                  "--domino-report", "--domino-report-iters", "1")  # fmt: skip
    model_config = SimpleNamespace(pre_wrap_hooks=[])
    original = megatron_training.train_step
    hook = megatron_lm.attach(model_config, args)
    try:
        assert model_config.pre_wrap_hooks == [hook]
        hooks = megatron_training.train_step.__self__
        assert hooks._domino_ab.setting == "p2" and hooks._domino_hook is hook
        # The report, after the A/B, ends with the A/B's numbers against stock.
        assert hooks._domino_report.against_stock is hooks._domino_ab
    finally:
        hook.loop_patches.close()
    assert megatron_training.train_step is original
    assert megatron_lm.attach(model_config, _parse(monkeypatch)) is None  # no --domino


def test_the_banner_names_config_chunks_tp_sp_and_the_backward(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 4)
    hook = megatron_lm.DominoModelHook(DominoConfig(chunks=2, split_along="sequence"))
    hook._chunks = [SimpleNamespace(config=SimpleNamespace(sequence_parallel=True))] * 2
    assert hook.banner() == (
        f"> Domino: {hook.config!r} on 2 model chunk(s), TP 4, sequence parallel on, "
        "backward order legs"
    )
    assert "split_along='sequence'" in hook.banner()
    hook = megatron_lm.DominoModelHook(DominoConfig(chunks=2, backward_overlap=False))
    hook._chunks = [SimpleNamespace(config=SimpleNamespace(sequence_parallel=False))]
    assert hook.banner().endswith(
        "backward Megatron-Core's own (no backward collective in flight to order)"
    )


MEGATRON_LM = os.environ.get("MEGATRON_LM")


def _patched(name: str, launcher: str, tmp_path: Path) -> tuple[Path, list, dict, list]:
    """For the patched Megatron-LM script ``name`` of the ``MEGATRON_LM`` checkout: the script,
    the two-rank torchrun command that runs it under ``launcher`` (a path in this repository),
    its environment (the checkout's ``megatron`` first) and the tiny model's flags."""
    from launch import TINY_GPT

    checkout = Path(MEGATRON_LM).resolve()
    script = checkout / name
    assert "help_lists_domino" in script.read_text(), f"{script}: apply the patch in patches/"
    env = {**os.environ, "PYTHONPATH": str(checkout), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch = [*torchrun, "--nproc-per-node", "2", str(REPO / launcher), str(script)]
    common = [*TINY_GPT, "--tensor-model-parallel-size", "2", "--lr", "1e-3", *MOCK]
    common += ["--use-cpu-initialization", "--data-cache-path", str(tmp_path / "cache")]
    return script, launch, env, common


@pytest.mark.slow
@pytest.mark.skipif(
    not MEGATRON_LM,
    reason="set MEGATRON_LM to a Megatron-LM core_r0.19.0 checkout with the patch applied",
)
def test_patched_pretrain_gpt_on_two_cpu_ranks(tmp_path):
    """Megatron-LM's patched ``pretrain_gpt.py`` under ``patches/cpu_launch.py``: the banner
    once, the A/B line, the report against stock and their records; a refusal in one line;
    ``--help`` exit 0."""
    script, launch, env, common = _patched("pretrain_gpt.py", "patches/cpu_launch.py", tmp_path)

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*launch, *common, *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip

    log_json = tmp_path / "log.jsonl"
    done = run("--train-iters", "8", "--domino", "--domino-ab", "2", "--domino-report",
               "--domino-report-iters", "1", "--log-json", str(log_json))  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert output.count("> Domino: DominoConfig(chunks=2") == 1
    assert "on 1 model chunk(s), TP 2, sequence parallel off" in output
    (line,) = re.findall(r"^Domino p2: \d+\.\d\dx stock's iteration time on this run .*$",
                         output, flags=re.MULTILINE)  # fmt: skip
    assert f"[domino-report] against stock (--domino-ab, this run): {line}" in output
    assert len(read_records(log_json, "train")) == 8
    (ab,) = read_records(log_json, "domino_ab")
    (report,) = read_records(log_json, "domino_report")
    assert ab.pop("kind") == "domino_ab" and ab.pop("iteration") == 6
    assert report["against_stock"] == ab
    print(f"patched pretrain_gpt.py: {line}")

    done = run("--train-iters", "2", "--domino", "--domino-chunks", "3")
    output = done.stdout + done.stderr
    assert done.returncode != 0
    errors = [x for x in output.splitlines() if x.startswith("pretrain_gpt.py: error: ")]
    assert len(errors) == 1 and "not divisible by --domino-chunks 3" in errors[0]
    tracebacks = output.split("Traceback (most recent call last):")[1:]
    assert all("torch/distributed/run.py" in t[:400] for t in tracebacks)  # torchrun's only

    help_run = subprocess.run(
        [sys.executable, str(script), "--help"], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    assert "--domino-ab N" in help_run.stdout


@pytest.mark.slow
@pytest.mark.te
@pytest.mark.skipif(
    not MEGATRON_LM,
    reason="set MEGATRON_LM to a Megatron-LM core_r0.19.0 checkout with the patches applied",
)
def test_patched_pretrain_hybrid_on_two_cpu_ranks(tmp_path):
    """Megatron-LM's patched ``pretrain_hybrid.py`` (``HybridModel``, pattern ``*-*-``, local
    layers) under ``tests/cpu_launch_te.py``: without and with ``--domino``, the same losses
    per iteration (to 1e-6 relative); Domino bound (its banner names the pattern) only with
    ``--domino``."""
    _, launch, env, common = _patched("pretrain_hybrid.py", "tests/cpu_launch_te.py", tmp_path)
    common += ["--hybrid-layer-pattern", "*-*-", "--train-iters", "3"]
    common += ["--attention-dropout", "0", "--hidden-dropout", "0"]  # chunks draw other masks
    common += ["--spec", "megatron_domino.specs.hybrid_spec", "local_hybrid_stack_spec"]
    losses, outputs = {}, {}
    for arm, flags in (("stock", []), ("domino", ["--domino"])):
        record = tmp_path / arm
        done = subprocess.run(
            [*launch, *common, *flags], cwd=tmp_path, env={**env, "CPU_LAUNCH_RECORD": str(record)},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        outputs[arm] = done.stdout + done.stderr
        assert done.returncode == 0, outputs[arm][-5000:]
        iterations = json.loads(Path(f"{record}.rank0.json").read_text())["iterations"]
        losses[arm] = [iteration["loss"] for iteration in iterations]
    assert "of HybridModel pattern '*-*-'" in outputs["domino"]
    assert "> Domino" not in outputs["stock"]
    assert len(losses["stock"]) == 3
    assert losses["domino"] == pytest.approx(losses["stock"], rel=1e-6)
    print(f"patched pretrain_hybrid.py: losses {losses['domino']}")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_hopper_fp8_recipes_attach_through_the_patch(recipe, monkeypatch):
    """The FP8 recipes H100 users run pass the patch's checks with Transformer Engine layers
    and SP (``tests/ranks/test_te_fp8_recipes.py`` runs them on TE's own modules); MXFP8 is
    refused there, as in ``pretrain_gpt_domino.py``."""
    te_fp8 = ["--transformer-impl", "transformer_engine", "--sequence-parallel"]
    te_fp8 += ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    te_fp8 += ["--spec", "megatron_domino.specs.te_spec", "te_norms_apart_block_spec"]
    model_config = SimpleNamespace(pre_wrap_hooks=[])
    hook = megatron_lm.attach(model_config, _parse(monkeypatch, "--domino", *te_fp8))
    try:
        assert model_config.pre_wrap_hooks == [hook]
    finally:
        hook.loop_patches.close()
