"""The hang watchdog: timeout derivation, phase awareness, and a hang injected on one rank of
two ending the job within the timeout with stack dumps, the last collective and exit 75."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.config import WatchdogConfig
from pretrain.observe.watchdog import EXIT_HANG, Watchdog, hang_reports
from tests.distributed import REPO


def test_timeout_is_startup_then_derived_from_the_median_with_a_floor(tmp_path):
    dog = Watchdog(WatchdogConfig(min_timeout_s=60, step_time_factor=10, startup_timeout_s=900), str(tmp_path), 0)
    assert dog.timeout()[0] == 900  # fewer than 5 steps timed
    for seconds in (1.0, 2.0, 3.0, 4.0, 100.0):  # the median (3 s) ignores one slow step
        dog.end_step(seconds)
    assert dog.timeout() == (30 * 2, "watchdog.min_timeout_s")  # 10 x 3 s = 30 s is under the floor
    for seconds in (20.0,) * 5:
        dog.end_step(seconds)
    assert dog.timeout()[0] == 200  # 10 x the median 20 s
    fixed = Watchdog(WatchdogConfig(timeout_s=7, startup_timeout_s=900), str(tmp_path), 0)
    assert fixed.timeout()[0] == 900  # the first step has start-up costs
    fixed.end_step(1.0)
    assert fixed.timeout() == (7, "watchdog.timeout_s")


_PAUSED_THEN_STUCK = r"""
import sys, time
from pretrain.config import WatchdogConfig
from pretrain.observe.watchdog import Watchdog
dog = Watchdog(WatchdogConfig(timeout_s=1.0), sys.argv[1], rank=3, poll_s=0.05)
dog.start()
dog.begin_step(6)
dog.end_step(0.1)
dog.begin_step(7)
with dog.paused("checkpoint save"):
    time.sleep(2.5)  # a long save: not a hang
print("survived the pause", flush=True)
def stuck_in_a_collective():
    time.sleep(30)
stuck_in_a_collective()
"""


def _fires_after(script: str, survived: str, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """Run a watchdog script that gets past a pause (printing `survived`) and then sticks in a
    30 s sleep: it must exit 75 well before the sleep ends, with one report; returns the run
    and the report's text."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_HANG, result.stdout + result.stderr
    assert survived in result.stdout
    assert time.monotonic() - start < 20  # not the 30 s sleep
    (report,) = hang_reports(str(tmp_path))
    return result, report.read_text()


def test_pauses_for_long_phases_then_fires_with_stacks_and_exit_75(tmp_path):
    result, text = _fires_after(_PAUSED_THEN_STUCK, "survived the pause", tmp_path)
    assert "rank 3" in text and "step 7, phase: checkpoint save" not in text
    assert "step 7, phase: train step" in text  # the phase it was in after the pause
    assert 'in stuck_in_a_collective' in text and "Thread" in text
    assert "hang watchdog: no progress in step 7" in result.stderr


_SAVE_STUCK = r"""
import sys, time
from pretrain.config import WatchdogConfig
from pretrain.observe.watchdog import Watchdog
dog = Watchdog(WatchdogConfig(timeout_s=1.0), sys.argv[1], rank=1, poll_s=0.05)
dog.start()
dog.begin_step(4)
dog.end_step(0.1)
with dog.paused("checkpoint save", 3.0, "watchdog.save_timeout_s"):
    time.sleep(2.0)  # longer than a step may take, within the save's own timeout
print("saved", flush=True)
dog.begin_step(5)
dog.end_step(0.1)
def stuck_in_a_save_collective():
    time.sleep(30)
with dog.paused("checkpoint save", 3.0, "watchdog.save_timeout_s"):
    stuck_in_a_save_collective()
"""


def test_a_save_has_its_own_timeout(tmp_path):
    """watchdog.save_timeout_s: a save may outlast the step timeout, not its own."""
    _, text = _fires_after(_SAVE_STUCK, "saved", tmp_path)
    assert "step 5, phase: checkpoint save" in text
    assert re.search(r"made no progress for \d+\.\d s; timeout 3\.0 s \(watchdog\.save_timeout_s\)", text), text
    assert "in stuck_in_a_save_collective" in text


_EVAL_STUCK = r"""
import sys, time
from pretrain.config import WatchdogConfig
from pretrain.observe.watchdog import Watchdog
dog = Watchdog(WatchdogConfig(timeout_s=1.5), sys.argv[1], rank=2, poll_s=0.05)
dog.start()
dog.begin_step(8)
dog.end_step(0.1)
with dog.batches("evaluation", 4) as begin_batch:
    for index in range(1, 5):
        begin_batch(index)
        time.sleep(0.7)  # 2.8 s of evaluation, each batch within the 1.5 s timeout
print("evaluated", flush=True)
dog.begin_step(9)
dog.end_step(0.1)
def stuck_in_an_evaluation_collective():
    time.sleep(30)
with dog.batches("evaluation", 4) as begin_batch:
    begin_batch(1)
    time.sleep(0.5)
    begin_batch(2)
    stuck_in_an_evaluation_collective()
"""


def test_each_evaluation_batch_is_timed_by_the_step_timeout(tmp_path):
    """An evaluation longer than the step timeout is not a hang; one batch that long is."""
    _, text = _fires_after(_EVAL_STUCK, "evaluated", tmp_path)
    assert "step 9, phase: evaluation, batch 2 of 4" in text, text
    assert re.search(r"made no progress for \d+\.\d s; timeout 1\.5 s \(watchdog\.timeout_s\)", text), text
    assert "in stuck_in_an_evaluation_collective" in text


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.distributed
@pytest.mark.slow
def test_hang_on_one_of_two_ranks_ends_the_job_with_stacks_and_exit_75(tmp_path):
    timeout = 10
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-llama", "--nproc", "2",
            "schedule.train_steps=20", "schedule.micro_batch_size=1", "schedule.global_batch_size=4",
            "schedule.seq_length=32", "schedule.eval_interval=0", "data.demo=false", "data.mock=true",
            "runtime.spec=portable", "logging.tensorboard=false", "logging.log_interval=1",
            f"logging.run_dir={run_dir}", "runtime.inject_hang_step=3", "runtime.inject_hang_rank=1",
            f"watchdog.timeout_s={timeout}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "launch.local", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=400)
    ended = time.time()
    assert proc.returncode == EXIT_HANG, out[-3000:] + err[-3000:]
    injected = float(re.search(r"rank 1 hangs in step 3 for 3600 s \(from unix time ([0-9.]+)\)", out).group(1))
    ended_after = ended - injected
    fired_after = min(p.stat().st_mtime for p in hang_reports(str(run_dir))) - injected
    timing = (f"the job ended {ended_after:.1f} s after the hang began (first stack dump after "
              f"{fired_after:.1f} s; timeout {timeout} s)")
    # The watchdog: the timeout, counted from the step's start (its forward/backward ran
    # before the injection: under a second, a few on a busy machine), its 1 s poll, the dump.
    assert timeout - 3 < fired_after < timeout + 2, timing
    # Then torchrun notices the exit (0.1 s), stops the other rank and exits, and launch.local
    # reports: about 3.5 s at load 12 on the 2-core machine, more when it is busier.
    assert ended_after < timeout + 10, timing
    assert "error: the hang watchdog stopped the run (exit 75" in err
    assert len(_metrics(run_dir)) == 2  # step 3 never finished
    reports = {int(p.name.split(".")[0].removeprefix("rank_")): p.read_text() for p in hang_reports(str(run_dir))}
    assert 1 in reports, list(reports)
    assert "step 3, phase: train step" in reports[1] and "in injected_hang" in reports[1]
    collectives = reports[1].split("last collectives")[1].split("Python stacks")[0]
    assert "gloo:all_reduce on group DATA_PARALLEL_GROUP" in collectives, collectives  # the grad sync
    # Rank 0 waits for rank 1 in the step's loss all-reduce. Its watchdog dumps too unless
    # rank 1's exit broke that all-reduce first (gloo: "Connection closed by peer", exit 1):
    # both time the same step, so which comes first is a race (rank 0 dumped in 18 of 19 runs).
    if 0 in reports:
        assert "in _agree" in reports[0] and "all_reduce" in reports[0].split("Python stacks")[0]
    print(timing + f"; ranks that dumped stacks: {sorted(reports)}")


@pytest.mark.distributed
def test_a_setup_step_that_never_ends_is_ended_by_the_startup_timeout(tmp_path):
    """The watchdog is armed from the start of set-up: a dataset build that never ends (rank 0
    spins, rank 1 waits in a barrier) ends with exit 75 and a report naming the set-up step."""
    from tests.distributed import RankFailure, run_ranks

    run_dir = tmp_path / "run"
    overrides = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
                 "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "schedule.seq_length=64",
                 "schedule.eval_interval=0", "watchdog.startup_timeout_s=20", f"logging.run_dir={run_dir}"]
    with pytest.raises(RankFailure, match=f"exited with {EXIT_HANG}"):
        run_ranks(2, "tests.pretrain.workers:stuck_in_dataset_build", overrides=overrides, timeout=240)
    reports = [p.read_text() for p in hang_reports(str(run_dir))]
    assert reports and all("phase: set-up: datasets" in r for r in reports), reports
    assert "watchdog.startup_timeout_s (set-up and the run's first step)" in reports[0]


def _stuck_two_ranks(tmp_path, worker: str, overrides: list[str]) -> dict[int, str]:
    """Train tiny-llama on 2 ranks with `worker` (tests.pretrain.workers) holding rank 1 in some
    phase: the job must end with exit 75 within 200 s; returns each rank's hang report."""
    from tests.distributed import RankFailure, run_ranks

    run_dir = tmp_path / "run"
    overrides = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
                 "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "schedule.seq_length=64",
                 "schedule.train_steps=4", *overrides, f"logging.run_dir={run_dir}"]
    start = time.monotonic()
    with pytest.raises(RankFailure, match=f"exited with {EXIT_HANG}"):
        run_ranks(2, f"tests.pretrain.workers:{worker}", overrides=overrides, timeout=240)
    assert time.monotonic() - start < 200
    reports = {int(p.name.split(".")[0].removeprefix("rank_")): p.read_text() for p in hang_reports(str(run_dir))}
    assert reports, "no hang report"
    return reports


@pytest.mark.distributed
def test_a_checkpoint_save_that_never_ends_is_ended_by_the_save_timeout(tmp_path):
    """watchdog.save_timeout_s in the training loop: a save that never ends (rank 1 stuck in
    it, rank 0 waiting in a barrier) ends with exit 75 and a report naming the save, well
    before the step timeout (600 s)."""
    reports = _stuck_two_ranks(tmp_path, "stuck_in_checkpoint_save", [
        "schedule.eval_interval=0", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_interval=2",
        "watchdog.timeout_s=600", "watchdog.save_timeout_s=8"])
    for rank, text in reports.items():
        assert "step 2, phase: checkpoint save" in text, text
        assert "timeout 8.0 s (watchdog.save_timeout_s)" in text, text
    if 1 in reports:
        assert "in stuck_writing_shards" in reports[1]


@pytest.mark.distributed
def test_an_evaluation_batch_that_never_ends_is_ended_by_the_step_timeout(tmp_path):
    """Evaluation in the training loop is watched batch by batch: a batch stuck on rank 1 (rank
    0 waiting in a barrier) ends with exit 75 and a report naming the evaluation batch."""
    reports = _stuck_two_ranks(tmp_path, "stuck_in_evaluation", [
        "schedule.eval_interval=2", "schedule.eval_steps=3", "watchdog.timeout_s=8"])
    for rank, text in reports.items():
        assert "step 2, phase: evaluation, batch 2 of 3" in text, text
        assert "timeout 8.0 s (watchdog.timeout_s)" in text, text
    if 1 in reports:
        assert "in stuck_in_an_evaluation_batch" in reports[1]
