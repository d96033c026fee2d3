"""No code runs from a checkpoint: a crafted `.metadata` (torch DCP's pickled index) or a crafted
stored object is refused by every loader: resume, reshard, export and verify."""

from __future__ import annotations

import io
import os
import pickle
import shutil

import pytest

from tests.distributed import REPO, run_module, run_ranks

BASE = ["schedule.train_steps=1", "schedule.seq_length=32", "schedule.micro_batch_size=2",
        "schedule.global_batch_size=2", "data.demo=false", "data.mock=true", "runtime.spec=portable",
        "logging.tensorboard=false", "checkpoint.resume=none"]


class _RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(module_tmp_factory):
    root = module_tmp_factory.mktemp("safety")
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=BASE + [f"checkpoint.dir={root / 'ckpt'}", f"logging.run_dir={root / 'run'}"])
    return root / "ckpt" / "step_00000001"


def _cli(*args, cwd=REPO):
    return run_module(args[0], args[1:], cwd=cwd)


@pytest.mark.parametrize("command", ["resume", "reshard", "export_hf", "verify"])
def test_crafted_metadata_runs_no_code_anywhere(checkpoint, tmp_path, command):
    crafted = tmp_path / "crafted" / "step_00000001"
    shutil.copytree(checkpoint, crafted)
    marker = tmp_path / "pwned"
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    argv = {
        "resume": ["pretrain", "--recipe", "tiny-llama", *BASE[:-1], f"checkpoint.resume={crafted}",
                   f"logging.run_dir={tmp_path / 'run'}"],
        "reshard": ["checkpoints_tools.reshard", str(crafted), str(tmp_path / "out"), "--tp", "1"],
        "export_hf": ["checkpoints_tools.export_hf", str(crafted), str(tmp_path / "hf"), "--no-tokenizer"],
        "verify": ["checkpoints_tools.verify", str(crafted), str(tmp_path)],
    }[command]
    result = _cli(*argv)
    assert not marker.exists(), "code from the checkpoint ran"
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to load posix.system" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()


def test_crafted_stored_object_runs_no_code(tmp_path):
    """Stored objects (Megatron's ShardedObjects inside the .distcp shards) go through torch's
    weights-only unpickler once megatron_fixes is applied."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from pretrain import megatron_fixes

    megatron_fixes.apply(cpu=False)  # idempotent; the CPU stand-ins are not needed here
    marker = tmp_path / "pwned"
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})()})()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, io.BytesIO(pickle.dumps(_RunsCode(marker))))
    assert not marker.exists()
    buffer = io.BytesIO()
    torch.save({"extra_state": None, "t": torch.ones(2)}, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)  # what a real checkpoint stores still loads
    assert planner.state_dict["x"]["extra_state"] is None and planner.state_dict["x"]["t"].sum() == 2
