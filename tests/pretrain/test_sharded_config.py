"""Sharded data parallelism: the keys, and every composition Megatron-FSDP (0.16.1, kept for 0.19.2) cannot run
(or runs wrong) refused before any process group, in one line that says why."""

from __future__ import annotations


import pytest

from pretrain.cli import resolve_config
from pretrain.config import data_parallel_sharding, validate_for_world
from tests.bad_input import run_cli
from tests.distributed import run_module

BASE = ["data.mock=true", "data.demo=false", "runtime.spec=portable"]


def _cli(*args):
    result = run_module("pretrain", list(args), timeout=300)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("recipe, world, overrides, message", [
    ("tiny-llama", 2, ["parallel.sharding=zero3", "parallel.pipeline_parallel=2"],
     "sharding=zero3 (Megatron-FSDP) does not support pipeline_parallel=2"),
    ("tiny-llama", 4, ["parallel.hsdp_replicas=2"], "hsdp_replicas=2 needs sharding=zero2 or zero3"),
    ("tiny-llama", 4, ["parallel.sharding=zero3", "parallel.hsdp_replicas=3"],
     "hsdp_replicas=3 does not divide DP x CP = 4; valid hsdp_replicas: 1, 2"),
    # (A shard group of one rank, MoE with expert DP 1 and MoE with HSDP were refused on 0.16.1;
    # on 0.19.2 they match one rank: tests/pretrain/test_sharded_dp.py.)
    ("tiny-moe", 4, ["parallel.sharding=zero3", "parallel.expert_parallel=2", "parallel.hsdp_replicas=4"],
     "hsdp_replicas=4 does not divide the expert data-parallel size 2"),
    ("tiny-llama", 2, ["parallel.sharding=zero3", "optimizer.distributed=false"],
     "optimizer.distributed=false asks for an unsharded optimizer"),
    ("tiny-llama", 2, ["parallel.sharding=zero3", "runtime.dtype=fp16"], "not supported here with fp16"),
    ("tiny-llama", 2, ["parallel.sharding=none", "optimizer.cpu_offload=true"],
     "optimizer.cpu_offload needs a sharded optimizer"),
    ("tiny-llama", 2, ["parallel.sharding=zero4"], "parallel.sharding"),
])
def test_unsupported_sharding_is_refused_in_one_line(recipe, world, overrides, message):
    # In this process (the CLI's main, process groups refused): a dry run starts none anyway.
    result = run_cli("pretrain", ["--recipe", recipe, "--dry-run", "--world-size", str(world), *BASE, *overrides])
    assert result.code == 2 and message in result.output and result.crash is None, result
    assert "Traceback" not in result.output and len(result.error_lines) == 1, result.output


def test_cpu_offload_needs_a_gpu_and_says_so_before_any_process_group(tmp_path):
    code, out = _cli("--recipe", "tiny-llama", *BASE, "optimizer.cpu_offload=true",
                     f"logging.run_dir={tmp_path / 'run'}")
    assert code == 2 and "optimizer.cpu_offload=true moves optimizer state from GPU" in out, out
    assert not (tmp_path / "run").exists()


def test_sharding_follows_optimizer_distributed_unless_set():
    def sharding(*overrides):
        return data_parallel_sharding(resolve_config("tiny-llama", None, BASE + list(overrides)))

    assert sharding() == "zero1" and sharding("optimizer.distributed=false") == "none"
    assert sharding("parallel.sharding=zero2") == "zero2" and sharding("parallel.sharding=none") == "none"
    config = resolve_config("tiny-llama", None, BASE + ["parallel.sharding=zero3", "parallel.hsdp_replicas=2",
                                                     "schedule.global_batch_size=32"])
    validate_for_world(config, 8)
    assert config.parallel.describe(8) == "TP1xPP1xDP8xZeRO3xHSDP2" and config.parallel.shard_group_size(8) == 4


@pytest.mark.parametrize("saved, resumed", [("zero3", "zero1"), ("zero1", "zero2")])
def test_moe_optimizer_state_does_not_move_between_fsdp_and_ddp(tmp_path, saved, resumed):
    """A MoE checkpoint with optimizer state, resumed across the Megatron-FSDP / DDP line,
    is refused before loading with the way out (same level, or reshard --drop-optimizer)."""
    from pretrain.checkpointing.checkpointer import CheckpointError, check_compatible
    from pretrain.cli import resolve_config
    from tests.pretrain.test_checkpoint import _fake_checkpoints

    def config(level):
        return resolve_config("tiny-moe", None, [*BASE, f"parallel.sharding={level}"])

    _fake_checkpoints(tmp_path, config(saved), [4])
    step = tmp_path / "step_00000004"
    check_compatible(step, config(saved))  # same level: fine
    with pytest.raises(CheckpointError, match="--drop-optimizer"):
        check_compatible(step, config(resumed))
