"""optimizer.name=muon: its keys, the layouts and precisions Megatron-Core 0.19.2 cannot run with
Muon refused before any process group in one line, and which parameters Muon steps (issue 46)."""

from __future__ import annotations

import pytest

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, dump_yaml, validation
from tests.bad_input import run_cli
from tests.distributed import run_ranks
from tests.pretrain.test_muon import needs_emerging_optimizers

BASE = ["data.mock=true", "data.demo=false", "runtime.spec=portable"]


@pytest.mark.parametrize("world, overrides, message", [
    (1, ["optimizer.muon.momentum=0.9"], "optimizer.muon.momentum is set but optimizer.name=adamw"),
    (2, ["optimizer.name=muon", "parallel.sharding=zero3"], "Megatron-Core 0.19 runs Muon with DDP only"),
    (2, ["optimizer.name=muon", "parallel.sharding=zero2"], "Megatron-Core 0.19 runs Muon with DDP only"),
    (1, ["optimizer.name=muon", "runtime.dtype=fp16"], "emerging optimizers with fp16"),
    (2, ["optimizer.name=muon"], "layer-wise distributed optimizer cannot step or save fp32 parameters"),
    (1, ["optimizer.name=muon", "optimizer.muon.adamw_lr=1e-5"], "min LR 0.0003 exceeds their LR 1e-05"),
    (1, ["optimizer.name=muon", "optimizer.muon.tp_mode=rowwise"], "optimizer.muon.tp_mode"),
    (1, ["optimizer.name=sgd"], "optimizer.name"),
])
def test_what_muon_cannot_run_is_refused_in_one_line(world, overrides, message):
    result = run_cli("pretrain", ["--recipe", "tiny-llama", "--dry-run", "--world-size", str(world), *BASE,
                                  *overrides])
    assert result.code == 2 and message in result.output and result.crash is None, result
    assert "Traceback" not in result.output and len(result.error_lines) == 1, result.output


def test_dry_run_config_shows_the_muon_section():
    config = resolve_config("tiny-llama", None, BASE + ["optimizer.name=muon", "optimizer.muon.nesterov=true"])
    text = dump_yaml(config)
    assert "name: muon" in text and "nesterov: true" in text and "tp_mode: duplicated" in text
    # A saved adamw config lists every muon key at its default: it must load again.
    assert resolve_config("tiny-llama", None, BASE).optimizer.muon == config.optimizer.muon.model_copy(
        update={"nesterov": False})


def test_missing_emerging_optimizers_is_refused_before_any_process_group(monkeypatch):
    monkeypatch.setattr(validation, "muon_available", lambda: False)
    config = resolve_config("tiny-llama", None, BASE + ["optimizer.name=muon"])
    with pytest.raises(ConfigError, match="needs NVIDIA's emerging-optimizers package"):
        validation.validate_for_machine(config)
    validation.validate_for_machine(resolve_config("tiny-llama", None, BASE))  # adamw does not need it


@needs_emerging_optimizers
def test_muon_steps_hidden_matrices_and_adamw_the_rest_router_included(tmp_path):
    owner = run_ranks(1, "tests.pretrain.muon_reference:optimizer_of_each_param", recipe="tiny-moe",
                      overrides=BASE + ["optimizer.name=muon", "model.num_layers=1",
                                        f"logging.run_dir={tmp_path}"])[0]
    routers = [n for n in owner if ".router." in n]
    assert routers and all(owner[n] == "AdamW" for n in routers), owner
    assert all(owner[n] == "AdamW" for n in owner if "embedding" in n or "output_layer" in n or "norm" in n)
    hidden = [n for n in owner if n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                              "linear_fc2.weight")) or "experts" in n]
    assert hidden and all(owner[n] == "TensorParallelMuon" for n in hidden), owner
    assert None not in owner.values(), owner


@needs_emerging_optimizers
def test_learned_position_embeddings_and_biases_go_to_adamw(tmp_path):
    gpt = ["model.normalization=LayerNorm", "model.activation=gelu", "model.position_embedding=learned_absolute",
           "model.add_bias_linear=true", "model.add_qkv_bias=true", "model.tie_embeddings=true"]
    owner = run_ranks(1, "tests.pretrain.muon_reference:optimizer_of_each_param", recipe="tiny-llama",
                      overrides=BASE + gpt + ["optimizer.name=muon", "model.num_layers=1",
                                              f"logging.run_dir={tmp_path}"])[0]
    assert owner["embedding.position_embeddings.weight"] == "AdamW", owner
    assert all(owner[n] == "AdamW" for n in owner if n.endswith(".bias")), owner
    assert owner["decoder.layers.0.self_attention.linear_qkv.weight"] == "TensorParallelMuon", owner
