"""The batch host of an elastic `--no-requeue` job is lost: the job ends, saying why.

    PRETRAIN_REQUIRE_SLURM=1 python -m pytest tests/launch/test_multinode_batch_host_no_requeue.py -s

As tests/launch/test_multinode_batch_host.py (3 nodes, `--elastic-min-nodes 2`, the first
node crashed after a checkpoint), but the job may not be requeued: a survivor's
launch.launchers.elastic_guard cancels it instead of leaving it RUNNING with nothing training,
with one line in its node's log (seen by hand: CANCELLED at +34.7 s after the crash).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.launch.slurm_helpers import TERMINAL, describe, job_info, multinode_cluster
from tests.launch.test_multinode_elastic import submit_past_first_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

END_DEADLINE_S = 150  # from the crash; the batch host is DOWN after ~27 s (SlurmdTimeout=10)


@pytest.fixture(scope="module")
def cluster():
    with multinode_cluster(3, "pretrain-mq-") as cluster:
        yield cluster


def test_the_job_is_cancelled_with_a_message_when_it_may_not_be_requeued(cluster, module_tmp_factory):
    from launch.launchers import ci_multinode

    layout, env = cluster
    job_id, run_dir, _ = submit_past_first_checkpoint(module_tmp_factory.mktemp("no-requeue"), env, "--no-requeue")
    info = job_info(job_id, env)
    assert info["JobState"] == "RUNNING" and info["BatchHost"] == "mn1", info
    ci_multinode.crash_node(layout, 1)
    t0 = time.monotonic()
    seen: list[tuple] = []
    while time.monotonic() - t0 < END_DEADLINE_S:
        info = job_info(job_id, env)
        state = (info["JobState"], info["NodeList"], info["Restarts"])
        if not seen or seen[-1][1:] != state:
            seen.append((round(time.monotonic() - t0, 1), *state))
        if info["JobState"] in TERMINAL:
            break
        time.sleep(0.5)
    assert seen[-1][1] == "CANCELLED" and seen[-1][3] == "0", (
        f"job {job_id} not cancelled within {END_DEADLINE_S} s of the crash of its batch host mn1: "
        f"(s, state, NodeList, Restarts) seen {seen}\n{describe(run_dir)}")
    guard_logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(f"{job_id}-guard-*.log")))
    line = re.search(rf"\[launch\.slurm\] the batch host mn1 is down \(State=DOWN\S*\) and job {job_id} may not be "
                     rf"requeued \(--no-requeue\): "
                     "cancelling it; resubmit to resume from the last checkpoint", guard_logs)
    assert line, describe(run_dir)
    print(f"\njob {job_id} after the crash of mn1 (s, state, NodeList, Restarts): {seen}")
