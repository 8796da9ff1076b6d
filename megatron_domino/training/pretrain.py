"""The body of ``pretrain_gpt_domino.py``: Megatron-LM's ``pretrain()`` with Domino applied.

The order is Megatron-LM's, with Domino's pieces where Megatron-LM leaves room for them:

1. the Megatron-Core that is imported is checked against the tested releases;
2. Megatron's own ``parse_and_validate_args`` parses every Megatron-LM flag, with
   ``extra_args_provider`` adding ``--domino*`` and this script's
   ``--log-json``/``--domino-report``/``--domino-ab`` (:func:`.flags.add_flags`, the patch's
   too); right after Megatron's
   ``validate_args``, and before it builds the tokenizer or opens any log, the checks run:
   with ``--domino`` Domino's (:func:`~megatron_domino.training.megatron_lm.check_args`, which builds
   the one :class:`~megatron_domino.base.config.DominoConfig` of the run), the flags this GPT path
   does not implement, and the files the run reads (:func:`.inputs.check_run_inputs`), so a
   bad command line or a bad input file fails before anything is written;
3. the model config is Megatron-LM's (``gpt_config_from_args``, or with ``--hybrid-layer-pattern``
   ``hybrid_config_from_args``: Megatron-Core's ``HybridModel``, as ``pretrain_hybrid.py`` builds
   it), with Domino's pre-wrap hook
   (every model chunk, before ``Float16Module``/DDP;
   :func:`~megatron_domino.training.megatron_lm.add_hook`) and a check that the model-parallel layout
   and the TP RNG streams are the ones asked for;
4. ``megatron.training.pretrain`` runs the rest, inside :func:`.loop_runtime.megatron_loop_runtime`
   and with :class:`.loop_hooks.LoopHooks` around its ``train_step`` and ``evaluate``; a
   checkpoint that does not fit fails with one line (:func:`.inputs.clear_load_errors`).

Without ``--domino`` the run imports, of Domino, only its flags and errors
(:mod:`megatron_domino.base.config` and :mod:`megatron_domino.training.parser_help`, no torch) and the
version check: nothing that patches,
schedules or refuses (``megatron_domino.training.megatron_lm`` and everything below it are imported
only with ``--domino``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.training import arguments as megatron_arguments
from megatron.training import pretrain
from megatron.training.argument_utils import (
    gpt_config_from_args,
    hybrid_config_from_args,
    pretrain_cfg_container_from_args,
)

from megatron_domino.base.config import (
    DominoConfig,
    DominoConfigError,
    DominoUnsupportedError,
)
from megatron_domino.base.version import UnsupportedMegatronVersion, check_megatron_core_version
from megatron_domino.data.files import DataFileError
from megatron_domino.runtime.distributed import export_torchrun_environment
from megatron_domino.runtime.patch import Patch
from megatron_domino.training.flags import add_flags
from megatron_domino.training.gpt_steps import (
    forward_step,
    train_valid_test_datasets_provider,
    unsupported_flags,
)
from megatron_domino.training.inputs import CheckpointError, check_run_inputs, clear_load_errors
from megatron_domino.training.loop_hooks import LoopHooks, loop_hook_problems
from megatron_domino.training.loop_runtime import megatron_loop_runtime

__all__ = ["StartupError", "main"]

#: Megatron-LM's ``pretrain_gpt.py`` defaults the tokenizer to GPT-2's BPE; so does this script.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


class StartupError(ValueError):
    """A flag combination this script cannot run; the message names it and the fix."""


def _script_checks(args: argparse.Namespace) -> DominoConfig | None:
    """Checks of this script's own flags and of what its GPT path implements; the run's
    Domino config (``None`` without ``--domino``).

    Domino's checks come before the GPT path's, so a feature Domino refuses (context
    parallelism, MoE) is refused with Domino's reason rather than pointed at the patched
    ``pretrain_gpt.py``, which would refuse it the same way."""
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise StartupError(
            "There is no CUDA device here and NCCL needs one: add --distributed-backend gloo "
            "to run on the CPU (with the recipes in examples/: CPU=1, which also replaces "
            "Megatron-LM's other GPU-only defaults, docs/cpu.md)."
        )
    problems = loop_hook_problems(args)
    if problems:
        raise StartupError("\n".join(problems))
    domino_config = None
    if args.domino:
        from megatron_domino.training.megatron_lm import check_args

        domino_config = check_args(args)
        _check_tuning_fits(args, domino_config)
    unsupported = unsupported_flags(args)
    if unsupported:
        where = (
            "Domino's own checks accept this command line, so Megatron-LM's pretrain_gpt.py "
            "with the patch in megatron-domino's patches/ runs it with --domino"
            if args.domino
            else "Megatron-LM's own pretrain_gpt.py runs it (its patch in megatron-domino's "
            "patches/ adds --domino)"
        )
        raise StartupError(
            f"pretrain_gpt_domino.py trains dense GPT models and does not implement "
            f"{', '.join(unsupported)}; {where}."
        )
    check_run_inputs(args)
    return domino_config


def _check_tuning_fits(args: argparse.Namespace, domino_config) -> None:
    """With ``--domino-chunks auto``, the run must be long enough to try every candidate."""
    from megatron_domino.autotune import AutoTuner

    if not isinstance(domino_config, AutoTuner) or args.train_iters is None:
        return
    if args.train_iters < domino_config.iterations:
        raise StartupError(
            f"--domino-chunks auto needs {domino_config.iterations} iterations to time its candidates "
            f"({domino_config!r}), but --train-iters is {args.train_iters}: train longer, "
            "lower --domino-auto-iters, or give --domino-chunks a number."
        )


def _validate_then_check(validate_args, checked: list):
    """Megatron's ``validate_args``, then :func:`_script_checks`, whose result goes into
    ``checked``."""

    @functools.wraps(validate_args)
    def wrapper(args, defaults=None):
        validated = validate_args(args, defaults or {})
        checked.append(_script_checks(args))
        return validated

    return wrapper


def _check_layout(args: argparse.Namespace, model_chunks: list) -> list:
    """Pre-wrap hook: the model-parallel layout and TP RNG streams Megatron set up are the
    ones asked for. On the CPU two of the loop runtime's patches would otherwise fail
    silently (no TP groups, no TP RNG seeding) and train a different model."""
    found = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    asked = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if found != asked:
        raise RuntimeError(
            f"Megatron set up TP x PP = {found[0]} x {found[1]}, but {asked[0]} x {asked[1]} "
            "was asked for: the runtime patches did not take effect on this Megatron version."
        )
    if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
        raise RuntimeError(
            "Megatron's tensor-parallel RNG tracker was not seeded (no 'model-parallel-rng' "
            "stream): dropout would not match across runs."
        )
    return model_chunks


def _announce_off(model_chunks: list) -> list:
    """Pre-wrap hook without ``--domino``: say so on rank 0 (with it, Domino's hook prints
    its banner, :meth:`~megatron_domino.training.megatron_lm.DominoModelHook.banner`)."""
    if torch.distributed.get_rank() == 0:
        print("> Domino: off", flush=True)
    return model_chunks


def _parse_args() -> tuple[argparse.Namespace, DominoConfig | None]:
    """Megatron's parsed and validated arguments, and the run's Domino config."""
    checked: list = []
    validate = Patch(
        megatron_arguments,
        "validate_args",
        _validate_then_check(megatron_arguments.validate_args, checked),
        "Domino's checks run after Megatron's validation, before anything is written.",
    )
    with validate.applied():
        args = megatron_arguments.parse_and_validate_args(
            extra_args_provider=add_flags, args_defaults=ARGS_DEFAULTS
        )
    return args, checked[-1]


def model_config_from_args(args: argparse.Namespace):
    """Megatron-LM's model config: a ``HybridModelConfig`` with ``--hybrid-layer-pattern`` (as
    Megatron-LM's ``pretrain_hybrid.py`` builds it), else a ``GPTModelConfig``."""
    if args.hybrid_layer_pattern is not None:
        return hybrid_config_from_args(args)
    return gpt_config_from_args(args)


def _run() -> None:
    args, domino_config = _parse_args()
    model_config = model_config_from_args(args)
    model_config.pre_wrap_hooks.append(functools.partial(_check_layout, args))
    hook = None
    if domino_config is not None:
        from megatron_domino.training.megatron_lm import add_hook

        hook = add_hook(model_config, domino_config)
    else:
        model_config.pre_wrap_hooks.append(_announce_off)
    hooks = LoopHooks.from_args(args, hook)
    with contextlib.ExitStack() as stack:
        for patch in (*hooks.patches(), clear_load_errors()):
            stack.enter_context(patch.applied())
        pretrain(
            pretrain_cfg_container_from_args(args, model_config),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )


def main() -> None:
    """Run the job ``sys.argv`` describes; every rank of the launch calls this."""
    try:
        check_megatron_core_version()
        export_torchrun_environment()
        with megatron_loop_runtime():
            _run()
    except (
        StartupError,
        DominoConfigError,
        DominoUnsupportedError,
        UnsupportedMegatronVersion,
        DataFileError,
        CheckpointError,
    ) as err:
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike; one says why
            print(f"pretrain_gpt_domino.py: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
