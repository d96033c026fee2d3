"""launch.slurm against a real single-node Slurm cluster: submit, finish, preempt, resume.

Every job is the CPU tiny-llama recipe through `python -m launch.slurm ... --submit`, as a
user runs it; the cluster comes from the `slurm_env` fixture (skips without Slurm).
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pretrain.cli import resolve_config
from tests.launch.slurm_helpers import (
    describe,
    read_losses,
    slurm_env,  # noqa: F401  (fixture)
    submit,
    wait_for_job,
    wait_for_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 12
# TP2 x PP2 over 4 gloo ranks; small batches so a job is mostly start-up (~30 s on 2 cores).
TINY = [
    "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", f"schedule.train_steps={STEPS}",
    "schedule.seq_length=64", "schedule.global_batch_size=8", "schedule.micro_batch_size=2",
    "schedule.eval_interval=0", "logging.tensorboard=false", "logging.log_interval=1",
    "checkpoint.save_interval=4",
]


def cpu_job(run_dir: Path, cache: Path, ranks: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--recipe", "tiny-llama", "--cpu", "--nodes", "1", "--ntasks-per-node", str(ranks),
            "--partition", "debug", "--time", "10", "--run-dir", str(run_dir), *extra,
            f"data.cache_dir={cache}"]


@pytest.fixture(scope="module")
def cache_dir(module_tmp_factory) -> Path:
    return module_tmp_factory.mktemp("demo-data")  # the demo corpus, tokenised once for all jobs


@pytest.fixture(scope="module")
def uninterrupted(slurm_env, module_tmp_factory, cache_dir):
    """The TP2 x PP2 job run to the end once; the reference for the preemption test."""
    run_dir = module_tmp_factory.mktemp("uninterrupted") / "run"
    job_id = submit(cpu_job(run_dir, cache_dir) + TINY, slurm_env)
    return run_dir, job_id, wait_for_job(job_id, slurm_env, run_dir)


def test_submit_tp2_pp2_runs_to_completion(uninterrupted):
    run_dir, job_id, info = uninterrupted
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    losses = read_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)), describe(run_dir)
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 0.3, f"loss did not fall: {losses}"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["tensor_parallel"] == 2
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "training exited with status 0" in batch_log
    node_logs = list((run_dir / "logs").glob(f"{job_id}-node0-*.log"))
    assert len(node_logs) == 1, list((run_dir / "logs").iterdir())
    labels = {line.split(":", 1)[0] for line in node_logs[0].read_text().splitlines() if ":" in line}
    assert {"0", "1", "2", "3"} <= labels  # every rank's output, prefixed with its task id


def test_usr1_saves_requeues_resumes_and_matches_uninterrupted(slurm_env, tmp_path, cache_dir, uninterrupted):
    run_dir = tmp_path / "run"
    job_id = submit(cpu_job(run_dir, cache_dir) + TINY, slurm_env)
    wait_for_step(run_dir, 3, job_id, slurm_env)
    # What Slurm does --signal-seconds before the time limit: USR1 to the batch script only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_env, check=True)
    info = wait_for_job(job_id, slurm_env, run_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    assert int(info["Restarts"]) == 1, describe(run_dir)
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "requeueing job" in batch_log and "attempt 1" in batch_log, batch_log
    node_log = next((run_dir / "logs").glob(f"{job_id}-node0-*.log")).read_text()
    assert "resumed from" in node_log, describe(run_dir)
    resumed = read_losses(run_dir)
    reference = read_losses(uninterrupted[0])
    assert sorted(resumed) == sorted(reference)
    mismatched = {s: (resumed[s], reference[s]) for s in reference
                  if not math.isclose(resumed[s], reference[s], rel_tol=1e-6, abs_tol=1e-6)}
    assert not mismatched, f"step: (resumed, uninterrupted) {mismatched}\n{describe(run_dir)}"


def test_hostile_names_paths_and_overrides_run_no_command(slurm_env, tmp_path, cache_dir):
    """Values from the command line land in #SBATCH lines, comments and bash; none may run."""
    marker = tmp_path / "pwned"
    # The example, then command substitutions, quotes and a line break.
    name = f"x; rm -rf ~; touch {marker}-1 $(touch {marker}-2) `touch {marker}-3` \"q\" 'q'\n touch {marker}-4"
    job_name = f"job \"x; touch {marker}-5 $(touch {marker}-6) # '"
    run_dir = tmp_path / "run dir with 'quotes', \"double\", $HOME, %j and spaces"
    extra = ("--job-name", job_name, "--env", f"HOSTILE=$(touch {marker}-7)'\"")
    overrides = [f"name={name}", "schedule.train_steps=2", "schedule.seq_length=32",
                 "schedule.global_batch_size=2", "schedule.micro_batch_size=2",
                 "schedule.eval_interval=0", "logging.tensorboard=false", "logging.log_interval=1"]
    job_id = submit(cpu_job(run_dir, cache_dir, ranks=1, extra=extra) + overrides, slurm_env)
    info = wait_for_job(job_id, slurm_env, run_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    assert not list(tmp_path.glob("pwned*")), "a command from user input ran"
    raw = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=slurm_env,
                         capture_output=True, text=True, check=True).stdout
    assert re.search(r"JobName=(.*?) UserId=", raw).group(1) == job_name
    # The override reached the training exactly as `key=value` parsing reads it.
    expected = resolve_config("tiny-llama", None, [f"name={name}"]).name
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["name"] == expected
    assert read_losses(run_dir).keys() == {1, 2}
    assert (run_dir / "logs" / f"slurm-{job_id}.out").is_file()  # %j in the path stayed literal


def test_job_exit_code_is_the_trainings(slurm_env, tmp_path, cache_dir):
    """A training that fails (data only 'the compute nodes see', and it is not there) fails the
    job with the training's status: 2, the missing data refused before any process group."""
    run_dir = tmp_path / "run"
    overrides = ["data.demo=false", f"data.blend=[[1.0, {tmp_path}/missing/prefix]]", "data.tokenizer=byte",
                 "schedule.train_steps=2", "logging.tensorboard=false"]
    job_id = submit(cpu_job(run_dir, cache_dir, ranks=1, extra=("--no-path-check",)) + overrides, slurm_env)
    info = wait_for_job(job_id, slurm_env, run_dir)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    assert "training exited with status 2" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def test_torchrun_per_node_launcher(slurm_env, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = ["parallel.pipeline_parallel=2", "schedule.train_steps=3", "schedule.seq_length=32",
                 "schedule.global_batch_size=4", "schedule.micro_batch_size=2",
                 "schedule.eval_interval=0", "logging.tensorboard=false", "logging.log_interval=1"]
    job_id = submit(cpu_job(run_dir, cache_dir, ranks=2, extra=("--launcher", "torchrun")) + overrides, slurm_env)
    info = wait_for_job(job_id, slurm_env, run_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    assert read_losses(run_dir).keys() == {1, 2, 3}
    assert "(torchrun, cpu/gloo)" in describe(run_dir)  # ranks came from torchrun, not srun


def test_hang_watchdog_exit_requeues_and_resumes_from_the_last_checkpoint(slurm_env, tmp_path, cache_dir,
                                                                           uninterrupted):
    """Rank 1 of 4 stops making progress at step 6 (test-only fault injection): the watchdogs
    dump their stacks and exit 75, the job script requeues the job, and the new attempt
    resumes from step 4's checkpoint (the injection is skipped in a resumed run) to the end,
    matching the uninterrupted run."""
    run_dir = tmp_path / "run"
    hang = ["runtime.inject_hang_step=6", "runtime.inject_hang_rank=1", "watchdog.timeout_s=20"]
    job_id = submit(cpu_job(run_dir, cache_dir) + TINY + hang, slurm_env)
    info = wait_for_job(job_id, slurm_env, run_dir, timeout=600)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    assert int(info["Restarts"]) == 1, describe(run_dir)
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "the hang watchdog stopped the ranks" in batch_log and "hang requeue 1 of 3" in batch_log, batch_log
    assert "attempt 1" in batch_log, batch_log
    reports = list((run_dir / "hang").glob("rank_1.*.txt"))
    assert len(reports) == 1 and "in injected_hang" in reports[0].read_text(), describe(run_dir)
    node_log = next((run_dir / "logs").glob(f"{job_id}-node0-*.log")).read_text()
    assert "resumed from" in node_log and "step_00000004" in node_log, describe(run_dir)
    resumed, reference = read_losses(run_dir), read_losses(uninterrupted[0])
    assert sorted(resumed) == sorted(reference)
    mismatched = {s: (resumed[s], reference[s]) for s in reference
                  if not math.isclose(resumed[s], reference[s], rel_tol=1e-6, abs_tol=1e-6)}
    assert not mismatched, f"step: (resumed, uninterrupted) {mismatched}\n{describe(run_dir)}"
