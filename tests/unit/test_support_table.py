"""The README's support table is the refusal records (megatron_domino/refusal_table.py), and
every record that names a ``TransformerConfig`` attribute refuses it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_domino.refusal_table import REFUSALS, config_refusals, support_table

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- support table: begin -->", "<!-- support table: end -->"

#: A value each attribute record refuses.
_REFUSED_VALUES = {
    "cuda_graph_impl": ("local", "full_iteration"),
    "num_moe_experts": (8,),
    "fp4": ("nvfp4",),
    "symmetric_ar_type": ("two_shot",),
    "context_parallel_size": (2,),
    "experimental_attention_variant": ("gated_delta_net",),
    "gtp_weight_remat_size": (2,),
    "quant_recipe": ("kitchen",),
    "mlp_chunks_for_training": (2,),
}


def test_the_readme_table_is_the_records():
    text = README.read_text()
    assert BEGIN in text and END in text, f"README.md lost its {BEGIN} / {END} markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip() + "\n"
    assert table == support_table(), (
        "README.md's support table differs from the refusal records; paste this between the "
        f"markers:\n{support_table()}"
    )


def test_every_record_says_why_and_what_instead():
    for refusal in REFUSALS:
        assert refusal.kind in ("by design", "not yet"), refusal
        assert refusal.refused and refusal.why and refusal.instead, refusal
        assert (refusal.attribute is None) == (refusal.applies is None), refusal


@pytest.mark.parametrize(
    "attribute", sorted({r.attribute for r in REFUSALS if r.attribute is not None})
)
def test_each_attribute_record_refuses_its_attribute_and_only_it(attribute):
    records = [r for r in REFUSALS if r.attribute == attribute]
    assert config_refusals(SimpleNamespace()) == []
    for value in _REFUSED_VALUES.get(attribute, (True,)):
        found = config_refusals(SimpleNamespace(**{attribute: value}))
        expected = [r.message for r in records if r.applies(value)]
        assert found == expected and len(found) == 1, (attribute, value, found)
    assert config_refusals(SimpleNamespace(**{attribute: None})) == []
