"""launch.plan: enumeration honours the training's own validation, drops what does not
fit with the reason, ranks by time, explains impossible requests, writes a usable override."""

from __future__ import annotations

import dataclasses

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
    for dist_opt, shards in ((True, 8), (False, 1)):
        c = dataclasses.replace(base, layout=ParallelLayout(), micro_batch=1, recompute="full",
                                distributed_optimizer=dist_opt)
        b = peak_memory(c)
        assert (b.params, b.grads, b.main_params, b.optimizer_states) == (
            2 * params, 4 * params, 4 * params / shards, 8 * params / shards)


def test_search_space_restricts_enumeration():
    p = plan(get_recipe("llama3-8b"), world_size=8, device=H100,
             space=SearchSpace(tp=[2], recompute=("selective",), distributed_optimizer=(True,)))
    assert {e.candidate.tp for e in p.ranked} == {2}
    assert {e.candidate.recompute for e in p.ranked} == {"selective"}


def test_gpus_must_fill_nodes():
    with pytest.raises(PlanError, match="12 GPUs is not a whole number of h100-80gb nodes.*use 8 or 16 GPUs"):
        plan(get_recipe("llama3-70b"), world_size=12, device=H100)


def test_no_fit_says_what_would_fit():
    with pytest.raises(PlanError) as err:
        plan(get_recipe("llama3-70b"), world_size=8, device=H100)
    message = str(err.value)
    assert "no layout of llama3-70b fits 8 x h100-80gb" in message
    assert "closest:" in message and "params" in message and "optimizer" in message
    assert "more GPUs: 16" in message


def test_no_fit_suggests_recompute_and_shorter_sequence():
    # Pure DP: more GPUs shrink only the sharded optimizer state, never the activations of
    # seq 8192 without recompute, so the fixes are recompute or a shorter sequence.
    narrow = SearchSpace(tp=[1], pp=[1], cp=[1], recompute=("none",))
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
    assert "fastest layouts that fit" in text and "recommended:" in text and "ZeRO" in text
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
])
def test_cli_bad_input(argv, message, capsys):
    base = ["--recipe", "llama3-8b", "--gpus", "8"]
    assert plan_mod.main(base + argv) == 2
    assert message in capsys.readouterr().err
