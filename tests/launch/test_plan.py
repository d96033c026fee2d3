"""launch.plan: enumeration honours the training's own validation, drops what does not
fit with the reason, ranks by time, explains impossible requests, writes a usable override."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launch import plan as plan_mod
from launch.planner.candidate import Candidate
from launch.planner.devices import get_device
from launch.planner.memory import MemoryOptions, peak_memory
from launch.planner.search import PlanError, SearchSpace, plan
from models.layout import ParallelLayout
from pretrain.config import apply_overrides, validate_for_world
from pretrain.recipes import get_recipe

H100 = get_device("h100-80gb")


@pytest.fixture(scope="module")
def llama8b_plan():
    return plan(get_recipe("llama3-8b"), world_size=8, device=H100)


def test_ranked_layouts_fit_are_valid_and_sorted(llama8b_plan):
    p = llama8b_plan
    assert p.ranked and p.dropped
    keys = [(float(f"{e.estimate.step_s:.3g}"), e.memory.total) for e in p.ranked]
    assert keys == sorted(keys)  # time (to the model's precision), then memory
    for e in p.ranked[:50]:
        assert e.memory.total <= H100.memory_bytes
        validate_for_world(e.candidate.apply_to(p.config), 8)  # the training accepts it
    for e in p.dropped[:50]:
        assert e.memory.total > H100.memory_bytes


def test_static_memory_of_plain_data_parallel_is_the_textbook_math():
    """llama3-8b has 8,030,261,248 parameters (Meta's model card; its 128,256-token vocab is
    already a multiple of 128, so padding adds none). At TP1 x PP1 x DP8 in BF16 with the
    distributed optimizer every GPU holds 2 bytes of weights and 4 of fp32 gradients per
    parameter; the 4 bytes of fp32 main weights and 8 of Adam moments are sharded 8 ways."""
    params = 8_030_261_248
    base = Candidate.from_config(get_recipe("llama3-8b"), 8)
    for zero, shards in ((1, 8), (0, 1)):
        c = dataclasses.replace(base, layout=ParallelLayout(), micro_batch=1, recompute="full", zero=zero)
        b = peak_memory(c)
        assert (b.params, b.grads, b.main_params, b.optimizer_states) == (
            2 * params, 4 * params, 4 * params / shards, 8 * params / shards)


def test_search_space_restricts_enumeration():
    p = plan(get_recipe("llama3-8b"), world_size=8, device=H100,
             space=SearchSpace(tp=[2], recompute=("selective",), zero=(1,)))
    assert {e.candidate.tp for e in p.ranked} == {2}
    assert {e.candidate.recompute for e in p.ranked} == {"selective"}


def test_gpus_must_fill_nodes():
    with pytest.raises(PlanError, match="12 GPUs is not a whole number of h100-80gb nodes.*use 8 or 16 GPUs"):
        plan(get_recipe("llama3-70b"), world_size=12, device=H100)


def test_no_fit_says_what_would_fit():
    # With the optimizer offloaded to the host, TP8 holds llama3-70b on one node; without, no layout does.
    with pytest.raises(PlanError) as err:
        plan(get_recipe("llama3-70b"), world_size=8, device=H100, space=SearchSpace(offload=(False,)))
    message = str(err.value)
    assert "no layout of llama3-70b fits 8 x h100-80gb" in message
    assert "closest:" in message and "params" in message and "optimizer" in message
    assert "more GPUs: 16" in message


def test_no_fit_suggests_recompute_and_shorter_sequence():
    # Pure DP with ZeRO-0/1: more GPUs shrink only the sharded optimizer state, never the
    # activations of seq 8192 without recompute, so the fixes are recompute or a shorter
    # sequence. (ZeRO-3 fits: test_zero3_fits_where_zero1_does_not.)
    narrow = SearchSpace(tp=[1], pp=[1], cp=[1], recompute=("none",), zero=(0, 1), offload=(False,))
    with pytest.raises(PlanError) as err:
        plan(get_recipe("llama3-8b"), world_size=8, device=H100, space=narrow)
    assert "allow full recompute" in str(err.value)
    assert "more GPUs" not in str(err.value)
    lean = MemoryOptions(framework_gib=0.5, fragmentation=0.0)
    with pytest.raises(PlanError, match="shorter sequence: --seq 4096"):
        plan(get_recipe("llama3-8b"), world_size=8, device=H100, space=narrow, memory_options=lean)


def test_cli_prints_ranking_and_writes_override(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    rc = plan_mod.main(["--recipe", "llama3-8b", "--gpus", "16", "--seq", "4096", "--top", "3",
                        "--write-override", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "fastest layouts that fit" in text and "recommended:" in text and "sharding" in text
    config = apply_overrides(get_recipe("llama3-8b"), yaml_file=str(out))
    validate_for_world(config, 16)
    expected = plan(get_recipe("llama3-8b").model_copy(update=dict(
        schedule=get_recipe("llama3-8b").schedule.model_copy(update=dict(seq_length=4096)))),
        world_size=16, device=H100).best.candidate
    assert Candidate.from_config(config, 16) == expected


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "a100"], "unknown GPU type 'a100'"),
    (["--gpus", "12"], "not a whole number of h100-80gb nodes"),
    (["schedule.micro_batchsize=2"], "did you mean 'micro_batch_size'"),
    (["--overlap", "xx=0.5"], "--overlap 'xx=0.5'"),
    (["--document-length", "512"], "add data.reset_attention_mask=true"),
])
def test_cli_bad_input(argv, message, capsys):
    base = ["--recipe", "llama3-8b", "--gpus", "8"]
    assert plan_mod.main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_zero3_fits_where_zero1_does_not():
    """llama3-8b at seq 8192 without recompute on 8 GPUs, pure DP: under ZeRO-0/1 the
    unsharded weights and fp32 gradients leave too little for the activations; ZeRO-3
    shards them 8 ways and fits."""
    narrow = SearchSpace(tp=[1], pp=[1], cp=[1], recompute=("none",), offload=(False,))
    p = plan(get_recipe("llama3-8b"), world_size=8, device=H100, space=narrow)
    assert {e.candidate.zero for e in p.ranked} == {3}
    assert {e.candidate.zero for e in p.dropped} >= {0, 1, 2}


def test_sharded_candidates_follow_the_training_validation(llama8b_plan):
    evaluated = [e.candidate for e in llama8b_plan.ranked + llama8b_plan.dropped]
    assert {c.zero for c in evaluated} == {0, 1, 2, 3}
    assert any(c.hsdp_replicas > 1 for c in evaluated) and any(c.offload for c in evaluated)
    # Megatron-FSDP (0.16.1-0.19.2) has no pipeline dimension; HSDP only with ZeRO-2/3.
    assert not [c for c in evaluated if c.zero >= 2 and c.pp > 1]
    assert not [c for c in evaluated if c.hsdp_replicas > 1 and c.zero < 2]
    moe = plan(get_recipe("mixtral-8x7b"), world_size=64, device=H100, space=SearchSpace(micro_batch=(1,)))
    # MoE + HSDP: offered on 0.19.2 (refused on 0.16.1), the replicas dividing the expert DP size.
    hsdp = [e.candidate for e in moe.ranked + moe.dropped if e.candidate.hsdp_replicas > 1]
    assert hsdp and all(c.layout.expert_data_parallel(64) % c.hsdp_replicas == 0 for c in hsdp)


def test_candidate_round_trips_through_the_config():
    base = get_recipe("llama3-8b")
    c = dataclasses.replace(Candidate.from_config(base, 16), layout=ParallelLayout(tensor_parallel=2,
                            sequence_parallel=True), zero=3, hsdp_replicas=2, offload=True)
    config = c.apply_to(base)
    assert (config.parallel.sharding, config.parallel.hsdp_replicas) == ("zero3", 2)
    assert (config.optimizer.distributed, config.optimizer.cpu_offload) == (True, True)
    assert Candidate.from_config(config, 16) == c
    assert apply_overrides(base, overrides=[]).parallel.sharding is None  # the recipes leave it to follow
    zero0 = dataclasses.replace(c, zero=0, hsdp_replicas=1, offload=False).apply_to(base)
    assert (zero0.parallel.sharding, zero0.optimizer.distributed) == ("none", False)


def test_cli_json(capsys):
    rc = plan_mod.main(["--recipe", "llama3-70b", "--gpus", "16", "--json", "--top", "4", "--show-dropped", "2"])
    doc = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON document
    assert rc == 0
    cands = doc["candidates"]
    assert [c["fits"] for c in cands] == [True] * 4 + [False] * 2
    assert [c["rank"] for c in cands] == [1, 2, 3, 4, None, None]
    steps = [float(f"{c['step_s']:.3g}") for c in cands[:4]]  # ranked as the tables (test above)
    assert steps == sorted(steps)
    for c in cands:
        assert set(c["layout"]) >= {"tp", "pp", "vpp", "cp", "ep", "dp", "zero", "hsdp_replicas", "offload",
                                    "micro_batch", "recompute"}
        mem = c["memory_gib"]
        assert set(mem) == {"params", "grads", "main_params", "optimizer", "activations", "overhead", "total"}
        assert sum(v for k, v in mem.items() if k != "total") == pytest.approx(mem["total"], abs=0.01)
        assert c["n_params"] == 70_553_706_496
        lay = c["layout"]
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == 16
        assert len(lay["layers_per_stage"]) == lay["pp"] and sum(lay["layers_per_stage"]) == 80
    for c in cands[4:]:
        assert c["step_s"] is None and c["memory_gib"]["total"] > H100.memory_gib
        assert c["reason"].startswith(f"needs {c['memory_gib']['total']:.1f} GiB per GPU")
    # The JSON's first candidate is the plan's best.
    best = plan(get_recipe("llama3-70b"), world_size=16, device=H100).best.candidate
    first = cands[0]["layout"]
    assert (first["tp"], first["pp"], first["cp"], first["zero"], first["hsdp_replicas"], first["offload"],
            first["micro_batch"], first["recompute"]) == (best.tp, best.pp, best.cp, best.zero, best.hsdp_replicas,
                                                         best.offload, best.micro_batch, best.recompute)


def test_cli_zero_and_offload_flags_restrict_and_write_the_keys(tmp_path, capsys):
    out = tmp_path / "z3.yaml"
    rc = plan_mod.main(["--recipe", "llama3-8b", "--gpus", "16", "--zero", "3", "--offload", "off", "--json",
                        "--top", "all", "--show-dropped", "all", "--write-override", str(out)])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert rc == 0 and "wrote" in captured.err
    assert doc["candidates"] and {c["layout"]["zero"] for c in doc["candidates"]} == {3}
    assert not [c for c in doc["candidates"] if c["layout"]["offload"]]
    assert len(doc["candidates"]) == doc["fitting"] + doc["dropped"]
    config = apply_overrides(get_recipe("llama3-8b"), yaml_file=str(out))
    validate_for_world(config, 16)
    assert config.parallel.sharding == "zero3" and config.optimizer.cpu_offload is False
    first = doc["candidates"][0]["layout"]
    assert (config.parallel.tensor_parallel, config.parallel.hsdp_replicas) == (first["tp"], first["hsdp_replicas"])


def test_document_masking_plans_faster_steps_and_no_layout_the_te_spec_refuses():
    """With documents of 512 tokens at seq 8192 the attention work is ~6% of the dense one:
    the te-spec estimate is faster; CP > 1 (te + CP + masking is refused at launch) is not
    offered."""
    masked = apply_overrides(get_recipe("llama3-8b"), overrides=["data.reset_attention_mask=true",
                                                                "data.reset_position_ids=true"])
    space = SearchSpace(tp=[1, 2], pp=[1], recompute=("none", "selective"), offload=(False,))
    dense = plan(get_recipe("llama3-8b"), world_size=8, device=H100, space=space)
    docs = plan(masked, world_size=8, device=H100, space=dataclasses.replace(space, document_length=512))
    assert any(e.candidate.cp > 1 for e in dense.ranked) and all(e.candidate.cp == 1 for e in docs.ranked)
    by_layout = {e.candidate.describe(): e.estimate.step_s for e in dense.ranked}
    faster = [(by_layout[e.candidate.describe()], e.estimate.step_s) for e in docs.ranked
              if e.candidate.describe() in by_layout]
    assert faster and all(d < s for s, d in faster), faster


def test_qwen3_30b_a3b_plan_validates_and_its_recipe_layout_fits():
    """Issue 45: `launch.plan --recipe qwen3-30b-a3b --gpus 16`: the ranked layouts pass the
    training's own validation at world size 16, and the recipe's PP2 x EP8 layout fits an H100."""
    recipe = get_recipe("qwen3-30b-a3b")
    space = SearchSpace(micro_batch=(1,), recompute=("selective",))
    p = plan(recipe, world_size=16, device=H100, space=space)
    assert p.ranked and any(e.candidate.layout.expert_parallel > 1 for e in p.ranked + p.dropped)
    for e in p.ranked[:5]:
        validate_for_world(e.candidate.apply_to(recipe), 16)
    own = plan(recipe, world_size=16, device=H100, space=dataclasses.replace(
        space, tp=(1,), pp=(2,), vpp=(1,), cp=(1,), ep=(8,), zero=(1,), uneven_stages=False))  # the recipe's even split
    assert [e.candidate.layout.describe(16) for e in own.ranked][:1] == ["TP1xPP2xEP8xDP8"]
    assert own.ranked[0].memory.total <= H100.memory_bytes

