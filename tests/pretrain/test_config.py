"""Config layering and validation: every bad value fails before any process group exists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, apply_overrides, dump_yaml, validate_for_world
from pretrain.recipes import RECIPES, get_recipe
from tests.distributed import REPO


def test_every_recipe_resolves_and_validates_for_its_intended_scale():
    worlds = {"tiny-llama": 4, "tiny-moe": 4, "llama3-8b": 8, "llama3-70b": 64, "gpt3-175b": 1024,
              "mixtral-8x7b": 32}
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
])
def test_world_dependent_validation(overrides, world, message):
    config = apply_overrides(get_recipe("tiny-llama"), overrides=overrides)
    with pytest.raises(ConfigError) as err:
        validate_for_world(config, world)
    assert message in str(err.value)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = get_recipe("llama3-70b")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(config))
    again = apply_overrides(get_recipe("tiny-llama"), yaml_file=str(path))
    assert again == config


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_prints_resolved_config_and_validates():
    ok = _cli("--recipe", "llama3-70b", "--dry-run", "--world-size", "64")
    assert ok.returncode == 0, ok.stderr
    assert "tensor_parallel: 8" in ok.stdout and "valid for world size 64: TP8xPP4xVPP5xDP2" in ok.stdout
    bad = _cli("--recipe", "llama3-70b", "--dry-run", "--world-size", "60")
    assert bad.returncode == 2
    assert "world size 60 is not divisible by TP(8) x PP(4) x CP(1) = 32" in bad.stderr
    unknown = _cli("--recipe", "llama-8b", "--dry-run")
    assert unknown.returncode == 2 and "Did you mean 'llama3-8b'" in unknown.stderr


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
