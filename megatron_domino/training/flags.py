"""Every flag this project adds to Megatron-LM's parser, in one place for both entry points.

``pretrain_gpt_domino.py`` (:mod:`.pretrain`) and the patch of Megatron-LM's
``pretrain_gpt.py`` (:func:`megatron_domino.training.megatron_lm.add_args`) pass :func:`add_flags` as
(part of) Megatron's ``extra_args_provider``. It imports only the flags' own modules, not the
library behind them: a run without ``--domino`` imports none of it.
"""

from __future__ import annotations

import argparse

from megatron_domino.autotune import add_auto_tune_args
from megatron_domino.base.config import add_domino_args
from megatron_domino.training.loop_hooks import add_loop_hook_args
from megatron_domino.training.parser_help import escape_help

__all__ = ["add_flags"]


def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--domino*`` (:func:`~megatron_domino.base.config.add_domino_args`,
    :func:`~megatron_domino.autotune.add_auto_tune_args`), the loop's
    ``--log-json``/``--domino-report``/``--domino-ab``
    (:func:`~megatron_domino.training.loop_hooks.add_loop_hook_args`), with help strings that
    ``--help`` can print (:func:`~megatron_domino.training.parser_help.escape_help`); returns ``parser``."""
    return escape_help(add_loop_hook_args(add_auto_tune_args(add_domino_args(parser))))
