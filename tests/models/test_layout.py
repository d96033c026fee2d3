"""Layout validation: every impossible layout fails with the value and the valid choices."""

from __future__ import annotations

import pytest

from models.config import get_flavor
from models.layout import LayoutError, ParallelLayout, validate_layout

TINY = get_flavor("tiny-llama")  # 8 heads, 2 query groups, 4 layers, FFN 352


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (ParallelLayout(tensor_parallel=3), 6, "TP=3 does not divide num_attention_heads=8; valid TP: 1, 2, 4, 8"),
        (ParallelLayout(tensor_parallel=4), 4, "TP=4 does not divide num_query_groups=2; valid TP: 1, 2"),
        (ParallelLayout(tensor_parallel=2), 3, "world size 3 is not divisible by TP(2) x PP(1) x CP(1) = 2"),
        (ParallelLayout(pipeline_parallel=3), 3, "num_layers=4 cannot be split evenly over PP(3) x VPP(1)"),
        (ParallelLayout(pipeline_parallel=2, virtual_pipeline=4), 2, "PP x VPP must be one of [1, 2, 4]"),
        (ParallelLayout(virtual_pipeline=2), 1, "virtual_pipeline=2 needs pipeline_parallel > 1"),
        (ParallelLayout(sequence_parallel=True), 1, "sequence_parallel=true needs tensor_parallel > 1"),
        (ParallelLayout(expert_parallel=2), 2, "expert_parallel=2 needs a MoE model"),
    ],
)
def test_invalid_layouts_name_value_and_choices(layout, world, message):
    with pytest.raises(LayoutError) as err:
        validate_layout(TINY, layout, world)
    assert message in str(err.value)


def test_moe_experts_must_divide_by_ep():
    moe = get_flavor("tiny-moe")  # 4 experts
    with pytest.raises(LayoutError, match="EP=3 does not divide num_experts=4; valid EP: 1, 2, 4"):
        validate_layout(moe, ParallelLayout(expert_parallel=3), 3)
    validate_layout(moe, ParallelLayout(expert_parallel=2), 2)


def test_valid_layouts_pass_and_describe():
    layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2)
    validate_layout(TINY, layout, 8)
    assert layout.describe(8) == "TP2xPP2xVPP2xDP2"


def test_layout_is_strict():
    with pytest.raises(ValueError):
        ParallelLayout(tensor_paralel=2)
    with pytest.raises(ValueError):
        ParallelLayout(tensor_parallel="2")
