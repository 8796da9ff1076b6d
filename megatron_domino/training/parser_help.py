"""``--help`` on Megatron-LM's parser: escape the bare ``%`` in help strings before printing.

argparse formats every help string with ``%`` (``%(default)s`` and friends) when it prints
``--help``. Megatron-Core 0.19.2 generates the help of ``--moe-paged-stash-buffer-size-factor-cuda``
from a config docstring that contains a literal percent sign, so ``--help`` raises
``ValueError: unsupported format character`` for every script built on Megatron-LM's parser.
:func:`escape_help` doubles each ``%`` that does not start a format (``%(name)s``) or an
escaped ``%%``, on the parser that already holds Megatron's flags (an ``extra_args_provider``
receives it), so Megatron itself is not edited and formats that are meant stay intact.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["escape_help"]

#: A ``%(name)<conversion>`` format, a ``%%``, or (group 1 empty) a bare ``%``.
_PERCENT = re.compile(r"%(\([^)]*\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%)?")


def _escaped(text: str) -> str:
    return _PERCENT.sub(lambda match: match.group(0) if match.group(1) else "%%", text)


def escape_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Double every bare ``%`` in the help of ``parser``'s arguments; return ``parser``."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _escaped(action.help)
    return parser
