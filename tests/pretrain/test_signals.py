"""A stop request (SIGTERM/SIGUSR1) during setup ends setup on every rank: exit 0, nothing
trained, nothing saved; before the process group exists it ends at once."""

from __future__ import annotations

import time

import pytest

from tests.distributed import RankFailure, run_ranks

BASE = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
        "checkpoint.resume=none", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
        "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.train_steps=5"]


def test_stop_before_the_process_group_ends_setup_at_once(tmp_path):
    overrides = BASE + [f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    [result] = run_ranks(1, "tests.pretrain.workers:stop_during_setup", overrides=overrides, signal_rank=0,
                         at="validate_before_start", timeout=300)
    assert result == {"code": 0, "trained": False}
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run").exists()  # it stopped before writing


@pytest.mark.distributed
def test_stop_on_one_rank_during_setup_stops_every_rank(tmp_path):
    overrides = BASE + ["parallel.pipeline_parallel=2", f"logging.run_dir={tmp_path / 'run'}",
                        f"checkpoint.dir={tmp_path / 'ckpt'}"]
    results = run_ranks(2, "tests.pretrain.workers:stop_during_setup", overrides=overrides, signal_rank=1,
                        at="build_model_chunks", timeout=300)
    assert results == [{"code": 0, "trained": False}] * 2
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("signame, code", [("SIGTERM", -15), ("SIGINT", -2)])
def test_stop_during_a_long_setup_step_ends_every_rank_within_seconds(tmp_path, signame, code):
    """A dataset build that never ends (rank 0 spinning in Python, rank 1 in a barrier): SIGTERM
    (or Ctrl-C's SIGINT) ends the ranks at once (the signal's default action in the long set-up steps), where a
    handler that only sets a flag left both running until killed."""
    overrides = BASE + ["watchdog.startup_timeout_s=600", f"logging.run_dir={tmp_path / 'run'}"]
    start = time.monotonic()
    with pytest.raises(RankFailure, match=f"exited with {code}"):
        run_ranks(2, "tests.pretrain.workers:stuck_in_dataset_build", overrides=overrides, signal_after_s=5.0,
                  signame=signame, timeout=240)
    assert time.monotonic() - start < 120  # set-up (~10-30 s on a busy 2-core machine) + 5 s, not the timeout
