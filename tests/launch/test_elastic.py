"""Elastic training (launch.slurm --elastic-min-nodes): losing a node does not end the run.

Two torchrun agents ("nodes") of 2 ranks each on this machine, c10d rendezvous, --nnodes 1:2,
as the sbatch script runs them. One agent and its ranks are SIGKILLed mid-run (a node
crash); the survivor re-forms a world of 2, resumes from the last complete checkpoint
resharded from DP4 to DP2, and keeps the global batch (twice the micro-batches per rank)
and the sample order: every step after the loss matches the uninterrupted DP4 run at fp32
reduction tolerance. Also: the script launch.slurm writes for it, and its input checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch.launchers.local import free_port
from launch.launchers.slurm import main
from tests.distributed import REPO

STEPS, SAVE_EVERY = 8, 2
# micro batch 2, global batch 8: DP4 runs 1 micro-batch per rank, DP2 runs 2.
BASE = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
        "schedule.micro_batch_size=2", "schedule.global_batch_size=8", "schedule.seq_length=64",
        "schedule.eval_interval=0", "logging.log_interval=1", f"schedule.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}", "checkpoint.resume=auto", "optimizer.lr=1e-2",
        "schedule.warmup_steps=2"]
# Another DP size sums in another order: fp32 reduction tolerance (as tests/launch/test_multinode.py).
RESHARD_TOL = dict(rel=1e-5, abs=1e-6)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
       # What the sbatch script exports for an elastic job (pytorch/pytorch#135712).
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
       # Both "nodes" are this host: loopback on purpose (pretrain.netcheck refuses it otherwise).
       "GLOO_SOCKET_IFNAME": "lo"}


def _steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm); a step run again after the re-formation keeps its last record."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def _train_args(run_dir: Path) -> list[str]:
    return ["-m", "pretrain", "--recipe", "tiny-llama", *BASE, f"logging.run_dir={run_dir}",
            f"checkpoint.dir={run_dir}/ckpt"]


def _agent(port: int, run_dir: Path, log: Path) -> subprocess.Popen:
    """One node's torchrun with the elastic options of launch.slurm's script."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--max-restarts=3",
           "--rdzv-conf=last_call_timeout=5", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", *_train_args(run_dir)]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _crash(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its ranks at once, as a node crash does."""
    tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)


@pytest.mark.slow
@pytest.mark.distributed
def test_losing_a_node_shrinks_dp_and_the_losses_match_the_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "elastic"
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          *_train_args(ref_dir)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    reference = _steps(ref_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    port = free_port()
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    survivor = _agent(port, run_dir, logs[0])
    time.sleep(1)  # the survivor hosts the rendezvous store (on a cluster: the first node)
    lost = _agent(port, run_dir, logs[1])
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "ckpt" / f"step_{SAVE_EVERY:08d}" / "COMPLETE").exists() or \
                max(_steps(run_dir), default=0) <= SAVE_EVERY:
            assert survivor.poll() is None and lost.poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        crashed_at = max(_steps(run_dir))
        _crash(lost)
        t_crash = time.monotonic()
        assert survivor.wait(timeout=300) == 0, logs[0].read_text()[-4000:]
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                _crash(proc)
    out = logs[0].read_text()
    assert "world 2 = TP1xPP1xDP2" in out, out[-3000:]
    resumed = int(out.split("resumed from ")[1].split(" at step ")[1].split(":")[0])
    assert resumed >= SAVE_EVERY and resumed <= crashed_at
    assert "resharded from TP1xPP1xDP4 to TP1xPP1xDP2" in out
    got = _steps(run_dir)
    assert sorted(got) == sorted(reference)
    for step, (want, have) in enumerate(zip([reference[s] for s in sorted(reference)],
                                             [got[s] for s in sorted(got)], strict=True), start=1):
        if step <= resumed:  # before the loss of the node: the same run, bitwise
            assert have == want, f"step {step}: {have} != {want}"
        else:
            assert have[0] == pytest.approx(want[0], **RESHARD_TOL), f"step {step} loss"
            assert have[1] == pytest.approx(want[1], **RESHARD_TOL), f"step {step} grad norm"
    print(f"\nnode lost after step {crashed_at}; survivor resumed from step {resumed} at DP2 and "
          f"finished {time.monotonic() - t_crash:.1f} s after the crash")


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
