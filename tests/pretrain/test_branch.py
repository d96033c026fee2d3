"""Cooldown branches (checkpoint.branch_from, pretrain/checkpointing/branch.py): a cooldown of c
steps from a stable-phase checkpoint at step k is bit for bit the uninterrupted WSD run of k + c
steps (losses, grad norms, LRs, final weights and optimizer state), at one rank, TP2 x PP2 and
ZeRO-3 DP2, leaving the stable run untouched; and every branch that would be something else is
refused in one line, before any process group."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import yaml

from pretrain.checkpointing.format import CheckpointError, mark_complete, step_dir_name
from pretrain.checkpointing.resume import plan_resume
from pretrain.cli import resolve_config
from pretrain.config import dump_yaml
from tests.compare import assert_steps_equal
from tests.distributed import run_module, run_ranks

BASE = [
    "schedule.micro_batch_size=2", "schedule.global_batch_size=8", "schedule.seq_length=64",
    "schedule.eval_interval=0", "schedule.warmup_steps=2", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "logging.log_interval=1",
    "optimizer.lr=3e-3", "optimizer.min_lr=3e-5", "schedule.decay_style=wsd",
]
K, C = 3, 2  # branch at step 3, cooldown of 2 steps: the WSD run of 5 steps
# The stable run: its cooldown (2 steps) starts after step 4, so step 3 is in its stable phase.
STABLE = ["schedule.train_steps=6", "schedule.wsd_decay_steps=2"]
BRANCH = [f"schedule.train_steps={K + C}", f"schedule.wsd_decay_steps={C}"]


def _fake_checkpoint(root, step, overrides, has_optimizer=True, drop_optimizer_keys=()):
    """A checkpoint folder that passes every check a stat can make, with the config.yaml and
    meta.json a run of `overrides` writes (no model inside: the checks read no shard)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from pretrain.checkpointing.checkpointer import training_meta
    from pretrain.checkpointing.integrity import collect_file_table

    config = resolve_config("tiny-llama", None, BASE + overrides)
    directory = root / step_dir_name(step)
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    saved = yaml.safe_load(dump_yaml(config))
    for key in drop_optimizer_keys:  # as a run from before those keys existed saved it
        del saved["optimizer"][key]
    (directory / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    meta = training_meta(config, step, 1)
    meta.has_optimizer = has_optimizer
    meta.files = collect_file_table(directory)
    meta.write(directory)
    mark_complete(directory)
    return directory


def _branch_config(tmp_path, source, extra=()):
    return resolve_config("tiny-llama", None, BASE + BRANCH + [
        f"checkpoint.branch_from={source}", f"checkpoint.dir={tmp_path / 'branch' / 'ckpt'}",
        f"logging.run_dir={tmp_path / 'branch'}", *extra])


def _stable(tmp_path, extra=(), **kwargs):
    run = [f"logging.run_dir={tmp_path / 'stable'}", *STABLE, *extra]
    return _fake_checkpoint(tmp_path / "stable" / "ckpt", K, run, **kwargs)


def test_a_branch_plans_from_its_source_then_from_its_own_checkpoints(tmp_path):
    source = _stable(tmp_path)
    plan = plan_resume(_branch_config(tmp_path, source), print)
    assert plan.candidates == [source] and plan.branch and plan.explicit
    # A constant-LR stable run is a stable phase too.
    constant = _fake_checkpoint(tmp_path / "const" / "ckpt", K, [f"logging.run_dir={tmp_path / 'const'}",
                                                                  "schedule.decay_style=constant", "schedule.train_steps=9",
                                                                  "schedule.wsd_decay_steps=null"])
    assert plan_resume(_branch_config(tmp_path, constant), print).branch
    # Requeued after its first save, the branch resumes itself with the schedule it saved.
    own = _fake_checkpoint(tmp_path / "branch" / "ckpt", 4, BRANCH)
    lines = []
    plan = plan_resume(_branch_config(tmp_path, source), lines.append)
    assert plan.candidates == [own] and not plan.branch
    assert any("its own checkpoint" in line for line in lines), lines


# (stable run's overrides, branch's overrides, words the refusal must hold)
REFUSALS = {
    "inside-cooldown": (["schedule.train_steps=4", "schedule.wsd_decay_steps=2"], [],
                        ["step 3 is inside its run's cooldown (steps 3-4)", "at or before step 2"]),
    "decaying-run": (["schedule.decay_style=cosine", "schedule.wsd_decay_steps=null", "schedule.train_steps=9"], [],
                     ["decay_style=cosine", "already below the maximum"]),
    "other-warmup": ([], ["schedule.warmup_steps=1"], ["schedule.warmup_steps 2 there vs 1 here"]),
    "other-max-lr": ([], ["optimizer.lr=1e-3"], ["optimizer.lr 0.003 there vs 0.001 here"]),
    "other-min-lr": ([], ["optimizer.min_lr=0.0"], ["optimizer.min_lr 3e-05 there vs 0.0 here"]),
    "other-batch": ([], ["schedule.global_batch_size=16"], ["schedule.global_batch_size 8 there vs 16 here"]),
    "other-optimizer": (["optimizer.name=muon"], [], ["optimizer.name 'muon' there vs 'adamw' here"]),
    "other-muon": (["optimizer.name=muon"], ["optimizer.name=muon", "optimizer.muon.momentum=0.9"],
                   ["optimizer.muon {", "'momentum': 0.95", "'momentum': 0.9,"]),
    "not-a-cooldown": ([], ["schedule.decay_style=cosine", "schedule.wsd_decay_steps=null"],
                       ["a branch is a cooldown", "decay_style=cosine"]),
    "cooldown-elsewhere": ([], ["schedule.train_steps=7"],
                           ["starts the cooldown after step 5", "schedule.train_steps=5 schedule.wsd_decay_steps=2"]),
    "ends-after-cooldown": ([], ["schedule.train_steps=7", "schedule.decay_steps=5"],
                            ["decay_steps=5 differs", "after its cooldown"]),
    "resume-none": ([], ["checkpoint.resume=none"], ["checkpoint.resume=none contradicts it"]),
    "stable-ckpt-dir": ([], ["checkpoint.dir={stable}/ckpt"], ["is the stable run's own", "new checkpoint.dir"]),
    "stable-run-dir": ([], ["logging.run_dir={stable}"], ["is the stable run's own", "new logging.run_dir"]),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_branch_that_would_not_be_the_cooldown_is_refused(tmp_path, name):
    stable, branch, words = REFUSALS[name]
    source = _stable(tmp_path, stable)
    extra = [o.format(stable=tmp_path / "stable") for o in branch]
    with pytest.raises(CheckpointError) as info:
        plan_resume(_branch_config(tmp_path, source, extra), print)
    message = str(info.value)
    assert message.startswith(f"checkpoint.branch_from={source}: ") or name == "resume-none", message
    assert "\n" not in message and all(w in message for w in words), message


def test_a_source_from_before_the_optimizer_keys_reads_them_as_their_defaults(tmp_path):
    """A stable run saved before optimizer.name / optimizer.muon existed ran AdamW."""
    source = _stable(tmp_path, drop_optimizer_keys=("name", "muon"))
    assert plan_resume(_branch_config(tmp_path, source), print).branch
    with pytest.raises(CheckpointError, match="optimizer.name 'adamw' there vs 'muon' here"):
        plan_resume(_branch_config(tmp_path, source, ["optimizer.name=muon"]), print)


def test_a_missing_or_model_only_source_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"^checkpoint.branch_from: checkpoint .*/nothing does not exist"):
        plan_resume(_branch_config(tmp_path, tmp_path / "nothing"), print)
    source = _stable(tmp_path, has_optimizer=False)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        plan_resume(_branch_config(tmp_path, source), print)


def test_the_command_refuses_in_one_line_with_exit_2(tmp_path):
    source = _stable(tmp_path, ["schedule.train_steps=4", "schedule.wsd_decay_steps=2"])
    result = run_module("pretrain", ["--recipe", "tiny-llama", *BASE, *BRANCH, f"checkpoint.branch_from={source}",
                                     f"checkpoint.dir={tmp_path / 'b' / 'ckpt'}", f"logging.run_dir={tmp_path / 'b'}"],
                        timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [f"error: checkpoint.branch_from={source}: step 3 is inside its run's cooldown (steps 3-4); "
                      "branch from a checkpoint at or before step 2"], result.stderr
    assert not (tmp_path / "b").exists()  # refused before the run wrote anything


def _train(nproc, root, tag, extra):
    run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=BASE + extra + [f"checkpoint.dir={root / tag / 'ckpt'}", f"logging.run_dir={root / tag}"])
    return [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]


def _tensors(checkpoint):
    from checkpoints_tools.dcp_io import CheckpointReader

    reader = CheckpointReader(checkpoint)
    return {key: reader.read(key) for key in reader.tensor_keys()}


def _assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) and want, f"{what}: other tensors ({len(got)} vs {len(want)})"
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"{what}: {len(differ)} tensors differ, first {differ[0]}"


LAYOUTS = {
    "one-rank": (1, []),
    "TP2xPP2": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]),
    "ZeRO3-DP2": (2, ["parallel.sharding=zero3"]),
    # A constant-LR stable run (its LR max, min + 1.0 x (max - min) in a wsd run: equal here).
    "one-rank-constant-stable": (1, []),
}
CONSTANT = ["schedule.decay_style=constant", "schedule.wsd_decay_steps=null"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_branch_is_bitwise_the_uninterrupted_wsd_run(tmp_path, name):
    nproc, layout = LAYOUTS[name]
    reference = _train(nproc, tmp_path, "reference", layout + BRANCH + ["checkpoint.resume=none"])
    stable_schedule = STABLE + (CONSTANT if name.endswith("constant-stable") else [])
    stable = _train(nproc, tmp_path, "stable", layout + stable_schedule + [f"checkpoint.save_interval={K}",
                                                                            "checkpoint.resume=none"])
    source = tmp_path / "stable" / "ckpt" / step_dir_name(K)
    meta_before = (source / "meta.json").read_text()
    branch = _train(nproc, tmp_path, "branch", layout + BRANCH + [f"checkpoint.branch_from={source}"])
    assert [r["step"] for r in branch] == [K + 1, K + C]
    for key in ("loss", "grad_norm", "lr"):
        want = [r[key] for r in reference]
        assert_steps_equal([r[key] for r in stable[:K]], want[:K], what=f"{name} stable-phase {key}")
        assert_steps_equal([r[key] for r in branch], want[K:], what=f"{name} branch {key}", start=K + 1)
    # The branch cooled down where the stable run kept the maximum LR. (The update of step s uses
    # the scheduler's LR at s - 1, as in Megatron-LM: the cooldown's first update is still at max.)
    assert stable[K + 1]["lr"] == 3e-3 and branch[1]["lr"] < 3e-3
    final = step_dir_name(K + C)
    _assert_same_tensors(_tensors(tmp_path / "branch" / "ckpt" / final),
                         _tensors(tmp_path / "reference" / "ckpt" / final), f"{name} final weights and optimizer state")
    # The stable run is untouched and still resumable where it was.
    assert (tmp_path / "stable" / "ckpt" / "latest").read_text().strip() == step_dir_name(len(stable))
    assert (source / "meta.json").read_text() == meta_before
    assert len((tmp_path / "stable" / "metrics.jsonl").read_text().splitlines()) == len(stable)


def test_save_steps_are_saved_and_kept_past_keep_last(tmp_path):
    """checkpoint.save_steps (a stable run's branch points): due at those steps, and retention
    (keep_last) never deletes them."""
    from pretrain.checkpointing.checkpointer import Checkpointer, _retain

    root = tmp_path / "ckpt"
    for step in (2, 3, 4, 6, 8):
        _fake_checkpoint(root, step, STABLE)
    _retain(root, 1, root / step_dir_name(8), (3, 6))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        step_dir_name(s) for s in (3, 6, 8)]
    config = resolve_config("tiny-llama", None, BASE + STABLE + [f"checkpoint.dir={root}", "checkpoint.save_steps=[3]"])
    saver, due = Checkpointer(config, 1, print), []
    saver.save_now = lambda step, state, in_process=False: due.append(step)
    for step in range(1, 7):
        saver.save(step, None, last_step=step == 6)
    assert due == [3, 6]
