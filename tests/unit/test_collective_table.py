"""The table of collectives (:data:`megatron_domino.communication.collectives.COLLECTIVE_SITES`) names what
exists: every ``module:function`` of its launch and wait paths is a function of the library,
every label constant has its rows, and no two rows share a label and direction. That each
traced step records exactly these rows, launched and waited along these paths, is
``tests/ranks/test_collective_sites.py``."""

from __future__ import annotations

import importlib

from megatron_domino.communication.collectives import (
    COLLECTIVE_SITES,
    EMBEDDING_AR,
    FP8_AMAX_AR,
    HEAD_DGRAD_AR,
    SUBLAYER_LABELS,
    collective_site,
)

KINDS = {"all_reduce", "all_gather", "reduce_scatter"}


def _resolve(where: str):
    module, qualname = where.split(":")
    found = importlib.import_module(f"megatron_domino.{module}")
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def test_every_path_names_a_function_of_the_library():
    for site in COLLECTIVE_SITES:
        for where in (*site.launched_in, *site.waited_in):
            assert callable(_resolve(where)), (site.label, where)


def test_one_row_per_label_and_direction_of_a_known_kind():
    keys = [(site.label, site.direction) for site in COLLECTIVE_SITES]
    assert len(keys) == len(set(keys)) == 18
    for site in COLLECTIVE_SITES:
        assert site.kind in KINDS and site.direction in ("fwd", "bwd"), site
        assert site.launched_in and site.waited_in and site.what, site
        assert collective_site(site.label, site.direction) is site


def test_every_label_constant_has_its_rows():
    constants = {EMBEDDING_AR, HEAD_DGRAD_AR, FP8_AMAX_AR}
    for labels in SUBLAYER_LABELS.values():
        constants |= {
            labels.output_ar,
            labels.output_rs,
            labels.input_dgrad_ar,
            labels.input_ag,
            labels.input_regather,
        }
    assert {site.label for site in COLLECTIVE_SITES} == constants
