"""Checkpoints: exact resume, reshard on load, SIGTERM, crash mid-save, NaN policies, bad input."""

from __future__ import annotations

import json
import signal
import time

import pytest

from pretrain.checkpointing.format import CheckpointError
from pretrain.checkpointing.resume import plan_resume
from pretrain.cli import resolve_config
from tests.compare import assert_steps_close, assert_steps_equal
from tests.distributed import ModuleProcess, RankFailure, run_ranks
from tests.pretrain.workers import logged_losses

pytestmark = [pytest.mark.distributed]

BASE = [
    "schedule.train_steps=6", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.seq_length=64", "schedule.eval_interval=0", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "checkpoint.save_interval=3",
]
TP2PP2 = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]


def _train(nproc, tmp_path, tag, extra):
    return logged_losses(run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
                                   overrides=BASE + extra + [f"logging.run_dir={tmp_path / tag}"]))


@pytest.mark.slow
def test_exact_resume_and_reshard_on_load(tmp_path):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    full = _train(4, tmp_path, "full", TP2PP2 + [ckpt, "checkpoint.resume=none"])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000006"
    # Rewinding to step 3 in the same checkpoint.dir: step_6 of the run before is moved aside.
    resume = [ckpt, "checkpoint.resume=3", "checkpoint.on_newer=move_aside"]
    same = _train(4, tmp_path, "same", TP2PP2 + resume)
    assert_steps_equal(same, full[3:], what="same-layout resume loss", start=4)
    for name, nproc, layout in [("TP1xPP1", 1, []), ("TP1xPP2xDP2", 4, ["parallel.pipeline_parallel=2"])]:
        got = _train(nproc, tmp_path, name, layout + resume)
        assert_steps_close(got, full[3:], rtol=1e-5, what=f"{name} loss", start=4)


@pytest.mark.slow
def test_exact_resume_interleaved_distributed_optimizer_async_save(tmp_path):
    layout = ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", "optimizer.distributed=true"]
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    full = _train(2, tmp_path, "full", layout + [ckpt, "checkpoint.resume=none", "checkpoint.async_save=true"])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000006"
    resumed = _train(2, tmp_path, "resumed", layout + [ckpt, "checkpoint.resume=3", "checkpoint.on_newer=move_aside"])
    assert_steps_equal(resumed, full[3:], what="resumed loss", start=4)


@pytest.mark.slow
def test_async_save_at_dp2_resumes_exactly_and_at_tp2(tmp_path):
    # DP2 with the distributed optimizer: each rank holds half of the optimizer state, which
    # the save gathers on DP rank 0 (pretrain/megatron_fixes/optimizer_save.py) and stages for the writer.
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    full = _train(2, tmp_path, "full", [ckpt, "checkpoint.resume=none", "checkpoint.async_save=true"])
    rewind = [ckpt, "checkpoint.resume=3", "checkpoint.on_newer=move_aside"]
    assert_steps_equal(_train(2, tmp_path, "same", rewind), full[3:], what="DP2 resume loss", start=4)
    got = _train(2, tmp_path, "tp2", ["parallel.tensor_parallel=2", *rewind])
    assert_steps_close(got, full[3:], rtol=1e-5, what="TP2 loss", start=4)


@pytest.mark.parametrize("nproc, recipe, layout", [
    (4, "tiny-llama", ["parallel.tensor_parallel=2"]),  # TP2xDP2, SwiGLU factories
    (2, "tiny-moe", []),  # DP2: dense and expert optimizers (chained)
])
def test_optimizer_save_state_matches_megatron(nproc, recipe, layout):
    overrides = ["schedule.train_steps=2", "schedule.micro_batch_size=1", "schedule.global_batch_size=4",
                 "schedule.seq_length=32", "schedule.eval_interval=0", "data.demo=false",
                 "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
                 "checkpoint.resume=none", *layout]
    results = run_ranks(nproc, "tests.pretrain.workers:optimizer_state_vs_megatron", recipe=recipe,
                        overrides=overrides)
    for rank, r in enumerate(results):
        if r["dp_rank"] == 0:
            assert r["ours"] == r["theirs"] > 0 and not r["differ"], (rank, r)
            assert len(r["zero"]) <= r["ours"] // 10, (rank, r)  # trained: the values are real
        else:
            assert r["ours"] == 0, (rank, r)  # only DP rank 0 returns the gathered state


def _metrics(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pretrain(args):
    """`python -m pretrain` as a user starts it (forked with its imports done), signals and all."""
    return ModuleProcess("pretrain", ["--recipe", "tiny-llama", *args])


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resume_matches(tmp_path):
    common = [o for o in BASE if not o.startswith(("schedule.train_steps", "checkpoint.save_interval"))]
    common += ["schedule.train_steps=40", "logging.log_interval=1", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    ref = _pretrain(common + [f"logging.run_dir={tmp_path / 'ref'}", "checkpoint.dir=null"])
    assert ref.wait(timeout=300) == 0, ref.stdout.read()
    reference = [m["loss"] for m in _metrics(tmp_path / "ref")]

    proc = _pretrain(common + [f"logging.run_dir={tmp_path / 'run'}"])
    deadline = time.monotonic() + 240
    while len(_metrics(tmp_path / "run")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "training ended before the signal"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal during the save must not corrupt it
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out
    stopped = len(_metrics(tmp_path / "run"))
    assert stopped < 40 and "stopping after step" in out
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert latest == f"step_{stopped:08d}" and (tmp_path / "ckpt" / latest / "COMPLETE").is_file()

    resumed = _pretrain(common + [f"logging.run_dir={tmp_path / 'resumed'}"])
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read()
    assert_steps_equal([m["loss"] for m in _metrics(tmp_path / "resumed")], reference[stopped:],
                       what="loss after the SIGTERM resume", start=stopped + 1)


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_resumable_latest(tmp_path):
    """Kill -9 a run that saves every step at several moments; each time `latest` names a
    complete checkpoint and training resumes from it."""
    ckpt = tmp_path / "ckpt"
    common = [o for o in BASE if not o.startswith(("schedule.train_steps", "checkpoint.save_interval"))]
    common += ["schedule.train_steps=200", "checkpoint.save_interval=1", "logging.log_interval=1",
               f"checkpoint.dir={ckpt}", "checkpoint.keep_last=2"]
    for attempt, delay in enumerate([0.0, 0.13, 0.31]):
        proc = _pretrain(common + [f"logging.run_dir={tmp_path / f'run{attempt}'}"])
        deadline = time.monotonic() + 240
        while len(_metrics(tmp_path / f"run{attempt}")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            time.sleep(0.02)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        latest = ckpt / (ckpt / "latest").read_text().strip()
        assert (latest / "COMPLETE").is_file(), f"latest -> {latest} is not complete"
        config = resolve_config("tiny-llama", None, common)
        assert plan_resume(config, print).first is not None
    results = run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=common + [
        "schedule.train_steps=" + str(int((ckpt / "latest").read_text().strip()[5:]) + 1),
        f"logging.run_dir={tmp_path / 'final'}"])
    assert len(logged_losses(results)) == 1


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    _train(1, tmp_path, "run", [f"checkpoint.dir={ckpt}", "checkpoint.resume=none"])
    # Simulate crashes at the points of the save protocol: shards written into the temporary
    # directory; directory renamed but COMPLETE missing (cannot happen in our order, but a
    # copied or truncated checkpoint looks like this); COMPLETE written but latest not moved.
    (ckpt / ".tmp.step_00000009").mkdir()
    (ckpt / ".tmp.step_00000009" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "step_00000012").mkdir()
    (ckpt / "step_00000012" / "meta.json").write_text("{}")
    config = resolve_config("tiny-llama", None, BASE + [f"checkpoint.dir={ckpt}"])
    warnings = []
    assert plan_resume(config, warnings.append).first == ckpt / "step_00000006"
    assert any("incomplete checkpoint" in w and "step_00000012" in w for w in warnings)
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    with pytest.raises(CheckpointError, match="incomplete"):
        plan_resume(config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
            update={"resume": str(ckpt / "step_00000012")})}), print)
    # Resuming with auto after the "crash" works and continues at step 7.
    results = run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=BASE + [
        f"checkpoint.dir={ckpt}", "checkpoint.resume=auto", "schedule.train_steps=7",
        f"logging.run_dir={tmp_path / 'again'}"])
    assert len(logged_losses(results)) == 1


def _fake_checkpoints(ckpt, config, steps):
    """Checkpoint folders that pass every check a stat can make (no model inside)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from pretrain.checkpointing.checkpointer import training_meta
    from pretrain.checkpointing.format import mark_complete, step_dir_name
    from pretrain.checkpointing.integrity import collect_file_table

    for step in steps:
        directory = ckpt / step_dir_name(step)
        directory.mkdir(parents=True)
        (directory / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
        torch.save({}, directory / "common.pt")
        meta = training_meta(config, step, 1)
        meta.files = collect_file_table(directory)
        meta.write(directory)
        mark_complete(directory)


def test_resume_auto_follows_latest_and_falls_back_when_it_is_stale(tmp_path):
    """Training (checkpoint.resume=auto) and the tools pick the same checkpoint, through the
    one format module: the one `latest` names; the newest complete one, with a warning, when
    `latest` names something missing or incomplete. A `latest` pointing back past newer
    checkpoints is followed by the tools; training refuses to run over the newer ones."""
    from checkpoints_tools.common import resolve_checkpoint
    from pretrain.checkpointing.format import COMPLETE, write_latest

    ckpt = tmp_path / "ckpt"
    config = resolve_config("tiny-llama", None, BASE + [f"checkpoint.dir={ckpt}"])
    _fake_checkpoints(ckpt, config, (3, 6, 9))
    cases = [("step_00000009", "step_00000009", None),
             ("step_00000012", "step_00000009", "names 'step_00000012', which is not a complete checkpoint"),
             ("garbage\n\n", "step_00000009", "names 'garbage'")]
    for pointer, expected, warning in cases:
        write_latest(ckpt, pointer)
        warnings = []
        assert plan_resume(config, warnings.append).first == ckpt / expected
        assert resolve_checkpoint(ckpt) == ckpt / expected
        assert (warning is None and not warnings) or any(warning in w for w in warnings), warnings
    write_latest(ckpt, "step_00000006")  # pointed back on purpose
    assert resolve_checkpoint(ckpt) == ckpt / "step_00000006"
    with pytest.raises(CheckpointError, match="newer than this run starts from step 6.*step_00000009"):
        plan_resume(config, print)
    (ckpt / "step_00000009" / COMPLETE).unlink()  # a damaged newest one
    write_latest(ckpt, "step_00000009")
    warnings = []
    assert plan_resume(config, warnings.append).first == ckpt / "step_00000006"
    assert any("incomplete checkpoint" in w for w in warnings) and any("not a complete" in w for w in warnings)


@pytest.mark.parametrize("resume, message", [
    ("{tmp}/missing", "does not exist"),
    ("{tmp}", "is not a checkpoint"),
])
def test_bad_resume_paths(tmp_path, resume, message):
    config = resolve_config("tiny-llama", None, BASE + [f"checkpoint.resume={resume.format(tmp=tmp_path)}"])
    with pytest.raises(CheckpointError, match=message):
        plan_resume(config, print)


def test_incompatible_model_is_refused_before_training(tmp_path):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    _train(1, tmp_path, "a", [ckpt, "checkpoint.resume=none", "schedule.train_steps=3"])
    with pytest.raises(RankFailure, match=r"(?s)incompatible model:.*hidden_size: checkpoint 128 vs config 64"):
        _train(1, tmp_path, "b", [ckpt, "model.hidden_size=64", "model.ffn_hidden_size=176"])


def test_nan_skip_policy_skips_the_update_and_continues(tmp_path):
    _train(2, tmp_path, "skip", ["runtime.inject_nan_step=2", "checkpoint.on_nan=skip", "logging.log_interval=1"])
    records = _metrics(tmp_path / "skip")
    assert [r["skipped"] for r in records] == [False, True, False, False, False, False]
    assert all(r["loss"] == r["loss"] for r in records)  # losses stay finite


def test_nan_stop_policy_names_step_and_saves_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailure, match="non-finite loss or gradients at step 4"):
        _train(2, tmp_path, "stop", ["runtime.inject_nan_step=4", f"checkpoint.dir={ckpt}"])
    assert (ckpt / "latest").read_text().strip() == "step_00000003"
    assert not (ckpt / "step_00000004").exists()
