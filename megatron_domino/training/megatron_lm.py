"""Domino inside Megatron-LM's own training loop (``megatron.training``).

Megatron-LM builds its GPT model from a ``GPTModelConfig`` (``gpt_config_from_args``) whose
``pre_wrap_hooks`` run on the list of built model chunks (one per pipeline stage, or per
virtual stage) before ``Float16Module`` and DDP wrap them. That is where Domino goes: it binds
``forward`` onto module instances, which the wrappers keep. Three calls connect a Megatron-LM
script to Domino:

* :func:`add_domino_args` (from :mod:`megatron_domino.base.config`) as (part of)
  ``extra_args_provider``: ``--domino`` and one flag per
  :class:`~megatron_domino.base.config.DominoConfig` field on Megatron's own parser
  (:func:`add_args` adds every flag of the project, the loop's and the tuner's too, for the
  patch);
* :func:`check_args` once Megatron has validated its arguments: builds the
  :class:`~megatron_domino.base.config.DominoConfig` and runs every refusal that needs no built
  model (flag values, shapes, TP = 1, features Domino cannot combine with), so a bad command
  line fails before a process group, checkpoint or log directory exists;
* :func:`add_hook` on the ``GPTModelConfig``: appends the pre-wrap hook that applies Domino to
  every model chunk (and runs the structural refusals of
  :func:`~megatron_domino.apply.apply_domino` on the built layers).

:func:`attach` is the last two in one call, for a script that checks nothing earlier, plus
the loop hooks (``--log-json``, ``--domino-report``, ``--domino-ab``) and a one-message exit
on a refused command line: the patch for Megatron-LM's ``pretrain_gpt.py`` (``patches/``)
calls :func:`add_args` and :func:`attach` (and :func:`help_lists_domino` for ``--help``);
``pretrain_gpt_domino.py`` checks its flags inside Megatron's validation and adds the hook
with the config it got. Neither imports this module without ``--domino`` (the patch imports
it for ``--help`` too, to list Domino's flags).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch

from megatron_domino.apply import DominoHandle, apply_domino
from megatron_domino.autotune import AutoTuner, candidate_configs
from megatron_domino.base.config import (
    AUTO,
    DominoConfig,
    DominoConfigError,
    DominoUnsupportedError,
    add_domino_args,
)
from megatron_domino.base.version import (
    UnsupportedMegatronVersion,
    check_megatron_core_version,
    check_transformer_engine_version,
)
from megatron_domino.refusals import (
    TE_FUSED_NORM_UNDER_SP,
    config_problems,
    fsdp_problems,
    raise_problems,
)
from megatron_domino.runtime.patch import Patch

__all__ = [
    "DominoModelHook",
    "add_args",
    "add_domino_args",
    "add_hook",
    "attach",
    "check_args",
    "help_lists_domino",
]


def check_args(args: argparse.Namespace) -> DominoConfig | AutoTuner | None:
    """Domino's config from Megatron's validated ``args``, or ``None`` without ``--domino``.

    With ``--domino-chunks auto`` it is an :class:`~megatron_domino.autotune.AutoTuner` over
    every setting this model can run (the others' reasons are dropped: they are why those
    settings are not candidates); the pre-wrap hook applies its first candidate and
    :meth:`DominoModelHook.tune` moves through the rest.

    Raises:
        UnsupportedMegatronVersion: the imported Megatron-Core is not a tested release.
        DominoConfigError: a ``--domino*`` value is invalid or the shapes cannot be split.
        DominoUnsupportedError: the flags ask for something Domino cannot run with; the
            message lists every reason with its fix. First, with ``--transformer-impl
            transformer_engine``, an installed Transformer Engine older than
            :data:`~megatron_domino.base.version.TE_MIN_VERSION`.
        NoCandidateError: ``auto``, and no setting can run (each reason listed).
    """
    if not args.domino:
        return None
    check_megatron_core_version()
    if args.transformer_impl == "transformer_engine":
        check_transformer_engine_version()
    shapes = dict(
        micro_batch_size=args.micro_batch_size,
        hidden_size=args.hidden_size,
        seq_length=args.seq_length,
        sequence_parallel_size=args.tensor_model_parallel_size if args.sequence_parallel else 1,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    transformer_config = core_transformer_config_from_args(args)
    # Not in the TransformerConfig: Megatron-LM wraps the built model after the pre-wrap hook.
    fsdp = fsdp_problems(megatron_fsdp=args.use_megatron_fsdp, torch_fsdp2=args.use_torch_fsdp2)

    te_layers = args.transformer_impl == "transformer_engine"
    # Without --spec, Megatron-LM builds TE's fused norm + column linear.
    fused_te_norms = te_layers and args.sequence_parallel and getattr(args, "spec", None) is None

    def refusals(config: DominoConfig) -> list[str]:
        problems = config_problems(
            transformer_config, config, tp_size=args.tensor_model_parallel_size, te_layers=te_layers
        )
        return problems + ([TE_FUSED_NORM_UNDER_SP] if fused_te_norms else [])

    if args.domino_chunks == AUTO:
        raise_problems(fsdp)
        candidates, _ = candidate_configs(
            lambda config: config.shape_problems(**shapes) + refusals(config),
            **DominoConfig.auto_fields(args),
        )
        return AutoTuner.from_args(args, candidates)
    config = DominoConfig.from_args(args)
    config.check_shapes(**shapes)
    raise_problems(refusals(config) + fsdp)
    return config


class DominoModelHook:
    """A ``GPTModelConfig`` pre-wrap hook: Domino on every built model chunk.

    Megatron-LM calls it once with the list of this rank's model chunks, right after building
    them and before wrapping them. The handles are kept (:attr:`handles`, one per chunk) so
    a caller can reach each chunk's Domino runtime (e.g. the overlap report's recorder).
    Given an :class:`~megatron_domino.autotune.AutoTuner`, it applies the tuner's current
    setting and :meth:`tune` switches every chunk to the next one between iterations.
    """

    def __init__(self, config: DominoConfig | AutoTuner) -> None:
        self.tuner = config if isinstance(config, AutoTuner) else None
        self.config = self.tuner.current if self.tuner else config
        self.handles: list[DominoHandle] = []
        self._chunks: list[torch.nn.Module] = []
        #: The loop hooks :func:`attach` installed (closing it removes them), else ``None``.
        self.loop_patches: contextlib.ExitStack | None = None

    def __call__(self, model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        if self.handles:
            raise RuntimeError("The Domino model hook already ran; build the model once.")
        self._chunks = list(model_chunks)
        self.handles = [apply_domino(chunk, self.config) for chunk in model_chunks]
        if torch.distributed.get_rank() == 0:
            print(self.banner(), flush=True)
        return model_chunks

    def banner(self) -> str:
        """What runs, said once by rank 0 of either entry point, e.g. ``> Domino:
        DominoConfig(chunks=2, ...) on 1 model chunk(s), TP 2, sequence parallel off``."""
        from megatron.core import parallel_state

        what = self.tuner if self.tuner else self.config
        sequence_parallel = any(
            getattr(chunk.config, "sequence_parallel", False) for chunk in self._chunks
        )
        config = self.config
        backward = (
            f"backward order {config.backward_order}"
            if config.backward_overlap or sequence_parallel
            else "backward Megatron-Core's own (no backward collective in flight to order)"
        )
        return (
            f"> Domino: {what!r} on {len(self._chunks)} model chunk(s){self._layers()}, TP "
            f"{parallel_state.get_tensor_model_parallel_world_size()}, sequence parallel "
            f"{'on' if sequence_parallel else 'off'}, {backward}"
        )

    def _layers(self) -> str:
        """For a HybridModel: ``" of HybridModel pattern '*-*-' (Domino runs every layer: 2
        attention, 2 MLP)"``; empty for a GPTModel."""
        patterns = [getattr(chunk, "hybrid_layer_pattern", None) for chunk in self._chunks]
        patterns = [p for p in patterns if p is not None]
        if not patterns:
            return ""
        kinds = [k for handle in self.handles for k in handle.runtime.layer_sublayers]
        attention = sum("attention" in k for k in kinds)
        mlp = sum("mlp" in k for k in kinds)
        return (
            f" of HybridModel pattern {patterns[0]!r} (Domino runs every layer of this rank: "
            f"{attention} attention, {mlp} MLP)"
        )

    @property
    def tuning(self) -> bool:
        """Whether ``--domino-chunks auto`` is still trying candidates."""
        return self.tuner is not None and not self.tuner.done

    def tune(self, seconds: float) -> None:
        """Give the tuner the last iteration's time (the same on every rank: the caller takes
        the slowest rank's); switch every model chunk if the next iteration runs another
        setting. Domino binds ``forward`` on module instances, which the Float16/DDP wrappers
        built after this hook keep, so reverting and re-applying between iterations changes
        the schedule only; parameters, gradients and optimizer state are untouched."""
        next_config = self.tuner.record(seconds)
        if next_config is not None:
            self.switch(next_config)

    def switch(self, config: DominoConfig | None) -> None:
        """Between optimizer steps: every model chunk to ``config``, or to stock for ``None``
        (``--domino-ab``; :attr:`config` stays the Domino setting to switch back to)."""
        for handle in self.handles:
            handle.revert()
        self.handles = []
        if config is not None:
            self.handles = [apply_domino(chunk, config) for chunk in self._chunks]
            self.config = config


def add_hook(model_config, config: DominoConfig | AutoTuner) -> DominoModelHook:
    """Append Domino's hook for ``config`` (from :func:`check_args`) to
    ``model_config.pre_wrap_hooks`` (Megatron-LM's ``GPTModelConfig``); return it."""
    hook = DominoModelHook(config)
    model_config.pre_wrap_hooks.append(hook)
    return hook


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The patch's ``extra_args_provider`` part: every flag of this project
    (:func:`megatron_domino.training.flags.add_flags`, which ``pretrain_gpt_domino.py`` uses
    too)."""
    from megatron_domino.training.flags import add_flags

    return add_flags(parser)


def help_lists_domino() -> None:
    """For ``--help`` through the patch: Megatron-LM's ``pretrain_gpt.py`` parses its command
    line once before its ``extra_args_provider`` is used (in-process restart's
    ``parse_args(ignore_unknown_args=True)``), and ``--help`` prints and exits there. So for
    the rest of the process ``megatron.training.arguments.add_megatron_arguments`` (looked up
    by ``parse_args`` at call time) also runs :func:`add_args`: the help lists Domino's and
    the loop's flags, and prints (:func:`~megatron_domino.training.parser_help.escape_help`)."""
    from megatron.training import arguments

    add_megatron_arguments = arguments.add_megatron_arguments
    patch = Patch(
        arguments,
        "add_megatron_arguments",
        lambda parser: add_args(add_megatron_arguments(parser)),
        "--help lists Domino's flags and survives megatron-core 0.19's bare '%'",
    )
    stack = contextlib.ExitStack()
    stack.enter_context(patch.applied())
    atexit.register(stack.close)


def _refuse(err: Exception) -> NoReturn:
    """Every rank fails alike: rank 0 says why in one message, all exit with status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


def _patch_config(args: argparse.Namespace) -> DominoConfig:
    """:func:`check_args` plus the loop flags' checks, for a loop that is Megatron-LM's own."""
    from megatron_domino.training.loop_hooks import loop_hook_problems

    problems = loop_hook_problems(args)
    if args.domino_chunks == AUTO:
        problems.append(
            "--domino-chunks auto times candidate settings on the first iterations, which "
            "pretrain_gpt_domino.py does and this patch does not: run pretrain_gpt_domino.py, "
            "or give --domino-chunks a number here."
        )
    if problems:
        raise DominoConfigError("\n".join(problems))
    return check_args(args)


def attach(model_config, args: argparse.Namespace) -> DominoModelHook | None:
    """What the patch of Megatron-LM's ``pretrain_gpt.py`` calls once its arguments are
    validated, before ``pretrain()``: ``None`` without ``--domino``; with it, every check of
    :func:`check_args` and of the loop flags, Domino's hook on ``model_config``
    (:func:`add_hook`, which prints the banner on rank 0 when the model is built), and the
    loop hooks of ``--log-json``/``--domino-report``/``--domino-ab`` installed on
    ``megatron.training.training`` for the rest of the process (the script ends after
    ``pretrain()``; :attr:`DominoModelHook.loop_patches` closes them earlier).

    A refused command line ends the process with status 2 and one message on rank 0 (no
    traceback on every rank), as ``pretrain_gpt_domino.py`` does.

    Args:
        model_config: Megatron-LM's ``GPTModelConfig`` (``gpt_config_from_args(args)``).
        args: Megatron's validated arguments.
    """
    if not args.domino:
        return None
    from megatron_domino.training.loop_hooks import LoopHooks

    try:
        config = _patch_config(args)
    except (DominoConfigError, DominoUnsupportedError, UnsupportedMegatronVersion) as err:
        _refuse(err)
    hook = add_hook(model_config, config)
    hook.loop_patches = contextlib.ExitStack()
    for patch in LoopHooks.from_args(args, hook).patches():
        hook.loop_patches.enter_context(patch.applied())
    atexit.register(hook.loop_patches.close)
    return hook
