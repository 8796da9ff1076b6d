"""Named Domino settings: what ``p2``, ``p2-k2`` or ``sp-s2`` means, written down once.

The tests, the benchmark and the GPU check name the settings they run; a name is read by
:func:`setting`, from this grammar::

    [sp-](p|s)P[-kK][-intra-layer][-no-backward-overlap][-autograd-order|-serial-order]

========================  ===================================================================
part                      meaning
========================  ===================================================================
``pP``                    the batch split into ``P`` chunks (``--domino-chunks P``)
``sP``                    the sequence split into ``P`` chunks (``--domino-split sequence``)
``-kK``                   ``K`` column pieces (``--domino-column-chunks K``)
``-intra-layer``          ``--no-domino-inter-layer``
``-no-backward-overlap``  ``--no-domino-backward-overlap``
``-autograd-order``       ``--domino-backward-order autograd`` (the ablation)
``-serial-order``         ``--domino-backward-order serial`` (the negative control)
``sp-``                   the model runs with ``--sequence-parallel`` (not a Domino field)
========================  ===================================================================

So ``p1-k2`` is ``DominoConfig(chunks=1, column_chunks=2)`` and ``sp-s2`` the sequence split
into two chunks on a sequence-parallel model. Only :mod:`megatron_domino.base.config` is imported.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from megatron_domino.base.config import DominoConfig

__all__ = ["Setting", "domino_configs", "setting", "setting_name"]

_GRAMMAR = re.compile(
    r"(?P<sp>sp-)?(?P<split>[ps])(?P<chunks>\d+)(?:-k(?P<pieces>\d+))?"
    r"(?P<intra>-intra-layer)?(?P<no_backward>-no-backward-overlap)?"
    r"(?:-(?P<order>autograd|serial)-order)?"
)


@dataclass(frozen=True)
class Setting:
    """A named setting: the Domino config and whether the model is sequence-parallel."""

    name: str
    config: DominoConfig
    sequence_parallel: bool

    @property
    def fields(self) -> dict:
        """The config's fields, e.g. for a JSON record (``DominoConfig(**fields)``)."""
        return dataclasses.asdict(self.config)


def setting(name: str) -> Setting:
    """The setting ``name`` stands for (module docstring).

    Raises:
        ValueError: ``name`` does not follow the grammar.
        DominoConfigError: it does, but names an invalid config (``p1``).
    """
    match = _GRAMMAR.fullmatch(name)
    if match is None:
        raise ValueError(
            f"{name!r} is not a setting name: [sp-](p|s)P[-kK][-intra-layer]"
            "[-no-backward-overlap][-autograd-order|-serial-order], e.g. p2, p2-k2, s4, sp-p2."
        )
    config = DominoConfig(
        chunks=int(match["chunks"]),
        column_chunks=int(match["pieces"] or 1),
        split_along="sequence" if match["split"] == "s" else "batch",
        inter_layer=not match["intra"],
        backward_overlap=not match["no_backward"],
        backward_order=match["order"] or "legs",
    )
    return Setting(name, config, sequence_parallel=bool(match["sp"]))


def setting_name(config: DominoConfig) -> str:
    """The short name of ``config``'s split in this grammar (``p2``, ``p2-k2``, ``s4``): what
    ``--domino-chunks auto`` and ``--domino-ab`` print."""
    name = f"{'s' if config.split_along == 'sequence' else 'p'}{config.chunks}"
    return name + (f"-k{config.column_chunks}" if config.column_chunks > 1 else "")


def domino_configs(*names: str) -> dict[str, DominoConfig]:
    """``{name: DominoConfig}`` for ``names``, in order."""
    return {name: setting(name).config for name in names}
