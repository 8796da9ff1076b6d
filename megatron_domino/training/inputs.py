"""What a run reads, checked before anything is written, and checkpoint load failures made plain.

Megatron-LM meets bad input late and loudly: a truncated ``.bin`` fails in a DataLoader worker
after the index caches were written, an unparsable tokenizer inside SentencePiece's C++, a
checkpoint of another model shape in a 60-line traceback per rank. And one bad input it meets
silently: a ``latest_checkpointed_iteration.txt`` that is empty or garbled (a save interrupted
while rank 0 rewrote it) makes ``read_metadata`` call ``sys.exit()`` with status 0, so
torchrun and SLURM see a job that finished. This module adds:

* :func:`check_run_inputs`, run with the script's other checks right after Megatron's
  ``validate_args`` (before the tokenizer, a log or a cache is created): every ``--data-path``
  prefix is a complete indexed dataset (:func:`~megatron_domino.data.checks.check_indexed_dataset`),
  tokenizer files load, and the checkpoint ``--load`` would resume from is named by a readable
  tracker and was completely saved. Object-store paths (``scheme://``) are left to Megatron.
* :func:`clear_load_errors`, a patch of the ``load_checkpoint`` that ``setup_model_and_optimizer``
  calls: whatever makes the load fail (a tensor of another shape, Megatron's own argument
  comparison, a changed learning-rate schedule, the distributed optimizer's resume without
  Apex or Transformer Engine) is raised again as :class:`CheckpointError`,
  one line naming the checkpoint, the cause and the fix. It fails on every rank (the checks
  that fail are collective or run on every rank), before the data caches, ``--log-json`` or a
  checkpoint are written (a ``--tensorboard-dir`` is already open by then).

A checkpoint of another tensor-parallel size is *not* refused: Megatron-LM reshards
``torch_dist`` checkpoints on load (and prints "(TP, PP) mismatch after resume ...: RNG state
will be ignored"), which is how users change parallelism; the legacy ``torch`` format cannot be
resharded and is refused by Megatron's argument comparison, reworded here.
"""

from __future__ import annotations

import argparse
import functools
import re
import traceback
from pathlib import Path

from megatron.training import get_args
from megatron.training import training as megatron_training
from megatron.training.checkpointing import get_loaded_iteration
from megatron.training.utils import get_blend_and_blend_per_split
from torch.distributed.checkpoint.api import CheckpointException

from megatron_domino.data.checks import check_indexed_dataset, check_sentencepiece_model
from megatron_domino.data.files import PREPARE_COMMAND, DataFileError, require_readable_file
from megatron_domino.runtime.patch import Patch

__all__ = ["CheckpointError", "check_run_inputs", "clear_load_errors"]

#: Megatron-LM's tracker file, written by rank 0 after every rank's shards are on disk.
TRACKER = "latest_checkpointed_iteration.txt"
#: Tokenizer types whose ``--tokenizer-model`` is a SentencePiece model file.
SENTENCEPIECE_TOKENIZERS = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
)
_ITERATION_DIR = re.compile(r"iter_(\d{7})")


class CheckpointError(ValueError):
    """A checkpoint that ``--load`` cannot resume from; the message names it and the fix."""


def check_run_inputs(args: argparse.Namespace) -> None:
    """Raise :class:`DataFileError` or :class:`CheckpointError` for an input the run would
    fail on later (see the module docstring)."""
    if not args.mock_data:
        for prefix in _data_prefixes(args):
            check_indexed_dataset(prefix)
    _check_tokenizer_files(args)
    if args.load and not _is_remote(args.load):
        _check_load_dir(Path(args.load), getattr(args, "ckpt_step", None))


def clear_load_errors() -> Patch:
    """The patch of ``megatron.training.training.load_checkpoint`` described above."""
    return Patch(
        megatron_training,
        "load_checkpoint",
        _reworded(megatron_training.load_checkpoint),
        "a checkpoint that does not fit the run fails in one line, not a traceback per rank.",
    )


def _is_remote(path: str) -> bool:
    return "://" in str(path)


def _data_prefixes(args: argparse.Namespace) -> list[str]:
    try:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except (OSError, ValueError) as err:  # --data-args-path / --per-split-data-args-path
        raise DataFileError(f"cannot read the data paths file: {err}") from err
    blends = [blend, *(blend_per_split or [])]
    prefixes = [prefix for found in blends if found for prefix in found[0]]
    return [prefix for prefix in prefixes if not _is_remote(prefix)]


def _check_tokenizer_files(args: argparse.Namespace) -> None:
    if args.tokenizer_type in SENTENCEPIECE_TOKENIZERS and args.tokenizer_model:
        check_sentencepiece_model(
            args.tokenizer_model,
            what="--tokenizer-model",
            fix=f"Pass the .model file the data was tokenised with (`{PREPARE_COMMAND}` "
            "writes DIR/tokenizer.model).",
        )
    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if path and not _is_remote(path):
                require_readable_file(path, what=flag, fix="Pass GPT-2's vocab.json/merges.txt.")


def _check_load_dir(load: Path, ckpt_step: int | None) -> None:
    """The checkpoint Megatron would load from ``load``, by its rules: the tracker's iteration
    (or ``--ckpt-step``); with neither, it starts from scratch, which is fine."""
    tracker = load / TRACKER
    name = None
    if tracker.is_file():
        raw = tracker.read_bytes()
        text = raw.decode("utf-8", errors="replace").strip()
        if text == "release":
            name = "release"
        elif text.isdecimal():
            name = f"iter_{int(text):07d}"
        else:
            held = repr(text[:40]) if text.isprintable() else f"{len(raw)} bytes that are not text"
            raise CheckpointError(
                f"--load {load}: {TRACKER} holds {held}, not an iteration number (Megatron "
                "would exit with status 0 without training): a save was interrupted while the "
                f"file was rewritten, or it was edited. {_complete_hint(load)}"
            )
    if ckpt_step:
        name = f"iter_{ckpt_step:07d}"
    if name is None:
        return
    problem = _incomplete(load / name)
    if problem:
        what = f"--ckpt-step {ckpt_step}" if ckpt_step else TRACKER
        raise CheckpointError(
            f"--load {load}: {name} (from {what}) {problem}. {_complete_hint(load)}"
        )


def _incomplete(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be a finished save, or None. A ``torch_dist`` save is finished
    when it has ``metadata.json`` and ``.metadata`` (written by rank 0 after every shard)."""
    if not checkpoint.is_dir():
        return "does not exist"
    names = {entry.name for entry in checkpoint.iterdir()}
    if "metadata.json" in names and ".metadata" not in names:
        return "has no .metadata: its save did not finish"
    if not ({"metadata.json", ".metadata"} & names or any(n.startswith("mp_rank_") for n in names)):
        return "holds no checkpoint (no metadata.json, .metadata or mp_rank_* files): its save did not finish"
    return None


def _complete_hint(load: Path) -> str:
    complete = sorted(
        int(match.group(1))
        for entry in load.iterdir()
        if (match := _ITERATION_DIR.fullmatch(entry.name)) and not _incomplete(entry)
    )
    if not complete:
        return f"It holds no complete checkpoint: move {TRACKER} away to start from scratch."
    shown = ", ".join(map(str, complete[-5:]))
    return (
        f"Complete checkpoints there: iterations {shown}; to resume from the latest, write "
        f"{complete[-1]} into {load / TRACKER}."
    )


def _root_cause(err: BaseException) -> BaseException:
    """The exception behind torch.distributed.checkpoint's per-rank wrapper."""
    while isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    return err


#: Why a run with ``--use-distributed-optimizer`` cannot resume without Apex or Transformer
#: Engine, and what to do instead (see :func:`_distributed_optimizer_without_fused_adam`).
_DISTRIBUTED_OPTIMIZER_FIX = (
    "Megatron-Core's distributed optimizer cannot resume without Apex or Transformer Engine "
    "(it then falls back to torch's Adam, whose state is empty until the first step, and its "
    "state_dict asserts on that before loading; pretrain_gpt_domino.py's CPU runtime patches "
    "that load on a machine without CUDA, not on a GPU one): the flags are not the problem. "
    "Resume where Apex or Transformer Engine is installed, or start a new run (another "
    "--save/--load directory) without --use-distributed-optimizer (the recipes in examples/: "
    "DISTRIBUTED_OPTIMIZER=0)."
)


def _distributed_optimizer_without_fused_adam(cause: BaseException) -> bool:
    """Whether ``cause`` is Megatron-Core 0.19's assertion in ``DistributedOptimizer.state_dict``
    that a resume meets without Apex or TE: it reads Adam's ``step`` from torch's optimizer
    state, which is empty before the first step, i.e. at every load. The flags match the
    checkpoint's then, so the generic hint would send the user looking for a difference that
    is not there."""
    from megatron.core.optimizer import distrib_optimizer

    if not isinstance(cause, AssertionError) or distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    frames = traceback.extract_tb(cause.__traceback__)
    return bool(frames) and frames[-1].filename == distrib_optimizer.__file__


def _reworded(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def wrapper(*args, **kwargs):
        try:
            return load_checkpoint(*args, **kwargs)
        except (Exception, CheckpointException) as err:
            flag = kwargs.get("load_arg", "load")
            cause = _root_cause(err)
            text = str(cause).strip()
            message = (text.splitlines()[0].rstrip(".") + ".") if text else "(no message)."
            if "OptimizerParamScheduler" in message:
                fix = (
                    "The learning-rate schedule flags differ from the checkpoint's: add "
                    "--override-opt-param-scheduler to take them from the command line."
                )
            elif _distributed_optimizer_without_fused_adam(cause):
                fix = _DISTRIBUTED_OPTIMIZER_FIX
            else:
                fix = (
                    "Resume with the model flags the checkpoint was saved with (its arguments "
                    "are stored in it; --use-checkpoint-args reads them), or start a new run "
                    "with another --save/--load directory."
                )
            iteration = get_loaded_iteration()
            at = f" at iteration {iteration}" if iteration is not None and iteration >= 0 else ""
            raise CheckpointError(
                f"--{flag.replace('_', '-')} {getattr(get_args(), flag)}: cannot resume from its "
                f"checkpoint{at}: {type(cause).__name__}: {message} {fix}"
            ) from err

    return wrapper
