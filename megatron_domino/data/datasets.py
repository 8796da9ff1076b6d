"""Training-side data: Megatron-Core's tokenizer, GPT datasets and micro-batches, on CPU.

Everything here is Megatron-Core's own machinery (``megatron.core.tokenizers``,
``BlendedMegatronDatasetBuilder``, ``GPTDataset``/``MockGPTDataset``); this module only chooses
its settings and checks inputs so that mistakes surface as messages, not asserts:

* No attention mask is built (``create_attention_mask=False``): GPTDataset's default mask is a
  per-sample ``[1, s, s]`` tensor the caller does not need, since the model's causal mask is
  supplied explicitly by the training loop (Megatron's default one is CUDA-only).
* Every rank builds its own datasets (rank 0 first, the others after a barrier, from its index
  cache) instead of Megatron's build-on-TP-rank-0-and-broadcast: the datasets are
  deterministic, so each tensor-parallel rank reads the same micro-batches without a collective.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from torch.utils.data import Dataset

from megatron_domino.data.files import (
    PREPARE_COMMAND,
    digest,
    file_fingerprint,
    require_readable_file,
)

#: The ``--tokenizer-type`` values supported, named as in Megatron-LM.
TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")

#: The keys of a micro-batch, as Megatron's ``pretrain_gpt.get_batch`` names them (without
#: ``attention_mask``, which the caller supplies); each value is ``[micro_batch, seq_length]``.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")

_CREATE_HINT = (
    f"Create it with `{PREPARE_COMMAND} --input FILE [FILE ...] --output-dir DIR` "
    "(or `--stdlib-corpus` instead of `--input` for the demo corpus)"
)


class DataConfigError(ValueError):
    """An invalid combination of data settings; the message names the flags and the fix."""


def build_tokenizer(
    *,
    tokenizer_type: str,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> MegatronTokenizerBase:
    """Build a tokenizer through ``megatron.core.tokenizers``.

    Args:
        tokenizer_type: ``"SentencePieceTokenizer"`` (needs ``tokenizer_model``, e.g. from
            :mod:`megatron_domino.data.prepare`) or ``"NullTokenizer"`` (needs ``vocab_size``;
            for ``--mock-data``).
        tokenizer_model: the SentencePiece ``.model`` file.
        vocab_size: NullTokenizer only. As in Megatron-LM (megatron-core 0.19's ``null-text``
            library), ids ``0..vocab_size-1`` are tokens, the last of them (``vocab_size - 1``)
            the end-of-document id.

    Raises:
        DataFileError: the model file is missing or unreadable (the message says how to
            create it).
        DataConfigError: the type is unknown or its required argument is missing.
    """
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise DataConfigError(
                "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model."
            )
        path = require_readable_file(
            tokenizer_model,
            what="--tokenizer-model",
            fix=f"{_CREATE_HINT} and pass --tokenizer-model DIR/tokenizer.model.",
        )
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(path), metadata_path={"library": "sentencepiece"}
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise DataConfigError(
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}."
            )
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=vocab_size
        )
    raise DataConfigError(
        f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {tokenizer_type!r}."
    )


def build_datasets(
    *,
    tokenizer: MegatronTokenizerBase,
    sequence_length: int,
    num_samples: Sequence[int],
    seed: int,
    path_to_cache: str | os.PathLike,
    data_path: str | Sequence[str] | None = None,
    split: str = "949,50,1",
    mock_data: bool = False,
    eod_mask_loss: bool = False,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Build the train, valid and test datasets with ``BlendedMegatronDatasetBuilder``.

    Call on every rank, with ``torch.distributed`` initialised (any backend, e.g. gloo) or, in
    a single process, not initialised. Each sample is a dict of ``sequence_length``-long tensors
    (see :data:`BATCH_KEYS`); :func:`iterate_micro_batches` stacks them.

    Args:
        tokenizer: from :func:`build_tokenizer`; its ``eod`` marks document boundaries.
        sequence_length: tokens per sample (``--seq-length``).
        num_samples: samples to draw for (train, valid, test), e.g. ``train_iters *
            global_batch_size`` for train; a split shorter than that is repeated in epochs.
        seed: seed of the document and sample shuffles.
        path_to_cache: where GPTDataset caches its index files (``--data-cache-path``). They
            go into a subfolder named by a fingerprint of the ``.bin/.idx`` files, because
            Megatron-Core keys its cache by path, not content: re-preparing a corpus under the
            same prefix would otherwise reuse indices of the old one.
        data_path: ``--data-path``: one prefix (a string or a one-item list), several
            prefixes (blended by size), or alternating weights and prefixes
            (``["0.3", "a", "0.7", "b"]``). Not with ``mock_data``.
        split: ``--split``: relative train/valid/test weights of each prefix's documents
            (ignored with ``mock_data``, which splits evenly).
        mock_data: ``--mock-data``: Megatron's synthetic ``MockGPTDataset`` instead of files.
        eod_mask_loss: ``--eod-mask-loss``: no loss on predicting the token after an EOD.

    Returns:
        ``(train, valid, test)``: ``GPTDataset``, ``MockGPTDataset`` or, for several prefixes,
        ``BlendedDataset``; a split with weight 0 in ``split`` is ``None``.

    Raises:
        DataConfigError: neither or both of ``data_path``/``mock_data``, a blend of several
            prefixes without ``torch.distributed``, bad sample counts, or a split that would
            get no documents (Megatron-Core would hang).
        DataFileError: a ``.bin``/``.idx`` file is missing or unreadable; the message says
            how to create it.
    """
    if isinstance(data_path, str):
        data_path = [data_path]
    if bool(data_path) == mock_data:
        raise DataConfigError(
            "pass exactly one of --data-path PREFIX (files made by "
            f"`{PREPARE_COMMAND}`) and --mock-data."
        )
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise DataConfigError(
            f"num_samples must be three counts >= 0 (train, valid, test), got {num_samples}."
        )
    if mock_data:
        blend, prefixes, cache_name = None, [], "mock"
    else:
        blend = get_blend_from_list(list(data_path))
        prefixes = blend[0]
        cache_name = digest([_check_prefix(prefix) for prefix in prefixes])[:16]
        if len(prefixes) > 1 and not torch.distributed.is_initialized():
            # Megatron-Core 0.16's BlendedDataset calls torch.distributed.get_rank() when it
            # builds its cache, which raises without a process group.
            raise DataConfigError(
                f"blending {len(prefixes)} --data-path prefixes needs torch.distributed to be "
                "initialised (a one-process gloo group is enough), or pass a single prefix."
            )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length,
        blend=blend,
        split=None if mock_data else split,
        path_to_cache=str(Path(path_to_cache) / cache_name),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    for prefix in prefixes:
        _check_every_split_gets_documents(prefix, config.split_matrix, split)
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock_data else GPTDataset,
        list(num_samples),
        lambda: True,  # every rank builds (module docstring)
        config,
    )
    train, valid, test = builder.build()
    return train, valid, test


def iterate_micro_batches(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    consumed_samples: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches in order, like Megatron's pretraining sampler.

    Each step takes the next ``micro_batch_size * data_parallel_size`` samples; data-parallel
    rank ``r`` gets the ``r``-th block of ``micro_batch_size`` of them, so ranks never share a
    sample and tensor-parallel ranks (same ``r``) get identical batches. Stops before a step
    the dataset cannot fill. ``consumed_samples`` resumes after a checkpoint.

    Yields:
        dicts with :data:`BATCH_KEYS`: ``tokens``, ``labels`` (the next tokens), ``position_ids``
        (int64) and ``loss_mask`` (float32), each ``[micro_batch_size, seq_length]``, on CPU.
    """
    if micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise DataConfigError(
            f"need micro_batch_size >= 1 and 0 <= data_parallel_rank < data_parallel_size, got "
            f"{micro_batch_size}, {data_parallel_rank}, {data_parallel_size}."
        )
    step = micro_batch_size * data_parallel_size
    for start in range(consumed_samples, len(dataset) - step + 1, step):
        first = start + data_parallel_rank * micro_batch_size
        samples = [dataset[index] for index in range(first, first + micro_batch_size)]
        yield {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}


def _check_every_split_gets_documents(
    prefix: str, split_matrix: Sequence[tuple[float, float] | None], split: str
) -> None:
    """Refuse a split that would get no documents of ``prefix``: Megatron-Core 0.16's GPTDataset
    then loops forever looking for the tokens of one epoch. The bounds are rounded as
    ``BlendedMegatronDatasetBuilder`` rounds them."""
    num_documents = len(IndexedDataset(prefix))
    for name, bounds in zip(("train", "valid", "test"), split_matrix, strict=True):
        if bounds is not None and round(bounds[0] * num_documents) == round(
            bounds[1] * num_documents
        ):
            raise DataConfigError(
                f"--split {split} leaves the {name} split no documents of the {num_documents} "
                f"in --data-path {prefix}; prepare a larger corpus or give {name} weight 0."
            )


def _check_prefix(prefix: str) -> list[dict[str, int | str]]:
    """Fingerprints of a prefix's .idx and .bin, after checking that both can be read."""
    fix = f"{_CREATE_HINT} and pass --data-path DIR/text_document."
    return [
        file_fingerprint(require_readable_file(path, what=f"--data-path {prefix}", fix=fix))
        for path in (get_idx_path(prefix), get_bin_path(prefix))
    ]
