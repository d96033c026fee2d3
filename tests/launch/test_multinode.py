"""launch.slurm across two nodes of a real Slurm cluster whose nodes are network namespaces.

Each node has its own hostname, address and slurmd (launch/launchers/ci_multinode.py): a
rank that bound loopback, or a TP group split over hosts, shows here as on real nodes. One
cluster serves the module; every 2-node job is submitted at once and the one-node
references (the same layout and training code, ranks forked by tests/distributed.py) run
while they wait. Skips with the reason where it cannot run (not root, no `ip netns`, no
Slurm), a failure under PRETRAIN_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.launch.slurm_helpers import REPO, describe, multinode_cluster, submit, wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 4
SMALL = [f"schedule.train_steps={STEPS}", "schedule.seq_length=64", "schedule.global_batch_size=8",
         "schedule.micro_batch_size=2", "schedule.eval_interval=0", "logging.tensorboard=false",
         "logging.log_interval=1"]
# name -> (recipe, launcher, layout overrides); each runs on 2 nodes x 2 ranks and on 1 node x 4.
LAYOUTS = {
    "tp2-pp2": ("tiny-llama", "srun", ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                                       "checkpoint.save_interval=2"]),
    "tp2-dp2": ("tiny-llama", "torchrun", ["parallel.tensor_parallel=2"]),
    "zero3-dp4": ("tiny-llama", "srun", ["parallel.sharding=zero3"]),
    "ep2-dp2": ("tiny-moe", "torchrun", ["parallel.expert_parallel=2"]),
}
# A changed layout sums in another order: the resumed steps match at fp32 reduction tolerance.
RESHARD_TOL = dict(rel_tol=1e-5, abs_tol=1e-6)


@pytest.fixture(scope="module")
def cluster():
    """A 2-node cluster of this module's own."""
    with multinode_cluster(2, "pretrain-mn-") as cluster:
        yield cluster


def read_steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) from metrics.jsonl; a re-run step keeps its last record."""
    steps = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            steps[record["step"]] = (record["loss"], record["grad_norm"])
    return steps


def _cache(base: Path, demo: Path, name: str) -> Path:
    """A cache directory per run (Megatron's index files are written unlocked, so two jobs
    building the same one at once could read a half-written file), sharing the corpus."""
    cache = base / f"cache-{name}"
    cache.mkdir()
    (cache / "demo").symlink_to(demo)
    return cache


def _two_node(name: str, recipe: str, launcher: str, overrides: list[str], base: Path, demo: Path,
              env: dict, per_node: int = 2) -> tuple[str, Path]:
    run_dir = base / f"2n-{name}"
    args = ["--recipe", recipe, "--cpu", "--nodes", "2", "--ntasks-per-node", str(per_node), "--launcher", launcher,
            "--partition", "debug", "--time", "10", "--run-dir", str(run_dir), *SMALL, *overrides,
            f"data.cache_dir={_cache(base, demo, '2n-' + name)}"]
    return submit(args, env), run_dir


def one_node_reference(run_dir: Path, nproc: int, recipe: str, overrides: list[str], cache: Path) -> Path:
    """An uninterrupted run on this machine (loopback): nproc ranks from the test forkserver,
    which run the same setup and training as `launch.local`'s (tests/distributed.py), without
    torchrun and each rank's imports (~6 CPU-s a rank)."""
    run_ranks(nproc, "tests.pretrain.workers:train", timeout=300, recipe=recipe, overrides=[
        *overrides, f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", f"data.cache_dir={cache}"])
    return run_dir


def _one_node(name: str, recipe: str, overrides: list[str], base: Path, demo: Path, nproc: int = 4) -> Path:
    """The same layout on one node."""
    return one_node_reference(base / f"1n-{name}", nproc, recipe, [*SMALL, *overrides],
                              _cache(base, demo, "1n-" + name))


@pytest.fixture(scope="module")
def runs(cluster, module_tmp_factory):
    """Every run of the module; 2-node jobs queue in Slurm while the one-node ones run here."""
    from data_pipeline.datasets import ensure_demo_dataset

    layout, env = cluster
    base = module_tmp_factory.mktemp("multinode")
    demo = base / "demo"
    ensure_demo_dataset(str(demo))
    jobs = {name: _two_node(name, recipe, launcher, overrides, base, demo, env)
            for name, (recipe, launcher, overrides) in LAYOUTS.items()}
    local = {}
    recipe, _, overrides = LAYOUTS["tp2-pp2"]
    local["tp2-pp2"] = _one_node("tp2-pp2", recipe, overrides, base, demo)
    # Saved on one node as TP2 x PP2, resumed on two as PP2 (one rank per node: resharded TP).
    step2 = local["tp2-pp2"] / "checkpoints" / "step_00000002"
    jobs["resume-on-2"] = _two_node("resume-on-2", "tiny-llama", "srun", [
        "parallel.pipeline_parallel=2", f"checkpoint.resume={step2}"], base, demo, env, per_node=1)
    for name, (recipe, _, overrides) in LAYOUTS.items():
        if name != "tp2-pp2":
            local[name] = _one_node(name, recipe, overrides, base, demo)
    finished = {name: wait_for_job(job_id, env, run_dir) for name, (job_id, run_dir) in jobs.items()
                if name != "resume-on-2"}
    # Saved on two nodes as TP2 x PP2, resumed on one as TP2 (2 ranks: resharded PP).
    saved = jobs["tp2-pp2"][1] / "checkpoints"
    local["resume-on-1"] = _one_node("resume-on-1", "tiny-llama", [
        "parallel.tensor_parallel=2", f"checkpoint.resume={saved / 'step_00000002'}"], base, demo, nproc=2)
    job_id, run_dir = jobs["resume-on-2"]
    finished["resume-on-2"] = wait_for_job(job_id, env, run_dir)
    return jobs, finished, local


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_nodes_match_one_node_bitwise(runs, name):
    """Same layout, same ranks, same reduction order: per-step loss and grad norm bitwise equal."""
    jobs, finished, local = runs
    job_id, run_dir = jobs[name]
    info = finished[name]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    two, one = read_steps(run_dir), read_steps(local[name])
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1)), (two, one)
    for step in sorted(two):
        assert two[step] == one[step], f"{name} step {step}: 2 nodes (loss, grad norm) {two[step]} != 1 node {one[step]}"


def _placement(run_dir: Path, job_id: str) -> list[tuple[int, str, dict[str, int]]]:
    """The start-up lines `rank R -> HOST -> (TP t, PP p, DP d, ...)` from rank 0's log."""
    # With torchrun, global rank 0 is on whichever node the rendezvous ranked first.
    text = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob(f"{job_id}-node*.log")))
    rows = []
    for rank, host, coords in re.findall(r"\[placement\] rank (\d+) -> (\S+) -> \(([^)]*)\)", text):
        rows.append((int(rank), host, {k: int(v) for k, v in (c.split() for c in coords.split(", "))}))
    return rows


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_placement_is_logged_and_tp_groups_stay_in_a_node(runs, name):
    jobs, finished, _ = runs
    job_id, run_dir = jobs[name]
    rows = _placement(run_dir, job_id)
    assert [r[0] for r in rows] == [0, 1, 2, 3], describe(run_dir)
    # Block distribution: ranks 0, 1 on one node, 2, 3 on the other (srun: mn1 first).
    hosts = [r[1] for r in rows]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"mn1", "mn2"}, rows
    if LAYOUTS[name][1] == "srun":
        assert hosts[0] == "mn1", rows
    groups: dict[tuple, set[str]] = {}
    for _, host, coords in rows:
        groups.setdefault(tuple(v for k, v in sorted(coords.items()) if k != "TP"), set()).add(host)
    assert all(len(hosts) == 1 for hosts in groups.values()), f"a TP group spans hosts: {groups}"
    if name == "ep2-dp2":
        assert all("EP" in coords for _, _, coords in rows), rows


def test_checkpoints_cross_nodes_both_ways(runs):
    """Saved by ranks on 2 nodes -> resumed on 1 (PP resharded), and 1 node -> 2 (TP resharded)."""
    from pretrain.checkpointing.format import read_latest

    jobs, finished, local = runs
    _, saved_run = jobs["tp2-pp2"]
    root = saved_run / "checkpoints"
    # Written once, by global rank 0: every step complete, `latest` the last, nothing moved
    # aside or left half-written (a second writer per node would rename over the first).
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"], list(root.iterdir())
    assert all((root / s / "COMPLETE").is_file() for s in ("step_00000002", "step_00000004"))
    assert read_latest(root) == "step_00000004"
    reference = read_steps(saved_run)
    resumed_on_1 = read_steps(local["resume-on-1"])
    info = finished["resume-on-2"]
    _, run_dir = jobs["resume-on-2"]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), describe(run_dir)
    assert "resumed from" in (run_dir / "logs" / f"{jobs['resume-on-2'][0]}-node0-mn1.log").read_text(), describe(run_dir)
    resumed_on_2, one_node = read_steps(run_dir), read_steps(local["tp2-pp2"])
    for what, resumed, ref in (("2 nodes -> 1", resumed_on_1, reference), ("1 node -> 2", resumed_on_2, one_node)):
        assert sorted(resumed) == [3, 4], f"{what}: {resumed}"
        for step in resumed:
            for got, want in zip(resumed[step], ref[step], strict=True):
                assert math.isclose(got, want, **RESHARD_TOL), f"{what} step {step}: {resumed[step]} vs {ref[step]}"


def _on_node(layout, index: int, hosts: str, env: dict, argv: list[str]) -> subprocess.CompletedProcess:
    """argv on node index with its hostname, resolving names through `hosts` (not the cluster's)."""
    from launch.launchers import ci_multinode

    script = f"mount --bind {hosts} /etc/hosts && hostname {ci_multinode.node_name(index)} && exec \"$@\""
    return subprocess.run(["nsenter", f"--net=/run/netns/{layout.namespace(index)}", "--", "unshare", "--uts",
                           "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_loopback_hostname_and_missing_interface_are_refused_before_the_rendezvous(cluster, tmp_path):
    """On a real node: one line naming the fix, exit 2, no process group (no MASTER reachable)."""
    layout, env = cluster
    loopback_hosts = tmp_path / "hosts"
    loopback_hosts.write_text("127.0.0.1 localhost\n127.0.1.1 mn1\n")  # Debian's default line
    # Rank 0 of a 2-node srun job; MASTER_ADDR points nowhere: a rendezvous would hang, not fail.
    rank = dict(env, SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_JOB_NUM_NODES="2",
                MASTER_ADDR="10.255.255.1", MASTER_PORT="29400", PYTHONWARNINGS="ignore")
    train = [sys.executable, "-m", "pretrain", "--recipe", "tiny-llama", "parallel.tensor_parallel=2",
             f"logging.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", *SMALL]
    result = _on_node(layout, 1, str(loopback_hosts), rank, train)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "resolves to 127.0.1.1 (loopback)" in errors[0] and "GLOO_SOCKET_IFNAME" in errors[0], errors
    assert "Traceback" not in result.stderr
    result = _on_node(layout, 1, str(layout.hosts_file), dict(rank, GLOO_SOCKET_IFNAME="eth9"), train)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "GLOO_SOCKET_IFNAME=eth9 names no network interface of host mn1 (it has: lo, mn0)" in errors[0], errors


# A parent and, behind DECOYS processes in PID order, a child that connects out once its parent
# has died: srun and its shepherd, which asks the controller to kill the step when srun dies.
# Killed one by one (the old crash_node) the child had the time of DECOYS kills to do it.
_LAST_GASP = r"""
import os, socket, subprocess, sys
decoys = [subprocess.Popen(["sleep", "300"]) for _ in range(int(sys.argv[3]))]
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    os.read(r, 1)  # returns at the parent's death
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).sendall(b"gasp")
    os._exit(0)
os.close(r)
print("ready", flush=True)
os.read(0, 1)
"""
DECOYS = 300


def test_a_crashed_node_gets_no_last_message_out(cluster):
    """crash_node is a power loss: its link is down while its processes die (then back up),
    so a process woken by another's death reaches nobody; a link cut before stays cut."""
    import socket

    from launch.launchers import ci_daemons, ci_multinode

    layout, _ = cluster
    listener = socket.create_server((f"{layout.subnet}.1", 0))  # the bridge's address, any port
    listener.settimeout(3)
    argv = ci_multinode._in_namespace(layout, 2, [sys.executable, "-c", _LAST_GASP, f"{layout.subnet}.1",
                                                  str(listener.getsockname()[1]), str(DECOYS)])
    gasp = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert gasp.stdout.readline().strip() == "ready"
        killed = ci_multinode.crash_node(layout, 2)
        try:
            conn, _ = listener.accept()
            with conn:
                heard = conn.recv(16)
        except TimeoutError:
            heard = b""
        assert heard == b"", f"a process of the crashed node got {heard!r} out"
        assert killed >= DECOYS + 3 and ci_multinode.namespace_pids(layout, 2) == []
        assert ci_multinode._link_is_up(layout.host_veth(2)), "the link stays down after the crash"
        ci_multinode.restart_slurmd(layout, 2)
        ci_multinode.cut_network(layout, 2)
        ci_multinode.crash_node(layout, 2)
        assert not ci_multinode._link_is_up(layout.host_veth(2)), "a cut link came back with the crash"
    finally:
        gasp.kill()
        listener.close()
        ci_multinode.heal_network(layout, 2)
    ci_multinode.restart_slurmd(layout, 2)
    ci_daemons.wait_for(lambda: ci_multinode.ping(layout), "node mn2 after the crash", layout.paths, timeout=60)
