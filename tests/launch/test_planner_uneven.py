"""The planner's search over uneven first / last pipeline stages (launch.planner.search.uneven_splits):
the splits it tries are ones the training's own validation accepts, they make a layer count that
divides by no PP plannable (DeepSeek-V3's 61 layers), and a request no split can serve is refused
with the real reason. Static memory of an uneven layout against Megatron-Core's allocations is in
test_memory_measured.py (tiny-llama PP2, first stage 1 layer)."""

from __future__ import annotations

import json

import pytest

from launch import plan as plan_mod
from launch.planner.devices import get_device
from launch.planner.search import PlanError, SearchSpace, enumerate_candidates, plan, uneven_splits
from models.layout import ParallelLayout, pipeline_split, validate_layout
from pretrain.config import apply_overrides, validate_for_world
from pretrain.recipes import get_recipe

H100 = get_device("h100-80gb")


def _stages(layers: int, pp: int, first, last, vpp: int = 1) -> list[int]:
    layout = ParallelLayout(pipeline_parallel=pp, virtual_pipeline=vpp if vpp > 1 else None,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    return [sum(chunks) for chunks in pipeline_split(layers, layout)]


def test_deepseek_61_layers_at_pp16_include_the_published_splits():
    """61 = f + 14 x 4 + l: every split with neither edge heavier than the middle's 4 layers,
    DeepSeek's paper (3 | 14 x 4 | 2) and Megatron-Bridge's (4 | 14 x 4 | 1) among them."""
    splits = uneven_splits(61, 16)
    counts = [_stages(61, 16, first, last) for first, last, _ in splits]
    want = [[4] + [4] * 14 + [1], [3] + [4] * 14 + [2], [2] + [4] * 14 + [3], [1] + [4] * 14 + [4]]
    assert sorted(counts, reverse=True) == want
    assert all(vpps == [1] for _, _, vpps in splits)  # 61 is prime: no VPP divides every stage
    assert uneven_splits(61, 32) == []  # 30 x 2 = 60 middle layers leave 1 for two edges


@pytest.mark.parametrize("layers, pp", [(80, 2), (80, 4), (80, 8), (32, 4), (14, 4), (126, 8), (5, 2)])
def test_every_split_is_valid_and_no_edge_is_heavier(layers, pp):
    """Each split the search tries is one models.layout accepts at every VPP offered; the middle
    stages split evenly and each edge holds no more than they do (at PP2 the lighter edge is
    at most 2 layers below the other, else each edge at most 2 below the middle, unless L
    divides by no PP)."""
    for first, last, vpps in uneven_splits(layers, pp):
        counts = _stages(layers, pp, first, last)
        middle = max(counts)
        assert sum(counts) == layers and len(set(counts[1:-1])) <= 1 and counts != [middle] * pp
        assert layers % pp or middle - min(counts) <= 2, counts
        for vpp in vpps:
            assert _stages(layers, pp, first, last, vpp) == counts


def test_uneven_splits_the_search_adds():
    """80 layers (llama3-70b): PP2 39 | 41 or 41 | 39, PP4 19 | 21 x 2 | 19, none at PP8 (an edge
    would have to be 4 layers lighter); 14 layers at PP4: 2 | 4 x 3 also at VPP2."""
    assert sorted(_stages(80, 2, f, l) for f, l, _ in uneven_splits(80, 2)) == [[39, 41], [41, 39]]
    assert [_stages(80, 4, f, l) for f, l, _ in uneven_splits(80, 4)] == [[19, 21, 21, 19]]
    assert uneven_splits(80, 8) == []
    assert (2, None, [1, 2]) in uneven_splits(14, 4)


def test_search_yields_valid_uneven_layouts_when_layers_do_not_divide():
    """tiny-llama with 5 layers on 4 ranks: no even split over PP2 or PP4, so every PP > 1 layout
    the search offers is uneven, and each passes the training's own validation."""
    config = apply_overrides(get_recipe("tiny-llama"), overrides=["model.num_layers=5"])
    space = SearchSpace(micro_batch=(1,), recompute=("none",), zero=(1,), offload=(False,))
    candidates, _ = enumerate_candidates(config, 4, H100, space)
    piped = [c for c in candidates if c.pp > 1]
    assert piped and {c.pp for c in piped} == {2}
    assert {(c.layout.num_layers_in_first_pipeline_stage, c.layout.num_layers_in_last_pipeline_stage)
            for c in piped} == {(2, None), (None, 2)}
    for c in piped:
        validate_layout(config.model, c.layout, 4)
        validate_for_world(c.apply_to(config), 4)
    off, _ = enumerate_candidates(config, 4, H100, SearchSpace(micro_batch=(1,), recompute=("none",), zero=(1,),
                                                               offload=(False,), uneven_stages=False))
    assert off and all(c.pp == 1 for c in off)


def test_deepseek_v3_at_1024_gpus_plans_pipelines():
    """`launch.plan --recipe deepseek-v3 --gpus 1024` (a narrowed space): PP > 1 layouts, uneven
    over 61 layers, are planned and fit, and the ones ranked first are ones our training accepts."""
    recipe = get_recipe("deepseek-v3")
    space = SearchSpace(micro_batch=(1,), recompute=("selective",), offload=(False,))
    p = plan(recipe, world_size=1024, device=H100, space=space)
    piped = [e for e in p.ranked if e.candidate.pp > 1]
    assert piped and all(e.candidate.layout.uneven_pipeline for e in piped)
    assert {e.candidate.pp for e in piped} >= {4, 8, 16}
    for e in p.ranked[:5] + piped[:5]:
        validate_for_world(e.candidate.apply_to(recipe), 1024)
        assert e.memory.total <= H100.memory_bytes


def test_no_valid_pipeline_split_is_the_reason_given(capsys):
    """61 layers at PP32 split no way the training accepts: the refusal says so (not the batch)."""
    with pytest.raises(PlanError, match=r"num_layers=61 splits over none of PP \[32\].*PP that split it on "
                                        r"1024 GPUs: \[1, 2, 4, 8, 16\]"):
        plan(get_recipe("deepseek-v3"), world_size=1024, device=H100, space=SearchSpace(pp=(32,)))
    assert plan_mod.main(["--recipe", "deepseek-v3", "--gpus", "1024", "--pp", "32"]) == 2
    assert "num_layers=61 splits over none of PP [32]" in capsys.readouterr().err


def test_batch_refusal_names_the_batch():
    """When the training refuses every combination for the batch, the message quotes its refusal."""
    with pytest.raises(PlanError, match=r"most often \(\d+\) with: schedule.global_batch_size=7 is not divisible.*"
                                        r"try --global-batch 8"):
        plan(apply_overrides(get_recipe("llama3-8b"), overrides=["schedule.global_batch_size=7"]), world_size=8,
             device=H100, space=SearchSpace(tp=(1,), pp=(1,), cp=(1,)))


def test_cli_shows_the_split_and_can_leave_uneven_stages_out(capsys):
    """--json gives each layout's layers per stage; --uneven-stages off searches the even and the
    embedding/loss splits only, which for 61 layers on 1024 GPUs means PP1."""
    base = ["--recipe", "deepseek-v3", "--gpus", "1024", "--micro-batch", "1", "--recompute", "selective",
            "--offload", "off", "--json", "--top", "all", "--show-dropped", "0"]
    for flag, pps in (("on", {1, 2, 4, 8, 16}), ("off", {1})):
        assert plan_mod.main(base + ["--uneven-stages", flag]) == 0
        layouts = [c["layout"] for c in json.loads(capsys.readouterr().out)["candidates"]]
        assert {lay["pp"] for lay in layouts} <= pps and 1 in {lay["pp"] for lay in layouts}
        for lay in layouts:
            assert len(lay["layers_per_stage"]) == lay["pp"] and sum(lay["layers_per_stage"]) == 61
        if flag == "on":
            assert [4] + [4] * 14 + [1] in [lay["layers_per_stage"] for lay in layouts]


def test_no_split_at_the_vpp_asked_for_says_to_drop_it():
    """61 layers split over no PP x VPP2 (prime): the refusal says which PP work without --vpp."""
    with pytest.raises(PlanError, match=r"splits over none of PP .* x VPP \[2\].*PP that split it on 1024 GPUs "
                                        r"without --vpp: \[1, 2, 4, 8, 16\]"):
        plan(get_recipe("deepseek-v3"), world_size=1024, device=H100, space=SearchSpace(vpp=(2,)))
