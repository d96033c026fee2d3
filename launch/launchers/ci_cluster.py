"""A real Slurm cluster on this machine (one node, or N as network namespaces): CI and trying launch.slurm.

    python -m launch.launchers.ci_cluster install   # apt-get the Debian packages (root)
    python -m launch.launchers.ci_cluster start     # start munged + slurmctld + slurmd; prints SLURM_CONF
    export SLURM_CONF=/tmp/pretrain-slurm/slurm.conf
    sinfo; python -m launch.slurm --cpu --ntasks-per-node 4 ... --submit
    python -m launch.launchers.ci_cluster stop      # stop the daemons this directory started

Everything (munge key and socket, slurm.conf, spool, state, logs, PID files) lives under
one directory (--dir, default $PRETRAIN_SLURM_DIR or /tmp/pretrain-slurm), so several
checkouts on one machine share one cluster and `start` reuses a running one. There is no
systemd here: the daemons are started in the background and stopped by their recorded PID.

    python -m launch.launchers.ci_cluster start --nodes 2   # N nodes: launch/launchers/ci_multinode.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from launch.launchers import ci_multinode
from launch.launchers.ci_daemons import (
    DAEMONS,
    NETWORK_PACKAGES,
    PACKAGES,
    SCHEDULING,
    ClusterPaths,
    SlurmUnavailable,
    alive,
    binary,
    cluster_env,
    locked,
    missing_binaries,
    munge_setup,
    probe_node,
    read_pid,
    start_daemon,
    start_munged,
    wait_for,
)

DEFAULT_DIR = os.environ.get("PRETRAIN_SLURM_DIR", "/tmp/pretrain-slurm")
# Task slots on the node. CPU-mode test jobs run more ranks than this machine has cores
# (4 gloo ranks on 2 cores); slots are what Slurm counts, the ranks still share the cores.
MIN_SLOTS = 8


def install_packages() -> None:
    """apt-get the Debian packages; their install scripts start no services."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("installing Slurm needs root (apt-get); run as root or use sudo")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES, *NETWORK_PACKAGES],
                   check=True, env=env)


def ping(paths: ClusterPaths) -> bool:
    """True when this directory's cluster answers and its node can run jobs."""
    if not paths.conf.is_file() or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=cluster_env(paths),
                             capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    states = out.stdout.split()
    return out.returncode == 0 and any(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states)


def _node_line(slots: int) -> str:
    """slurm.conf's node line: NodeName must be this host's short name (what slurmd checks)."""
    cpus, memory = probe_node(slots)
    return f"NodeName={socket.gethostname().split('.')[0]} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN"


def write_config(paths: ClusterPaths, slots: int = MIN_SLOTS) -> None:
    for sub in ("log", "spool", "state"):
        (paths.root / sub).mkdir(parents=True, exist_ok=True)
    munge_setup(paths)
    root = paths.root
    paths.conf.write_text("\n".join([
        "# Single-node test cluster written by launch/slurm_cluster.py.",
        "ClusterName=pretrain-ci",
        "SlurmctldHost=localhost",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job waits this long before it may start again (default 120 s).
        f"AuthInfo=socket={paths.munge_socket},cred_expire=10",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={paths.pid_file('slurmctld')}",
        f"SlurmdPidFile={paths.pid_file('slurmd')}",
        f"SlurmctldLogFile={paths.log_file('slurmctld')}",
        f"SlurmdLogFile={paths.log_file('slurmd')}",
        *SCHEDULING,
        _node_line(slots),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))


def start(paths: ClusterPaths, slots: int = MIN_SLOTS) -> bool:
    """Start the cluster unless it already runs; returns True when this call started it."""
    missing = missing_binaries()
    if missing:
        raise SlurmUnavailable(
            f"Slurm is not installed (missing: {', '.join(missing)}); install it with "
            "`python -m launch.launchers.ci_cluster install` (Debian: apt-get install "
            f"{' '.join(PACKAGES)})")
    paths.root.mkdir(parents=True, exist_ok=True)
    with locked(paths):
        if ping(paths):
            return False
        stop(paths)  # leftovers of a half-started cluster hold the ports
        write_config(paths, slots)
        start_munged(paths)
        # -c: start from a clean state (no jobs of an earlier test cluster are resurrected).
        start_daemon(paths, "slurmctld", [binary("slurmctld"), "-c", "-f", str(paths.conf)])
        start_daemon(paths, "slurmd", [binary("slurmd"), "-f", str(paths.conf)])
        wait_for(lambda: ping(paths), "the Slurm node", paths)
        return True


def stop(paths: ClusterPaths) -> list[str]:
    """Stop this directory's daemons by their recorded PIDs; returns the ones stopped."""
    stopped = []
    for name in reversed(DAEMONS):  # slurmd, slurmctld, then munged (which they need)
        pid = read_pid(paths.pid_file(name))
        if pid is None or not alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        stopped.append(f"{name} ({pid})")
        paths.pid_file(name).unlink(missing_ok=True)
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.launchers.ci_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["install", "start", "status", "stop", *MULTINODE_FAULTS])
    parser.add_argument("--dir", help=f"cluster directory (default {DEFAULT_DIR}; with --nodes > 1 or a "
                        "fault action $PRETRAIN_MULTINODE_DIR or /tmp/pretrain-multinode)")
    parser.add_argument("--slots", type=int, default=MIN_SLOTS, help="task slots on the single node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes; > 1: one network namespace each (root)")
    parser.add_argument("--node", type=int, help="the node (1..N) a fault action acts on")
    parser.add_argument("--prefix", help="multi-node: link/namespace name prefix (default: from --dir)")
    parser.add_argument("--subnet", help="multi-node: the /24's first three numbers, e.g. 10.77.0 (default: from --dir)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes} must be at least 1")
    if args.action in MULTINODE_FAULTS and args.node is None:
        parser.error(f"{args.action} needs --node I (1..N)")
    try:
        if args.action == "install":
            if missing_binaries() or shutil.which("ip") is None:
                install_packages()
            print("slurm installed:", ", ".join(binary(n) for n in DAEMONS))
            return 0
        multi = _multinode_dir(args)
        if multi is not None:
            return _main_multinode(args, multi)
        paths = ClusterPaths(Path(args.dir or DEFAULT_DIR).resolve())
        if args.action == "start":
            started = start(paths, args.slots)
            print(f"{'started' if started else 'already running'}: export SLURM_CONF={paths.conf}")
        elif args.action == "status":
            up = ping(paths)
            print(f"{'up' if up else 'down'}: SLURM_CONF={paths.conf}")
            return 0 if up else 1
        else:
            print("stopped:", ", ".join(stop(paths)) or "nothing was running")
    except (SlurmUnavailable, subprocess.CalledProcessError) as exc:
        detail = f" ({exc.stderr.strip()})" if getattr(exc, "stderr", None) else ""
        print(f"error: {exc}{detail}", file=sys.stderr)
        return 1
    return 0


MULTINODE_FAULTS = ("crash", "cut", "heal", "restart-slurmd")


def _multinode_dir(args: argparse.Namespace) -> Path | None:
    """The multi-node cluster's directory when this command is about one, else None."""
    if args.dir is not None:
        root = Path(args.dir).resolve()
        if args.nodes > 1 or args.action in MULTINODE_FAULTS or (root / ci_multinode.STATE_NAME).exists():
            return root
        return None
    if args.nodes > 1 or args.action in MULTINODE_FAULTS:
        return Path(ci_multinode.DEFAULT_DIR).resolve()
    return None


def _main_multinode(args: argparse.Namespace, root: Path) -> int:
    if args.action == "start":
        layout = ci_multinode.derive_layout(root, args.nodes, args.prefix, args.subnet)
        started = ci_multinode.start(layout)
        running = ci_multinode.load_layout(root)
        print(f"{'started' if started else 'already running'}: {running.nodes} nodes\n"
              + ci_multinode.describe(running))
        return 0
    if args.action == "stop":
        print("stopped:", ", ".join(ci_multinode.stop(root)) or "nothing was running")
        return 0
    layout = ci_multinode.load_layout(root)
    if layout is None:
        print(f"down: no multi-node cluster in {root}", file=sys.stderr)
        return 1
    if args.action == "status":
        up = ci_multinode.ping(layout)
        print(f"{'up' if up else 'degraded'}: {layout.nodes} nodes\n" + ci_multinode.describe(layout))
        return 0 if up else 1
    result = ci_multinode.FAULTS[args.action](layout, args.node)
    print(f"{args.action} node {args.node}" + (f": {result} process(es) killed" if result is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
