"""Domino inside Megatron-LM's own training loop (``megatron.training``).

Megatron-LM builds its GPT model from a ``GPTModelConfig`` (``gpt_config_from_args``) whose
``pre_wrap_hooks`` run on the list of built model chunks (one per pipeline stage, or per
virtual stage) before ``Float16Module`` and DDP wrap them. That is where Domino goes: it binds
``forward`` onto module instances, which the wrappers keep. Three calls connect a Megatron-LM
script to Domino, and both ``pretrain_gpt_domino.py`` and the patch for Megatron-LM's
``pretrain_gpt.py`` (``patches/``) make exactly these:

* :func:`add_domino_args` as (part of) ``extra_args_provider``: ``--domino`` and one flag per
  :class:`~megatron_domino.config.DominoConfig` field on Megatron's own parser;
* :func:`check_args` once Megatron has validated its arguments: every refusal that needs no
  built model (flag values, shapes, TP = 1, features Domino cannot combine with), so a bad
  command line fails before a process group, checkpoint or log directory exists;
* :func:`attach` on the ``GPTModelConfig``: appends the pre-wrap hook that applies Domino to
  every model chunk (and runs the structural refusals of
  :func:`~megatron_domino.integration.apply_domino` on the built layers).

Without ``--domino`` nothing of Domino is imported by the script or the patch.
"""

from __future__ import annotations

import argparse

import torch

from megatron_domino.config import DominoConfig, add_domino_args
from megatron_domino.integration import (
    DominoHandle,
    apply_domino,
    config_problems,
    fsdp_problems,
    raise_problems,
)
from megatron_domino.te_linears import te_problems
from megatron_domino.version import check_megatron_core_version

__all__ = ["DominoModelHook", "add_domino_args", "attach", "check_args"]


def check_args(args: argparse.Namespace) -> DominoConfig | None:
    """Domino's config from Megatron's validated ``args``, or ``None`` without ``--domino``.

    Raises:
        UnsupportedMegatronVersion: the imported Megatron-Core is not a tested release.
        DominoConfigError: a ``--domino*`` value is invalid or the shapes cannot be split.
        DominoUnsupportedError: the flags ask for something Domino cannot run with; the
            message lists every reason with its fix.
    """
    config = DominoConfig.from_args(args)
    if config is None:
        return None
    check_megatron_core_version()
    config.check_shapes(
        micro_batch_size=args.micro_batch_size,
        hidden_size=args.hidden_size,
        seq_length=args.seq_length,
        sequence_parallel_size=args.tensor_model_parallel_size if args.sequence_parallel else 1,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    model_config = core_transformer_config_from_args(args)
    problems = config_problems(model_config, config, tp_size=args.tensor_model_parallel_size)
    # Not in the TransformerConfig: Megatron-LM wraps the built model after the pre-wrap hook.
    problems += fsdp_problems(
        megatron_fsdp=args.use_megatron_fsdp, torch_fsdp2=args.use_torch_fsdp2
    )
    if args.transformer_impl == "transformer_engine":
        problems += te_problems(
            config,
            sequence_parallel=args.sequence_parallel,
            fp8_recipe=args.fp8_recipe if args.fp8 else None,
        )
    elif args.fp8:
        problems.append(
            "FP8 runs only in Transformer Engine layers, and --transformer-impl local builds "
            "Megatron's own linears; use --transformer-impl transformer_engine or drop --fp8-format"
        )
    raise_problems(problems)
    return config


class DominoModelHook:
    """A ``GPTModelConfig`` pre-wrap hook: Domino on every built model chunk.

    Megatron-LM calls it once with the list of this rank's model chunks, right after building
    them and before wrapping them. The handles are kept (:attr:`handles`, one per chunk) so
    a caller can reach each chunk's Domino runtime (e.g. the overlap report's recorder).
    """

    def __init__(self, config: DominoConfig) -> None:
        self.config = config
        self.handles: list[DominoHandle] = []

    def __call__(self, model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        if self.handles:
            raise RuntimeError("The Domino model hook already ran; build the model once.")
        self.handles = [apply_domino(chunk, self.config) for chunk in model_chunks]
        return model_chunks


def attach(model_config, args: argparse.Namespace) -> DominoModelHook | None:
    """Run :func:`check_args` and append Domino's hook to ``model_config.pre_wrap_hooks``.

    Args:
        model_config: Megatron-LM's ``GPTModelConfig`` (``gpt_config_from_args(args)``).
        args: Megatron's validated arguments.
    Returns:
        The hook (``None`` without ``--domino``).
    """
    config = check_args(args)
    if config is None:
        return None
    hook = DominoModelHook(config)
    model_config.pre_wrap_hooks.append(hook)
    return hook
