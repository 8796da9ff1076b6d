"""A reversible attribute patch: the one way the CPU runtime and the training hooks replace
something of Megatron-Core's or torch's for a while.

Each patch names what it replaces and why, checks that the owner still defines the attribute
(an upgrade that renames it fails loudly instead of patching nothing) and, on exit, puts back
exactly the object it found, also when the block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch", "PatchError"]


class PatchError(RuntimeError):
    """The attribute to patch is not defined by its owner (renamed or moved upstream)."""


@dataclass(frozen=True)
class Patch:
    """One attribute of a module or class, replaced while :meth:`applied` is active.

    Attributes:
        owner: the module or class whose attribute is replaced.
        name: the attribute's name.
        replacement: what the attribute is while the patch is applied.
        why: one line on why it is replaced (which Megatron-Core code needs it).
    """

    owner: Any
    name: str
    replacement: Any
    why: str

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Install the replacement; on exit put back exactly the object found on entry.

        Only attributes the owner defines itself are patched: restoring an inherited method
        would leave a copy in the subclass instead of removing it.
        """
        if self.name not in vars(self.owner):
            raise PatchError(f"{self.owner!r} does not define {self.name!r} itself.")
        original = vars(self.owner)[self.name]
        setattr(self.owner, self.name, self.replacement)
        try:
            yield
        finally:
            setattr(self.owner, self.name, original)
