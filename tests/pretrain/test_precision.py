"""FP8 and GPU speed keys: strict keys, checks before any process group or model (with the
GPU faked through models.precision.probe_machine on CPU), and the precision recorded in
checkpoints (a resume with other settings warns)."""

from __future__ import annotations

import json
import signal

import pytest
import torch.distributed as dist

from models import precision
from pretrain.checkpointing.checkpointer import precision_change, training_meta
from pretrain.checkpointing.format import CheckpointMeta
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_machine, validate_for_world
from tests.distributed import run_module
from tests.models.test_precision import B200, H100

BF16 = ["runtime.dtype=bf16"]


@pytest.mark.parametrize("override, message", [
    ("runtime.fp8_recpie=tensorwise", "did you mean 'fp8_recipe'"),
    ("runtime.fp8_recipe=fp4", "runtime.fp8_recipe"),
    ("runtime.fp8=e5m2", "runtime.fp8"),
    ("runtime.fp8_amax_history_len=0", "runtime.fp8_amax_history_len"),
    ("runtime.fp8_amax_compute_algo=mean", "runtime.fp8_amax_compute_algo"),
    ("optimizer.overlap_grad_reduc=true", "did you mean 'overlap_grad_reduce'"),
    ("runtime.fused_rop=true", "did you mean 'fused_rope'"),
])
def test_bad_fp8_keys_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config("tiny-llama", None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["runtime.fp8_recipe=tensorwise"], "runtime.fp8_recipe=tensorwise has no effect without runtime.fp8; set "
                                        "runtime.fp8=hybrid"),
    (["runtime.fp8_param_gather=true"], "runtime.fp8_param_gather=True has no effect without runtime.fp8"),
    (["runtime.fp8=hybrid"], "runtime.fp8 runs inside BF16/FP16 mixed precision"),
    (BF16 + ["runtime.fp8=hybrid", "runtime.fp8_recipe=tensorwise", "runtime.fp8_amax_history_len=16"],
     "runtime.fp8_amax_history_len applies to fp8_recipe=delayed only"),
    (BF16 + ["runtime.fp8=hybrid", "runtime.fp8_bf16_first_layers=1"],
     "need a recipe other than delayed"),
    (BF16 + ["runtime.fp8=hybrid", "runtime.fp8_recipe=tensorwise", "runtime.fp8_bf16_last_layers=3",
             "parallel.pipeline_parallel=2"],
     "runtime.fp8_bf16_last_layers=3 exceeds the layers per pipeline stage (4 / PP2 = 2), Megatron-Core's limit; "
     "valid: 0..2"),
    (BF16 + ["runtime.fp8=hybrid", "runtime.fp8_recipe=blockwise", "runtime.fp8_bf16_first_layers=2",
             "runtime.fp8_bf16_last_layers=2"], "keeps all 4 layers in BF16"),
    (BF16 + ["runtime.fp8=hybrid", "runtime.fp8_param_gather=true", "optimizer.distributed=false"],
     "runtime.fp8_param_gather=true needs optimizer.distributed=true"),
    (["optimizer.overlap_param_gather=true", "optimizer.distributed=false"],
     "optimizer.overlap_param_gather=true needs optimizer.distributed=true"),
])
def test_fp8_settings_that_cannot_work_fail_with_the_world_checks(overrides, message):
    config = resolve_config("tiny-llama", None, overrides)
    with pytest.raises(ConfigError) as err:
        validate_for_world(config, 2)
    assert message in str(err.value)


def test_good_fp8_settings_pass_the_world_checks():
    for extra in (["runtime.fp8=hybrid"], ["runtime.fp8=e4m3", "runtime.fp8_recipe=tensorwise",
                                           "runtime.fp8_bf16_first_layers=1", "runtime.fp8_bf16_last_layers=1",
                                           "runtime.fp8_param_gather=true"]):
        validate_for_world(resolve_config("tiny-llama", None, BF16 + extra), 1)


def _fake(monkeypatch, facts):
    monkeypatch.setattr(precision, "probe_machine", lambda: facts)


def test_mxfp8_on_an_h100_fails_before_any_model_is_built(monkeypatch, tmp_path):
    from pretrain.loop import main_train

    _fake(monkeypatch, H100)
    run_dir = tmp_path / "run"
    config = resolve_config("tiny-llama", None, BF16 + ["runtime.fp8=e4m3", "runtime.fp8_recipe=mxfp8",
                                                         f"logging.run_dir={run_dir}"])
    with pytest.raises(ConfigError, match=r"^MXFP8 needs compute capability 10\.0 \(Blackwell\); this GPU "
                                          r"\(NVIDIA H100 80GB HBM3\) is 9\.0 \(Hopper\)"):
        validate_for_machine(config)
    # Through the training entry: exit code 2, one line, nothing created.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert main_train(config) == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not run_dir.exists() and not dist.is_initialized()


def test_recipes_the_faked_gpu_runs_pass_and_auto_resolves_to_te(monkeypatch):
    _fake(monkeypatch, B200)
    config = resolve_config("tiny-llama", None, BF16 + ["runtime.fp8=e4m3", "runtime.fp8_recipe=mxfp8"])
    assert validate_for_machine(config) == "te"  # runtime.spec=auto
    _fake(monkeypatch, H100)
    for recipe in ("delayed", "tensorwise", "blockwise"):
        config = resolve_config("tiny-llama", None, BF16 + ["runtime.fp8=hybrid", f"runtime.fp8_recipe={recipe}"])
        assert validate_for_machine(config) == "te"


def test_gpu_only_speed_options_are_refused_on_cpu():
    config = resolve_config("tiny-llama", None, ["optimizer.overlap_grad_reduce=true",
                                                 "optimizer.overlap_param_gather=true"])
    validate_for_world(config, 2)
    with pytest.raises(ConfigError) as err:
        validate_for_machine(config, precision.MachineFacts())
    assert str(err.value) == ("optimizer.overlap_grad_reduce=true needs a GPU (NCCL); remove it on this machine; "
                              "optimizer.overlap_param_gather=true needs a GPU (NCCL); remove it on this machine")
    fused = resolve_config("tiny-llama", None, ["runtime.fused_cross_entropy=true"])
    with pytest.raises(ConfigError, match="runtime.fused_cross_entropy=true needs the Transformer Engine spec"):
        validate_for_machine(fused, precision.MachineFacts())


# --- the precision a checkpoint records ---------------------------------------------------

def test_checkpoint_meta_records_precision_and_old_checkpoints_still_load(tmp_path):
    config = resolve_config("tiny-llama", None, BF16 + ["runtime.fp8=hybrid", "runtime.fp8_recipe=tensorwise"])
    meta = training_meta(config, 3, 1)
    meta.write(tmp_path)
    assert json.loads((tmp_path / "meta.json").read_text())["precision"] == config.runtime.precision()
    assert precision_change(tmp_path, CheckpointMeta.read(tmp_path), config) is None
    other = resolve_config("tiny-llama", None, BF16 + ["runtime.fp8=hybrid", "runtime.fp8_recipe=blockwise"])
    assert precision_change(tmp_path, CheckpointMeta.read(tmp_path), other) == (
        f"warning: checkpoint {tmp_path} was trained with other precision settings than this run "
        "(fp8_recipe 'tensorwise' -> 'blockwise'); resuming from its weights and optimizer state anyway: "
        "the loss may jump and will not match an uninterrupted run")
    bf16 = resolve_config("tiny-llama", None, BF16)
    assert "fp8 'hybrid' -> None" in precision_change(tmp_path, CheckpointMeta.read(tmp_path), bf16)
    # A meta.json written before the field existed loads, and no precision warning is made up.
    data = json.loads((tmp_path / "meta.json").read_text())
    del data["precision"]
    (tmp_path / "meta.json").write_text(json.dumps(data))
    old = CheckpointMeta.read(tmp_path)
    assert old.precision is None and precision_change(tmp_path, old, other) is None


@pytest.mark.slow
def test_resume_with_other_precision_warns_and_continues(tmp_path):
    """A real checkpoint (fp32, CPU) resumed in bf16: the run warns, names the change, trains on."""
    base = ["schedule.micro_batch_size=2", "schedule.global_batch_size=4", "schedule.seq_length=32",
            "schedule.eval_interval=0", "data.demo=false", "data.mock=true", "runtime.spec=portable",
            "logging.tensorboard=false", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path}"]

    def run(*extra):
        proc = run_module("pretrain", ["--recipe", "tiny-llama", *base, *extra])  # OMP_NUM_THREADS=1
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    first = run("schedule.train_steps=2")
    assert "other precision settings" not in first
    meta = json.loads((tmp_path / "ckpt" / "step_00000002" / "meta.json").read_text())
    assert meta["precision"] == {"dtype": "fp32", "fp8": None}
    second = run("schedule.train_steps=3", "runtime.dtype=bf16")
    assert "was trained with other precision settings than this run (dtype 'fp32' -> 'bf16')" in second
    assert "resumed from" in second and (tmp_path / "ckpt" / "step_00000003").is_dir()
