"""data_pipeline.preprocess_slurm on a real Slurm cluster (the `slurm_env` fixture; skips
without Slurm, fails under PRETRAIN_REQUIRE_SLURM=1): the job array, a task that fails,
the dependent merge, byte for byte against one `preprocess` run.

A task is made to fail for real by what is in its way: its `.bin.partial` is a symlink to
a directory, so opening it for writing fails (IsADirectoryError, exit 1); the failed
attempt removes its temporaries, the symlink among them, so the next attempt succeeds.
Both runs are submitted first and then waited for, so their waits overlap.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from data_pipeline.preprocess import main as preprocess_main
from tests.data_pipeline.test_preprocess_slurm import corpus, options
from tests.distributed import run_module
from tests.launch.slurm_helpers import slurm_env, wait_for_job  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow]


def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return run_module("data_pipeline.preprocess_slurm", args, env=env, timeout=300)


def submit(args: list[str], env: dict) -> tuple[str | None, str, str]:
    """(array job or None, merge job, output) of one `--submit` run."""
    result = cli([*args, "--submit"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    array = re.search(r"submitted: array job (\d+)", result.stdout)
    merge = re.search(r"submitted: merge job (\d+)", result.stdout)
    assert merge, result.stdout
    return (array.group(1) if array else None), merge.group(1), result.stdout


def wait_until_gone(job: str, env: dict, timeout: float = 120) -> None:
    """Until no task of the (array) job is queued or running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout
        if not queued.strip():
            return
        time.sleep(1.0)
    pytest.fail(f"array job {job} still queued after {timeout:.0f} s")


def block_first_attempt(work_dir: Path, shard: int, target: Path) -> Path:
    shards = work_dir / "shards"
    shards.mkdir(parents=True)
    obstacle = shards / f"shard-{shard:05d}.bin.partial"
    obstacle.symlink_to(target, target_is_directory=True)
    return obstacle


def log_of(work_dir: Path, array: str, task: int) -> str:
    return (work_dir / "logs" / f"task-{array}_{task}.out").read_text()


def test_failed_task_reruns_alone_and_the_merge_is_byte_identical(slurm_env, tmp_path):
    inputs = corpus(tmp_path)
    job = ["--partition", "debug", "--time", "5"]  # few shards: each task pays ~5 CPU-s of imports
    # Ordered so the waits overlap: b's failure and re-run go on while a's task is requeued.
    # b: no retries; shard 1 fails, Slurm cancels the merge; the same command again submits
    # shard 1 alone and a new merge
    obstacle_b = block_first_attempt(tmp_path / "b.shards", 1, tmp_path)
    argv_b = [*options(inputs), "-o", str(tmp_path / "b"), *job, "--shards", "2", "--retries", "0"]
    array_b, merge_b, _ = submit(argv_b, slurm_env)
    # a: one retry; shard 1's first attempt fails, requeues itself alone, the merge waits for it
    block_first_attempt(tmp_path / "a.shards", 1, tmp_path)
    array_a, merge_a, out_a = submit([*options(inputs), "-o", str(tmp_path / "a"), *job, "--shards", "3",
                                      "--retries", "1"], slurm_env)
    assert f"$ sbatch --parsable --array=0-2 {tmp_path}/a.shards/task.sh" in out_a
    assert f"$ sbatch --parsable --dependency=afterok:{array_a} --kill-on-invalid-dep=yes" in out_a

    info = wait_for_job(merge_b, slurm_env, tmp_path / "b.shards")
    assert info["JobState"] == "CANCELLED" and info["Reason"] == "DependencyNeverSatisfied", info
    wait_until_gone(array_b, slurm_env)
    assert not obstacle_b.is_symlink()  # the failed attempt removed its temporaries
    assert not (tmp_path / "b.bin").exists()
    kept = {0: (tmp_path / "b.shards/shards/shard-00000.bin").stat()}
    rerun_array, rerun_merge, out = submit(argv_b, slurm_env)
    assert f"--array=1 {tmp_path}/b.shards/task.sh" in out, out

    assert preprocess_main([*options(inputs), "-o", str(tmp_path / "one"), "--workers", "0", "--no-progress"]) == 0
    one = {ext: (tmp_path / f"one.{ext}").read_bytes() for ext in ("bin", "idx")}

    info = wait_for_job(merge_a, slurm_env, tmp_path / "a.shards")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == one[ext], ext
    retried = log_of(tmp_path / "a.shards", array_a, 1)
    assert "shard-00001.bin" in retried and "Is a directory" in retried, retried
    assert "shard 1 failed (exit 1); requeueing it alone (retry 1 of 1)" in retried, retried
    assert "shard 1 attempt 1 on" in retried and "shard 1 exited with status 0" in retried, retried
    for task in (0, 2):  # the others ran once
        log = log_of(tmp_path / "a.shards", array_a, task)
        assert "attempt 0" in log and "attempt 1" not in log, log

    info = wait_for_job(rerun_merge, slurm_env, tmp_path / "b.shards")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    for ext in ("bin", "idx"):
        assert (tmp_path / f"b.{ext}").read_bytes() == one[ext], ext
    for k, before in kept.items():  # finished shards were not rewritten
        after = (tmp_path / f"b.shards/shards/shard-{k:05d}.bin").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), k
    assert sorted(p.name for p in (tmp_path / "b.shards/logs").glob(f"task-{rerun_array}_*")) == \
        [f"task-{rerun_array}_1.out"]
