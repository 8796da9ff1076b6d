"""The old ``harness`` folder, dissolved in the house layout of 2026-12-03: only the aliases of
its modules that command lines name (:mod:`megatron_domino.base.moved`)."""
