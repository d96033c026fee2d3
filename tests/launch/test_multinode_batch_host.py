"""Elastic job on a real 3-node Slurm cluster of network namespaces loses its FIRST node.

    PRETRAIN_REQUIRE_SLURM=1 python -m pytest tests/launch/test_multinode_batch_host.py -s

The first node runs the batch script and hosts torchrun's rendezvous store (MASTER_ADDR).
Under --no-kill its loss does not end the job: without launch.launchers.elastic_guard the
torchruns left exit, Slurm drops the node, and the job stays RUNNING with nothing training
until its time limit. With the guard, a survivor sees its torchrun fail, finds the batch host
DOWN in Slurm, and requeues the job on the nodes left: the second attempt runs on 2 nodes,
resumes resharded DP3 -> DP2 from the last complete checkpoint with the same global batch
and sample order, and matches the uninterrupted DP3 run (forked on this host while the
cluster recovers) within the elastic module's RESHARD_TOL.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.launch.slurm_helpers import TERMINAL, describe, job_info, multinode_cluster
from tests.launch.test_multinode import _cache, one_node_reference
from tests.launch.test_multinode_elastic import (COMMON, RESHARD_TOL, SAVE_EVERY, STEPS, _hostnames, _records,
                                                 submit_past_first_checkpoint)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# From the crash: the survivors' torchruns exit within ~3-17 s, Slurm marks the node DOWN
# after SlurmdTimeout=10 (+ its ping interval, ~27 s seen), then the guard requeues.
REQUEUE_DEADLINE_S = 150
FINISH_DEADLINE_S = 420


@pytest.fixture(scope="module")
def cluster():
    with multinode_cluster(3, "pretrain-mb-") as cluster:
        yield cluster


def _watch(job_id: str, env: dict, t0: float, facts: dict) -> None:
    """The job's (state, node list, node count, restarts) at each change after the crash,
    until it ends, FINISH_DEADLINE_S passes, or REQUEUE_DEADLINE_S passes unrequeued."""
    while time.monotonic() - t0 < FINISH_DEADLINE_S:
        try:
            info = job_info(job_id, env)
        except Exception as exc:  # the controller busy for a moment: try again
            facts["errors"] = facts.get("errors", 0) + 1
            facts["last_error"] = str(exc)
            time.sleep(0.5)
            continue
        seen = (info["JobState"], info["NodeList"], info["NumNodes"], info["Restarts"])
        if not facts["job"] or facts["job"][-1][1:] != seen:
            facts["job"].append((round(time.monotonic() - t0, 1), *seen))
        if info["JobState"] in TERMINAL:
            facts["final"] = info
            return
        if info["Restarts"] == "0" and time.monotonic() - t0 > REQUEUE_DEADLINE_S:
            return  # not requeued: the test says so, without waiting for the time limit
        time.sleep(0.5)


@pytest.fixture(scope="module")
def lost_batch_host(cluster, module_tmp_factory):
    """The 3-node elastic job, its batch host crashed after a checkpoint; the reference; what was seen."""
    from launch.launchers import ci_multinode

    layout, env = cluster
    base = module_tmp_factory.mktemp("batch-host")
    started = time.monotonic()
    job_id, run_dir, last = submit_past_first_checkpoint(base, env)
    info = job_info(job_id, env)
    assert info["JobState"] == "RUNNING", info
    nodes = _hostnames(info["NodeList"], env)
    victim = info["BatchHost"]
    assert victim == nodes[0], info  # the batch host is the first node, where MASTER_ADDR points
    facts: dict = {"job": [], "nodes": nodes, "victim": victim, "struck_after_step": last,
                   "started_to_strike": round(time.monotonic() - started, 1)}
    facts["killed_processes"] = ci_multinode.crash_node(layout, int(victim.removeprefix("mn")))
    t0 = time.monotonic()
    watcher = threading.Thread(target=_watch, args=(job_id, env, t0, facts), daemon=True)
    watcher.start()
    reference = one_node_reference(base / "reference", 3, "tiny-llama", COMMON, _cache(base, base / "demo", "reference"))
    facts["reference_done"] = round(time.monotonic() - t0, 1)
    watcher.join(timeout=FINISH_DEADLINE_S + 30)
    facts["victim_state"] = ci_multinode.node_states(layout).get(victim)
    # The daemons' logs beside the job's, for a failed run's post-mortem (the cluster's own
    # folder goes with the module; repeat_multinode keeps a failed run's test folders).
    shutil.copytree(Path(layout.paths.log_file("slurmctld")).parent, base / "cluster-log")
    facts["total_s"] = round(time.monotonic() - started, 1)
    return job_id, run_dir, reference, facts


def _first(facts: dict, predicate) -> tuple | None:
    return next((seen for seen in facts["job"] if predicate(seen)), None)


def test_the_job_is_requeued_onto_the_nodes_left(lost_batch_host):
    """Not left RUNNING with nothing training: a survivor requeues the job (Restarts=1) within
    REQUEUE_DEADLINE_S of the crash, saying why in its log; the second attempt runs on the 2
    nodes left and ends COMPLETED."""
    job_id, run_dir, _, facts = lost_batch_host
    requeued = _first(facts, lambda seen: seen[4] != "0")
    assert requeued and requeued[0] <= REQUEUE_DEADLINE_S, (
        f"job {job_id} not requeued within {REQUEUE_DEADLINE_S} s of the crash of its batch host "
        f"{facts['victim']}: (s, state, NodeList, NumNodes, Restarts) seen {facts['job']}\n{describe(run_dir)}")
    final = facts.get("final")
    assert final, f"job {job_id} not finished {FINISH_DEADLINE_S} s after the crash: {facts['job']}\n{describe(run_dir)}"
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), describe(run_dir)
    survivors = [n for n in facts["nodes"] if n != facts["victim"]]
    assert final["NumNodes"] == "2" and final["BatchHost"] == survivors[0], final
    # The guard writes its lines to its own file too (the step's stdout may break with srun).
    guard_logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(f"{job_id}-guard-*.log")))
    line = re.search(rf"\[launch\.slurm\] the batch host {facts['victim']} is down \(State=DOWN\S*\): "
                     rf"requeueing job {job_id} to resume from the last checkpoint on the nodes left", guard_logs)
    assert line, describe(run_dir)
    script_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert re.search(rf"job {job_id} attempt 1: 2 node\(s\), rendezvous {survivors[0]}:", script_log), script_log[-2000:]
    assert "training exited with status 0" in script_log, script_log[-2000:]
    running = _first(facts, lambda seen: seen[4] == "1" and seen[1] == "RUNNING")
    print(f"\njob {job_id}: {facts['nodes']}, batch host {facts['victim']} struck after step "
          f"{facts['struck_after_step']} ({facts['started_to_strike']} s after sbatch, {facts['killed_processes']} "
          f"processes killed); requeued +{requeued[0]} s, running again +{running[0] if running else '?'} s; "
          f"{facts['victim']} is {facts['victim_state']} at the end; reference done +{facts['reference_done']} s; "
          f"{facts['total_s']} s in all")
    print("job after the crash (s, state, NodeList, NumNodes, Restarts):", facts["job"])
    print("guard:", guard_logs.splitlines())
    print("srun/script:", [ln for ln in script_log.splitlines() if "srun:" in ln or "[launch.slurm]" in ln])


def test_the_requeued_attempt_resumes_at_dp2_and_matches_the_uninterrupted_run(lost_batch_host):
    """The second attempt resumes resharded DP3 -> DP2 from the last complete checkpoint:
    steps up to it bitwise equal to the DP3 run, the rest within RESHARD_TOL."""
    job_id, run_dir, reference_dir, facts = lost_batch_host
    log = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(f"{job_id}-node*.log")))
    match = re.search(r"resumed from \S+ at step (\d+): resharded from TP1xPP1xDP3 to TP1xPP1xDP2", log)
    assert match, describe(run_dir)
    resumed, struck = int(match.group(1)), facts["struck_after_step"]
    assert SAVE_EVERY <= resumed <= struck + 1 and resumed % SAVE_EVERY == 0, (resumed, struck)
    reference = {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(Path(reference_dir))}
    got: dict[int, list[tuple[float, float]]] = {}
    for r in _records(run_dir):
        got.setdefault(r["step"], []).append((r["loss"], r["grad_norm"]))
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(got), sorted(reference))
    worst = 0.0
    for step, seen in sorted(got.items()):
        want = reference[step]
        if step <= resumed:  # trained once, at DP3, before the crash
            assert seen == [want], f"step {step}: {seen} != {want}"
        else:  # trained (again) at DP2 by the requeued attempt
            assert seen[-1] == pytest.approx(want, **RESHARD_TOL), f"step {step}: {seen} vs {want}"
            worst = max(worst, abs(seen[-1][0] - want[0]) / abs(want[0]))
    print(f"\nresumed from step {resumed} (struck after step {struck}); steps {resumed + 1}-{STEPS} at DP2: "
          f"worst loss difference {worst:.1e} relative")
