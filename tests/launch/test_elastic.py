"""Elastic training (launch.slurm --elastic-min-nodes): the script it writes and its input checks.

The elastic run itself (a node lost mid-run, the survivor re-forming at the smaller DP and
matching the uninterrupted run) is a job on the multi-node Slurm cluster in
tests/launch/test_multinode_faults.py (2 nodes -> 1) and tests/launch/test_multinode_elastic.py
(3 nodes -> 2: the survivors re-form across hosts).
"""

from __future__ import annotations

import pytest

from launch.launchers.slurm import main

ELASTIC = ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "2", "--launcher", "torchrun",
           "--partition", "debug", "--time", "10", "--dry-run", "checkpoint.resume=auto",
           "checkpoint.save_interval=2", "schedule.micro_batch_size=2"]


def test_elastic_script_keeps_the_job_when_a_node_fails(capsys):
    # DP 4, 6 or 8 as 2, 3 or 4 nodes are left: 48 = micro batch 2 x 4, x 6 and x 8 times a whole number.
    assert main(ELASTIC + ["--nodes", "4", "--elastic-min-nodes", "2", "schedule.global_batch_size=48"]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --no-kill", "--no-kill \\", "--kill-on-bad-exit=0", '--nnodes="2:$SLURM_JOB_NUM_NODES"',
                 "--max-restarts=3", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert line in script, line
    assert "--kill-on-bad-exit=1" not in script
    assert main(ELASTIC + ["--nodes", "4", "schedule.global_batch_size=48"]) == 0
    plain = capsys.readouterr().out
    assert "--no-kill" not in plain and "--kill-on-bad-exit=1" in plain and "TORCH_DISABLE_SHARE" not in plain


@pytest.mark.parametrize("extra, message", [
    # 3 nodes x 2 ranks = DP6: 16 is not a multiple of micro batch 2 x 6 (2 and 4 nodes fit)
    (["--nodes", "4", "--elastic-min-nodes", "2", "schedule.global_batch_size=16"],
     "3 node(s) = 6 ranks: schedule.global_batch_size=16 is not divisible"),
    (["--nodes", "2", "--elastic-min-nodes", "2", "schedule.global_batch_size=8"], "below --nodes 2"),
    (["--nodes", "2", "--elastic-min-nodes", "1", "schedule.global_batch_size=8", "--launcher", "srun"],
     "needs --launcher torchrun"),
    (["--nodes", "2", "--elastic-min-nodes", "1", "schedule.global_batch_size=8", "checkpoint.resume=none"],
     "checkpoint.resume=auto"),
])
def test_elastic_bad_input_is_one_line_before_anything(extra, message, capsys):
    code = main(ELASTIC + extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
