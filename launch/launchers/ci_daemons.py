"""What both test Slurm clusters (ci_cluster: one node; ci_multinode: N as network namespaces) share.

The cluster directory's layout (ClusterPaths: slurm.conf, munge key and socket, PID files,
logs), the Debian packages and binaries, munged, starting a daemon detached and waiting for
it, PID bookkeeping, the directory lock, and the slurm.conf scheduling lines. ci_cluster (the
CLI) uses ci_multinode for N nodes; both use this module, and it uses neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
# The multi-node cluster's network namespaces and veths (`ip`); nsenter/unshare are in util-linux.
NETWORK_PACKAGES = ["iproute2"]
DAEMONS = ["munged", "slurmctld", "slurmd"]
CLIENTS = ["sbatch", "srun", "scontrol", "sinfo", "scancel"]


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be used here; the message says why and how to install it."""


@dataclasses.dataclass(frozen=True)
class ClusterPaths:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    def pid_file(self, daemon: str) -> Path:
        return self.root / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS + CLIENTS + ["mungekey"] if shutil.which(name) is None
            and not Path("/usr/sbin", name).exists()]


def binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def cluster_env(paths: ClusterPaths) -> dict[str, str]:
    """The environment client commands (sbatch, scontrol, ...) need to find this cluster."""
    return dict(os.environ, SLURM_CONF=str(paths.conf))


def probe_node(slots: int) -> tuple[int, str]:
    """(CPUs, RealMemory) for slurm.conf: what `slurmd -C` finds, at least `slots` CPUs."""
    probe = subprocess.run([binary("slurmd"), "-C"], capture_output=True, text=True, check=True)
    fields = dict(item.split("=", 1) for item in probe.stdout.split() if "=" in item)
    return max(int(fields.get("CPUs", 1)), slots), fields.get("RealMemory", "1")


def munge_setup(paths: ClusterPaths) -> None:
    """The munge directory and key (created once)."""
    paths.munge_dir.mkdir(parents=True, exist_ok=True)
    # munged refuses a socket directory others cannot enter and a key others can read.
    os.chmod(paths.munge_dir, 0o755)
    key = paths.munge_dir / "munge.key"
    if not key.exists():
        subprocess.run([binary("mungekey"), "--create", f"--keyfile={key}"], check=True)
    os.chmod(key, 0o600)


def start_munged(paths: ClusterPaths) -> None:
    munge = paths.munge_dir
    start_daemon(paths, "munged", [
        binary("munged"), "--force", f"--socket={paths.munge_socket}",
        f"--key-file={munge / 'munge.key'}", f"--pid-file={paths.pid_file('munged')}",
        f"--log-file={paths.log_file('munged')}", f"--seed-file={munge / 'munge.seed'}"])
    wait_for(paths.munge_socket.exists, "munged", paths)


# slurm.conf lines both test clusters (one node, or N: ci_multinode) share.
SCHEDULING = (
    # pgid: a job's background children die with it (linuxproc would let them outlive it);
    # no cgroup plugins: the multi-node cluster's nodes share one cgroup tree.
    "ProctrackType=proctrack/pgid",
    "TaskPlugin=task/none",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_CPU",
    "SchedulerType=sched/builtin",
    # Look for runnable jobs every 2 s (default 60): a requeued job starts when eligible.
    "SchedulerParameters=sched_interval=2",
    "MpiDefault=none",
    "ReturnToService=2",
    # No accounting daemon: `scontrol show job` is the record; keep finished jobs an hour.
    "MinJobAge=3600",
    "JobAcctGatherType=jobacct_gather/none",
    "AccountingStorageType=accounting_storage/none",
    # The node line declares more CPUs (task slots) than the machine has; accept it.
    "SlurmdParameters=config_overrides",
    "KillWait=30",
)


def start_daemon(paths: ClusterPaths, name: str, argv: list[str]) -> None:
    log = paths.log_file(name)
    with open(log, "a") as out:
        # New session: the daemons must not die with the shell or pytest that started them.
        subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=cluster_env(paths),
                       check=True, start_new_session=True, timeout=30)


def wait_for(predicate, what: str, paths: ClusterPaths, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in (paths.root / "log").glob("*.log"))
    raise SlurmUnavailable(f"{what} did not come up within {timeout:.0f} s; daemon logs:\n{logs}")


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def locked(paths: ClusterPaths):
    """Two test sessions starting the cluster at once would fight over the ports."""
    with open(paths.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
