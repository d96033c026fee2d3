"""Nothing lost: damaged checkpoints are found (sizes always, checksums by default) and passed
over for the previous one; newer checkpoints are never overwritten or deleted by a run that
resumes from an older one; retention keeps what this run saved last."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.distributed import run_module, run_ranks
from tests.pretrain.workers import logged_losses

pytestmark = [pytest.mark.distributed]

BASE = ["schedule.seq_length=32", "schedule.micro_batch_size=2", "schedule.global_batch_size=2",
        "data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
        "logging.log_interval=1"]


@pytest.fixture(scope="module")
def trained(module_tmp_factory):
    """Four steps, checkpoints at 2 and 4 (one rank), and the uninterrupted losses."""
    root = module_tmp_factory.mktemp("integrity")
    losses = logged_losses(run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=BASE + [
        "schedule.train_steps=4", "checkpoint.save_interval=2", f"checkpoint.dir={root / 'ckpt'}",
        "checkpoint.resume=none", f"logging.run_dir={root / 'run'}"]))
    return root / "ckpt", losses


def _copy(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[0], ckpt)
    return ckpt


def _resume(ckpt, tmp_path, *extra, steps=4):
    """python -m pretrain as a user runs it (forked with its imports done): (exit code, output)."""
    result = run_module("pretrain", ["--recipe", "tiny-llama", *BASE, f"schedule.train_steps={steps}",
                                     f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path / 'run'}", *extra])
    return result.returncode, result.stdout + result.stderr


def _losses(tmp_path) -> dict[int, float]:
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _flip(path, offset=4096, length=64 << 10):
    data = bytearray(path.read_bytes())
    data[offset:offset + length] = bytes(b ^ 0xFF for b in data[offset:offset + length])
    path.write_bytes(bytes(data))


def test_every_file_is_in_the_table_with_what_was_written(trained):
    ckpt, _ = trained
    for step in (2, 4):
        directory = ckpt / f"step_{step:08d}"
        table = json.loads((directory / "meta.json").read_text())["files"]
        on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
        assert set(table) == on_disk - {"meta.json", "COMPLETE"}
        import xxhash

        for name, entry in table.items():  # an independent hash of every file
            data = (directory / name).read_bytes()
            assert entry == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
        assert not list(directory.rglob("*.xxh3"))  # the writers' notes are folded in and gone


def test_flipped_bytes_in_the_newest_fall_back_to_the_previous_exactly(trained, tmp_path):
    ckpt = _copy(trained, tmp_path)
    shard = sorted((ckpt / "step_00000004").glob("*.distcp"))[0]
    _flip(shard)
    code, out = _resume(ckpt, tmp_path, f"checkpoint.resume={ckpt / 'step_00000004'}")
    assert code == 2 and f"{shard.name} differs from what was written" in out and "Traceback" not in out, out
    code, out = _resume(ckpt, tmp_path, "checkpoint.resume=auto")
    assert code == 0, out
    assert "step_00000004 is damaged" in out and "falling back" in out and "resumed from" in out, out
    assert "resuming from step 2" in out and "not from step 4: 2 steps are lost" in out, out
    assert _losses(tmp_path) == {3: trained[1][2], 4: trained[1][3]}  # bitwise: the same run
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("damaged.step_00000004")]
    assert (ckpt / "latest").read_text().strip() == "step_00000004" and (ckpt / "step_00000004" / "COMPLETE").is_file()


@pytest.mark.parametrize("damage, message", [
    ("truncate", "has 1000 bytes"),
    ("meta", "meta.json is unreadable"),
    ("megatron-metadata", "metadata.json is missing"),  # (format 1 had a common.pt to lose too)
])
def test_cheaply_found_damage_is_refused_or_passed_over_before_training(trained, tmp_path, damage, message):
    ckpt = _copy(trained, tmp_path)
    newest = ckpt / "step_00000004"
    if damage == "truncate":
        shard = sorted(newest.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "meta":
        (newest / "meta.json").write_text('{"step": 4, ')
    else:
        (newest / "metadata.json").unlink()
    code, out = _resume(ckpt, tmp_path, f"checkpoint.resume={newest}")
    assert code == 2 and message in out and "Traceback" not in out, out
    code, out = _resume(ckpt, tmp_path, "checkpoint.resume=auto", "schedule.train_steps=3")
    assert code == 0 and f"skipping damaged checkpoint {newest}" in out and message in out, out
    assert "resuming from step 2" in out and "not from step 4: 2 steps are lost" in out, out
    assert _losses(tmp_path) == {3: trained[1][2]}


def _only_newest(trained, tmp_path):
    ckpt = _copy(trained, tmp_path)
    shutil.rmtree(ckpt / "step_00000002")
    return ckpt, ckpt / "step_00000004"


def _refused(code, out, *names):
    """Exit 2, one `error:` line naming every fragment, no traceback."""
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert all(name in errors[0] for name in names), errors[0]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_auto_with_its_only_checkpoint_damaged_refuses_to_start_fresh(trained, tmp_path, damage):
    """Issue 48: the only checkpoint damaged (a shard truncated: found by a stat before any
    process group; bytes flipped: by the checksums after) and `auto` moved it aside and trained
    from step 0, exit 0: under Slurm's requeue a long run would restart from scratch. Now it
    refuses, keeps the checkpoint where it was, and says how to start fresh on purpose."""
    ckpt, only = _only_newest(trained, tmp_path)
    shard = sorted(only.glob("*.distcp"))[0]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        _flip(shard)
    code, out = _resume(ckpt, tmp_path, "checkpoint.resume=auto")
    _refused(code, out, "no usable checkpoint", "step_00000004 is damaged", shard.name,
             "checkpoint.resume=none checkpoint.on_newer=move_aside")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
    assert (only / "COMPLETE").is_file() and sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004"]
    if damage == "truncate":  # the way out it names works
        code, out = _resume(ckpt, tmp_path, "checkpoint.resume=none", "checkpoint.on_newer=move_aside", steps=1)
        assert code == 0 and list(ckpt.glob("superseded-*/step_00000004")), out


def test_auto_with_latest_naming_a_missing_checkpoint_refuses_to_start_fresh(trained, tmp_path):
    ckpt, only = _only_newest(trained, tmp_path)
    shutil.rmtree(only)  # `latest` still names it
    code, out = _resume(ckpt, tmp_path, "checkpoint.resume=auto")
    _refused(code, out, "no usable checkpoint", "latest names 'step_00000004', which is missing",
             "checkpoint.resume=none")
    assert "on_newer" not in out  # nothing complete is left to move aside
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resuming_from_an_older_step_never_deletes_or_overwrites_the_newer(trained, tmp_path):
    """The reproduction from the issue: step_2 and step_4 present, resume=2, save every step,
    keep_last=1, 3 steps: step 3 was saved and then deleted, `latest` left naming nothing."""
    ckpt = _copy(trained, tmp_path)
    args = ["checkpoint.resume=2", "checkpoint.save_interval=1", "checkpoint.keep_last=1"]
    code, out = _resume(ckpt, tmp_path, *args, steps=3)
    assert code == 2 and "newer than this run starts from step 2" in out and "step_00000004" in out, out
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000004"]
    code, out = _resume(ckpt, tmp_path, *args, "checkpoint.on_newer=move_aside", steps=3)
    assert code == 0, out
    aside = list(ckpt.glob("superseded-*/step_00000004/COMPLETE"))
    assert aside, out  # moved, whole
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000003"]  # keep_last=1: the newest
    assert (ckpt / "latest").read_text().strip() == "step_00000003"
    assert _losses(tmp_path) == {3: trained[1][2]}


def test_a_fresh_run_into_a_used_checkpoint_dir_is_refused(trained, tmp_path):
    ckpt = _copy(trained, tmp_path)
    code, out = _resume(ckpt, tmp_path, "checkpoint.resume=none", steps=2)
    assert code == 2 and "from scratch" in out and "step_00000002, step_00000004" in out, out


def test_auto_in_a_folder_of_interrupted_first_saves_starts_fresh(tmp_path):
    """Nothing was ever completed there (no COMPLETE, no `latest`): nothing to lose, no refusal."""
    from pretrain.checkpointing.resume import plan_resume
    from pretrain.cli import resolve_config

    ckpt = tmp_path / "ckpt"
    (ckpt / ".tmp.step_00000002").mkdir(parents=True)
    (ckpt / "step_00000004").mkdir()
    (ckpt / "step_00000004" / "meta.json").write_text("{}")
    config = resolve_config("tiny-llama", None, BASE + [f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"])
    warnings: list[str] = []
    assert plan_resume(config, warnings.append).first is None
    assert any("incomplete checkpoint" in w for w in warnings), warnings
