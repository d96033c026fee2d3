"""The Slurm test cluster fixture and helpers to submit through `launch.slurm` and wait.

The cluster is a real single-node Slurm (launch/slurm_cluster.py): reused when one runs
under the same directory, otherwise started here and stopped at the end of the session.
Without the Debian packages the tests skip, naming the command that installs them; set
PRETRAIN_REQUIRE_SLURM=1 (CI) to make that a failure instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launch.launchers.ci_cluster import DEFAULT_DIR, start, stop
from launch.launchers.ci_daemons import ClusterPaths, SlurmUnavailable, cluster_env, missing_binaries
from tests.distributed import run_module

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _unavailable(reason: str) -> None:
    if os.environ.get("PRETRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(f"PRETRAIN_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_env():
    """Environment for Slurm's client commands (SLURM_CONF) pointing at the test cluster."""
    missing = missing_binaries()
    if missing:
        _unavailable(f"Slurm is not installed (missing {', '.join(missing)}); "
                     "`bash launch/launchers/ci_slurm.sh install` installs it (as root; .ci/run does)")
    if os.geteuid() != 0:
        _unavailable("the test cluster's daemons (munged, slurmctld, slurmd) need root")
    paths = ClusterPaths(Path(DEFAULT_DIR))
    try:
        started = start(paths)
    except SlurmUnavailable as exc:
        pytest.fail(f"Slurm is installed but the test cluster did not start: {exc}")
    yield cluster_env(paths)
    if started:
        queue = subprocess.run(["squeue", "--noheader"], env=cluster_env(paths), capture_output=True, text=True)
        if not queue.stdout.strip():  # another session may still be using it
            stop(paths)


def _multinode_unavailable() -> str | None:
    """Why a multi-node cluster of network namespaces cannot run here (None: it can)."""
    missing = missing_binaries()
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}); `bash launch/launchers/ci_slurm.sh "
                "install` installs it (as root; .ci/run does)")
    if os.geteuid() != 0:
        return "a multi-node test cluster needs root (network namespaces, bind mounts)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True) if shutil.which("ip") else None
    if probe is None or probe.returncode != 0:
        return "`ip netns` is not available (install iproute2; network namespaces need CAP_NET_ADMIN)"
    return None


@contextlib.contextmanager
def multinode_cluster(nodes: int, prefix: str):
    """A test module's own multi-node cluster (its directory, names, subnet: never a user's):
    yields (layout, client environment); stopped at the end, checked to leave nothing behind."""
    from launch.launchers import ci_multinode

    reason = _multinode_unavailable()
    if reason:
        _unavailable(reason)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: the munge socket path
    layout = ci_multinode.derive_layout(root, nodes)
    try:
        ci_multinode.start(layout)
    except SlurmUnavailable as exc:
        ci_multinode.stop(root)
        pytest.fail(f"the multi-node test cluster did not start: {exc}")
    yield layout, cluster_env(layout.paths)
    ci_multinode.stop(root)
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(layout.prefix)]
    assert not left and not ci_multinode._link_exists(layout.bridge), f"stop left {left} / {layout.bridge}"
    shutil.rmtree(root, ignore_errors=True)


def launch(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m launch.slurm ARGS` as a user types it (forked with its imports done)."""
    return run_module("launch.slurm", args, env=env, timeout=60)


def submit(args: list[str], env: dict) -> str:
    result = launch([*args, "--submit"], env)
    assert result.returncode == 0, f"launch.slurm failed:\n{result.stdout}\n{result.stderr}"
    match = re.search(r"submitted: job (\d+)", result.stdout)
    assert match, result.stdout
    return match.group(1)


def job_info(job_id: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=env,
                         capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def describe(run_dir: Path) -> str:
    """The tail of every log of a run, for assertion messages."""
    parts = []
    for log in sorted((run_dir / "logs").glob("*")):
        lines = log.read_text(errors="replace").splitlines()
        keep = [ln for ln in lines if "warn" not in ln.lower()][-25:]
        parts.append(f"--- {log.name}\n" + "\n".join(keep))
    return "\n".join(parts)


def wait_for_job(job_id: str, env: dict, run_dir: Path, timeout: float = 240) -> dict[str, str]:
    """Poll `scontrol` (faster than `sbatch --wait`) until the job reaches a final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id, env)
        if info["JobState"] in TERMINAL:
            return info
        time.sleep(1.0)
    subprocess.run(["scancel", job_id], env=env)
    pytest.fail(f"job {job_id} not finished after {timeout:.0f} s\n{describe(run_dir)}")


def read_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (re-run after a restart) keeps the last."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def wait_for_step(run_dir: Path, step: int, job_id: str, env: dict, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and max(read_losses(run_dir), default=0) >= step:
            return
        if job_info(job_id, env)["JobState"] in TERMINAL:
            pytest.fail(f"job {job_id} ended before step {step}\n{describe(run_dir)}")
        time.sleep(0.5)
    pytest.fail(f"job {job_id} did not reach step {step} in {timeout:.0f} s\n{describe(run_dir)}")
