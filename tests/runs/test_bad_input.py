"""Bad input, tried systematically: a clear error naming the problem, a non-zero exit, and no
file written or changed.

Two entry points get malformed inputs: ``pretrain_gpt_domino.py`` (data files, tokenizer
files, checkpoint folders, contradictory Domino flags) and ``python -m
megatron_domino.data.prepare`` (corpus files and tokenizer models). Each case runs the real
``main()`` of the entry point in this process (their checks all run before anything is
created, so a case costs milliseconds) with every output flag (``--save``, ``--log-json``,
``--data-cache-path``, ``--tensorboard-dir``, ``--output-dir``) pointing into a folder whose
every file is fingerprinted before and after. A checkpoint of another model shape is only
found when Megatron loads it, after initialisation, so that case launches the script for real
(:func:`test_a_checkpoint_of_another_model_shape_is_refused_by_a_real_launch`).

Not bad input: a ``torch_dist`` checkpoint of another tensor-parallel size. Megatron-LM
reshards it on load (that is how users change TP) and prints "(TP, PP) mismatch after resume
... RNG state will be ignored"; :mod:`megatron_domino.training.inputs` explains.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch import TINY_GPT, run_pretrain
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from megatron_domino.data import prepare as prepare_module
from megatron_domino.data.corpus import stdlib_corpus
from megatron_domino.data.prepare import SentencePieceSettings, prepare
from megatron_domino.training import inputs
from megatron_domino.training import pretrain as entry

BINARY = bytes(range(256)) * 8  # every byte value: not UTF-8, not an index, not a model
LATIN1 = "crème brûlée, déjà vu\n".encode("latin-1")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A small prepared dataset and tokenizer, and the bad files made from them."""
    root = tmp_path_factory.mktemp("inputs")
    data = prepare(
        corpus=stdlib_corpus(max_bytes=100_000),
        output_dir=root / "good",
        settings=SentencePieceSettings(vocab_size=600),
        num_threads=2,
    )
    idx, bin_ = (Path(data.data_prefix + suffix).read_bytes() for suffix in (".idx", ".bin"))
    bad = root / "bad"
    bad.mkdir()
    files = {
        "empty.idx": b"", "empty.bin": b"",
        "garbage.idx": BINARY, "garbage.bin": bin_,
        "latin1.idx": LATIN1, "latin1.bin": bin_,
        "short_bin.idx": idx, "short_bin.bin": bin_[: len(bin_) // 2],
        "short_idx.idx": idx[:40], "short_idx.bin": bin_,
        "no_bin.idx": idx,
        "binary.model": BINARY, "empty.model": b"", "latin1.model": LATIN1,
    }  # fmt: skip
    for name, content in files.items():
        (bad / name).write_bytes(content)
    return {"prefix": Path(data.data_prefix), "model": data.tokenizer_model, "bad": bad}


def fingerprints(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root`` (size, modification time, content digest) and every folder
    (a temporary folder made and removed inside one is no change)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            stat = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns, digest)
        else:
            found[str(path.relative_to(root))] = "folder"
    return found


def run_entry(monkeypatch, capsys, argv: list[str], *, world_size: int) -> str:
    """``pretrain_gpt_domino.py``'s ``main()`` on ``argv`` as rank 0 of ``world_size``; it must
    exit with status 2 before training. Returns what it printed on stderr."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", *argv])
    for name, value in {
        "RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)

    def no_training(*args, **kwargs):
        raise AssertionError("the bad input was not refused before training")

    monkeypatch.setattr(entry, "pretrain", no_training)
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 2
    return capsys.readouterr().err


#: Flags that make the run write somewhere: each must stay untouched by a refused run.
def outputs(root: Path) -> list[str]:
    return [
        "--save", str(root / "ckpt"), "--save-interval", "2", "--log-json", str(root / "log.jsonl"),
        "--data-cache-path", str(root / "cache"), "--tensorboard-dir", str(root / "tb"),
    ]  # fmt: skip


BASE = [*TINY_GPT, "--lr", "1e-3", "--train-iters", "4"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


def real_data(good, *, prefix=None, model=None) -> list[str]:
    return [
        "--data-path", *(prefix or [str(good["prefix"])]), "--split", "90,10,0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model or good["model"]),
    ]  # fmt: skip


#: name -> (flags given ``good`` files, world size, expected fragments of the one-line error)
ENTRY_CASES = {
    "missing data prefix": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "missing")]), 1,
        ["--data-path", "missing.idx does not exist", "megatron_domino.data.prepare"],
    ),
    ".idx without its .bin": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "no_bin")]), 1,
        ["no_bin.bin does not exist"],
    ),
    "empty .bin/.idx": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "empty")]), 1, ["empty.idx is empty"],
    ),
    "binary .idx": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "garbage")]), 1,
        ["garbage.idx is not a Megatron index"],
    ),
    "non-UTF-8 text as .idx": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "latin1")]), 1,
        ["latin1.idx is not a Megatron index"],
    ),
    "truncated .idx": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "short_idx")]), 1,
        ["short_idx.idx is 40 bytes", "truncated"],
    ),
    "truncated .bin": (
        lambda g: real_data(g, prefix=[str(g["bad"] / "short_bin")]), 1,
        ["short_bin.bin is truncated"],
    ),
    "a blend with one truncated prefix": (
        lambda g: real_data(g, prefix=["0.5", str(g["prefix"]), "0.5", str(g["bad"] / "short_bin")]),
        1, ["short_bin.bin is truncated"],
    ),
    "binary tokenizer model": (
        lambda g: real_data(g, model=g["bad"] / "binary.model"), 1,
        ["--tokenizer-model", "binary.model is not a SentencePiece model"],
    ),
    "empty tokenizer model": (
        lambda g: real_data(g, model=g["bad"] / "empty.model"), 1, ["empty.model is empty"],
    ),
    "non-UTF-8 text as tokenizer model": (
        lambda g: real_data(g, model=g["bad"] / "latin1.model"), 1,
        ["latin1.model is not a SentencePiece model"],
    ),
    "missing tokenizer model": (
        lambda g: real_data(g, model=g["bad"] / "missing.model"), 1,
        ["missing.model does not exist"],
    ),
    "--domino at TP 1": (lambda g: [*MOCK, "--domino"], 2, ["tensor-model-parallel size is 1"]),
    "--domino-chunks not dividing the micro-batch": (
        lambda g: [*MOCK, "--domino", "--tensor-model-parallel-size", "2", "--domino-chunks", "4"],
        2, ["--micro-batch-size 2 is not divisible by --domino-chunks 4"],
    ),
    "--domino-chunks 1 without column chunks": (
        lambda g: [*MOCK, "--domino", "--tensor-model-parallel-size", "2", "--domino-chunks", "1"],
        2, ["leaves nothing to overlap"],
    ),
    "--domino-column-chunks not dividing the hidden size": (
        lambda g: [
            *MOCK, "--domino", "--tensor-model-parallel-size", "2", "--domino-chunks", "1",
            "--domino-column-chunks", "3",
        ],
        2, ["--hidden-size 64 is not divisible by --domino-column-chunks 3"],
    ),
    # Named by the flag and by the recipes' knob (issue 29: a recipe run without CPU=1 on a
    # CPU node was told only the flag, which the recipe user does not write).
    "NCCL without a GPU": (
        lambda g: [*MOCK, "--distributed-backend", "nccl"], 1,
        ["no CUDA device here", "add --distributed-backend gloo", "recipes in examples/: CPU=1"],
    ),
    "--domino-report without --domino": (
        lambda g: [*MOCK, "--domino-report"], 1, ["--domino-report reports Domino's overlap"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ENTRY_CASES)
def test_the_training_script_refuses_bad_input_before_writing(
    tmp_path, monkeypatch, capsys, good, case
):
    if case == "NCCL without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: NCCL can run")
    flags, world_size, expected = ENTRY_CASES[case]
    watched = [tmp_path, good["prefix"].parent, good["bad"]]
    before = [fingerprints(root) for root in watched]
    error = run_entry(
        monkeypatch, capsys, [*BASE, *flags(good), *outputs(tmp_path)], world_size=world_size
    )
    assert error.startswith("pretrain_gpt_domino.py: error: "), error
    assert "Traceback" not in error, error
    for fragment in expected:
        assert fragment in error, (fragment, error)
    assert [fingerprints(root) for root in watched] == before


def fake_checkpoint(root: Path, tracker: bytes | None, iterations: dict[int, list[str]]) -> Path:
    """A ``--load`` folder: the tracker's bytes and, per iteration, the files of its folder."""
    load = root / "ckpt"
    load.mkdir()
    if tracker is not None:
        (load / inputs.TRACKER).write_bytes(tracker)
    for iteration, names in iterations.items():
        folder = load / f"iter_{iteration:07d}"
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"x")
    return load


COMPLETE = [".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp"]
#: name -> (tracker bytes, iteration folders, extra flags, expected fragments)
CHECKPOINT_CASES = {
    "empty tracker (a kill while rank 0 rewrote it)": (
        b"", {4: COMPLETE}, [], ["holds '', not an iteration number", "write 4 into"],
    ),
    "binary tracker": (BINARY, {4: COMPLETE}, [], ["not an iteration number", "write 4 into"]),
    "tracker naming a missing iteration": (
        b"1\n", {4: COMPLETE}, [], ["iter_0000001 (from", "does not exist"],
    ),
    "tracker naming a half-written save": (
        b"8", {4: COMPLETE, 8: ["__1_0.distcp"]}, [],
        ["iter_0000008", "its save did not finish", "write 4 into"],
    ),
    "save without .metadata": (
        b"8", {8: ["metadata.json", "__0_0.distcp"]}, [], ["has no .metadata"],
    ),
    "--ckpt-step of a missing iteration": (
        b"4", {4: COMPLETE}, ["--ckpt-step", "6"], ["iter_0000006 (from --ckpt-step 6)"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_the_training_script_refuses_a_checkpoint_it_cannot_resume_from(
    tmp_path, monkeypatch, capsys, case
):
    tracker, iterations, extra, expected = CHECKPOINT_CASES[case]
    load = fake_checkpoint(tmp_path, tracker, iterations)
    before = fingerprints(tmp_path)
    flags = [*BASE, *MOCK, "--load", str(load), *outputs(tmp_path), "--save", str(load), *extra]
    error = run_entry(monkeypatch, capsys, flags, world_size=1)
    assert error.startswith("pretrain_gpt_domino.py: error: --load "), error
    for fragment in expected:
        assert fragment in error, (fragment, error)
    assert fingerprints(tmp_path) == before


def test_megatron_s_own_load_failures_become_one_line(monkeypatch):
    """What Megatron raises inside ``load_checkpoint``, reworded with the cause and a fix."""
    monkeypatch.setattr(inputs, "get_args", lambda: type("Args", (), {"load": "/ckpt"})())
    shape = CheckpointingException("Global shape mismatch for loaded (torch.Size([32, 64]))")
    wrapped = CheckpointException("ranks:dict_keys([0])", {0: (shape, None)})
    schedule = AssertionError("OptimizerParamScheduler: class input value 36 and checkpoint...")
    for raised, expected in (
        (wrapped, "CheckpointingException: Global shape mismatch"),
        (schedule, "--override-opt-param-scheduler"),
    ):

        def load_checkpoint(*args, raised=raised, **kwargs):
            raise raised

        with pytest.raises(inputs.CheckpointError) as err:
            inputs._reworded(load_checkpoint)(None, None, None)
        assert str(err.value).startswith("--load /ckpt: cannot resume from its checkpoint")
        assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_distributed_optimizer_resume_without_fused_adam_names_the_cause(monkeypatch):
    """Without Apex or TE (the CPU) Megatron-Core 0.19's distributed optimizer asserts on
    torch Adam's empty state at every load. The hint used to be "resume with the model flags
    the checkpoint was saved with", though the flags were identical (issue 29)."""
    from megatron.core.optimizer import distrib_optimizer

    assert not distrib_optimizer.HAVE_APEX_OR_TE  # this suite's environment: no Apex, no TE
    args = type("Args", (), {"load": "/ckpt", "use_distributed_optimizer": True})()
    monkeypatch.setattr(inputs, "get_args", lambda: args)
    # Megatron's own state_dict on an optimizer that has not stepped: what a resume calls.
    not_stepped = SimpleNamespace(optimizer=SimpleNamespace(state_dict=lambda: {"state": {}}))

    def load_checkpoint(*args, **kwargs):
        distrib_optimizer.DistributedOptimizer.state_dict(not_stepped)

    with pytest.raises(inputs.CheckpointError) as err:
        inputs._reworded(load_checkpoint)(None, None, None)
    message = str(err.value)
    assert "distributed optimizer cannot resume without Apex or Transformer Engine" in message
    assert "DISTRIBUTED_OPTIMIZER=0" in message and "model flags" not in message

    # Any other assertion keeps the generic hint.
    def fails_elsewhere(*args, **kwargs):
        raise AssertionError

    with pytest.raises(inputs.CheckpointError) as err:
        inputs._reworded(fails_elsewhere)(None, None, None)
    assert "model flags" in str(err.value)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_shape_is_refused_by_a_real_launch(tmp_path):
    """Saved with --hidden-size 64, resumed with 96: one line from every rank's failure, a
    non-zero exit, the checkpoint untouched and nothing else written."""
    one_process = [*BASE, *MOCK, "--train-iters", "1", "--eval-iters", "0"]
    ckpt = tmp_path / "ckpt"
    run_pretrain(
        [*one_process, "--save", str(ckpt), "--save-interval", "1"], cwd=tmp_path, nproc=None
    )
    (tmp_path / "run").mkdir()
    before = fingerprints(tmp_path)
    resumed = [
        *one_process, "--hidden-size", "96", "--load", str(ckpt), "--save", str(ckpt),
        "--save-interval", "1",
        "--log-json", str(tmp_path / "run" / "log.jsonl"),
        "--data-cache-path", str(tmp_path / "run" / "cache"),
    ]  # fmt: skip
    output = run_pretrain(resumed, cwd=tmp_path / "run", nproc=None, expect_success=False)
    assert (
        f"pretrain_gpt_domino.py: error: --load {ckpt}: cannot resume from its checkpoint at "
        "iteration 1: CheckpointingException: Global shape mismatch"
    ) in output, output[-3000:]
    assert "Traceback" not in output
    assert fingerprints(tmp_path) == before


# --- python -m megatron_domino.data.prepare -------------------------------------------------

#: name -> (files in the inputs folder: name -> bytes, or None for a folder; the command's
#: flags, {root} being that folder; expected fragments of the one-line error)
TEXT = {"a.txt": b"hello world\n"}
PREPARE_CASES = {
    "empty text file": ({"a.txt": b""}, ["--input", "{root}/a.txt"], ["a.txt: no text to train"]),
    "empty JSONL file": ({"a.jsonl": b""}, ["--input", "{root}/a.jsonl"], ["no text to train"]),
    "blank JSONL lines": (
        {"a.jsonl": b"\n  \n\n"}, ["--input", "{root}/a.jsonl"], ["no text to train"],
    ),
    "binary text file": (
        {"a.txt": BINARY}, ["--input", "{root}/a.txt"], ["a.txt: not UTF-8 text (byte 128"],
    ),
    "binary JSONL file": ({"a.jsonl": BINARY}, ["--input", "{root}/a.jsonl"], ["not UTF-8 text"]),
    "non-UTF-8 text file": (
        {"a.txt": LATIN1}, ["--input", "{root}/a.txt"], ["a.txt: not UTF-8 text (byte 2"],
    ),
    "truncated JSONL": (
        {"a.jsonl": b'{"text": "one"}\n{"text": "tw'}, ["--input", "{root}/a.jsonl"],
        ["a.jsonl:2: not valid JSON"],
    ),
    "JSONL without the key": (
        {"a.jsonl": b'{"body": "x"}\n'}, ["--input", "{root}/a.jsonl"], ["no 'text' field"],
    ),
    "JSONL with a number as text": (
        {"a.jsonl": b'{"text": 5}\n'}, ["--input", "{root}/a.jsonl"], ["is a int, not a string"],
    ),
    "a folder as input": ({"d": None}, ["--input", "{root}/d"], ["d is not a regular file"]),
    "a missing input": ({}, ["--input", "{root}/missing.txt"], ["missing.txt does not exist"]),
    "binary tokenizer model": (
        {**TEXT, "t.model": BINARY}, ["--input", "{root}/a.txt", "--tokenizer-model", "{root}/t.model"],
        ["t.model is not a SentencePiece model"],
    ),
    "empty tokenizer model": (
        {**TEXT, "t.model": b""}, ["--input", "{root}/a.txt", "--tokenizer-model", "{root}/t.model"],
        ["t.model is empty"],
    ),
    "empty text with a good tokenizer model": (
        {"a.txt": b""}, ["--input", "{root}/a.txt", "--tokenizer-model", "{model}"],
        ["no non-empty documents"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", PREPARE_CASES)
@pytest.mark.parametrize("output", ["new", "existing"])
def test_prepare_refuses_bad_input_and_leaves_outputs_alone(tmp_path, capsys, good, case, output):
    """Into a new output folder (which must not be created) and over an existing prepared one
    (which must stay as it was)."""
    files, flags, expected = PREPARE_CASES[case]
    root = tmp_path / "inputs"
    root.mkdir()
    for name, content in files.items():
        if content is None:
            (root / name).mkdir()
        else:
            (root / name).write_bytes(content)
    out = tmp_path / "out" / "data"
    if output == "existing":
        out.mkdir(parents=True)
        for path in good["prefix"].parent.iterdir():
            (out / path.name).write_bytes(path.read_bytes())
    argv = [flag.format(root=root, model=good["model"]) for flag in flags]
    before = fingerprints(tmp_path)
    with pytest.raises(SystemExit) as exited:
        prepare_module.main(
            [*argv, "--output-dir", str(out), "--vocab-size", "300", "--workers", "1"]
        )
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m megatron_domino.data.prepare: error: "), error
    assert error.count("\n") == 1, error
    for fragment in expected:
        assert fragment in error, (fragment, error)
    assert fingerprints(tmp_path) == before
    assert out.exists() == (output == "existing")


def test_the_fixture_files_are_what_their_names_say(good):
    """Guards the cases above: the good pair and model are valid, so each refusal is caused by
    the one file a case swaps in."""
    from megatron_domino.data.checks import check_indexed_dataset, check_sentencepiece_model

    check_indexed_dataset(str(good["prefix"]))
    check_sentencepiece_model(good["model"], what="--tokenizer-model", fix="")
    manifest = json.loads((good["prefix"].parent / "manifest.json").read_text())
    assert manifest["num_documents"] > 0
