"""Config layering and validation: every bad value fails before any process group exists."""

from __future__ import annotations

import re
import subprocess

import pytest

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, apply_overrides, dump_yaml, validate_for_world
from pretrain.recipes import RECIPES, get_recipe
from tests.distributed import run_module


def test_every_recipe_resolves_and_validates_for_its_intended_scale():
    worlds = {"tiny-llama": 4, "tiny-moe": 4, "tiny-qwen3": 4, "tiny-qwen3-moe": 4, "tiny-deepseek": 4, "llama3-8b": 8, "qwen3-8b": 8,
              "qwen3-30b-a3b": 16, "deepseek-v3": 1024, "llama3-70b": 64, "gpt3-175b": 1024, "mixtral-8x7b": 32}
    for name in RECIPES:
        config = get_recipe(name)
        validate_for_world(config.model_copy(update={"data": config.data}), worlds[name])


def test_overrides_layer_yaml_then_key_values(tmp_path):
    yaml_file = tmp_path / "o.yaml"
    yaml_file.write_text("schedule:\n  train_steps: 7\n  seq_length: 64\noptimizer:\n  lr: 0.01\n")
    config = resolve_config("tiny-llama", str(yaml_file), ["optimizer.lr=3e-4", "model.num_layers=2"])
    assert config.schedule.train_steps == 7 and config.schedule.seq_length == 64
    assert config.optimizer.lr == 3e-4  # key=value wins over the YAML file
    assert config.model.num_layers == 2


def test_blend_override_parses_list_of_pairs():
    config = resolve_config("tiny-llama", None, ["data.demo=false", "data.blend=[[0.3, a], [0.7, b]]",
                                                 "data.tokenizer=byte"])
    assert config.data.blend == [(0.3, "a"), (0.7, "b")]


@pytest.mark.parametrize("override, message", [
    ("schedul.train_steps=3", "did you mean 'schedule'"),
    ("schedule.train_step=3", "did you mean 'train_steps'"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("schedule.train_steps=2.5", "schedule.train_steps"),
    ("runtime.dtype=fp64", "runtime.dtype"),
    ("schedule=3", "schedule"),
    ("train_steps", "is not key=value"),
])
def test_bad_overrides_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_recipe("tiny-llama"), overrides=[override])


@pytest.mark.parametrize("overrides, world, message", [
    (["schedule.global_batch_size=10", "schedule.micro_batch_size=4"], 1,
     "global_batch_size=10 is not divisible by micro_batch_size(4) x DP(1) = 4"),
    (["schedule.global_batch_size=12", "schedule.micro_batch_size=2"], 4,
     "global_batch_size=12 is not divisible by micro_batch_size(2) x DP(4) = 8"),
    (["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", "schedule.micro_batch_size=4",
      "schedule.global_batch_size=12"], 2, "multiple of PP=2"),
    (["parallel.tensor_parallel=4"], 4, "TP=4 does not divide num_query_groups=2"),
    (["schedule.seq_length=512"], 1, "exceeds model.max_seq_length=256"),
    (["data.demo=false"], 1, "set exactly one data source"),
    (["data.demo=false", "data.blend=[[1.0, x]]"], 1, "needs data.tokenizer"),
    # Megatron-Core's own assertions, refused up front (issue 27: each died at step 1).
    (["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "schedule.seq_length=127"], 2,
     "schedule.seq_length=127 with parallel.sequence_parallel=true must split over CP (1) and then TP (2) evenly: "
     "use a multiple of 2 (e.g. 126, 128)"),
    (["parallel.tensor_parallel=4", "parallel.context_parallel=2", "parallel.sequence_parallel=true",
      "model.num_query_groups=4", "schedule.seq_length=12"], 8, "use a multiple of 8 (e.g. 8, 16)"),
])
def test_world_dependent_validation(overrides, world, message):
    config = apply_overrides(get_recipe("tiny-llama"), overrides=overrides)
    with pytest.raises(ConfigError) as err:
        validate_for_world(config, world)
    assert message in str(err.value)


def test_rope_needs_an_even_head_dimension():
    """hidden 120 over 8 heads (head dim 15) with RoPE died in Megatron-Core's rotary code."""
    with pytest.raises(ConfigError, match=r"needs an even head dimension .* = 120/8 = 15; e.g. hidden_size=112 or 128"):
        apply_overrides(get_recipe("tiny-llama"), overrides=["model.hidden_size=120"])
    # Learned absolute positions rotate nothing: an odd head dimension is fine there.
    apply_overrides(get_recipe("tiny-llama"), overrides=["model=tiny-gpt", "model.hidden_size=60"])


@pytest.mark.parametrize("recipe, overrides, world, message", [
    # Megatron-Core assertions at model build (transformer_config.py, moe/shared_experts.py).
    ("tiny-moe", ["model.moe_router_topk=1"], 1, "moe_router_topk=1 needs moe_router_pre_softmax=true"),
    ("tiny-moe", ["model.moe_shared_expert_hidden_size=128", "model.add_bias_linear=true"], 1,
     "moe_shared_expert_hidden_size needs add_bias_linear=false"),
    ("tiny-moe", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "model.add_bias_linear=true"], 2,
     "needs expert TP 1 (got 2"),
    ("tiny-llama", ["parallel.expert_tensor_parallel=1"], 2, "expert_tensor_parallel=1 needs a MoE model"),
    ("tiny-llama", ["model.rope_base=10000.5"], 1, "rope_base=10000.5 must be a whole number above 1"),
    ("tiny-llama", ["model.rope_base=1"], 1, "rope_base=1.0 must be a whole number above 1"),
])
def test_megatron_model_assertions_are_validation_rules(recipe, overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_for_world(apply_overrides(get_recipe(recipe), overrides=overrides), world)


def test_a_whole_section_refusal_is_one_short_line():
    """A model-level check printed the whole model section (~1,000 characters) as its input."""
    with pytest.raises(ConfigError) as err:
        apply_overrides(get_recipe("tiny-llama"), overrides=["model.num_query_groups=3"])
    message = str(err.value)
    assert "\n" not in message and len(message) < 200 and "num_query_groups=3 must divide" in message, message


@pytest.fixture(scope="module")
def kjv_prefixes(module_tmp_factory):
    """Indexed datasets of the first 500 and 501 documents of the shipped demo corpus."""
    from tests.pretrain.config_fuzz import make_datasets

    return make_datasets(module_tmp_factory.mktemp("kjv"), sizes=(500, 501))


def test_a_split_part_without_documents_is_refused_before_any_work(kjv_prefixes, tmp_path):
    """Split 969,30,1 of 500 documents leaves the test part none: Megatron-Core's GPTDataset
    counted epochs of zero tokens forever (issue 27). 501 documents give it one."""
    from pretrain.config import validate_inputs
    from data_pipeline.datasets import DEMO_TOKENIZER

    common = ["data.demo=false", f"data.tokenizer={DEMO_TOKENIZER}", f"logging.run_dir={tmp_path}",
              "schedule.train_steps=2"]
    config = apply_overrides(get_recipe("tiny-llama"), overrides=common + [f"data.blend=[[1.0, {kjv_prefixes[500]}]]"])
    with pytest.raises(ConfigError, match=r"^data.split=969,30,1 gives the test part 0 of the 500 documents of .*"
                                          r"give that part weight 0 \(e.g. split=969,30,0\) or use at least 501 documents"):
        validate_inputs(config)
    validate_inputs(config.model_copy(update={"data": config.data.model_copy(update={"split": "969,30,0"})}))
    validate_inputs(apply_overrides(get_recipe("tiny-llama"), overrides=common + [
        f"data.blend=[[1.0, {kjv_prefixes[501]}]]"]))
    refused = _cli("--recipe", "tiny-llama", "--dry-run", "--world-size", "1", *common,
                   f"data.blend=[[1.0, {kjv_prefixes[500]}]]")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: data.split=969,30,1 gives the test part 0")


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = get_recipe("llama3-70b")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(config))
    again = apply_overrides(get_recipe("tiny-llama"), yaml_file=str(path))
    assert again == config


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("pretrain", list(args), timeout=120)


def test_dry_run_prints_resolved_config_and_validates():
    ok = _cli("--recipe", "llama3-70b", "--dry-run", "--world-size", "64")
    assert ok.returncode == 0, ok.stderr
    assert "tensor_parallel: 8" in ok.stdout and "valid for world size 64: TP8xPP4xVPP5xDP2" in ok.stdout
    bad = _cli("--recipe", "llama3-70b", "--dry-run", "--world-size", "60")
    assert bad.returncode == 2
    assert "world size 60 is not divisible by TP(8) x PP(4) x CP(1) = 32" in bad.stderr
    unknown = _cli("--recipe", "llama-8b", "--dry-run")
    assert unknown.returncode == 2 and "Did you mean 'llama3-8b'" in unknown.stderr


def test_qwen3_dry_run_shows_qk_norms_and_head_dim_and_refuses_bad_layouts():
    """Issue 45: the q/k norm switch and the head size are printed; a TP that splits Qwen3's
    query groups, or an odd head size under RoPE, is refused before any process group."""
    ok = _cli("--recipe", "qwen3-8b", "--dry-run", "--world-size", "16")
    assert ok.returncode == 0, ok.stderr
    assert "kv_channels: 128\n  qk_layernorm: true" in ok.stdout and "valid for world size 16: TP2" in ok.stdout
    tp4 = _cli("--recipe", "tiny-qwen3", "--dry-run", "--world-size", "4", "parallel.tensor_parallel=4")
    assert tp4.returncode == 2 and "TP=4 does not divide num_query_groups=2; valid TP: 1, 2" in tp4.stderr
    odd = _cli("--recipe", "tiny-qwen3", "--dry-run", "model.kv_channels=33")
    assert odd.returncode == 2 and "needs an even head dimension" in odd.stderr and "kv_channels = 33" in odd.stderr


def test_qwen3_moe_dry_run_shows_the_router_and_refuses_bad_layouts():
    """Issue 45: Qwen3-30B-A3B's experts, top-k and its renormalised router are printed; an EP that
    splits the experts, and top-1 without a pre-softmax router, are refused before any process group."""
    ok = _cli("--recipe", "qwen3-30b-a3b", "--dry-run", "--world-size", "16")
    assert ok.returncode == 0, ok.stderr
    for line in ("num_experts: 128", "moe_router_topk: 8", "moe_ffn_hidden_size: 768", "moe_router_pre_softmax: false",
                 "moe_shared_expert_hidden_size: null", "qk_layernorm: true", "kv_channels: 128"):
        assert f"  {line}\n" in ok.stdout, line
    assert "valid for world size 16: " in ok.stdout
    ep3 = _cli("--recipe", "tiny-qwen3-moe", "--dry-run", "--world-size", "3", "parallel.expert_parallel=3")
    assert ep3.returncode == 2 and "EP=3 does not divide num_experts=8; valid EP: 1, 2, 4, 8" in ep3.stderr
    top1 = _cli("--recipe", "tiny-qwen3-moe", "--dry-run", "model.moe_router_topk=1")
    assert top1.returncode == 2 and "moe_router_topk=1 needs moe_router_pre_softmax=true" in top1.stderr
    top1_pre = _cli("--recipe", "tiny-qwen3-moe", "--dry-run", "model.moe_router_topk=1", "model.moe_router_pre_softmax=true")
    assert top1_pre.returncode == 0, top1_pre.stderr
    dense = _cli("--recipe", "tiny-qwen3", "--dry-run", "model.moe_router_pre_softmax=true")
    assert dense.returncode == 2 and "moe_router_pre_softmax need(s) a MoE model" in dense.stderr


def test_model_flavor_override_replaces_the_model_then_fields_apply(tmp_path):
    from models.config import get_flavor

    config = resolve_config("tiny-llama", None, ["model=tiny-gpt", "model.num_layers=2"])
    assert config.model == get_flavor("tiny-gpt").model_copy(update={"num_layers": 2})
    assert get_flavor("tiny-gpt") != get_flavor("tiny-llama")  # the override changed something
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("model: tiny-llama-tied\n")
    assert resolve_config("tiny-llama", str(yaml_file), []).model == get_flavor("tiny-llama-tied")


def test_explicit_decay_must_outlast_warmup_and_floats_be_finite():
    with pytest.raises(ConfigError, match="schedule.decay_steps=5 must exceed schedule.warmup_steps=10"):
        apply_overrides(get_recipe("tiny-llama"), overrides=["schedule.warmup_steps=10", "schedule.decay_steps=5"])
    config = apply_overrides(get_recipe("tiny-llama"), overrides=["schedule.warmup_steps=10",
                                                                   "schedule.decay_steps=11"])
    assert config.schedule.decay_steps == 11
    for value in ("inf", "-inf", "nan"):
        with pytest.raises(ConfigError, match="optimizer.lr: Input should be a finite number"):
            apply_overrides(get_recipe("tiny-llama"), overrides=[f"optimizer.lr={value}"])
