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


@pytest.mark.parametrize("layout, world, message", [
    (ParallelLayout(expert_parallel=2, expert_tensor_parallel=2), 2,
     "world size 2 is not divisible by expert TP(2) x EP(2) x PP(1) = 4; with expert TP 2 choose EP from [1]"),
    (ParallelLayout(tensor_parallel=2, expert_parallel=2), 4, "needs sequence_parallel=true"),
    (ParallelLayout(expert_tensor_parallel=3), 3, "expert TP=3 does not divide moe ffn hidden size=256"),
])
def test_invalid_moe_layouts(layout, world, message):
    with pytest.raises(LayoutError) as err:
        validate_layout(get_flavor("tiny-moe"), layout, world)
    assert message in str(err.value)


def test_moe_layouts_where_ep_reuses_cp_and_tp_ranks():
    # EP x TP x CP x PP = 8 > 4 ranks is fine: Megatron-Core folds EP into the TP x CP x DP ranks.
    validate_layout(get_flavor("tiny-moe"), ParallelLayout(
        tensor_parallel=2, context_parallel=2, expert_parallel=2, sequence_parallel=True), 4)
    validate_layout(get_flavor("tiny-moe"), ParallelLayout(context_parallel=2, expert_parallel=2), 2)


def test_ulysses_cp_needs_heads_and_groups_divisible():
    with pytest.raises(LayoutError, match=r"CP \(cp_comm_type=a2a\)=4 does not divide query groups per TP rank=2"):
        validate_layout(TINY, ParallelLayout(context_parallel=4, cp_comm_type="a2a"), 4)
    validate_layout(TINY, ParallelLayout(context_parallel=2, cp_comm_type="a2a"), 2)


def test_moe_options_need_a_moe_model():
    with pytest.raises(ValueError, match="moe_capacity_factor need"):
        TINY.model_validate({**TINY.model_dump(), "moe_capacity_factor": 1.5})
    moe = get_flavor("tiny-moe")
    with pytest.raises(ValueError, match="moe_pad_to_capacity=true needs moe_capacity_factor"):
        moe.model_validate({**moe.model_dump(), "moe_pad_to_capacity": True})


def test_valid_layouts_pass_and_describe():
    layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2)
    validate_layout(TINY, layout, 8)
    assert layout.describe(8) == "TP2xPP2xVPP2xDP2"


def test_layout_is_strict():
    with pytest.raises(ValueError):
        ParallelLayout(tensor_paralel=2)
    with pytest.raises(ValueError):
        ParallelLayout(tensor_parallel="2")
