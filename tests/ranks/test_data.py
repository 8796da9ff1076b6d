"""The data path: corpus -> tokenizer + .bin/.idx -> Megatron-Core GPT datasets -> micro-batches.

Tiny corpora and small vocabularies keep this file to seconds; one test spawns two gloo ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_domino.data.corpus import CorpusError, file_corpus, stdlib_corpus
from megatron_domino.data.datasets import (
    BATCH_KEYS,
    DataConfigError,
    build_datasets,
    build_tokenizer,
    iterate_micro_batches,
)
from megatron_domino.data.files import DataFileError
from megatron_domino.data.prepare import (
    DATA_PREFIX_NAME,
    MANIFEST_FILE,
    SentencePieceSettings,
    SettingsError,
    main,
    prepare,
)
from megatron_domino.data.tokenizer import RESERVED_PIECES

SMALL = SentencePieceSettings(vocab_size=400, input_sentence_size=20_000)

#: Text that a lossy tokenizer would change: runs of spaces, tabs, CRLF, leading and trailing
#: blanks, characters outside any small vocabulary, and one line SentencePiece could not train on.
TRICKY_DOCUMENTS = [
    "  leading spaces,\ttabs\tand trailing spaces   \n\n\nthree newlines above\r\nCRLF line\n",
    "naïve café — Ελληνικά, 東京, emoji 🙂🚀, math ∑∫√, NBSP\u00a0and zero-width\u200bspace",
    "x" * 5000 + " a line longer than SentencePiece's 4192-byte sentence limit",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # code\n",
]


def _write_corpus(folder: Path) -> tuple[list[Path], list[str]]:
    """A text file and a JSONL file (with a blank line and an empty document); returns the
    files and the documents expected in the dataset, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    text_file = folder / "first.txt"
    text_file.write_text(TRICKY_DOCUMENTS[0], encoding="utf-8")
    real_text = list(stdlib_corpus(max_bytes=150_000))
    jsonl_docs = [*TRICKY_DOCUMENTS[1:], "", *real_text]
    jsonl_file = folder / "rest.jsonl"
    lines = [json.dumps({"id": i, "text": doc}) for i, doc in enumerate(jsonl_docs)]
    jsonl_file.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n", encoding="utf-8")
    expected = [TRICKY_DOCUMENTS[0], *(doc for doc in jsonl_docs if doc)]
    return [text_file, jsonl_file], expected


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The shared small corpus, prepared once: ``(PreparedData, expected documents)``."""
    folder = tmp_path_factory.mktemp("corpus")
    files, expected = _write_corpus(folder / "inputs")
    result = prepare(
        corpus=file_corpus(files), output_dir=folder / "out", settings=SMALL, num_threads=2
    )
    return result, expected


@pytest.fixture(scope="module")
def tokenizer(prepared):
    result, _ = prepared
    return build_tokenizer(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=result.tokenizer_model
    )


def test_prepare_round_trip_is_exact(prepared, tokenizer):
    result, expected = prepared
    assert not result.reused
    assert tokenizer.eod == result.eod
    _assert_round_trip(result, expected, tokenizer)


def test_unigram_round_trip_is_exact(tmp_path):
    files, expected = _write_corpus(tmp_path)
    settings = dataclasses.replace(SMALL, tokenizer_algorithm="unigram")
    result = prepare(corpus=file_corpus(files), output_dir=tmp_path / "out", settings=settings)
    tokenizer = build_tokenizer(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=result.tokenizer_model
    )
    _assert_round_trip(result, expected, tokenizer)


def _assert_round_trip(result, expected, tokenizer):
    """One sequence per document, EOD last and only there, and decoding gives the text back."""
    assert result.num_documents == len(expected)
    indexed = IndexedDataset(result.data_prefix)
    assert len(indexed) == len(expected)
    assert sum(len(indexed[i]) for i in range(len(indexed))) == result.num_tokens
    for i, document in enumerate(expected):
        ids = indexed[i].tolist()
        assert ids[-1] == result.eod and result.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == document


def test_prepare_reuses_outputs_until_an_input_or_setting_changes(tmp_path, prepared):
    source = tmp_path / "doc.txt"
    source.write_text("\n".join(TRICKY_DOCUMENTS), encoding="utf-8")
    out = tmp_path / "out"

    def run(**kwargs):
        return prepare(corpus=file_corpus([source]), output_dir=out, **kwargs)

    first = run(tokenizer_model=prepared[0].tokenizer_model)
    bin_file = Path(first.data_prefix + ".bin")
    built_ns = bin_file.stat().st_mtime_ns
    again = run(tokenizer_model=prepared[0].tokenizer_model)
    assert (first.reused, again.reused) == (False, True)
    assert again.num_tokens == first.num_tokens and bin_file.stat().st_mtime_ns == built_ns

    source.write_text("\n".join(TRICKY_DOCUMENTS) + "\nmore text", encoding="utf-8")
    changed = run(tokenizer_model=prepared[0].tokenizer_model)
    assert not changed.reused and changed.num_tokens > first.num_tokens

    trained = run(settings=SentencePieceSettings(vocab_size=400))
    retrained = run(settings=SentencePieceSettings(vocab_size=400, seed=7))
    assert not trained.reused and not retrained.reused
    assert run(settings=SentencePieceSettings(vocab_size=400, seed=7)).reused
    assert not run(settings=SentencePieceSettings(vocab_size=400, seed=7), force=True).reused
    own_model = out / "tokenizer.model"  # replaced by an identical copy on every rebuild
    assert not run(tokenizer_model=own_model).reused
    assert run(tokenizer_model=own_model).reused
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST_FILE, "tokenizer.model", f"{DATA_PREFIX_NAME}.bin", f"{DATA_PREFIX_NAME}.idx"]
    )


def test_failed_prepare_leaves_earlier_outputs_untouched(tmp_path, prepared):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = tmp_path / "out"
    model = prepared[0].tokenizer_model
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare(corpus=file_corpus([bad]), output_dir=out, settings=SMALL)  # while training
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare(corpus=file_corpus([bad]), output_dir=out, tokenizer_model=model)  # tokenising
    assert not out.exists()  # not even the folder: a failed run leaves nothing behind

    assert (
        prepare(corpus=file_corpus([good]), output_dir=out, tokenizer_model=model).num_documents
        == 1
    )
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CorpusError):
        prepare(corpus=file_corpus([good, bad]), output_dir=out, tokenizer_model=model)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot
    assert prepare(corpus=file_corpus([good]), output_dir=out, tokenizer_model=model).reused


def test_missing_or_malformed_inputs_give_clear_errors(tmp_path, prepared, tokenizer):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataFileError, match=r"--input: .*nope\.txt does not exist"):
        file_corpus([missing])
    with pytest.raises(DataFileError, match="is not a regular file"):
        file_corpus([tmp_path])
    no_key = tmp_path / "no_key.jsonl"
    no_key.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CorpusError, match=r"no_key\.jsonl:1: no 'text' field .*--json-key"):
        list(file_corpus([no_key]))
    assert list(file_corpus([no_key], json_key="body")) == ["x"]
    with pytest.raises(SettingsError, match="--vocab-size 100 is too small"):
        SentencePieceSettings(vocab_size=100)
    many_characters = tmp_path / "many_characters.txt"
    many_characters.write_text("".join(TRICKY_DOCUMENTS), encoding="utf-8")
    tiny_vocab = SentencePieceSettings(vocab_size=RESERVED_PIECES + 1)
    with pytest.raises(SettingsError, match="cannot train .*Vocabulary size is smaller"):
        prepare(
            corpus=file_corpus([many_characters]), output_dir=tmp_path / "o", settings=tiny_vocab
        )

    with pytest.raises(DataFileError, match=r"nope\.model does not exist.*megatron_domino\.data"):
        build_tokenizer(
            tokenizer_type="SentencePieceTokenizer", tokenizer_model=tmp_path / "nope.model"
        )
    only_idx = tmp_path / "half"
    Path(f"{only_idx}.idx").write_bytes(Path(prepared[0].data_prefix + ".idx").read_bytes())
    for prefix, absent in ((tmp_path / "none", "none.idx"), (only_idx, "half.bin")):
        with pytest.raises(DataFileError, match=rf"{absent} does not exist.*data\.prepare"):
            build_datasets(
                tokenizer=tokenizer,
                sequence_length=16,
                num_samples=(4, 4, 4),
                seed=0,
                path_to_cache=tmp_path / "cache",
                data_path=str(prefix),
            )
    with pytest.raises(DataConfigError, match="exactly one of --data-path"):
        build_datasets(
            tokenizer=tokenizer,
            sequence_length=16,
            num_samples=(4, 4, 4),
            seed=0,
            path_to_cache=tmp_path / "cache",
        )


def test_command_line(tmp_path, capsys):
    source = tmp_path / "doc.txt"
    source.write_text("\n".join(TRICKY_DOCUMENTS) * 3, encoding="utf-8")
    argv = ["--input", str(source), "--output-dir", str(tmp_path / "out"), "--vocab-size", "400"]
    assert main(argv) == 0
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("wrote 1 documents") and "\nreused 1 documents" in printed
    assert f"--data-path {tmp_path / 'out' / DATA_PREFIX_NAME}" in printed
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(tmp_path / "gone.txt"), "--output-dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "gone.txt does not exist" in capsys.readouterr().err


def test_stdlib_corpus_is_deterministic_and_bounded():
    first, second = stdlib_corpus(max_bytes=200_000), stdlib_corpus(max_bytes=200_000)
    assert first.fingerprint == second.fingerprint
    documents = list(first)
    assert documents == list(second) and len(documents) > 1
    assert sum(len(d.encode("utf-8")) for d in documents) <= 200_000
    assert stdlib_corpus(max_bytes=100_000).fingerprint != first.fingerprint


def _first_batch(dataset, micro_batch_size=4):
    return next(iterate_micro_batches(dataset, micro_batch_size=micro_batch_size))


def test_datasets_from_prepared_data(tmp_path, prepared, tokenizer):
    result, _ = prepared
    seq = 32
    num_samples = (40, 24, 8)
    common = dict(tokenizer=tokenizer, sequence_length=seq, num_samples=num_samples, seed=3)
    train, valid, test = build_datasets(
        **common, path_to_cache=tmp_path / "cache", data_path=[result.data_prefix], split="8,1,1"
    )
    assert len(train) >= 40 and len(valid) >= 24 and len(test) >= 8
    batch = _first_batch(train)
    assert set(batch) == set(BATCH_KEYS)
    for key in BATCH_KEYS:
        assert batch[key].shape == (4, seq)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"], torch.arange(seq).expand(4, seq))
    assert int(batch["tokens"].max()) < tokenizer.vocab_size
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").rglob("*.npy"))

    masked = build_datasets(
        **common,
        path_to_cache=tmp_path / "cache",
        data_path=result.data_prefix,
        split="8,1,1",
        eod_mask_loss=True,
    )[0]
    eod_at = torch.cat([b["tokens"] for b in iterate_micro_batches(masked, micro_batch_size=4)])
    loss_mask = torch.cat(
        [b["loss_mask"] for b in iterate_micro_batches(masked, micro_batch_size=4)]
    )
    assert bool((eod_at == tokenizer.eod).any())
    assert torch.equal(loss_mask == 0, eod_at == tokenizer.eod)


def test_index_cache_follows_the_data_not_just_its_path(tmp_path, prepared, tokenizer):
    source = tmp_path / "doc.txt"
    out, cache = tmp_path / "out", tmp_path / "cache"
    model = prepared[0].tokenizer_model

    def build(text):
        source.write_text(text, encoding="utf-8")
        prefix = prepare(corpus=file_corpus([source]), output_dir=out, tokenizer_model=model)
        return build_datasets(
            tokenizer=tokenizer,
            sequence_length=8,
            num_samples=(4, 0, 0),
            seed=0,
            path_to_cache=cache,
            data_path=prefix.data_prefix,
            split="1,0,0",
        )

    short_train, valid, test = build("a b c d e f " * 20)
    assert valid is None and test is None
    long_train = build("a b c d e f " * 200)[0]
    assert len(long_train) > len(short_train)
    assert len(list(cache.iterdir())) == 2


def test_split_without_documents_is_refused_not_hung(tmp_path, prepared, tokenizer):
    source = tmp_path / "one.txt"
    source.write_text("a single short document", encoding="utf-8")
    one = prepare(
        corpus=file_corpus([source]),
        output_dir=tmp_path / "out",
        tokenizer_model=prepared[0].tokenizer_model,
    )
    with pytest.raises(DataConfigError, match="leaves the valid split no documents of the 1"):
        build_datasets(
            tokenizer=tokenizer,
            sequence_length=8,
            num_samples=(4, 4, 4),
            seed=0,
            path_to_cache=tmp_path / "cache",
            data_path=one.data_prefix,
            split="8,1,1",
        )


def test_mock_data_with_null_tokenizer(tmp_path):
    tokenizer = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=128)
    assert (tokenizer.vocab_size, tokenizer.eod) == (128, 127)  # megatron-core 0.19
    datasets = build_datasets(
        tokenizer=tokenizer,
        sequence_length=24,
        num_samples=(16, 8, 8),
        seed=0,
        path_to_cache=tmp_path,
        mock_data=True,
    )
    for dataset in datasets:
        batch = _first_batch(dataset, micro_batch_size=2)
        assert {k: tuple(v.shape) for k, v in batch.items()} == dict.fromkeys(BATCH_KEYS, (2, 24))
        assert int(batch["tokens"].max()) < tokenizer.vocab_size
    with pytest.raises(DataConfigError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(tokenizer_type="NullTokenizer")


def test_micro_batches_split_data_parallel_ranks_like_megatron(tmp_path):
    tokenizer = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=64)
    train = build_datasets(
        tokenizer=tokenizer,
        sequence_length=8,
        num_samples=(12, 0, 0),
        seed=0,
        path_to_cache=tmp_path,
        mock_data=True,
    )[0]
    steps = 3
    single = [b["tokens"] for b in _take(_stream(train, rank=0, size=1), 2 * steps)]
    ranks = [[b["tokens"] for b in _take(_stream(train, rank=r, size=2), steps)] for r in (0, 1)]
    for step in range(steps):
        assert torch.equal(ranks[0][step], single[2 * step])
        assert torch.equal(ranks[1][step], single[2 * step + 1])
    resumed = next(iterate_micro_batches(train, micro_batch_size=2, consumed_samples=4))
    assert torch.equal(resumed["tokens"], single[2])
    five_samples = [train[i] for i in range(5)]
    assert len(list(iterate_micro_batches(five_samples, micro_batch_size=2))) == 2


def _stream(dataset, *, rank, size):
    return iterate_micro_batches(
        dataset, micro_batch_size=2, data_parallel_rank=rank, data_parallel_size=size
    )


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_blend_without_process_group_is_refused(tmp_path, prepared, tokenizer):
    prefix = prepared[0].data_prefix
    with pytest.raises(DataConfigError, match="needs torch.distributed to be initialised"):
        build_datasets(
            tokenizer=tokenizer,
            sequence_length=16,
            num_samples=(8, 8, 8),
            seed=0,
            path_to_cache=tmp_path,
            data_path=["0.3", prefix, "0.7", prefix],
        )


def _gloo_rank(rank: int, init_file: str, cache: str, model: str, prefix: str) -> None:
    """One rank: build a weighted blend, check who built the indices, compare batches."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tokenizer = build_tokenizer(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
        train, _, _ = build_datasets(
            tokenizer=tokenizer,
            sequence_length=16,
            num_samples=(32, 8, 8),
            seed=0,
            path_to_cache=cache,
            data_path=["0.3", prefix, "0.7", prefix],
            split="8,1,1",
        )
        # Rank 0 builds the indices and holds them in memory; rank 1 maps rank 0's files.
        assert isinstance(train.dataset_index, numpy.memmap) == (rank == 1)
        assert isinstance(train.datasets[0].sample_index, numpy.memmap) == (rank == 1)
        tokens = _first_batch(train)["tokens"]
        reference = tokens.clone()
        dist.broadcast(reference, src=0)
        assert torch.equal(tokens, reference)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_build_once_and_read_the_same_batches(tmp_path, prepared):
    result, _ = prepared
    mp.spawn(
        _gloo_rank,
        args=(
            str(tmp_path / "init"),
            str(tmp_path / "cache"),
            str(result.tokenizer_model),
            result.data_prefix,
        ),
        nprocs=2,
    )
    assert os.listdir(tmp_path / "cache")
