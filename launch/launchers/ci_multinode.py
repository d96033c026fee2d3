"""A real multi-node Slurm cluster on one machine: each node a network namespace (root only).

    python -m launch.launchers.ci_cluster start --nodes 2     # prints SLURM_CONF and the layout
    export SLURM_CONF=/tmp/pretrain-multinode/slurm.conf
    sinfo; python -m launch.slurm --cpu --nodes 2 --ntasks-per-node 2 ... --submit
    python -m launch.launchers.ci_cluster crash --node 2      # fault helpers: crash, cut, heal,
    python -m launch.launchers.ci_cluster restart-slurmd --node 2   # restart-slurmd
    python -m launch.launchers.ci_cluster stop --nodes 2      # daemons, namespaces, veths, bridge

Layout (see shared/notes/slurm-multinode.md for why each piece is as it is): a bridge in
the root namespace holding SUBNET.1 and no route anywhere else; the controller in its own
namespace (hostname `mnctl`, SUBNET.10); node i in its own namespace (hostname `mn<i>`,
interface `mn0` at SUBNET.(10+i)) with its own slurmd. One munged in the root namespace: its
socket is a file every namespace reaches. Names resolve through a hosts file bind-mounted
over /etc/hosts in each daemon's private mount namespace (job steps inherit it); the
machine's own /etc/hosts is never touched. Every name (namespaces, links), the subnet and
the ports derive from the cluster directory, so two clusters (a user's and a test run's)
coexist; `--prefix` / `--subnet` override them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from launch.launchers.ci_daemons import (
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

DEFAULT_DIR = os.environ.get("PRETRAIN_MULTINODE_DIR", "/tmp/pretrain-multinode")
STATE_NAME = "multinode.json"
NODE_IFACE = "mn0"  # the interface inside every node namespace
CONTROLLER = "mnctl"
SLOTS = 8  # task slots per node (ranks share the machine's cores; Slurm only counts slots)


def node_name(index: int) -> str:
    return f"mn{index}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Names and addresses of one cluster; written to STATE_NAME at start, read by the rest."""

    root: str
    nodes: int
    prefix: str  # at most 6 characters: link names are limited to 15
    subnet: str  # "10.A.B": the cluster's /24 is 10.A.B.0/24
    ctld_port: int
    slurmd_port: int

    @property
    def paths(self) -> ClusterPaths:
        return ClusterPaths(Path(self.root))

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def namespace(self, index: int) -> str:
        """Node index's network namespace; 0 is the controller's."""
        return f"{self.prefix}-{'ctl' if index == 0 else node_name(index)}"

    def host_veth(self, index: int) -> str:
        return f"{self.prefix}v{index}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{10 + index}"

    @property
    def hosts_file(self) -> Path:
        return Path(self.root) / "hosts"

    def node_indices(self) -> range:
        return range(1, self.nodes + 1)


def derive_layout(root: Path, nodes: int, prefix: str | None = None, subnet: str | None = None) -> Layout:
    """Names, subnet and ports from a hash of the directory, unless given."""
    digest = hashlib.sha256(str(root).encode()).digest()
    prefix = prefix or f"pm{digest[:2].hex()}"
    if not (prefix.isalnum() and prefix.isascii() and 1 <= len(prefix) <= 6):
        raise SlurmUnavailable(f"--prefix {prefix!r} must be 1 to 6 letters or digits (link names are "
                               "limited to 15 characters)")
    subnet = subnet or f"10.{128 + digest[2] % 120}.{digest[3]}"
    try:
        ipaddress.ip_network(f"{subnet}.0/24")
    except ValueError:
        raise SlurmUnavailable(f"--subnet {subnet!r} must be the first three numbers of a /24, e.g. 10.77.0") from None
    port = 17000 + 2 * (int.from_bytes(digest[4:6], "big") % 4000)
    return Layout(str(root), nodes, prefix, subnet, port, port + 1)


def load_layout(root: Path) -> Layout | None:
    try:
        return Layout(**json.loads((root / STATE_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------- network

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


def _namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


_ROUTE_TYPES = {"local", "broadcast", "unicast", "unreachable", "blackhole", "prohibit", "throw", "multicast", "anycast"}


def _check_free(layout: Layout) -> None:
    """Refuse names or a subnet another cluster (or the machine's network) already uses."""
    taken = [name for name in [layout.bridge] + [layout.host_veth(i) for i in range(layout.nodes + 1)]
             if _link_exists(name)]
    taken += sorted({layout.namespace(i) for i in range(layout.nodes + 1)} & _namespaces())
    if taken:
        raise SlurmUnavailable(f"{', '.join(taken)} already exist(s): another cluster uses prefix "
                               f"{layout.prefix!r}; stop it, or pass another --dir or --prefix")
    ours = ipaddress.ip_network(f"{layout.subnet}.0/24")
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        try:
            net = ipaddress.ip_network(words[0], strict=False) if words and words[0] != "default" else None
        except ValueError:
            net = None
        if net is not None and net.overlaps(ours):
            raise SlurmUnavailable(f"subnet {ours} overlaps {net} already on this machine ({line.strip()}); "
                                   "pass another --subnet (e.g. --subnet 10.77.0) or --dir")


def _build_network(layout: Layout) -> None:
    """Bridge with SUBNET.1 in the root namespace; one namespace + veth per node and controller."""
    _ip("link", "add", layout.bridge, "type", "bridge")
    _ip("addr", "add", f"{layout.subnet}.1/24", "dev", layout.bridge)
    _ip("link", "set", layout.bridge, "up")
    for index in range(layout.nodes + 1):
        ns, veth = layout.namespace(index), layout.host_veth(index)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
        _ip("link", "set", veth, "master", layout.bridge, "up")
        # A namespace with only lo cannot resolve even 127.0.0.1 (glibc AI_ADDRCONFIG).
        _ip("-n", ns, "addr", "add", f"{layout.address(index)}/24", "dev", NODE_IFACE)
        _ip("-n", ns, "link", "set", NODE_IFACE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _remove_network(layout: Layout) -> list[str]:
    removed = []
    for index in range(layout.nodes + 1):
        ns = layout.namespace(index)
        if ns in _namespaces():
            _ip("netns", "del", ns, check=False)  # deletes the in-namespace end of the veth
            removed.append(ns)
        if _link_exists(layout.host_veth(index)):
            _ip("link", "del", layout.host_veth(index), check=False)
    if _link_exists(layout.bridge):
        _ip("link", "del", layout.bridge, check=False)
        removed.append(layout.bridge)
    return removed


# ---------------------------------------------------------------- daemons

def _in_namespace(layout: Layout, index: int, argv: list[str]) -> list[str]:
    """argv in node index's namespace with its hostname and the cluster's hosts file.

    nsenter + unshare, not `ip netns exec`: that remounts /sys, and slurmd 22.05 then dies
    with "No filesystem mounted on /sys/fs/cgroup"."""
    host = CONTROLLER if index == 0 else node_name(index)
    script = (f"mount --bind {shlex.quote(str(layout.hosts_file))} /etc/hosts && hostname {host} "
              f"&& exec {shlex.join(argv)}")
    return ["nsenter", f"--net=/run/netns/{layout.namespace(index)}", "--", "unshare", "--uts", "--mount",
            "--propagation", "private", "--", "sh", "-c", script]


def _slurmd_pid_file(layout: Layout, index: int) -> Path:
    return Path(layout.root) / f"slurmd-{node_name(index)}.pid"


def start_slurmd(layout: Layout, index: int) -> None:
    paths = layout.paths
    start_daemon(paths, f"slurmd-{node_name(index)}", _in_namespace(
        layout, index, [binary("slurmd"), "-f", str(paths.conf), "-N", node_name(index)]))


def write_config(layout: Layout) -> None:
    paths = layout.paths
    root = Path(layout.root)
    for sub in ("log", "state", *(f"spool/{node_name(i)}" for i in layout.node_indices())):
        (root / sub).mkdir(parents=True, exist_ok=True)
    munge_setup(paths)
    names = [(CONTROLLER, layout.address(0))] + [(node_name(i), layout.address(i)) for i in layout.node_indices()]
    layout.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in names))
    cpus, memory = probe_node(SLOTS)
    paths.conf.write_text("\n".join([
        f"# {layout.nodes}-node test cluster written by launch/launchers/ci_multinode.py.",
        f"ClusterName=pretrain-{layout.prefix}",
        # By address: clients in the root namespace need no name lookup.
        f"SlurmctldHost={CONTROLLER}({layout.address(0)})",
        f"SlurmctldPort={layout.ctld_port}",
        f"SlurmdPort={layout.slurmd_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job may start again this long after it ended (default 120 s).
        f"AuthInfo=socket={paths.munge_socket},cred_expire=10",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={paths.pid_file('slurmctld')}",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={paths.log_file('slurmctld')}",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        # How each task ended (exit code or signal) is in the node's log: post-mortems need it.
        "SlurmdDebug=verbose",
        # A node that stops answering is DOWN after ~SlurmdTimeout (+ ping interval): its jobs requeue.
        "SlurmdTimeout=10",
        *SCHEDULING,
        *(f"NodeName={node_name(i)} NodeAddr={layout.address(i)} CPUs={cpus} RealMemory={memory} State=UNKNOWN"
          for i in layout.node_indices()),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))


def node_states(layout: Layout) -> dict[str, str]:
    """Node name -> Slurm state (e.g. idle, down*), {} when the controller does not answer."""
    try:
        out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], env=cluster_env(layout.paths),
                             capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return {}
    if out.returncode != 0:
        return {}
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)


def ping(layout: Layout) -> bool:
    """True when the controller answers and every node can run jobs."""
    states = node_states(layout)
    ready = [s for s in states.values() if s.rstrip("*") in ("idle", "mixed", "allocated")
             and not s.endswith("*")]
    return len(ready) == layout.nodes


def start(layout: Layout) -> bool:
    """Build and start the cluster unless this directory's already runs; True when started here."""
    missing = missing_binaries() + [t for t in ("ip", "nsenter", "unshare") if not _which(t)]
    if missing:
        raise SlurmUnavailable(f"missing {', '.join(missing)}; install Slurm with `python -m "
                               "launch.launchers.ci_cluster install` (iproute2 and util-linux for the rest)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("a multi-node cluster needs root (network namespaces, bind mounts)")
    root = Path(layout.root)
    root.mkdir(parents=True, exist_ok=True)
    with locked(layout.paths):
        running = load_layout(root)
        if running is not None:
            if running.nodes == layout.nodes and ping(running):
                return False
            _stop(running)  # a half-started or differently sized cluster: rebuild it
        _check_free(layout)
        (root / STATE_NAME).write_text(json.dumps(dataclasses.asdict(layout), indent=1))
        write_config(layout)
        _build_network(layout)
        start_munged(layout.paths)
        # -c: a clean state, no jobs of an earlier cluster in this directory come back.
        start_daemon(layout.paths, "slurmctld",
                      _in_namespace(layout, 0, [binary("slurmctld"), "-c", "-f", str(layout.paths.conf)]))
        for index in layout.node_indices():
            start_slurmd(layout, index)
        wait_for(lambda: ping(layout), f"the {layout.nodes} Slurm nodes", layout.paths, timeout=60)
        return True


def _which(tool: str) -> bool:
    return any(Path(d, tool).exists() for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"))


def namespace_pids(layout: Layout, index: int) -> list[int]:
    """Every process in node index's network namespace (daemons and job steps)."""
    out = _ip("netns", "pids", layout.namespace(index), check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(layout: Layout) -> list[str]:
    """Everything this cluster started: daemons by PID, then whatever is left in its
    namespaces (job steps), the namespaces, veths, bridge, munged."""
    paths = layout.paths
    stopped = []
    daemons = [(f"slurmd-{node_name(i)}", _slurmd_pid_file(layout, i)) for i in layout.node_indices()]
    daemons += [("slurmctld", paths.pid_file("slurmctld"))]
    running = []
    for name, pid_file in daemons:
        pid = read_pid(pid_file)
        if pid is not None and alive(pid):
            running.append(pid)
            stopped.append(f"{name} ({pid})")
        pid_file.unlink(missing_ok=True)
    _terminate(*running)  # all at once: one by one, 14 slurmds took 27 s
    for index in range(layout.nodes + 1):
        left = namespace_pids(layout, index)
        if left:
            _kill_all(left, signal.SIGKILL)
            stopped.append(f"{len(left)} process(es) in {layout.namespace(index)}")
    stopped += _remove_network(layout)
    pid = read_pid(paths.pid_file("munged"))
    if pid is not None and alive(pid):
        _terminate(pid)
        stopped.append(f"munged ({pid})")
    paths.pid_file("munged").unlink(missing_ok=True)
    (Path(layout.root) / STATE_NAME).unlink(missing_ok=True)
    return stopped


def _terminate(*pids: int, grace: float = 15.0) -> None:
    """SIGTERM every pid, wait up to `grace` seconds for them all, SIGKILL those left."""
    _kill_all(list(pids), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_all([pid for pid in pids if alive(pid)], signal.SIGKILL)


def stop(root: Path) -> list[str]:
    layout = load_layout(root)
    if layout is None:
        return []
    with locked(layout.paths):
        return _stop(layout)


# ---------------------------------------------------------------- faults

def _check_node(layout: Layout, index: int) -> None:
    if index not in layout.node_indices():
        raise SlurmUnavailable(f"--node {index}: this cluster has nodes 1..{layout.nodes}")


def crash_node(layout: Layout, index: int) -> int:
    """SIGKILL everything in the node's namespace (slurmd and job steps), as a power loss would;
    returns how many processes were killed. The filesystem, shared by all nodes, stays.

    The node's link is down while its processes die, so none of them gets a last message out:
    a power loss sends nothing, but signalled processes die one after another, and the batch
    host's srun forks a "shepherd" child whose job, once srun has died, is to ask the controller
    to SIGKILL srun's step everywhere. Some crashes of a batch host let it: the survivors' step
    was SIGKILLed at the crash (their slurmd at debug2: REQUEST_SIGNAL_TASKS signal 9; the
    controller at debug: a connection from the crashed node, then REQUEST_SIGNAL_TASKS to the
    step's nodes). Stopping every process first made it more frequent, most likely because the
    kernel sends SIGHUP + SIGCONT to a process group left orphaned with stopped members, which
    wakes the shepherd. The link comes back once all are gone (unless it was cut already), so
    the other nodes see the dead node's connections reset, as after a reboot, and its address
    refuses connections instead of timing out.
    """
    _check_node(layout, index)
    was_up = _link_is_up(layout.host_veth(index))
    if was_up:
        cut_network(layout, index)
    killed: set[int] = set()
    deadline = time.monotonic() + 10
    # Again until the namespace is empty: a process may fork between the listing and its kill.
    while (pids := namespace_pids(layout, index)) and time.monotonic() < deadline:
        _kill_all(pids, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.05)
    if was_up:
        heal_network(layout, index)
    return len(killed)


def _link_is_up(name: str) -> bool:
    # The administrative flag: `ip link set NAME down` removes UP from the link's flags.
    return "UP" in json.loads(_ip("-j", "link", "show", name).stdout)[0]["flags"]


def cut_network(layout: Layout, index: int) -> None:
    """Take the node's link to the bridge down: its processes live on, unreachable."""
    _check_node(layout, index)
    _ip("link", "set", layout.host_veth(index), "down")


def heal_network(layout: Layout, index: int) -> None:
    _check_node(layout, index)
    _ip("link", "set", layout.host_veth(index), "up")


def restart_slurmd(layout: Layout, index: int) -> None:
    """Start the node's slurmd again (after a crash); Slurm returns the node to service."""
    _check_node(layout, index)
    pid = read_pid(_slurmd_pid_file(layout, index))
    if pid is not None and alive(pid):
        _terminate(pid)
    start_slurmd(layout, index)


def describe(layout: Layout) -> str:
    lines = [f"export SLURM_CONF={layout.paths.conf}",
             f"controller {CONTROLLER} {layout.address(0)}:{layout.ctld_port} (namespace {layout.namespace(0)})"]
    states = node_states(layout)
    for i in layout.node_indices():
        lines.append(f"node {node_name(i)} {layout.address(i)} dev {NODE_IFACE} namespace {layout.namespace(i)} "
                     f"host link {layout.host_veth(i)}: {states.get(node_name(i), 'not answering')}")
    lines.append(f"bridge {layout.bridge} {layout.subnet}.1/24; run a command on a node: nsenter "
                 f"--net=/run/netns/{layout.namespace(1)} -- CMD")
    return "\n".join(lines)


FAULTS = {"crash": crash_node, "cut": cut_network, "heal": heal_network, "restart-slurmd": restart_slurmd}
