"""optimizer.name=lion: its keys (Megatron-Core's names and defaults), the layouts and precisions
Megatron-Core 0.19.2 cannot run with Lion refused before any process group in one line, and every
parameter stepped by emerging_optimizers' Lion (issue 46)."""

from __future__ import annotations

import pytest
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

from pretrain.cli import resolve_config
from pretrain.config import dump_yaml
from tests.bad_input import run_cli
from tests.distributed import run_ranks
from tests.pretrain.test_muon import needs_emerging_optimizers

BASE = ["data.mock=true", "data.demo=false", "runtime.spec=portable"]
LION = ["optimizer.name=lion"]


@pytest.mark.parametrize("world, overrides, message", [
    (1, ["optimizer.lion_beta1=0.9"], "optimizer.lion_beta1 is set but optimizer.name=adamw"),
    (1, ["optimizer.name=muon", "optimizer.lion_beta2=0.9"], "optimizer.lion_beta2 is set but optimizer.name=muon"),
    (1, LION + ["optimizer.lion_beta1=1.0"], "optimizer.lion_beta1"),
    (2, LION + ["parallel.sharding=zero3"], "Megatron-Core 0.19 runs Lion with DDP only"),
    (2, LION + ["parallel.sharding=zero2", "runtime.dtype=bf16"], "Megatron-Core 0.19 runs Lion with DDP only"),
    (1, LION + ["runtime.dtype=fp16"], "emerging optimizers with fp16"),
    (2, LION, "layer-wise distributed optimizer cannot step or save fp32 parameters"),
])
def test_what_lion_cannot_run_is_refused_in_one_line(world, overrides, message):
    result = run_cli("pretrain", ["--recipe", "tiny-llama", "--dry-run", "--world-size", str(world), *BASE,
                                  *overrides])
    assert result.code == 2 and message in result.output and result.crash is None, result
    assert "Traceback" not in result.output and len(result.error_lines) == 1, result.output


def test_dry_run_shows_lion_with_megatron_cores_defaults():
    config = resolve_config("tiny-llama", None, BASE + LION)
    text = dump_yaml(config)
    assert "name: lion" in text and "lion_beta1: 0.95" in text and "lion_beta2: 0.98" in text, text
    upstream = MegatronOptimizerConfig()
    assert (config.optimizer.lion_beta1, config.optimizer.lion_beta2) == (upstream.lion_beta1, upstream.lion_beta2)


@needs_emerging_optimizers
def test_lion_steps_every_parameter(tmp_path):
    # Upstream's registry entry would leave embeddings, norms and the output layer to Adam
    # (pretrain/megatron_fixes/lion.py); ours is Lion everywhere, biases included.
    gpt = ["model.add_bias_linear=true", "model.add_qkv_bias=true", "model.num_layers=1"]
    owner = run_ranks(1, "tests.pretrain.muon_reference:optimizer_of_each_param", recipe="tiny-llama",
                      overrides=BASE + LION + gpt + [f"logging.run_dir={tmp_path}"])[0]
    assert len(owner) > 5 and set(owner.values()) == {"Lion"}, owner
