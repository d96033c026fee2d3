"""Faults across nodes, each on a real multi-node Slurm cluster of network namespaces.

One 14-node cluster serves the module; six 2-node jobs (one rank per node, DP2, a checkpoint
every 2 steps; the elastic one two per node, DP4) run at once, each hit by one fault after its
step-2 checkpoint; the uninterrupted one-node references (DP2 and DP4, ranks forked by
tests/distributed.py) run here while the jobs finish. One rank per node halves the ranks to
start (the suite's time is mostly rank start-up); the faults are the nodes', and
tests/launch/test_multinode.py covers two ranks per node:
  (a) crash: everything on the job's second node is SIGKILLed mid-run (a power loss) -> Slurm
      requeues the job, which resumes from the last complete checkpoint on other nodes; every
      step bitwise equal to the uninterrupted run;
  (save) the same crash while the job writes its second checkpoint -> the half-written one is
      never used: the requeued job resumes from the one before, bitwise as in (a);
  (b) network cut: node 2's link goes down while the ranks wait in a collective -> the hang
      watchdog ends them (watchdog.timeout_s=20) -> requeue -> resume bitwise; the link comes
      back while the job trains elsewhere: nothing of the old attempt survives or writes. Cut
      right after a save, so it lands in one of the two steps before the next one: a save is
      not timed by the watchdog, and a cut landing in it was found by Slurm instead (~30 s);
      one did, with the strike after step 3 of 0.1-0.5 s steps;
  (c) preemption: USR1 to the batch script -> every rank on both nodes saves -> requeue -> resume;
  (d) one rank killed on a healthy node -> the job fails once (FAILED, not requeued), and the
      script's log names the failed task (rank) and its host;
  (elastic) the crash of (a) under `--launcher torchrun --elastic-min-nodes 1`: not requeued;
      the job keeps running on the node left (Slurm shrinks the allocation), whose torchrun
      re-forms the group at DP2 and resumes resharded: the steps before the crash bitwise equal
      to the uninterrupted DP4 run, those after at fp32 reduction tolerance.
Measured times (fault -> detected -> training again) are printed. Skips with the reason where a
cluster cannot run; a failure under PRETRAIN_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

# At the top, not where the poll first needs it: importing pretrain (torch, Megatron-Core) took
# 21 s on a loaded machine, inside the strike loop, while the jobs trained all their steps.
from pretrain.checkpointing.format import read_latest, step_dir_name
from tests.launch.slurm_helpers import describe, job_info, multinode_cluster, submit, wait_for_job
from tests.launch.test_multinode import _cache, one_node_reference

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, SAVE_EVERY = 10, 2
COMMON = [f"schedule.train_steps={STEPS}", "schedule.seq_length=64", "schedule.global_batch_size=8",
          "schedule.micro_batch_size=2", "schedule.eval_interval=0", "logging.tensorboard=false",
          "logging.log_interval=1", f"checkpoint.save_interval={SAVE_EVERY}", "checkpoint.resume=auto"]
FAULTS = ("crash", "save", "cut", "usr1", "rank", "elastic")
EXTRA = {
    # (b): the ranks on both sides of the cut wait in a collective until their hang watchdog ends them.
    "cut": ["watchdog.timeout_s=20"],
    # A save takes milliseconds here: each of this job's saves waits 3 s with its shards written
    # and the checkpoint not yet complete (pretrain.checkpointing.checkpointer, a fault drill).
    "save": ["--env", "PRETRAIN_FAULT_SAVE_PAUSE_S=3"],
    # The rendezvous store lives on the first node, which survives (the crash takes the second).
    "elastic": ["--launcher", "torchrun", "--elastic-min-nodes", "1"],
}
# Ranks per node: DP2 jobs; the elastic one shrinks from DP4 to DP2 when it loses a node.
PER_NODE = {name: 2 if name == "elastic" else 1 for name in FAULTS}
# DP4 -> DP2 sums in another order: fp32 reduction tolerance (as tests/launch/test_multinode.py).
RESHARD_TOL = dict(rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def cluster():
    # Two spare nodes: requeued jobs need not wait for the nodes the faults took down.
    with multinode_cluster(2 * len(FAULTS) + 2, "pretrain-mf-") as cluster:
        yield cluster


def _records(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if '"loss"' in ln] if path.exists() else []


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in _records(run_dir)), default=0)


def _just_saved(run_dir: Path, last: int) -> bool:
    """The last logged step `last` (past the first save) is the last complete checkpoint: the
    run is in the steps (timed by the watchdog) between two saves (not timed)."""
    return last >= 2 * SAVE_EVERY and read_latest(run_dir / "checkpoints") == step_dir_name(last)


def _nodes_of(name: str, job_id: str, env: dict) -> list[str]:
    """The nodes of a job that must still be running: a job struck after it ended would hit
    nodes that another job may hold by then."""
    info = job_info(job_id, env)
    assert info["JobState"] == "RUNNING", f"{name}: job {job_id} is {info['JobState']} before it could be struck"
    out = subprocess.run(["scontrol", "show", "hostnames", info["NodeList"]], env=env, capture_output=True, text=True)
    return out.stdout.split()


def _rank_pid(run_dir: Path, rank: int) -> int:
    """The training process of global rank `rank` of the job in run_dir (srun: SLURM_PROCID)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "-m pretrain" in cmd and str(run_dir) in cmd:
            try:
                if proc.environ().get("SLURM_PROCID") == str(rank):
                    return proc.pid
            except psutil.Error:
                continue
    raise AssertionError(f"no process of rank {rank} for {run_dir}")


def _strike(name: str, job_id: str, run_dir: Path, layout, env: dict, record: dict) -> None:
    """The fault for job `name`, then the time of the strike into `record`."""
    from launch.launchers import ci_multinode

    if name in ("crash", "save", "elastic"):
        victim = _nodes_of(name, job_id, env)[1]
        ci_multinode.crash_node(layout, int(victim.removeprefix("mn")))
        record["node"] = victim
    elif name == "cut":
        victim = _nodes_of(name, job_id, env)[1]
        ci_multinode.cut_network(layout, int(victim.removeprefix("mn")))
        record["node"] = victim
    elif name == "usr1":
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True)
    else:
        os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)  # the second node's
    record["t0"] = time.monotonic()


@pytest.fixture(scope="module")
def faults(cluster, module_tmp_factory):
    """Submit every job (started together), run the reference, strike each job after
    its step-2 checkpoint."""
    from data_pipeline.datasets import ensure_demo_dataset
    from launch.launchers import ci_multinode

    layout, env = cluster
    base = module_tmp_factory.mktemp("faults")
    demo = base / "demo"
    ensure_demo_dataset(str(demo))
    # Whole nodes per job (sbatch reads SBATCH_EXCLUSIVE): a crashed node hits one job only.
    env = dict(env, SBATCH_EXCLUSIVE="exclusive")
    # No job starts until all are submitted (each submission is a launch.slurm process, seconds
    # under load; sbatch 22.05 reads no SBATCH_HOLD): started together, they reach their first
    # checkpoint together, and the first does not finish before the striker looks at it.
    partition = ["scontrol", "update", "PartitionName=debug"]
    subprocess.run([*partition, "State=DOWN"], env=env, check=True)
    jobs = {}
    try:
        for name in FAULTS:
            run_dir = base / name
            jobs[name] = (submit(["--recipe", "tiny-llama", "--cpu", "--nodes", "2",
                                  "--ntasks-per-node", str(PER_NODE[name]),
                                  "--partition", "debug", "--time", "10", "--run-dir", str(run_dir), *COMMON,
                                  *EXTRA.get(name, []),
                                  f"data.cache_dir={_cache(base, demo, name)}"], env), run_dir)
    finally:
        subprocess.run([*partition, "State=UP"], env=env, check=True)
    ref_dirs = {dp: base / f"reference-dp{dp}" for dp in sorted({2 * n for n in PER_NODE.values()})}
    times: dict[str, dict[str, float]] = {name: {} for name in FAULTS}
    pending = set(FAULTS)
    deadline = time.monotonic() + 420
    pool, strikes = concurrent.futures.ThreadPoolExecutor(max_workers=len(FAULTS)), []
    while pending:  # strike each job past its first checkpoint (`save`: while it writes the next)
        assert time.monotonic() < deadline, {n: describe(jobs[n][1]) for n in pending}
        for name in sorted(pending):
            job_id, run_dir = jobs[name]
            last = _last_step(run_dir)
            # A job that trained its last step before the poll saw it in its window is never
            # struck (a loaded machine's poll can miss the window): say so, not the deadline.
            assert last < STEPS, f"the {name} job trained all {STEPS} steps before it could be struck; rerun"
            if last <= SAVE_EVERY or not (run_dir / "checkpoints" / "latest").exists():
                continue
            if name == "save" and not list((run_dir / "checkpoints").glob(".tmp.step_*")):
                continue
            if name == "cut" and not _just_saved(run_dir, last):
                continue
            times[name]["struck_after_step"] = last
            # In a thread: a strike runs scontrol / scans processes, seconds on a loaded machine,
            # and the poll must not miss the other jobs' windows meanwhile (the cut job's is a
            # step long).
            strikes.append(pool.submit(_strike, name, job_id, run_dir, layout, env, times[name]))
            pending.discard(name)
        time.sleep(0.02)
    pool.shutdown()
    for strike in strikes:
        strike.result()  # a strike's own failure, raised here
    _time_recovery(jobs, times, env)
    # The cut node comes back while the job trains elsewhere: its stray ranks (if any are
    # left) must not touch the run's checkpoints.
    ci_multinode.heal_network(layout, int(times["cut"]["node"].removeprefix("mn")))
    # The uninterrupted references, after the timings (their load would lengthen them), while
    # the jobs finish.
    for dp, ref_dir in ref_dirs.items():
        one_node_reference(ref_dir, dp, "tiny-llama", COMMON, _cache(base, demo, ref_dir.name))
    finished = {name: wait_for_job(job_id, env, run_dir, timeout=300) for name, (job_id, run_dir) in jobs.items()}
    return jobs, finished, times, ref_dirs


def _time_recovery(jobs: dict, times: dict, env: dict, timeout: float = 420) -> None:
    """Seconds from each strike to the job leaving RUNNING (detected; `elastic`: its survivor's
    torchrun seeing its workers fail) and to its first step after the requeue or the
    re-formation (`rank`: to its end, it is not requeued), all jobs polled together so one's
    wait does not inflate another's."""
    counts = {name: len(_records(run_dir)) for name, (_, run_dir) in jobs.items()}
    deadline = time.monotonic() + timeout
    while any(("detected" if name == "rank" else "training_again") not in times[name] for name in jobs):
        assert time.monotonic() < deadline, {n: describe(r) for n, (_, r) in jobs.items()}
        for name, (job_id, run_dir) in jobs.items():
            now = time.monotonic() - times[name]["t0"]
            if "detected" not in times[name]:
                if name == "elastic":
                    seen = "failed (exitcode" in _node_log(run_dir, job_id, 0)
                else:
                    info = job_info(job_id, env)
                    seen = info["JobState"] != "RUNNING" or int(info.get("Restarts", 0)) > 0
                if seen:
                    times[name]["detected"] = now
            elif "training_again" not in times[name] and len(_records(run_dir)) > counts[name]:
                times[name]["training_again"] = now
        time.sleep(0.25)


def _node_log(run_dir: Path, job_id: str, node: int) -> str:
    logs = list((run_dir / "logs").glob(f"{job_id}-node{node}-*.log"))
    return logs[0].read_text(errors="replace") if logs else ""


def _by_step(records: list[dict]) -> dict[int, list[tuple[float, float]]]:
    steps: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        steps.setdefault(r["step"], []).append((r["loss"], r["grad_norm"]))
    return steps


@pytest.mark.parametrize("name", ["crash", "save", "cut", "usr1"])
def test_requeued_job_resumes_bitwise(faults, name):
    """(a) node crash, a node crash during a save, and (c) USR1: requeued once, resumed from a complete checkpoint, every
    step (the re-run ones too) bitwise equal to the uninterrupted one-node run."""
    jobs, finished, times, ref_dirs = faults
    job_id, run_dir = jobs[name]
    info = finished[name]
    restarts = int(info["Restarts"])
    # A cut: the script's hang requeue and Slurm's node-failure requeue may both count.
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", describe(run_dir)
    assert restarts == 1 or (name == "cut" and restarts == 2), info
    # checkpoint.keep_last (3): the last three saves, complete, `latest` the final one.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(("step_", "latest")))
    assert ckpts == ["latest"] + [f"step_{s:08d}" for s in range(STEPS - 2 * SAVE_EVERY, STEPS + 1, SAVE_EVERY)], ckpts
    assert all((run_dir / "checkpoints" / c / "COMPLETE").is_file() for c in ckpts[1:])
    reference = {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(ref_dirs[2 * PER_NODE[name]])}
    got = _by_step(_records(run_dir))
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(got), sorted(reference))
    for step, seen in sorted(got.items()):
        assert all(s == reference[step] for s in seen), f"{name} step {step}: {seen} != {reference[step]}"
    log = "\n".join(p.read_text() for p in (run_dir / "logs").glob(f"{job_id}-node*.log"))
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert resumed and resumed[0] >= SAVE_EVERY and resumed[0] <= times[name]["struck_after_step"] + 1, log[-2000:]
    if name == "save":
        # The save the crash interrupted never became a checkpoint: resumed from the one before.
        assert resumed[0] < times[name]["struck_after_step"] + 1 and resumed[0] % SAVE_EVERY == 0, (resumed, times)
    if name == "cut":
        assert list((run_dir / "hang").glob("rank_*.txt")), "no hang report"
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
        assert not left, f"ranks of the cut node still alive after the heal: {left}"
    if name == "usr1":
        # Every rank on both nodes took part in the preemption save: the checkpoint is complete.
        assert resumed[0] >= times[name]["struck_after_step"], (resumed, times[name])
        assert "USR1: asking the ranks to save" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    print(f"\n{name}: struck after step {times[name]['struck_after_step']}, detected +{times[name]['detected']:.1f} s, "
          f"training again +{times[name]['training_again']:.1f} s, resumed from step {resumed[0]}")


def test_a_failed_rank_on_a_healthy_node_fails_the_job_once_naming_it(faults):
    """(d): FAILED, not requeued (no loop), and the log names the task (= rank) and host."""
    jobs, finished, times, _ = faults
    job_id, run_dir = jobs["rank"]
    info = finished["rank"]
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, describe(run_dir))
    script_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert re.search(r"srun: error: mn\d+: task 1: Killed", script_log), script_log[-2000:]
    print(f"\nrank: killed after step {times['rank']['struck_after_step']}, job FAILED +{times['rank']['detected']:.1f} s")


def test_elastic_job_loses_a_node_and_keeps_training_on_the_other(faults):
    """(elastic): not requeued; the allocation shrinks to the surviving node, whose torchrun
    re-forms the group at DP2 and resumes resharded from the last complete checkpoint with the
    same global batch; steps run once before the crash bitwise, the re-run ones and those after
    at fp32 reduction tolerance of the uninterrupted DP4 run."""
    jobs, finished, times, ref_dirs = faults
    job_id, run_dir = jobs["elastic"]
    info = finished["elastic"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), describe(run_dir)
    victim = times["elastic"]["node"]
    assert info["NodeList"] != victim and "," not in info["NodeList"] and "[" not in info["NodeList"], info
    script_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert f"srun: error: Node failure on {victim}" in script_log, script_log[-2000:]
    assert "training exited with status 0" in script_log, script_log[-2000:]
    log = _node_log(run_dir, job_id, 0)
    assert "world 4 = TP1xPP1xDP4" in log and "world 2 = TP1xPP1xDP2" in log, describe(run_dir)
    match = re.search(r"resumed from \S+ at step (\d+): resharded from TP1xPP1xDP4 to TP1xPP1xDP2", log)
    assert match, describe(run_dir)
    resumed, struck = int(match.group(1)), times["elastic"]["struck_after_step"]
    assert SAVE_EVERY <= resumed <= struck + 1, (resumed, struck)
    reference = {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(ref_dirs[4])}
    got = _by_step(_records(run_dir))
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(got), sorted(reference))
    for step, seen in sorted(got.items()):
        if step <= resumed:  # before the crash, at DP4: the same run
            assert seen == [reference[step]], f"elastic step {step}: {seen} != {reference[step]}"
        else:  # run again (or first) at DP2 after the re-formation
            assert seen[-1] == pytest.approx(reference[step], **RESHARD_TOL), f"elastic step {step}: {seen}"
    print(f"\nelastic: struck after step {struck}, survivor's torchrun saw it +{times['elastic']['detected']:.1f} s, "
          f"training again at DP2 +{times['elastic']['training_again']:.1f} s, resumed from step {resumed}")
