"""Moved to :mod:`megatron_domino.specs.te_spec`: an alias for one release (:mod:`megatron_domino.base.moved`)."""

from megatron_domino.base.moved import redirect

redirect(__name__)
