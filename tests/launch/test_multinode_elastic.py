"""Elastic shrink on a real 3-node Slurm cluster of network namespaces: 3 nodes -> 2.

One job (`launch.slurm --launcher torchrun --elastic-min-nodes 2`, one rank per node, DP3,
a checkpoint every 2 steps) loses its last node mid-run (everything in that node's namespace
SIGKILLed, as `ci_cluster crash` does). The two torchruns left must re-form a 2-node group
(a rendezvous across hosts, not one agent alone as in the 2 -> 1 case of
test_multinode_faults.py) and resume resharded to DP2 from the last complete checkpoint, with
the same global batch (3 micro-batches per rank instead of 2) and the same sample order.
The uninterrupted DP3 reference (ranks forked by tests/distributed.py on this host) runs
while the survivors wait for their rendezvous.

What Slurm and torchrun did is asserted and printed (`pytest -s`): the job's state and node
list while it shrank, srun's messages and exit status, and the environment of the workers
before and after the re-formation (the README's elastic section quotes them).
Skips with the reason where a cluster cannot run; a failure under PRETRAIN_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.launch.slurm_helpers import describe, job_info, multinode_cluster, submit, wait_for_job
from tests.launch.test_multinode import _cache, one_node_reference

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, SAVE_EVERY = 10, 2
# Global batch 12 = micro 2 x DP3 x 2 = micro 2 x DP2 x 3: the same batch at both sizes.
COMMON = [f"schedule.train_steps={STEPS}", "schedule.seq_length=64", "schedule.global_batch_size=12",
          "schedule.micro_batch_size=2", "schedule.eval_interval=0", "logging.tensorboard=false",
          "logging.log_interval=1", f"checkpoint.save_interval={SAVE_EVERY}", "checkpoint.resume=auto"]
# DP3 -> DP2 sums in another order (and accumulates 3 micro-batches, not 2): fp32 tolerance.
RESHARD_TOL = dict(rel=1e-5, abs=1e-6)
# What a worker learns from its environment: Slurm's (fixed when srun started the step) and
# torchrun's (set again at every re-formation).
ENV_KEYS = ("SLURMD_NODENAME", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_STEP_NUM_NODES",
            "SLURM_NODEID", "WORLD_SIZE", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(scope="module")
def cluster():
    with multinode_cluster(3, "pretrain-me-") as cluster:
        yield cluster


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if '"loss"' in ln] if path.exists() else []


def _worker_envs(run_dir: Path) -> list[dict[str, str]]:
    """ENV_KEYS of every live training process of this run (all nodes share one PID space)."""
    envs = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "-m pretrain" not in cmd or str(run_dir) not in cmd:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if "RANK" in env:  # a torchrun worker (not the agent, which has no RANK)
            envs.append({k: env.get(k, "-") for k in ENV_KEYS})
    return sorted(envs, key=lambda e: e["RANK"])


def _hostnames(nodelist: str, env: dict) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True)
    return out.stdout.split()


def _wait(what: str, check, run_dir: Path, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"{what} not seen in {timeout:.0f} s\n{describe(run_dir)}")


def submit_past_first_checkpoint(base: Path, env: dict, *extra: str) -> tuple[str, Path, int]:
    """The 3-node elastic job (one rank per node, --elastic-min-nodes 2, demo text under
    `base`) submitted and waited for until it trained a step after its first checkpoint:
    (job id, run dir, that step). The elastic and batch-host modules strike it then."""
    from data_pipeline.datasets import ensure_demo_dataset

    demo = base / "demo"
    ensure_demo_dataset(str(demo))
    run_dir = base / "job"
    job_id = submit(["--recipe", "tiny-llama", "--cpu", "--nodes", "3", "--ntasks-per-node", "1",
                     "--launcher", "torchrun", "--elastic-min-nodes", "2", *extra, "--partition", "debug",
                     "--time", "10", "--run-dir", str(run_dir), *COMMON, f"data.cache_dir={_cache(base, demo, 'job')}"],
                    env)
    # Past the first checkpoint (the steps since the last one are trained again).
    last = _wait("a step after the first checkpoint", lambda: (
        (run_dir / "checkpoints" / "latest").exists() and max((r["step"] for r in _records(run_dir)), default=0)),
        run_dir, timeout=180, every=0.05)
    return job_id, run_dir, last


def _watch_shrink(job_id: str, env: dict, run_dir: Path, t0: float, facts: dict) -> None:
    """From the crash until the survivors train again: the job's states and node lists as
    Slurm reports them, and the workers' environment once the group re-formed."""
    count = len(_records(run_dir))
    deadline = t0 + 240
    while "training_again" not in facts:
        if time.monotonic() > deadline:
            facts["watch_error"] = "the survivors did not train again within 240 s of the crash"
            return
        now = round(time.monotonic() - t0, 1)
        info = job_info(job_id, env)
        seen = (info["JobState"], info["NodeList"], info["NumNodes"])
        if not facts["job"] or facts["job"][-1][1:] != seen:
            facts["job"].append((now, *seen))
        workers = _worker_envs(run_dir)
        brief = [(e["SLURMD_NODENAME"], e["RANK"], e["WORLD_SIZE"], e["TORCHELASTIC_RESTART_COUNT"]) for e in workers]
        if not facts["workers_seen"] or facts["workers_seen"][-1][1] != brief:
            facts["workers_seen"].append((now, brief))
        # Both survivors' new workers: one torchrun may start its worker before the other does.
        if "workers_after" not in facts and len(workers) == 2 and all(e["WORLD_SIZE"] == "2" for e in workers):
            facts["workers_after"] = workers
            facts["respawned"] = now
        if len(_records(run_dir)) > count:
            facts["training_again"] = now
        time.sleep(0.25)


@pytest.fixture(scope="module")
def shrunk(cluster, module_tmp_factory):
    """The 3-node job, struck after its first checkpoint; the reference; what was seen."""
    from launch.launchers import ci_multinode

    layout, env = cluster
    base = module_tmp_factory.mktemp("elastic")
    started = time.monotonic()
    facts: dict = {"job": [], "workers_seen": [], "env": env}
    job_id, run_dir, last = submit_past_first_checkpoint(base, env)
    facts["workers_before"] = _worker_envs(run_dir)
    info = job_info(job_id, env)
    assert info["JobState"] == "RUNNING", info
    nodes = _hostnames(info["NodeList"], env)
    # The last node: the first hosts the rendezvous store (MASTER_ADDR), whose loss ends the job.
    victim = nodes[-1]
    facts.update(struck_after_step=last, nodes=nodes, victim=victim, started_to_strike=time.monotonic() - started)
    killed = ci_multinode.crash_node(layout, int(victim.removeprefix("mn")))
    t0 = time.monotonic()
    facts["killed_processes"] = killed
    # Watched from the first moment; the survivors wait ~45 s for their rendezvous (heartbeats,
    # then last_call_timeout): the uninterrupted reference runs here meanwhile.
    watcher = threading.Thread(target=_watch_shrink, args=(job_id, env, run_dir, t0, facts), daemon=True)
    watcher.start()
    reference = one_node_reference(base / "reference", 3, "tiny-llama", COMMON, _cache(base, base / "demo", "reference"))
    facts["reference_done"] = round(time.monotonic() - t0, 1)
    watcher.join(timeout=300)
    assert "training_again" in facts, f"{facts.get('watch_error', 'still watching')}\n{describe(run_dir)}"
    facts["finished"] = wait_for_job(job_id, env, run_dir, timeout=180)
    facts["victim_state"] = ci_multinode.node_states(layout).get(victim)
    facts["total_s"] = round(time.monotonic() - started, 1)
    return job_id, run_dir, reference, facts


def test_the_job_survives_the_loss_of_a_node(shrunk):
    """Under --no-kill the job stays RUNNING (never requeued), Slurm drops the lost node from
    the allocation, srun reports the node failure and still exits 0: the survivors finished."""
    job_id, run_dir, _, facts = shrunk
    info = facts["finished"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), describe(run_dir)
    victim, survivors = facts["victim"], [n for n in facts["nodes"] if n != facts["victim"]]
    assert _hostnames(info["NodeList"], facts["env"]) == survivors, info
    assert all(state == "RUNNING" for _, state, _, _ in facts["job"]), facts["job"]
    assert facts["job"][-1][3] == "2", facts["job"]  # NumNodes after the shrink
    script_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert f"srun: error: Node failure on {victim}" in script_log, script_log[-2000:]
    assert "training exited with status 0" in script_log, script_log[-2000:]
    print(f"\njob {job_id}: {facts['nodes']} struck after step {facts['struck_after_step']} "
          f"({facts['started_to_strike']:.1f} s after sbatch), {facts['killed_processes']} processes killed on "
          f"{victim}; job state/node list after the crash (s, state, NodeList, NumNodes): {facts['job']}; "
          f"{victim} is {facts['victim_state']} at the end; workers respawned +{facts['respawned']} s, "
          f"training again +{facts['training_again']} s; reference done +{facts['reference_done']} s; "
          f"{facts['total_s']} s in all")
    print("srun/script:", [ln for ln in script_log.splitlines() if "srun:" in ln or "[launch.slurm]" in ln])
    print("workers seen (s, [(node, RANK, WORLD_SIZE, restart count)]):", facts["workers_seen"])


def test_survivors_reform_at_dp2_and_match_the_uninterrupted_run(shrunk):
    """The 2 torchruns left re-form (world 2), resume resharded DP3 -> DP2
    from the last complete checkpoint; steps before the crash bitwise equal to the DP3 run,
    the re-run ones and those after within 1e-5."""
    job_id, run_dir, reference_dir, facts = shrunk
    log = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(f"{job_id}-node*.log")))
    assert "world 3 = TP1xPP1xDP3" in log and "world 2 = TP1xPP1xDP2" in log, describe(run_dir)
    match = re.search(r"resumed from \S+ at step (\d+): resharded from TP1xPP1xDP3 to TP1xPP1xDP2", log)
    assert match, describe(run_dir)
    resumed, struck = int(match.group(1)), facts["struck_after_step"]
    assert SAVE_EVERY <= resumed <= struck + 1 and resumed % SAVE_EVERY == 0, (resumed, struck)
    reference = {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(reference_dir)}
    got: dict[int, list[tuple[float, float]]] = {}
    for r in _records(run_dir):
        got.setdefault(r["step"], []).append((r["loss"], r["grad_norm"]))
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(got), sorted(reference))
    worst = 0.0
    for step, seen in sorted(got.items()):
        if step <= resumed:  # trained once, at DP3, before the crash: the same run
            assert seen == [reference[step]], f"step {step}: {seen} != {reference[step]}"
        else:  # trained (again) at DP2 after the re-formation
            want = reference[step]
            assert seen[-1] == pytest.approx(want, **RESHARD_TOL), f"step {step}: {seen} vs {want}"
            worst = max(worst, abs(seen[-1][0] - want[0]) / abs(want[0]))
    print(f"\nresumed from step {resumed} (struck after step {struck}); steps {resumed + 1}-{STEPS} at DP2: "
          f"worst loss difference {worst:.1e} relative")


def test_what_the_workers_are_told_before_and_after(shrunk):
    """torchrun's variables change at the re-formation; Slurm's do not (the step's
    environment was fixed when srun started it): a worker must read its world from torchrun."""
    _, _, _, facts = shrunk
    before, after = facts["workers_before"], facts["workers_after"]
    assert len(before) == 3 and {e["WORLD_SIZE"] for e in before} == {"3"}, before
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in before} == {"0"}, before
    survivors = sorted(n for n in facts["nodes"] if n != facts["victim"])
    assert sorted(e["SLURMD_NODENAME"] for e in after) == survivors, after
    assert {e["WORLD_SIZE"] for e in after} == {"2"} and sorted(e["RANK"] for e in after) == ["0", "1"], after
    assert {e["GROUP_WORLD_SIZE"] for e in after} == {"2"}, after
    # Per agent, not per group: an agent whose workers failed counts a restart; one whose
    # workers were still healthy (blocked in a collective) when the other re-joined is
    # restarted for the membership change, uncounted (seen: mn1 0, mn2 1). Not a generation id.
    counts = {e["TORCHELASTIC_RESTART_COUNT"] for e in after}
    assert "1" in counts and counts <= {"0", "1"}, after
    # Slurm's view, unchanged inside the running step: still 3 nodes.
    assert {e["SLURM_JOB_NUM_NODES"] for e in after} == {"3"}, after
    print("\nworkers before:", before, "\nworkers after:", after)
